//! A small inference engine on the kvcache-rs caches: the library the demo
//! binary, the benchmarks (the `kvcache-bench` crate: workloads, traces,
//! replica processes, E1-E5 and E8) and a server are built on, and a worked
//! example of adopting both cache designs. Its models, SmolLM2 (a Llama) and
//! Gemma 3 (window and global layers), are proven equal to recomputing
//! everything without a cache.
//!
//! Models and text:
//! - [`model`]: what the trie's path asks of any model on any backend,
//!   [`LayerModel`], and what the engine asks of a candle model, [`Model`]
//!   (hidden states through a causal cache, logits, the shape of its cache);
//!   [`BatchToken`].
//! - [`llama`]: the Llama on candle, full recompute (the reference) and
//!   through a [`kvcache_api::CausalCache`] or per-layer
//!   [`kvcache_api::LayerCache`]s; [`ModelFile`] loads it from GGUF.
//! - [`gemma`]: Gemma 3 on candle, its window layers through a
//!   `kvcache_causal::LayerGroupCache`, its tokenizer and turn format.
//! - Written once for both: `gguf` (a GGUF header and its tensors, shapes
//!   checked: [`GgufFile`]), `weights` ([`WeightMode`], the matrix type and
//!   random test weights), `decoder` (embedding, blocks, the attention and
//!   feed-forward code), `rope` ([`Rope`], either layout).
//! - [`attention`]: attention over a causal cache, dense (the reference) or
//!   paged, the models' default: kernels walking each row's visible cells in
//!   their stored type, [`attention::paged_attention`] on the CPU and
//!   [`attention::device`]'s on CUDA (the `cuda` feature).
//! - [`tokenizer`]: the [`Tokenizer`] trait (text, chat template, control
//!   tokens kept out of what users see) and SmolLM2's byte-level BPE with
//!   ChatML.
//! - `mlx` (on macOS, or on Linux when built through `cargo xtask`): both
//!   models on mlx-rs arrays through `kvcache_mlx`'s layer caches and
//!   `kvcache_trie`'s prefix trie.
//!
//! Serving:
//! - [`engine`]: greedy generation and continuous batching over a causal
//!   cache for any [`Model`], with context shift, a prefix store, and
//!   request ends it decides and reports ([`engine::FinishReason`]).
//! - [`chat`]: one live sequence of any [`LayerModel`] with prefix-trie,
//!   single-entry or no reuse (`trie_turn`: one turn through the trie).
//! - [`store`]: the prefix store of a model file (fingerprint, layout, tiers).
//!
//! Programs:
//! - [`paths`]: where the model and fixtures live.
//! - [`threads`]: candle's CPU threads set for a small machine (programs call
//!   [`threads::tune_cpu_threads`] first thing).
//!
//! Errors are one [`EngineError`]; bad input is an
//! [`EngineError::InvalidArgument`] returned before anything changes.
#![deny(missing_docs)]

pub mod attention;
pub mod chat;
mod config;
mod decoder;
pub mod engine;
mod error;
pub mod gemma;
mod gguf;
mod kernels;
pub mod llama;
#[cfg(any(target_os = "macos", kvcache_mlx))]
pub mod mlx;
pub mod model;
pub mod paths;
mod published;
mod q8;
mod rope;
pub mod sampling;
pub mod store;
#[cfg(test)]
#[path = "../tests/common/testing.rs"]
mod testing;
pub mod threads;
pub mod tokenizer;
mod weights;

pub use config::LlamaConfig;
pub use error::{EngineError, Result};
pub use gguf::{GgufFile, LoadProgress};
pub use llama::{Llama, ModelFile};
pub use model::{BatchToken, CellUse, LayerModel, Model};
pub use rope::Rope;
pub use tokenizer::ChatTokenizer;
pub use tokenizer::Tokenizer;
pub use weights::WeightMode;
