//! The prefix ends a [`LayerGroupCache`](super::LayerGroupCache) keeps: where
//! a later prompt can resume, and which window blocks each of them needs.
//!
//! A global group keeps every retained chain whole, as the causal cache does
//! for a model without windows. A window group keeps, per retained *end* (a
//! finished sequence's last position), only the tail of the chain within its
//! window memory before that end. This registry remembers each end's tail
//! blocks so that an end that stops being useful frees exactly the blocks no
//! other end still needs. Plain bookkeeping: the groups' indexes hold the
//! cells; this holds keys.
//!
//! An end stops being kept when
//! - a group loses one of its blocks (evicted least recently used by a pass
//!   that needed cells, aged, forgotten): it is no longer resumable;
//! - a sequence that resumed from within its last block is kept in its turn
//!   (the next turn of a conversation, or its last answer replaced): the new
//!   end takes its place, so a conversation keeps one tail, not one per turn.
//!   A *junction* (a prefix kept while its sequence went on, where later
//!   prompts share a prefix and part) is never replaced this way.
//!
//! Invariants (checked by [`LayerGroupCache::check`](super::LayerGroupCache::check)):
//! every end's blocks are indexed in their groups, every block of a window
//! group is some end's, and every leaf of the global group is an end (a block
//! leading to no end is forgotten: no prompt could resume in it).

use std::collections::{HashMap, HashSet};

use kvcache_api::block_key::BlockKey;
use kvcache_api::{Pos, SeqId};

/// One kept end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct End {
    /// One past its last position: the chain's length.
    pub len: Pos,
    /// Tokens per full block of its chain.
    pub block: Pos,
    /// Kept while its sequence went on (a shared-prefix junction): no
    /// sequence resuming from it replaces it.
    pub junction: bool,
    /// The window blocks kept for it: `(group, key)`.
    pub tails: Vec<(usize, BlockKey)>,
}

/// Kept ends by the key of their chain's last block.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ends {
    ends: HashMap<BlockKey, End>,
    /// Per sequence, the ends it resumed from within their last block.
    origins: HashMap<SeqId, Vec<BlockKey>>,
    /// How many blocks the groups' indexes had removed, together, when the
    /// ends were last compared with the groups.
    seen: u64,
}

impl Ends {
    /// Number of ends kept.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// The end whose chain's last block is `last`.
    pub fn get(&self, last: &BlockKey) -> Option<&End> {
        self.ends.get(last)
    }

