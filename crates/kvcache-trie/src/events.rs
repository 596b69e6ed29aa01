//! KV events from the trie: the whole blocks its paths hold, reported to a
//! [`KvEventSink`] as a cache-aware router reads them
//! ([`kvcache_api::events`]).
//!
//! A path of the trie, cut from its namespace's root into blocks of
//! `block_tokens` tokens, holds its full blocks; each block is named by the
//! low 64 bits of its chained [`BlockKey`] under the model's fingerprint and
//! the path's namespace (the store's keys, so the two never name one block
//! differently). A block belongs to the node whose edge holds its last token,
//! so:
//!
//! - the set of blocks the trie holds grows only where a path grows
//!   (`advance`), and is reported when a session closes, for the whole active
//!   path at once: the blocks not yet reported are a run at the path's end
//!   (what was reported is prefix-closed along every path), sent as one
//!   `BlockStored` whose parent is the block before the run;
//! - it shrinks only where a leaf is removed: the leaf's blocks go as one
//!   `BlockRemoved`. Splits, merges and a branch point losing its snapshots
//!   keep every path's tokens, so they report nothing (a path through a
//!   branch point without snapshots costs its edge again: the router's count
//!   is then an upper bound, as it is for any cache the router cannot see
//!   inside);
//! - [`PrefixCache::clear`] reports `AllBlocksCleared`.
//!
//! Every block is reported in one medium, [`Medium::Device`]: the live caches
//! and the paged-out snapshots are one tier to a router (both restore without
//! the store). Tails shorter than a block are not reported.

use std::collections::HashSet;
use std::sync::Arc;

use kvcache_api::block_key::{BlockKey, KeyChain, Scope};
use kvcache_api::events::{block_hash, EventBatch, KvEventSink, Medium};
use kvcache_api::{CacheError, Fingerprint, Namespace, Result, SnapshotCache};

use super::arena::{NodeId, NONE};
use super::cache::PrefixCache;

/// Where a trie reports its blocks, and what it has reported.
pub(crate) struct BlockEvents {
    sink: Arc<dyn KvEventSink>,
    block_tokens: usize,
    fingerprint: Fingerprint,
    /// The names of the blocks reported stored and not removed since.
    reported: HashSet<u64>,
}

impl std::fmt::Debug for BlockEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockEvents")
            .field("block_tokens", &self.block_tokens)
            .field("reported", &self.reported.len())
            .finish()
    }
}

impl BlockEvents {
    /// The chained keys of the full blocks of `tokens` (a path from its
    /// namespace's root).
    fn chain(&self, namespace: &Namespace, tokens: &[u32]) -> Vec<BlockKey> {
        let scope = Scope::new(&self.fingerprint, namespace);
        KeyChain::new(scope, self.block_tokens, tokens)
            .map(|(_, key)| key)
            .collect()
    }
}

impl<C: SnapshotCache> PrefixCache<C> {
    /// Reports the blocks the trie's paths hold to `sink` as KV events in
    /// vLLM's schema ([`kvcache_api::events`]; `kvcache-events` publishes
    /// them over ZMQ for a cache-aware router such as NVIDIA Dynamo's):
    /// `AllBlocksCleared` at once, then `BlockStored` for every full block of
    /// `block_tokens` tokens the trie holds now, and from then on every block
    /// a closed session adds (`BlockStored`, with its tokens, its parent and
    /// its namespace) or an eviction removes (`BlockRemoved`). A block's name
    /// is the low 64 bits of its chained [`BlockKey`] under `fingerprint` and
    /// its namespace ([`block_hash`]). Replaces any sink set before.
    ///
    /// `block_tokens == 0` is an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error that changes
    /// nothing.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use kvcache_api::events::{EventLog, KvEvent};
    /// use kvcache_api::{CacheError, Fingerprint};
    /// use kvcache_trie::fake::{feed_all, Counters, FakeKv};
    /// use kvcache_trie::PrefixCache;
    ///
    /// let counters = Counters::new();
    /// let mut trie = PrefixCache::new(vec![FakeKv::new(&counters)], 1 << 20)?;
    /// let log = Arc::new(EventLog::new());
    /// trie.set_event_sink(log.clone(), 4, Fingerprint([7; 32]))?;
    ///
    /// let mut session = trie.begin(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10])?;
    /// session.prefill(|tokens, caches| {
    ///     feed_all(caches, tokens);
    ///     Ok::<(), CacheError>(())
    /// })?;
    /// session.close()?;
    ///
    /// let events = log.take();
    /// assert_eq!(events[0], KvEvent::AllBlocksCleared);
    /// // Two full blocks of 4 tokens; tokens 9 and 10 are a tail.
    /// let KvEvent::BlockStored { block_hashes, token_ids, .. } = &events[1] else { panic!() };
    /// assert_eq!((block_hashes.len(), &token_ids[..]), (2, &[1, 2, 3, 4, 5, 6, 7, 8][..]));
    /// # Ok::<(), CacheError>(())
    /// ```
    pub fn set_event_sink(
        &mut self,
        sink: Arc<dyn KvEventSink>,
        block_tokens: usize,
        fingerprint: Fingerprint,
    ) -> Result<()> {
        if block_tokens == 0 {
            return Err(CacheError::InvalidArgument(
                "KV events need blocks of at least one token".into(),
            ));
        }
        let mut batch = EventBatch::new(block_tokens, Medium::Device);
        batch.cleared();
        batch.publish(sink.as_ref());
        self.events = Some(BlockEvents {
            sink,
            block_tokens,
            fingerprint,
            reported: HashSet::new(),
        });
        for leaf in self.leaves() {
            self.report_path(leaf);
        }
        Ok(())
    }

