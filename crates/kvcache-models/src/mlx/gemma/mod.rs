//! Gemma 3 on mlx-rs: window layers on
//! [`kvcache_mlx::layers::RotatingKvCache`]s, global layers on
//! [`kvcache_mlx::layers::KvCache`]s, each layer a [`MlxGemmaLayer`].
//!
//! - [`model`]: [`MlxGemma`], the forward pass without a cache (the reference)
//!   and through the per-layer caches.

pub mod model;

pub use model::{MlxGemma, MlxGemmaLayer};
