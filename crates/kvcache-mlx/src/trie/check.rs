//! The invariant checker tests run after every operation.

use std::collections::BTreeSet;

use kvcache_api::{CacheError, Namespace, Result, SnapshotCache};

use super::arena::{NodeId, NONE, ROOT};
use super::cache::PrefixCache;

impl<C: SnapshotCache> PrefixCache<C> {
    /// Checks every invariant of the trie and of the live caches at rest,
    /// panicking with a precise message on the first violation. Walks the whole
    /// trie: meant for tests, after every operation.
    ///
    /// - every namespace has one root (the shared one in slot 0), with an empty
    ///   edge at offset 0, no parent and no snapshots, and the root map and its
    ///   inverse agree; a root other than the shared one holds children or is
    ///   on the active path (empty ones are released);
    /// - every other node's start equals its parent's end and its edge holds
    ///   `end - start > 0` tokens;
    /// - parent and child links agree; siblings' edges start with distinct
    ///   tokens, and children are sorted by that token;
    /// - every node is reachable from exactly one root, and the free list holds
    ///   exactly the dead slots;
    /// - each snapshot ends at its node's end; per-node and total byte and
    ///   snapshot counts equal the sums of `size_bytes` and of snapshots;
    /// - the eviction index holds exactly the eligible nodes (not a root, not
    ///   active, some snapshot) under their current keys;
    /// - the active path is a chain down from one root and exactly its nodes
    ///   are marked active;
    /// - the snapshots fit the budget, or every snapshot lies on the active
    ///   path (then `over_budget` is set, and only then);
    /// - every live cache stands at the active path's end.
    pub fn check(&self) {
        self.check_structure();
        let end = self.arena.get(self.frontier()).end;
        for (i, cache) in self.caches.iter().enumerate() {
            assert_eq!(
                cache.offset(),
                end,
                "layer {i} holds {} tokens but the active path ends at {end}",
                cache.offset()
            );
        }
    }

