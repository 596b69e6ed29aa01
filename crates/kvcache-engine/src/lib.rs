//! A small inference engine on the kvcache-rs caches: what the demo, the
//! benchmarks and a server are built on. Its model, SmolLM2 (a Llama), is proven
//! equal to recomputing everything without a cache.
//!
//! - [`model`]: the Llama forward pass, full recompute and through a
//!   [`kvcache_api::CausalCache`].
//! - [`engine`]: greedy generation and continuous batching over a causal cache.
//! - [`chat`]: multi-conversation chat with prefix-trie, single-entry or no reuse.
//! - [`tokenizer`]: the GGUF-embedded byte-level BPE and the ChatML template.
//! - [`trace`]: the E1 chat trace.
//! - [`mod@bench`]: benchmarks E1 (chat reuse) and E2 (batched vs sequential decode).
//! - [`replica`], [`store_bench`]: engine processes sharing a prefix store, and
//!   benchmarks E3 (restart over a disk store) and E4 (two replicas over Redis).
//! - [`check`]: runs cache schedules and compares with full recompute.
//! - [`paths`]: where the model and fixtures live.
//! - `mlx` (on macOS, or on Linux when built through `cargo xtask`): the same
//!   Llama on mlx-rs arrays through `kvcache_mlx`'s layer caches and prefix trie.
#![deny(missing_docs)]

pub mod bench;
pub mod chat;
pub mod check;
mod config;
pub mod engine;
pub mod kv_accuracy;
mod error;
#[cfg(any(target_os = "macos", kvcache_mlx))]
pub mod mlx;
pub mod model;
pub mod paths;
pub mod replica;
pub mod store;
pub mod store_bench;
pub mod tokenizer;
pub mod trace;

pub use config::LlamaConfig;
pub use error::{EngineError, Result};
pub use model::{BatchToken, Llama, LoadProgress, ModelFile, Rope, WeightMode};
pub use tokenizer::ChatTokenizer;
