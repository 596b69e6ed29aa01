//! KV events for cache-aware routers: a [`KvEventSink`] that publishes
//! [`KvEvent`]s in vLLM's wire format on a ZMQ PUB socket, the stream that
//! NVIDIA Dynamo's KV router and indexer (and llm-d's kv-cache manager)
//! subscribe to.
//!
//! - [`encode_batch`]: vLLM's msgpack `KVEventBatch`, byte for byte;
//! - [`ZmqPublisher`]: binds `tcp://HOST:PORT`, sends `[topic, sequence
//!   number, batch]` per batch from a thread of its own, starts with
//!   `AllBlocksCleared`, and never makes its caller wait (a full queue or a
//!   slow subscriber drops, and drops are counted).
//!
//! What the events mean, and how a tenant's namespace and the model keep
//! routers from matching across tenants, is in [`kvcache_api::events`].
//!
//! ```no_run
//! use kvcache_api::events::{KvEvent, KvEventSink, Medium};
//! use kvcache_api::Namespace;
//! use kvcache_events::{ZmqPublisher, ZmqPublisherConfig};
//!
//! let publisher = ZmqPublisher::bind(ZmqPublisherConfig::new("tcp://127.0.0.1:5557"))?;
//! publisher.publish(vec![KvEvent::BlockStored {
//!     block_hashes: vec![11, 12],
//!     parent_block_hash: None,
//!     token_ids: (0..32).collect(),
//!     block_size: 16,
//!     medium: Medium::Device,
//!     namespace: Namespace::shared(),
//! }]);
//! # Ok::<(), kvcache_events::EventsError>(())
//! ```
#![deny(missing_docs)]

mod publisher;
mod wire;

pub use kvcache_api::events::{KvEvent, KvEventSink};
pub use publisher::{EventsError, ZmqPublisher, ZmqPublisherConfig};
pub use wire::encode_batch;
