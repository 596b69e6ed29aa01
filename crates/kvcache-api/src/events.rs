//! KV events: what a cache tells an external, cache-aware router about the
//! blocks it holds, in the shape vLLM publishes and NVIDIA Dynamo's KV
//! indexer reads. Plain types, no I/O: a [`KvEventSink`] carries them away
//! (`kvcache-events` has one that publishes over ZMQ; [`EventLog`] records
//! them for tests).
//!
//! # The schema
//!
//! [`KvEvent`] mirrors vLLM's `BlockStored`, `BlockRemoved` and
//! `AllBlocksCleared` (`vllm/distributed/kv_events.py`, vLLM 0.31.0, the
//! version `ai-dynamo` 1.6.1 pins), as decoded by Dynamo's
//! `lib/kv-router/src/zmq_wire.rs` (`RawKvEvent`):
//!
//! - block hashes are 64-bit integers (vLLM's default since
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`; Dynamo accepts signed or
//!   unsigned); [`block_hash`] turns one of our 32-byte block keys into one;
//! - `token_ids` are exactly `block_hashes.len() * block_size` tokens, the
//!   stored blocks' tokens in order; only whole blocks are published (Dynamo
//!   stops at the first block whose size differs from the size the worker was
//!   registered with);
//! - `parent_block_hash` is the block before the first stored one, `None` at
//!   the start of a sequence; it must be a block this sink has published as
//!   stored and not yet removed;
//! - vLLM's `lora_id` and `lora_name` are always sent as nil (no adapters
//!   here), its optional `extra_keys`, `group_idx` and cache-spec fields are
//!   left out (their defaults), and `medium` is a [`Medium`].
//!
//! # What identifies a block to a router, and how tenants and models stay apart
//!
//! The `block_hashes` an event carries are only *names*: Dynamo's indexer
//! (its `RadixTree` / `KvIndexer`, run standalone by `python -m
//! dynamo.indexer`) uses them to link a stored block to its parent and to
//! find the blocks a `BlockRemoved` names, per worker. It never matches a
//! request against them. For every stored block it computes its own
//! `LocalBlockHash` from the block's `token_ids` (XXH3-64, seed 1337, over
//! the block's tokens as little-endian `u32`s; `compute_block_hash_for_seq`:
//! checked, `[1, 2, 3, 4]` gives 14643705804678351452), and a query for a
//! request's token ids hashes them the same way and walks the tree. So two
//! workers that hold the same tokens match the same request whatever hashes
//! they publish, and a hash chain of ours (SHA-256 over the model
//! fingerprint, the namespace and the tokens) keeps no tenant apart there on
//! its own.
//!
//! What does enter Dynamo's local hash (checked against `ai-dynamo` 1.6.1):
//!
//! - **the namespace**: a `cache_salt` string on `BlockStored`. vLLM's own
//!   struct has no such field (vLLM puts a request's `cache_salt` untagged in
//!   `extra_keys`, which Dynamo 1.6.1 reads only for multimodal hashes, so it
//!   does not separate tenants), but Dynamo's decoder reads a `cache_salt`
//!   key and mixes it into the local hash (its `cache_namespace`); a query
//!   (`POST /query` with `cache_salt`, or a router's `cache_namespace`)
//!   matches only blocks stored with the same salt, and a query without one
//!   only blocks stored without one. [`KvEvent::BlockStored`]'s `namespace`
//!   is sent as that key: omitted for [`Namespace::shared`], so shared
//!   blocks are byte-for-byte vLLM's schema, and an extra map key for a
//!   tenant, which vLLM's own decoder (msgspec, unknown fields ignored)
//!   skips;
//! - **the model** does not enter the hash at all. Dynamo keeps one index
//!   per `(model_name, tenant_id)` it was told about when the worker's
//!   endpoint was registered (`--workers` / `POST /register` with
//!   `model_name`), and a query names the model. A replica therefore
//!   publishes each model's events on its own endpoint, registered under
//!   that model's name; two models never share one index.
//!
//! `lora_name` also enters the local hash; it stays nil here, so it is free
//! for adapters and not overloaded with tenants.
//!
//! # Sinks never block
//!
//! A [`KvEventSink`] is called from an engine's hot path, with a cache's lock
//! held: [`KvEventSink::publish`] returns at once, and a sink that cannot keep
//! up drops events (and counts them) rather than wait.

use std::sync::Mutex;

use crate::host::Namespace;
use crate::retention::BlockChange;

/// Where a block lives, sent as vLLM's `medium` string.
///
/// vLLM 0.31 names three (`MEDIUM_GPU`, `MEDIUM_CPU`, `MEDIUM_STORAGE`), and
/// Dynamo 1.6.1 maps them to its device, host and disk tiers. A shared Redis
/// store has no vLLM name: it is sent as `"REDIS"`, which Dynamo does not
/// count as this worker's cache (it ignores the event), which is right for a
/// tier every replica reads alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The accelerator's (or the CPU backend's) live cache: `"GPU"`.
    Device,
    /// Host memory, a store's memory tier: `"CPU"`.
    HostMemory,
    /// Local disk, a store's disk tier: `"STORAGE"`.
    Disk,
    /// A shared Redis tier: `"REDIS"`.
    Redis,
}

