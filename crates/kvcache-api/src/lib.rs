//! The contract between LLM inference engines and the kvcache-rs backends.
//!
//! Two cache designs, one per trait family:
//!
//! - [`CausalCache`]: one pool of *cells* shared by many sequences (continuous
//!   batching, sliding windows, chunked attention, prefix sharing). Implemented on
//!   candle by `kvcache-causal`.
//! - [`SnapshotCache`] / [`LayerCache`]: per-layer caches of one live sequence whose
//!   state pages out to [`Snapshot`]s, so a prefix trie can switch conversations.
//!   Implemented on mlx-rs by `kvcache-mlx`.
//!
//! Caches are `Send` and driven by one owner; [`Shared`] lets several threads
//! take turns on one cache.
//!
//! Keys and values outlive a cache through a [`PrefixStore`]; whoever drives a
//! cache (the prefix trie, the batching engine) talks to it through one
//! [`StoreClient`]: restore before evaluating, one write-back rule after.
//!
//! This crate has no tensor dependency: tensors appear as associated types.
//! Every fallible operation returns [`CacheError`]; bad input leaves the cache
//! unchanged.
//!
//! ```
//! use kvcache_api::{Batch, CausalConfig, SlidingWindow};
//!
//! // Two sequences decoding together in a cache with a 4096-position window.
//! let config = CausalConfig::new(2, 8192, 512).with_window(SlidingWindow::new(4096));
//! config.validate()?;
//! let step = Batch::from_tokens([(0, 100), (1, 37)])?;
//! assert_eq!(step.sequences(), &[0, 1]);
//! # Ok::<(), kvcache_api::CacheError>(())
//! ```
#![deny(missing_docs)]

mod batch;
pub mod block_key;
mod causal;
mod config;
#[cfg(feature = "contract-tests")]
pub mod contract;
mod error;
pub mod events;
pub mod host;
mod mixed;
mod paged;
pub mod paging;
pub mod retention;
mod shared;
mod snapshot;
mod store_client;
pub mod store_parts;

pub use batch::{Batch, Pos, SeqId};
pub use causal::{key_shift, CausalCache, ForwardMode, KeyShift, KvView, PosRange};
pub use config::{CausalConfig, DType, KvStorage, Placement, SlidingWindow, VLayout};
pub use error::{CacheError, Result};
pub use events::{EventBatch, EventLog, KvEvent, KvEventSink, Medium};
pub use host::{
    Fetched, Fingerprint, HostArray, HostKv, HostState, KvLayout, LayerRows, LayerRowsMut, Namespace,
    PrefixStore, SeqKv, Submitted,
};
pub use mixed::MixedLayer;
pub use paged::{CellRun, PagedKv, RowRuns, StoredKv};
pub use shared::{Shared, SharedGuard};
pub use snapshot::{BoxedSnapshot, LayerCache, Snapshot, SnapshotCache};
pub use store_client::{StoreClient, StoreCounters, WriteBack};
pub use store_parts::{PartsFetched, StorePart, StoreParts};
