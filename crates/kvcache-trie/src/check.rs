//! The invariant checker tests run after every operation.

use std::collections::BTreeSet;
use std::fmt;

use kvcache_api::{CacheError, Namespace, Result, SnapshotCache};

use super::arena::{Node, NodeId, NONE, ROOT};
use super::cache::PrefixCache;

/// A broken invariant of a [`PrefixCache`], as [`PrefixCache::try_check`] reports
/// it: the first one found, described precisely enough to log (which node or
/// layer, what it holds and what it should hold).
///
/// A violation means a bug in the trie or in a layer cache, never bad caller
/// input; an engine that finds one should log it and stop using the trie (drop
/// it and start a new one). It converts into
/// [`CacheError::InvalidState`] for code that returns `kvcache_api::Result`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrieViolation {
    message: String,
}

impl TrieViolation {
    fn new(message: String) -> Self {
        TrieViolation { message }
    }

    /// What is broken, in words.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for TrieViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "prefix trie invariant violated: {}", self.message)
    }
}

impl std::error::Error for TrieViolation {}

impl From<TrieViolation> for CacheError {
    fn from(v: TrieViolation) -> Self {
        CacheError::InvalidState(v.to_string())
    }
}

/// `assert!` that returns a [`TrieViolation`] instead of panicking.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(TrieViolation::new(format!($($msg)+)));
        }
    };
}

/// `assert_eq!` that returns a [`TrieViolation`] (with both values) instead of
/// panicking.
macro_rules! ensure_eq {
    ($left:expr, $right:expr, $($msg:tt)+) => {
        match (&$left, &$right) {
            (left, right) => {
                if !(*left == *right) {
                    return Err(TrieViolation::new(format!(
                        "{} (left: {:?}, right: {:?})",
                        format_args!($($msg)+),
                        left,
                        right
                    )));
                }
            }
        }
    };
}

impl<C: SnapshotCache> PrefixCache<C> {
    /// Checks every invariant of the trie and of the live caches at rest,
    /// panicking with a precise message on the first violation. Walks the whole
    /// trie: meant for tests, after every operation. An engine that wants to
    /// log a violation rather than crash calls [`try_check`](Self::try_check).
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
    /// - every live cache stands at the active path's end;
    /// - with an event sink ([`set_event_sink`](Self::set_event_sink)), every
    ///   block reported stored and not removed since is a full block some
    ///   path holds, and along each path the reported blocks come first.
    pub fn check(&self) {
        if let Err(violation) = self.try_check() {
            panic!("{}", violation.message());
        }
    }

    /// Checks the invariants of [`check`](Self::check), returning the first
    /// violation as an error instead of panicking. Changes nothing; walks the
    /// whole trie (a step per node and snapshot), so an engine runs it when it
    /// suspects trouble or on a debug endpoint, not per token.
    ///
    /// ```
    /// use kvcache_trie::{fake::{Counters, FakeKv}, PrefixCache};
    ///
    /// let counters = Counters::new();
    /// let trie = PrefixCache::new(vec![FakeKv::new(&counters), FakeKv::new(&counters)], 1 << 20)?;
    /// if let Err(violation) = trie.try_check() {
    ///     eprintln!("dropping the prefix trie: {violation}");
    /// }
    /// assert!(trie.try_check().is_ok());
    /// # Ok::<(), kvcache_api::CacheError>(())
    /// ```
    pub fn try_check(&self) -> std::result::Result<(), TrieViolation> {
        self.try_check_structure()?;
        let end = self.slot(self.frontier())?.end;
        for (i, cache) in self.caches.iter().enumerate() {
            ensure_eq!(
                cache.offset(),
                end,
                "layer {i} holds {} tokens but the active path ends at {end}",
                cache.offset()
            );
        }
        Ok(())
    }

    /// Every invariant of [`check`](Self::check) but the live caches' offsets,
    /// panicking on a violation.
    pub(super) fn check_structure(&self) {
        if let Err(violation) = self.try_check_structure() {
            panic!("{}", violation.message());
        }
    }

    /// The node in slot `id`, or a violation when no such slot exists.
    fn slot(&self, id: NodeId) -> std::result::Result<&Node, TrieViolation> {
        self.arena
            .nodes
            .get(id as usize)
            .ok_or_else(|| TrieViolation::new(format!("node {id} is no slot of the arena")))
    }

