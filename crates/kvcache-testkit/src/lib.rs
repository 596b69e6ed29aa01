//! What the kvcache-rs tests, benchmarks and demos share, kept out of the
//! libraries users depend on (`publish = false`):
//!
//! - [`redis_server`]: a `redis-server` of one's own on a Unix socket,
//!   started from `PATH` and killed by its process id;
//! - [`dynamo_indexer`]: NVIDIA Dynamo's standalone KV indexer of one's own
//!   (the router that reads our KV events), started in the Python
//!   environment xtask prepares and killed by its process id.
#![deny(missing_docs)]

pub mod dynamo_indexer;
pub mod redis_server;
