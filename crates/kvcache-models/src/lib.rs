//! The models of kvcache-rs, apart from the engine that drives them (as
//! candle-transformers stands beside candle-examples): SmolLM2 (a Llama) and
//! Gemma 3 (window and global layers) on candle and on mlx-rs, their weights,
//! kernels and tokenizers, proven equal to recomputing everything without a
//! cache.
//!
//! - [`model`]: what the trie's path asks of any model on any backend,
//!   [`LayerModel`], and what an engine asks of a candle model, [`Model`]
//!   (hidden states through a causal cache, logits, the shape of its cache);
//!   [`BatchToken`]; [`argmax`], the greedy pick.
//! - [`llama`]: the Llama on candle, full recompute (the reference) and
//!   through a [`kvcache_api::CausalCache`] or per-layer
//!   [`kvcache_api::LayerCache`]s; [`ModelFile`] loads it from GGUF.
//! - [`gemma`]: Gemma 3 on candle, its window layers through a
//!   `kvcache_causal::LayerGroupCache`, its tokenizer and turn format.
//! - Written once for both: `gguf` (a GGUF header and its tensors, shapes
//!   checked: [`GgufFile`]), `weights` ([`WeightMode`], the matrix type and
//!   random test weights), `decoder` (embedding, blocks, the attention and
//!   feed-forward code), `rope` ([`Rope`], either layout), `kernels` (the
//!   element-wise passes) and `q8` (Gemma's Q8_0 output head).
//! - [`quant`]: weights kept in 4- and 8-bit blocks ([`quant::QMatrix`])
//!   and multiplied in their own type against activations quantized per row
//!   ([`quant::QActivations`]), as ggml does: scalar, AVX2 and AVX-512 VNNI
//!   kernels chosen at run time, spread over rayon's pool, a row's result
//!   bit-identical whatever batch it runs in.
//! - [`attention`]: attention over a causal cache, dense (the reference) or
//!   paged, the models' default: kernels walking each row's visible cells in
//!   their stored type, [`attention::paged_attention`] on the CPU and
//!   [`attention::device`]'s on CUDA (the `cuda` feature).
//! - [`tokenizer`]: the [`Tokenizer`] trait (text, chat template, control
//!   tokens kept out of what users see) and SmolLM2's byte-level BPE with
//!   ChatML.
//! - `mlx` (on macOS, or on Linux when built through `cargo xtask`): both
//!   models on mlx-rs arrays through `kvcache_mlx`'s layer caches.
//! - [`loader`]: the one way programs get a model: a GGUF opened once, its
//!   architecture read, the model and tokenizer built on the caller's device
//!   with the caller's [`WeightMode`], with its name and store fingerprint.
//! - [`stand_in`]: a GGUF's header kept as a small skeleton, filled
//!   elsewhere into a file of the same shapes and block types with random
//!   weights (what a GPU machine without the model files serves).
//! - [`paths`]: where the model files and fixtures are; [`threads`]: candle's
//!   CPU threads set for a small machine (programs call
//!   [`threads::tune_cpu_threads`] first thing).
//!
//! Errors are one [`ModelError`]; bad input is a
//! [`ModelError::InvalidArgument`] returned before anything changes.
#![deny(missing_docs)]

pub mod attention;
mod config;
mod decoder;
mod error;
pub mod gemma;
mod gguf;
mod kernels;
pub mod llama;
pub mod loader;
#[cfg(any(target_os = "macos", kvcache_mlx))]
pub mod mlx;
pub mod model;
pub mod paths;
mod q8;
pub mod quant;
mod rope;
pub mod stand_in;
#[cfg(test)]
#[path = "../tests/common/testing.rs"]
mod testing;
pub mod threads;
pub mod tokenizer;
mod weights;

pub use config::LlamaConfig;
pub use error::{ModelError, Result};
pub use gguf::{GgufFile, LoadProgress};
pub use llama::{Llama, ModelFile};
pub use model::{argmax, BatchToken, CellUse, LayerModel, Model};
pub use rope::Rope;
pub use tokenizer::ChatTokenizer;
pub use tokenizer::Tokenizer;
pub use weights::WeightMode;