impl Medium {
    /// The string sent on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Device => "GPU",
            Medium::HostMemory => "CPU",
            Medium::Disk => "STORAGE",
            Medium::Redis => "REDIS",
        }
    }
}

/// One change to the blocks a cache holds (see the [module docs](self) for
/// the schema and what each field means to a router).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Whole blocks were stored, each following the one before it.
    BlockStored {
        /// The stored blocks' names, in sequence order ([`block_hash`]).
        block_hashes: Vec<u64>,
        /// The block before the first one, `None` at a sequence's start.
        parent_block_hash: Option<u64>,
        /// The stored blocks' tokens: `block_hashes.len() * block_size` ids.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// Where the blocks are.
        medium: Medium,
        /// The tenant's namespace (cache salt), sent as `cache_salt` unless
        /// shared.
        namespace: Namespace,
    },
    /// Blocks were evicted from `medium`.
    BlockRemoved {
        /// The removed blocks' names.
        block_hashes: Vec<u64>,
        /// Where they were.
        medium: Medium,
    },
    /// Every block is gone (published first at start: a restarted engine
    /// holds nothing, whatever a router remembers of it).
    AllBlocksCleared,
}

impl KvEvent {
    /// `BlockStored` for the blocks `names[first..]` of one chain: `names`
    /// name the chain's full blocks of `block_size` tokens from position 0,
    /// in order, and `tokens` are the chain's tokens (at least
    /// `names.len() * block_size`); the parent is `names[first - 1]`, none
    /// for `first == 0`.
    ///
    /// ```
    /// use kvcache_api::events::{KvEvent, Medium};
    /// use kvcache_api::Namespace;
    ///
    /// let event = KvEvent::stored_run(&[7, 8, 9], 1, &[1, 2, 3, 4, 5, 6, 7], 2, Medium::Device, &Namespace::shared());
    /// let KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } = event else { panic!() };
    /// assert_eq!((block_hashes, parent_block_hash, token_ids), (vec![8, 9], Some(7), vec![3, 4, 5, 6]));
    /// ```
    ///
    /// # Panics
    /// When `first > names.len()` or `tokens` are fewer than the named
    /// blocks hold.
    pub fn stored_run(
        names: &[u64],
        first: usize,
        tokens: &[u32],
        block_size: usize,
        medium: Medium,
        namespace: &Namespace,
    ) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: names[first..].to_vec(),
            parent_block_hash: first.checked_sub(1).map(|p| names[p]),
            token_ids: tokens[first * block_size..names.len() * block_size].to_vec(),
            block_size,
            medium,
            namespace: namespace.clone(),
        }
    }
}

/// The one way events are put together: every producer (the engine's block
/// index, its idle sequences, the prefix trie) adds what changed and hands
/// the batch to its sink, so runs of stored blocks are merged, parents named
/// and partial blocks left out the same way everywhere.
///
/// ```
/// use kvcache_api::events::{EventBatch, KvEvent, Medium};
/// use kvcache_api::Namespace;
///
/// let mut batch = EventBatch::new(2, Medium::Device);
/// let ns = Namespace::shared();
/// batch.stored(&[7, 8], 0, &[1, 2, 3, 4], &ns);
/// batch.stored(&[7, 8, 9], 2, &[1, 2, 3, 4, 5, 6], &ns); // continues the run
/// batch.removed(9);
/// batch.removed(8);
/// let events = batch.into_events();
/// assert_eq!(events.len(), 2);
/// let KvEvent::BlockStored { block_hashes, parent_block_hash, .. } = &events[0] else { panic!() };
/// assert_eq!((block_hashes.as_slice(), *parent_block_hash), (&[7, 8, 9][..], None));
/// assert_eq!(events[1], KvEvent::BlockRemoved { block_hashes: vec![9, 8], medium: Medium::Device });
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventBatch {
    block_size: usize,
    medium: Medium,
    events: Vec<KvEvent>,
}

impl EventBatch {
    /// An empty batch of blocks of `block_size` tokens kept in `medium`.
    pub fn new(block_size: usize, medium: Medium) -> Self {
        EventBatch {
            block_size,
            medium,
            events: Vec::new(),
        }
    }

