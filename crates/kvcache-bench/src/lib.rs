//! The kvcache-rs benchmarks on `kvcache_engine`: what they run (traces,
//! workloads, replica processes), how they measure, and their reports. The
//! engine knows nothing of them; the demo binary and the benchmark targets
//! print what they return.
//!
//! Workloads:
//! - [`trace`]: the E1 chat trace (`fixtures/e1_trace.json`).
//! - [`workloads`]: continuous batching, a sliding window and a context shift,
//!   each as an engine ready to run.
//! - [`conversation`]: several multi-turn conversations answered in interleaved
//!   turns through a chat.
//! - [`replica`]: an engine process answering trace requests over a shared
//!   store, the handle that drives one (started by a command its caller
//!   builds: the flags belong to the binary that serves replicas), and a
//!   conversation handed from one process to the next.
//!
//! Benchmarks:
//! - [`mod@bench`]: E1 (chat reuse) and E2 (batched vs sequential decode).
//! - [`store_bench`]: E3 (restart over a disk store) and E4 (two replicas over
//!   Redis).
//! - [`e5`]: E5, the Gemma 3 chat trace on a sliding-window model
//!   (`benches/e5.rs` runs it; `examples/make_e5_trace.rs` writes its trace).
//! - [`kv_accuracy`]: each KV storage type on the real model (perplexity,
//!   agreement with f32, bytes per token).
//!
//! - [`knobs`]: the benchmarks' settings from environment variables.
//!
//! `benches/e8.rs` (long-context batched decode, paged against dense
//! attention) uses the workloads' cache; `benches/e9.rs` times each weight
//! mode against llama-server.
#![deny(missing_docs)]

pub mod bench;
pub mod conversation;
pub mod e5;
pub mod knobs;
pub mod kv_accuracy;
pub mod replica;
pub mod store_bench;
pub mod trace;
pub mod workloads;
