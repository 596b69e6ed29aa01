//! What the kvcache-rs tests, benchmarks and demos share, kept out of the
//! libraries users depend on (`publish = false`):
//!
//! - [`redis_server`]: a `redis-server` of one's own on a Unix socket,
//!   started from `PATH` and killed by its process id.
#![deny(missing_docs)]

pub mod redis_server;