    /// Every invariant of [`check`](Self::check) but the live caches' offsets.
    pub(super) fn try_check_structure(&self) -> std::result::Result<(), TrieViolation> {
        let layers = self.caches.len();
        ensure_eq!(
            self.roots.get(&Namespace::shared()),
            Some(&ROOT),
            "the shared namespace's root is not slot {ROOT}"
        );
        ensure_eq!(
            self.roots.len(),
            self.root_names.len(),
            "the root map and its inverse differ in size"
        );
        for (name, &id) in &self.roots {
            ensure_eq!(
                self.root_names.get(&id),
                Some(name),
                "root {id} of namespace {name:?} is named otherwise in the inverse map"
            );
            let root = self.slot(id)?;
            ensure!(root.live, "the root slot {id} of {name:?} is dead");
            ensure!(
                root.tokens.is_empty() && root.start == 0 && root.end == 0,
                "the root of {name:?} has an edge"
            );
            ensure_eq!(root.parent, NONE, "the root of {name:?} has a parent");
            ensure!(
                root.snaps.is_empty() && root.n_snaps == 0,
                "the root of {name:?} holds snapshots"
            );
            ensure!(
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
            let n = self.slot(id)?;
            reached += 1;
            ensure!(n.live, "node {id} is reachable but dead");
            if !self.root_names.contains_key(&id) {
                let p = self.slot(n.parent)?;
                ensure!(p.live, "node {id}'s parent {} is dead", n.parent);
                ensure_eq!(
                    n.start,
                    p.end,
                    "node {id} starts at {} but its parent ends at {}",
                    n.start,
                    p.end
                );
                ensure!(!n.tokens.is_empty(), "node {id} has an empty edge");
                ensure_eq!(
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
                let child = self.slot(c)?;
                ensure!(child.live, "node {id} lists dead child {c}");
                ensure_eq!(
                    child.parent,
                    id,
                    "child {c} of node {id} names {} as its parent",
                    child.parent
                );
                ensure_eq!(
                    child.tokens.first(),
                    Some(&token),
                    "node {id} lists child {c} under token {token}, its edge starts with {:?}",
                    child.tokens.first()
                );
                ensure!(
                    last_token.is_none_or(|t| t < token),
                    "node {id}'s children are not sorted by distinct first tokens ({last_token:?} then {token})"
                );
                last_token = Some(token);
                stack.push(c);
            }

            // Snapshots.
            ensure!(
                n.snaps.is_empty() || n.snaps.len() == layers,
                "node {id} has {} snapshot slots for {layers} layers",
                n.snaps.len()
            );
            let mut node_bytes = 0;
            let mut node_snaps = 0;
            for (i, s) in n.snaps.iter().enumerate() {
                if let Some(s) = s {
                    let r = s.range();
                    ensure!(
                        r.end == n.end && r.start < r.end,
                        "node {id} [{}, {}) holds a layer {i} snapshot of {r:?}",
                        n.start,
                        n.end
                    );
                    node_bytes += s.size_bytes();
                    node_snaps += 1;
                }
            }
            ensure_eq!(
                n.bytes,
                node_bytes,
                "node {id} tracks {} snapshot bytes, holds {node_bytes}",
                n.bytes
            );
            ensure_eq!(
                n.n_snaps,
                node_snaps,
                "node {id} counts {} snapshots, holds {node_snaps}",
                n.n_snaps
            );
            bytes += node_bytes;
            snapshots += node_snaps;
            if n.active {
                active_bytes += node_bytes;
            }

            // Eviction index.
            let want = self.candidate_key(id);
            ensure_eq!(
                n.key,
                want,
                "node {id} is indexed under {:?}, should be {want:?}",
                n.key
            );
            if let Some(key) = want {
                ensure!(
                    self.index.contains(&key),
                    "eviction index misses node {id} ({key:?})"
                );
                candidates += 1;
            }
            if n.active {
                active_marked += 1;
            }
        }
        ensure_eq!(
            reached,
            self.arena.live,
            "{reached} nodes reachable, {} counted live",
            self.arena.live
        );
        let dead: BTreeSet<NodeId> = self.arena.free.iter().copied().collect();
        ensure_eq!(
            dead.len(),
            self.arena.free.len(),
            "the free list holds a slot twice"
        );
        ensure_eq!(
            self.arena.nodes.len(),
            self.arena.live + dead.len(),
            "{} slots: {} live and {} free",
            self.arena.nodes.len(),
            self.arena.live,
            dead.len()
        );
        for &id in &dead {
            let n = self.slot(id)?;
            ensure!(
                !n.live && n.snaps.is_empty() && n.key.is_none(),
                "free slot {id} is in use"
            );
        }
        ensure_eq!(
            self.paged_out,
            bytes,
            "tracking {} paged-out bytes, snapshots hold {bytes}",
            self.paged_out
        );
        ensure_eq!(
            self.snapshots,
            snapshots,
            "counting {} snapshots, nodes hold {snapshots}",
            self.snapshots
        );
        ensure_eq!(
            self.index.len(),
            candidates,
            "eviction index holds {} keys for {candidates} candidates",
            self.index.len()
        );

        // Active path.
        let first = self.active.first().copied();
        ensure!(
            first.is_some_and(|id| self.root_names.contains_key(&id)),
            "the active path does not start at a namespace's root: {first:?}"
        );
        for pair in self.active.windows(2) {
            ensure_eq!(
                self.slot(pair[1])?.parent,
                pair[0],
                "active path: node {} does not follow node {}",
                pair[1],
                pair[0]
            );
        }
        for &id in &self.active {
            ensure!(
                self.slot(id)?.active,
                "node {id} is on the active path but not marked"
            );
        }
        ensure_eq!(
            active_marked,
            self.active.len(),
            "nodes marked active off the active path"
        );

        // Budget: above it only with every snapshot on the active path (which
        // also leaves no eviction candidate).
        ensure!(
            self.paged_out <= self.budget || active_bytes == self.paged_out,
            "{} paged-out bytes over the {}-byte budget, {} of them off the active path",
            self.paged_out,
            self.budget,
            self.paged_out - active_bytes
        );
        ensure!(
            self.paged_out <= self.budget || self.index.is_empty(),
            "over the budget with {} eviction candidates left",
            self.index.len()
        );
        ensure_eq!(
            self.over_budget,
            self.paged_out > self.budget,
            "over_budget says {} with {} paged-out bytes for a {}-byte budget",
            self.over_budget,
            self.paged_out,
            self.budget
        );
        self.try_check_reported()
    }

    /// With an event sink: every block reported stored and not removed is
    /// held by some path, and along every path the reported blocks are a
    /// prefix (so each one's parent was reported before it).
    fn try_check_reported(&self) -> std::result::Result<(), TrieViolation> {
        let Some(reported) = self.reported_blocks() else {
            return Ok(());
        };
        let paths = self.held_block_paths();
        for (leaf, names) in &paths {
            let prefix = names.iter().take_while(|n| reported.contains(n)).count();
            ensure!(
                names[prefix..].iter().all(|n| !reported.contains(n)),
                "the path to node {leaf} has reported blocks after its unreported block {prefix}"
            );
        }
        let held: std::collections::HashSet<u64> = paths.into_iter().flat_map(|(_, names)| names).collect();
        let stale = reported.iter().filter(|n| !held.contains(n)).count();
        ensure_eq!(stale, 0, "blocks reported stored that no path holds");
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{feed_all, Counters, FakeKv, FakeLayer};

    fn trie() -> PrefixCache<FakeKv> {
        let counters = Counters::new();
        let caches = vec![FakeKv::new(&counters), FakeKv::new(&counters)];
        let mut trie = PrefixCache::new(caches, 1 << 20).unwrap();
        let mut session = trie.begin(&[1, 2, 3, 4]).unwrap();
        session
            .prefill(|tokens, caches| {
                feed_all(caches, tokens);
                Ok::<(), CacheError>(())
            })
            .unwrap();
        session.close().unwrap();
        trie
    }

    #[test]
    fn a_sound_trie_checks_ok() {
        let trie = trie();
        assert_eq!(trie.try_check(), Ok(()));
        trie.check();
    }

    #[test]
    fn a_broken_invariant_is_an_error_not_a_panic() {
        let mut trie = trie();
        trie.paged_out += 7;
        let violation = trie.try_check().unwrap_err();
        assert!(violation.message().contains("paged-out bytes"), "{violation}");
        let error: CacheError = violation.into();
        assert!(matches!(error, CacheError::InvalidState(_)), "{error:?}");

        // A dangling parent link is reported, not an index out of bounds.
        let mut trie = self::trie();
        let leaf = *trie.active.last().unwrap();
        trie.arena.get_mut(leaf).parent = 999;
        assert!(trie.try_check().is_err());
    }

    #[test]
    #[should_panic(expected = "paged-out bytes")]
    fn check_still_panics() {
        let mut trie = trie();
        trie.paged_out += 7;
        trie.check();
    }

    #[test]
    fn layers_off_the_path_are_reported() {
        let mut trie = trie();
        trie.caches[1].feed(&[5]);
        let violation = trie.try_check().unwrap_err();
        assert!(violation.message().contains("layer 1"), "{violation}");
    }
}