    /// Stops reporting blocks; returns the sink, if one was set.
    pub fn remove_event_sink(&mut self) -> Option<Arc<dyn KvEventSink>> {
        self.events.take().map(|events| events.sink)
    }

    /// Reports as stored the full blocks of the path from its root to `id`'s
    /// end that are not reported yet.
    pub(super) fn report_path(&mut self, id: NodeId) {
        let Some(events) = &self.events else { return };
        let (namespace, tokens) = self.path_of(id);
        let chain = events.chain(namespace, &tokens);
        let names: Vec<u64> = chain.iter().map(|key| block_hash(&key.0)).collect();
        // What was reported is prefix-closed along the path: the rest is a run.
        let first = names
            .iter()
            .take_while(|name| events.reported.contains(name))
            .count();
        if first == names.len() {
            return;
        }
        let mut batch = EventBatch::new(events.block_tokens, Medium::Device);
        batch.stored(&names, first, &tokens, namespace);
        let events = self.events.as_mut().expect("checked above");
        events.reported.extend(&names[first..]);
        batch.publish(events.sink.as_ref());
    }

    /// Reports as removed the reported blocks that leaf `id` holds (those
    /// whose last token its edge holds), before it goes.
    pub(super) fn report_leaf_removed(&mut self, id: NodeId) {
        let Some(events) = &self.events else { return };
        let start = self.arena.get(id).start;
        let (namespace, tokens) = self.path_of(id);
        let block = events.block_tokens;
        let gone: Vec<u64> = events
            .chain(namespace, &tokens)
            .iter()
            .enumerate()
            .filter(|&(k, _)| (k + 1) * block > start)
            .map(|(_, key)| block_hash(&key.0))
            .collect();
        let events = self.events.as_mut().expect("checked above");
        let mut batch = EventBatch::new(block, Medium::Device);
        for name in gone.into_iter().filter(|name| events.reported.remove(name)) {
            batch.removed(name);
        }
        batch.publish(events.sink.as_ref());
    }

    /// Reports that every block is gone.
    pub(super) fn report_cleared(&mut self) {
        if let Some(events) = &mut self.events {
            events.reported.clear();
            let mut batch = EventBatch::new(events.block_tokens, Medium::Device);
            batch.cleared();
            batch.publish(events.sink.as_ref());
        }
    }

    /// The names of the blocks reported stored and not removed since (empty
    /// without a sink), for the checker.
    pub(super) fn reported_blocks(&self) -> Option<&HashSet<u64>> {
        self.events.as_ref().map(|events| &events.reported)
    }

    /// Every leaf with the names of the full blocks on its path, root first
    /// (none without a sink), for the checker.
    pub(super) fn held_block_paths(&self) -> Vec<(NodeId, Vec<u64>)> {
        let Some(events) = &self.events else {
            return Vec::new();
        };
        self.leaves()
            .into_iter()
            .map(|leaf| {
                let (namespace, tokens) = self.path_of(leaf);
                let names = events
                    .chain(namespace, &tokens)
                    .iter()
                    .map(|key| block_hash(&key.0))
                    .collect();
                (leaf, names)
            })
            .collect()
    }

    /// Every node without children, roots included, in every namespace.
    fn leaves(&self) -> Vec<NodeId> {
        let mut leaves = Vec::new();
        let mut stack: Vec<NodeId> = self.roots.values().copied().collect();
        while let Some(id) = stack.pop() {
            let node = self.arena.get(id);
            if node.children.is_empty() {
                leaves.push(id);
            }
            stack.extend(node.children.iter().map(|&(_, child)| child));
        }
        leaves
    }

    /// The namespace of node `id` and the tokens from its root to its end.
    fn path_of(&self, id: NodeId) -> (&Namespace, Vec<u32>) {
        let mut edges = Vec::new();
        let mut cur = id;
        loop {
            let node = self.arena.get(cur);
            if node.parent == NONE {
                break;
            }
            edges.push(&node.tokens[..]);
            cur = node.parent;
        }
        let namespace = self.root_names.get(&cur).expect("every root has a namespace");
        (namespace, edges.into_iter().rev().flatten().copied().collect())
    }
}
