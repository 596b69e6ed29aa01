//! A small inference engine on the kvcache-rs caches and the models of
//! `kvcache_models`: the library the demo binary, the benchmarks (the
//! `kvcache-bench` crate: workloads, traces, replica processes, E1-E5 and E8)
//! and the server are built on, and a worked example of adopting both cache
//! designs.
//!
//! - [`engine`]: greedy generation and continuous batching over a causal
//!   cache for any [`kvcache_models::Model`], with context shift, a prefix
//!   store, block retention, KV events and request ends it decides and
//!   reports ([`engine::FinishReason`]); each token's event carries the text
//!   it adds to the answer.
//! - [`detokenizer`]: the answer's text, token by token (an incremental
//!   detokenizer: linear in the answer's length), cut before its first stop
//!   sequence, control tokens left out.
//! - [`sampling`]: temperature, top-k/top-p, seeds and log-probabilities.
//! - [`chat`]: one live sequence of any [`kvcache_models::LayerModel`] with
//!   prefix-trie, single-entry or no reuse (`trie_turn`: one turn through the
//!   trie).
//! - [`store`]: the prefix store of a model file (fingerprint, layout, tiers).
//! - `mlx` (on macOS, or on Linux when built through `cargo xtask`): chat on
//!   the mlx-rs models through `kvcache_mlx`'s layer caches and
//!   `kvcache_trie`'s prefix trie.
//!
//! Errors are one [`EngineError`]; bad input is an
//! [`EngineError::InvalidArgument`] returned before anything changes.
#![deny(missing_docs)]

pub mod chat;
pub mod detokenizer;
pub mod engine;
mod error;
#[cfg(any(target_os = "macos", kvcache_mlx))]
pub mod mlx;
pub mod sampling;
pub mod store;

pub use error::{EngineError, Result};
