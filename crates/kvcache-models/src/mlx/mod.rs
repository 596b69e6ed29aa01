//! The Llama of [`crate::llama`] and the Gemma of [`crate::gemma`] on mlx-rs arrays, running through the
//! `kvcache_mlx` layer caches (under `kvcache_trie`'s prefix trie in the engine's mlx chat).
//!
//! - [`weights`]: every weight as f32 host data, read from the GGUF with the
//!   same candle reader and dequantization the candle model uses, or random
//!   (the candle model's numbers: both draw from the same weight specs).
//! - [`model`]: [`MlxLlama`], the forward pass (RoPE, grouped-query attention,
//!   RMSNorm, SwiGLU, f32) without a cache (the reference) and through
//!   per-layer [`kvcache_api::LayerCache`]s such as
//!   [`kvcache_mlx::layers::KvCache`].
//! - [`gemma`]: [`MlxGemma`], Gemma 3 with its window and global layers
//!   (rotating caches for the window layers).
//!
//! Compiled on macOS, and on Linux with `--cfg kvcache_mlx` (what `cargo xtask`
//! passes together with the patched mlx-sys), like `kvcache_mlx::layers`.
//! Arrays live on mlx's default device (the CPU on Linux, the GPU on macOS).

pub mod gemma;
pub mod model;
pub mod weights;

pub use gemma::{MlxGemma, MlxGemmaLayer};
pub use model::MlxLlama;
pub use weights::{HostTensor, HostWeights};

/// Maps an mlx-rs error to [`crate::ModelError::Mlx`].
pub fn mlx_err(e: impl std::fmt::Display) -> crate::ModelError {
    crate::ModelError::Mlx(e.to_string())
}