    /// The ends, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockKey, &End)> {
        self.ends.iter()
    }

    /// Keeps `end` as the end of the chain whose last block is `last`;
    /// returns the blocks an end it replaces kept that no end needs now.
    pub fn insert(&mut self, last: BlockKey, end: End) -> Vec<(usize, BlockKey)> {
        let old = self.ends.insert(last, end);
        old.map_or_else(Vec::new, |old| self.unneeded(old.tails))
    }

    /// Stops keeping the end `last`; returns it with its blocks that no
    /// other end needs (`None` when it is not kept).
    pub fn release(&mut self, last: &BlockKey) -> Option<(End, Vec<(usize, BlockKey)>)> {
        let mut end = self.ends.remove(last)?;
        let unneeded = self.unneeded(std::mem::take(&mut end.tails));
        Some((end, unneeded))
    }

    fn unneeded(&self, tails: Vec<(usize, BlockKey)>) -> Vec<(usize, BlockKey)> {
        let needed: HashSet<&(usize, BlockKey)> = self.ends.values().flat_map(|e| &e.tails).collect();
        tails.into_iter().filter(|t| !needed.contains(t)).collect()
    }

    /// Whether some end keeps `key` in `group`.
    pub fn needs(&self, group: usize, key: &BlockKey) -> bool {
        self.ends.values().any(|e| e.tails.contains(&(group, *key)))
    }

    /// Notes that `seq` resumed at `len` from the window block `key` of
    /// `group`: every end keeping that block whose last block `len` falls in
    /// is one `seq` continues.
    pub fn resumed(&mut self, seq: SeqId, group: usize, key: &BlockKey, len: Pos) {
        let from: Vec<BlockKey> = self
            .ends
            .iter()
            .filter(|(_, e)| {
                !e.junction && len <= e.len && len > e.len - e.block && e.tails.contains(&(group, *key))
            })
            .map(|(last, _)| *last)
            .collect();
        self.origins.insert(seq, from);
    }

    /// The ends `seq` resumed from (forgotten here).
    pub fn take_origins(&mut self, seq: SeqId) -> Vec<BlockKey> {
        self.origins.remove(&seq).unwrap_or_default()
    }

    /// Whether the groups removed blocks since the last call, given their
    /// count of removals together (recorded for the next call).
    pub fn removals_since(&mut self, removed: u64) -> bool {
        let changed = removed != self.seen;
        self.seen = removed;
        changed
    }

    /// The ends a block of which is gone: `holds(group, key)` says whether
    /// `group` still indexes `key`, `global(key)` whether the chain's last
    /// block is still kept whole.
    pub fn broken(
        &self,
        mut holds: impl FnMut(usize, &BlockKey) -> bool,
        mut global: impl FnMut(&BlockKey) -> bool,
    ) -> Vec<BlockKey> {
        self.ends
            .iter()
            .filter(|(last, e)| !global(last) || e.tails.iter().any(|(g, k)| !holds(*g, k)))
            .map(|(last, _)| *last)
            .collect()
    }

    /// Forgets every end.
    pub fn clear(&mut self) {
        self.ends.clear();
        self.origins.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> BlockKey {
        BlockKey([n; 32])
    }

    #[test]
    fn a_released_end_frees_only_what_no_other_end_needs() {
        let mut ends = Ends::default();
        let a = End {
            len: 40,
            block: 16,
            junction: false,
            tails: vec![(0, key(1)), (0, key(2))],
        };
        let b = End {
            len: 48,
            block: 16,
            junction: false,
            tails: vec![(0, key(2)), (0, key(3))],
        };
        assert!(ends.insert(key(10), a).is_empty());
        assert!(ends.insert(key(11), b).is_empty());
        assert!(ends.needs(0, &key(2)));
        assert_eq!(ends.release(&key(10)).unwrap().1, vec![(0, key(1))]);
        assert!(ends.release(&key(10)).is_none(), "released twice");
        assert_eq!(ends.release(&key(11)).unwrap().1, vec![(0, key(2)), (0, key(3))]);
        assert_eq!(ends.len(), 0);
    }

    #[test]
    fn a_sequence_continues_the_ends_whose_last_block_it_resumed_in() {
        let mut ends = Ends::default();
        let end = |len| End {
            len,
            block: 16,
            junction: false,
            tails: vec![(0, key(1))],
        };
        ends.insert(key(10), end(40));
        ends.insert(key(11), end(70));
        // Resuming at 30 parts from the first end within its last block
        // (25..40), from the second far before its end.
        ends.resumed(3, 0, &key(1), 30);
        assert_eq!(ends.take_origins(3), vec![key(10)]);
        assert!(ends.take_origins(3).is_empty());
        ends.resumed(4, 0, &key(2), 38);
        assert!(ends.take_origins(4).is_empty(), "another block");
        // A junction is never continued away.
        ends.insert(
            key(12),
            End {
                junction: true,
                ..end(90)
            },
        );
        ends.resumed(5, 0, &key(1), 88);
        assert!(ends.take_origins(5).is_empty(), "a junction");
    }

    #[test]
    fn broken_ends_are_those_missing_a_block() {
        let mut ends = Ends::default();
        ends.insert(
            key(10),
            End {
                len: 40,
                block: 16,
                junction: false,
                tails: vec![(0, key(1))],
            },
        );
        ends.insert(
            key(11),
            End {
                len: 40,
                block: 16,
                junction: false,
                tails: vec![(0, key(2))],
            },
        );
        assert_eq!(ends.broken(|_, k| *k != key(2), |_| true), vec![key(11)]);
        assert_eq!(ends.broken(|_, _| true, |l| *l != key(10)), vec![key(10)]);
        assert!(ends.removals_since(1));
        assert!(!ends.removals_since(1));
    }
}
