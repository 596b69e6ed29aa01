//! What the kvcache-rs tests, benchmarks and demos share, kept out of the
//! libraries users depend on (`publish = false`):
//!
//! - [`redis_server`]: a `redis-server` of one's own on a Unix socket,
//!   started from `PATH` and killed by its process id;
//! - [`dynamo_indexer`]: NVIDIA Dynamo's standalone KV indexer of one's own
//!   (the router that reads our KV events), started in the Python
//!   environment xtask prepares and killed by its process id;
//! - [`models`]: the real model files (SmolLM2, Gemma 3) for tests, with one
//!   rule for both: a missing file skips the test with a printed reason, or
//!   fails it under `CI` or `KVCACHE_REQUIRE_MODELS`.
#![deny(missing_docs)]

pub mod dynamo_indexer;
pub mod models;
pub mod redis_server;
