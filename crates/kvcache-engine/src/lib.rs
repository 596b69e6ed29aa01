//! A small inference engine on the kvcache-rs caches: the library the demo
//! binary, the benchmarks and a server are built on, and a worked example of
//! adopting both cache designs. Its model, SmolLM2 (a Llama), is proven equal
//! to recomputing everything without a cache.
//!
//! Models and text:
//! - [`model`]: the Llama forward pass on candle, full recompute (the
//!   reference) and through a [`kvcache_api::CausalCache`] or per-layer
//!   [`kvcache_api::LayerCache`]s; [`ModelFile`] loads it from GGUF.
//! - [`attention`]: attention over a causal cache, dense (the reference) or
//!   paged ([`attention::paged_attention`]: a CPU kernel walking each row's
//!   visible cells in their stored type, the models' default).
//! - [`tokenizer`]: the GGUF-embedded byte-level BPE and the ChatML template.
//! - `mlx` (on macOS, or on Linux when built through `cargo xtask`): the same
//!   Llama on mlx-rs arrays through `kvcache_mlx`'s layer caches and `kvcache_trie`'s prefix trie.
//!
//! Serving:
//! - [`engine`]: greedy generation and continuous batching over a causal cache,
//!   with context shift and a prefix store.
//! - [`workloads`]: continuous batching, a sliding window and a context shift,
//!   each as an engine ready to run.
//! - [`chat`]: one live sequence with prefix-trie, single-entry or no reuse
//!   (`trie_turn`: one turn through the trie for any model).
//! - [`conversation`]: several multi-turn conversations answered in interleaved
//!   turns through a chat server.
//! - [`store`]: the prefix store of a model file (fingerprint, layout, tiers).
//! - [`replica`]: an engine process answering trace requests over a shared
//!   store, the handle that drives one, and a conversation handed from one
//!   process to the next.
//!
//! Measuring and checking:
//! - [`trace`]: the E1 chat trace.
//! - [`mod@bench`]: benchmarks E1 (chat reuse) and E2 (batched vs sequential decode).
//! - [`store_bench`]: benchmarks E3 (restart over a disk store) and E4 (two
//!   replicas over Redis).
//! - [`check`]: runs cache schedules and compares with full recompute.
//! - [`paths`]: where the model and fixtures live.
//! - [`threads`]: candle's CPU threads set for a small machine (programs call
//!   [`threads::tune_cpu_threads`] first thing).
//!
//! Errors are one [`EngineError`]; bad input is an
//! [`EngineError::InvalidArgument`] returned before anything changes.
#![deny(missing_docs)]

pub mod attention;
pub mod bench;
pub mod chat;
pub mod check;
mod config;
pub mod conversation;
pub mod e5;
pub mod engine;
mod error;
pub mod gemma;
mod kernels;
pub mod kv_accuracy;
#[cfg(any(target_os = "macos", kvcache_mlx))]
pub mod mlx;
pub mod model;
pub mod paths;
mod q8;
pub mod replica;
pub mod sampling;
pub mod store;
pub mod store_bench;
pub mod threads;
pub mod tokenizer;
pub mod trace;
pub mod workloads;

pub use config::LlamaConfig;
pub use error::{EngineError, Result};
pub use model::{BatchToken, Llama, LoadProgress, ModelFile, Rope, WeightMode};
pub use tokenizer::ChatTokenizer;