    /// Every invariant of [`check`](Self::check) but the live caches' offsets.
    pub(super) fn check_structure(&self) {
        let layers = self.caches.len();
        assert_eq!(
            self.roots.get(&Namespace::shared()),
            Some(&ROOT),
            "the shared namespace's root is not slot {ROOT}"
        );
        assert_eq!(
            self.roots.len(),
            self.root_names.len(),
            "the root map and its inverse differ in size"
        );
        for (name, &id) in &self.roots {
            assert_eq!(
                self.root_names.get(&id),
                Some(name),
                "root {id} of namespace {name:?} is named otherwise in the inverse map"
            );
            let root = self.arena.get(id);
            assert!(root.live, "the root slot {id} of {name:?} is dead");
            assert!(
                root.tokens.is_empty() && root.start == 0 && root.end == 0,
                "the root of {name:?} has an edge"
            );
            assert_eq!(root.parent, NONE, "the root of {name:?} has a parent");
            assert!(
                root.snaps.is_empty() && root.n_snaps == 0,
                "the root of {name:?} holds snapshots"
            );
            assert!(
                id == ROOT || root.active || !root.children.is_empty(),
                "the root of {name:?} is empty and inactive but was kept"
            );
        }

        let mut reached = 0usize;
        let mut bytes = 0usize;
        let mut snapshots = 0usize;
        let mut active_bytes = 0usize;
        let mut candidates = 0usize;
        let mut active_marked = 0usize;
        let mut stack: Vec<NodeId> = self.roots.values().copied().collect();
        while let Some(id) = stack.pop() {
            let n = self.arena.get(id);
            reached += 1;
            assert!(n.live, "node {id} is reachable but dead");
            if !self.root_names.contains_key(&id) {
                let p = self.arena.get(n.parent);
                assert!(p.live, "node {id}'s parent {} is dead", n.parent);
                assert_eq!(
                    n.start, p.end,
                    "node {id} starts at {} but its parent ends at {}",
                    n.start, p.end
                );
                assert!(!n.tokens.is_empty(), "node {id} has an empty edge");
                assert_eq!(
                    n.tokens.len(),
                    n.end - n.start,
                    "node {id} has {} edge tokens for [{}, {})",
                    n.tokens.len(),
                    n.start,
                    n.end
                );
            }
            let mut last_token = None;
            for &(token, c) in &n.children {
                let child = self.arena.get(c);
                assert!(child.live, "node {id} lists dead child {c}");
                assert_eq!(
                    child.parent, id,
                    "child {c} of node {id} names {} as its parent",
                    child.parent
                );
                assert_eq!(
                    child.tokens.first(),
                    Some(&token),
                    "node {id} lists child {c} under token {token}, its edge starts with {:?}",
                    child.tokens.first()
                );
                assert!(
                    last_token.is_none_or(|t| t < token),
                    "node {id}'s children are not sorted by distinct first tokens ({last_token:?} then {token})"
                );
                last_token = Some(token);
                stack.push(c);
            }

            // Snapshots.
            assert!(
                n.snaps.is_empty() || n.snaps.len() == layers,
                "node {id} has {} snapshot slots for {layers} layers",
                n.snaps.len()
            );
            let mut node_bytes = 0;
            let mut node_snaps = 0;
            for (i, s) in n.snaps.iter().enumerate() {
                if let Some(s) = s {
                    let r = s.range();
                    assert!(
                        r.end == n.end && r.start < r.end,
                        "node {id} [{}, {}) holds a layer {i} snapshot of {r:?}",
                        n.start,
                        n.end
                    );
                    node_bytes += s.size_bytes();
                    node_snaps += 1;
                }
            }
            assert_eq!(
                n.bytes, node_bytes,
                "node {id} tracks {} snapshot bytes, holds {node_bytes}",
                n.bytes
            );
            assert_eq!(
                n.n_snaps, node_snaps,
                "node {id} counts {} snapshots, holds {node_snaps}",
                n.n_snaps
            );
            bytes += node_bytes;
            snapshots += node_snaps;
            if n.active {
                active_bytes += node_bytes;
            }

            // Eviction index.
            let want = Self::candidate_key(id, n);
            assert_eq!(
                n.key, want,
                "node {id} is indexed under {:?}, should be {want:?}",
                n.key
            );
            if let Some(key) = want {
                assert!(
                    self.index.contains(&key),
                    "eviction index misses node {id} ({key:?})"
                );
                candidates += 1;
            }
            if n.active {
                active_marked += 1;
            }
        }
        assert_eq!(
            reached, self.arena.live,
            "{reached} nodes reachable, {} counted live",
            self.arena.live
        );
        let dead: BTreeSet<NodeId> = self.arena.free.iter().copied().collect();
        assert_eq!(
            dead.len(),
            self.arena.free.len(),
            "the free list holds a slot twice"
        );
        assert_eq!(
            self.arena.nodes.len(),
            self.arena.live + dead.len(),
            "{} slots: {} live and {} free",
            self.arena.nodes.len(),
            self.arena.live,
            dead.len()
        );
        for &id in &dead {
            let n = self.arena.get(id);
            assert!(
                !n.live && n.snaps.is_empty() && n.key.is_none(),
                "free slot {id} is in use"
            );
        }
        assert_eq!(
            self.paged_out, bytes,
            "tracking {} paged-out bytes, snapshots hold {bytes}",
            self.paged_out
        );
        assert_eq!(
            self.snapshots, snapshots,
            "counting {} snapshots, nodes hold {snapshots}",
            self.snapshots
        );
        assert_eq!(
            self.index.len(),
            candidates,
            "eviction index holds {} keys for {candidates} candidates",
            self.index.len()
        );

        // Active path.
        let first = self.active.first().copied();
        assert!(
            first.is_some_and(|id| self.root_names.contains_key(&id)),
            "the active path does not start at a namespace's root: {first:?}"
        );
        for pair in self.active.windows(2) {
            assert_eq!(
                self.arena.get(pair[1]).parent,
                pair[0],
                "active path: node {} does not follow node {}",
                pair[1],
                pair[0]
            );
        }
        for &id in &self.active {
            assert!(
                self.arena.get(id).active,
                "node {id} is on the active path but not marked"
            );
        }
        assert_eq!(
            active_marked,
            self.active.len(),
            "nodes marked active off the active path"
        );

        // Budget: above it only with every snapshot on the active path (which
        // also leaves no eviction candidate).
        assert!(
            self.paged_out <= self.budget || active_bytes == self.paged_out,
            "{} paged-out bytes over the {}-byte budget, {} of them off the active path",
            self.paged_out,
            self.budget,
            self.paged_out - active_bytes
        );
        assert!(
            self.paged_out <= self.budget || self.index.is_empty(),
            "over the budget with {} eviction candidates left",
            self.index.len()
        );
        assert_eq!(
            self.over_budget,
            self.paged_out > self.budget,
            "over_budget says {} with {} paged-out bytes for a {}-byte budget",
            self.over_budget,
            self.paged_out,
            self.budget
        );
    }

    /// The layers' common offset, or an error when they disagree.
    pub(super) fn uniform_offset(&self) -> Result<usize> {
        let offset = self.min_offset();
        if self.caches.iter().any(|c| c.offset() != offset) {
            return Err(CacheError::InvalidState(format!(
                "the layers stand at different offsets: {:?}",
                self.caches.iter().map(SnapshotCache::offset).collect::<Vec<_>>()
            )));
        }
        Ok(offset)
    }
}
