//! Gemma 3 on mlx-rs through the prefix trie: window layers on
//! [`kvcache_mlx::layers::RotatingKvCache`]s, global layers on
//! [`kvcache_mlx::layers::KvCache`]s, each layer a [`MlxGemmaLayer`].
//!
//! - [`model`]: [`MlxGemma`], the forward pass without a cache (the reference)
//!   and through the per-layer caches.
//! - [`chat`]: [`MlxGemmaChatServer`], multi-conversation chat through
//!   [`kvcache_trie::PrefixCache`] over those caches, keeping a restore
//!   point at every prompt's end so the next turn resumes there.

pub mod chat;
pub mod model;

pub use chat::MlxGemmaChatServer;
pub use model::{MlxGemma, MlxGemmaLayer};