    /// Tokens per reported block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks `names[first..]` of one chain stored ([`KvEvent::stored_run`]'s
    /// arguments); merged into the batch's last event when that stored the
    /// blocks just before them in the same namespace.
    pub fn stored(&mut self, names: &[u64], first: usize, tokens: &[u32], namespace: &Namespace) {
        if first >= names.len() {
            return;
        }
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            namespace: last_namespace,
            ..
        }) = self.events.last_mut()
        {
            if first > 0 && block_hashes.last() == Some(&names[first - 1]) && last_namespace == namespace {
                block_hashes.extend_from_slice(&names[first..]);
                token_ids.extend_from_slice(&tokens[first * self.block_size..names.len() * self.block_size]);
                return;
            }
        }
        self.events.push(KvEvent::stored_run(
            names,
            first,
            tokens,
            self.block_size,
            self.medium,
            namespace,
        ));
    }

    /// Block `name` removed; merged into the batch's last event when that
    /// removed blocks too.
    pub fn removed(&mut self, name: u64) {
        if let Some(KvEvent::BlockRemoved { block_hashes, .. }) = self.events.last_mut() {
            block_hashes.push(name);
            return;
        }
        self.events.push(KvEvent::BlockRemoved {
            block_hashes: vec![name],
            medium: self.medium,
        });
    }

    /// Every block gone.
    pub fn cleared(&mut self) {
        self.events.push(KvEvent::AllBlocksCleared);
    }

    /// A block index's changes ([`BlockChange`], in order): its full blocks
    /// of [`block_size`](Self::block_size) tokens stored and removed, its
    /// shorter tails left out (a router counts whole blocks; a tail is
    /// always a leaf, so no full block follows one).
    pub fn block_changes(&mut self, changes: &[BlockChange]) {
        for change in changes {
            match change {
                BlockChange::Stored {
                    key,
                    parent,
                    tokens,
                    namespace,
                } if tokens.len() == self.block_size => {
                    let name = block_hash(&key.0);
                    match parent.is_root() {
                        true => self.stored(&[name], 0, tokens, namespace),
                        false => {
                            // The run is [parent, this]; its tokens are the
                            // parent's (unused) and this block's.
                            let mut run = vec![0; self.block_size];
                            run.extend_from_slice(tokens);
                            self.stored(&[block_hash(&parent.0), name], 1, &run, namespace);
                        }
                    }
                }
                BlockChange::Removed { key, len } if *len == self.block_size => {
                    self.removed(block_hash(&key.0))
                }
                _ => {}
            }
        }
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The events, in order.
    pub fn into_events(self) -> Vec<KvEvent> {
        self.events
    }

    /// Hands the events to `sink` as one batch, unless there are none.
    pub fn publish(self, sink: &dyn KvEventSink) {
        if !self.events.is_empty() {
            sink.publish(self.events);
        }
    }
}

/// Where a cache's events go.
///
/// `publish` never blocks: it hands the events over and returns, and a sink
/// that cannot take them (a full queue, a slow consumer) drops them and
/// counts what it dropped. Events of one call stay together and in order.
pub trait KvEventSink: Send + Sync + std::fmt::Debug {
    /// Hands over one batch of events, in order.
    fn publish(&self, events: Vec<KvEvent>);
}

/// A sink that keeps every event in memory, for tests.
///
/// ```
/// use kvcache_api::events::{EventLog, KvEvent, KvEventSink};
///
/// let log = EventLog::new();
/// log.publish(vec![KvEvent::AllBlocksCleared]);
/// assert_eq!(log.take(), vec![KvEvent::AllBlocksCleared]);
/// assert!(log.take().is_empty());
/// ```
#[derive(Debug, Default)]
pub struct EventLog {
    events: Mutex<Vec<KvEvent>>,
}

impl EventLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every event published since the last `take`, in order.
    pub fn take(&self) -> Vec<KvEvent> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl KvEventSink for EventLog {
    fn publish(&self, events: Vec<KvEvent>) {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(events);
    }
}

/// The 64-bit block hash events carry for a 32-byte block key: the key read
/// as one big-endian integer, truncated to its low 64 bits (its last 8 bytes,
/// big-endian). This is vLLM's own conversion of its SHA-256 block hashes
/// (`maybe_convert_block_hash`), so keys that are digests name blocks the way
/// vLLM's do.
///
/// ```
/// let mut key = [0u8; 32];
/// key[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
/// assert_eq!(kvcache_api::events::block_hash(&key), 0x0102_0304_0506_0708);
/// ```
pub fn block_hash(key: &[u8; 32]) -> u64 {
    let mut last = [0u8; 8];
    last.copy_from_slice(&key[24..]);
    u64::from_be_bytes(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hash_is_the_low_64_bits_of_the_big_endian_key() {
        let key: [u8; 32] = std::array::from_fn(|i| i as u8);
        assert_eq!(block_hash(&key), 0x1819_1a1b_1c1d_1e1f);
        assert_eq!(block_hash(&[0xff; 32]), u64::MAX);
    }

    #[test]
    fn mediums_use_vllms_names() {
        let names: Vec<_> = [Medium::Device, Medium::HostMemory, Medium::Disk, Medium::Redis]
            .into_iter()
            .map(Medium::as_str)
            .collect();
        assert_eq!(names, ["GPU", "CPU", "STORAGE", "REDIS"]);
    }

    #[test]
    fn the_log_keeps_order_across_batches() {
        let log = EventLog::new();
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![7],
            medium: Medium::Device,
        };
        log.publish(vec![KvEvent::AllBlocksCleared]);
        log.publish(vec![removed.clone()]);
        assert_eq!(log.take(), vec![KvEvent::AllBlocksCleared, removed]);
    }
}
