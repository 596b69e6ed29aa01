//! The block index: cells kept for later requests by the chained key of the
//! prefix block they hold, independent of sequence ids (vLLM's automatic prefix
//! caching and SGLang's radix cache, on Ollama's cells).
//!
//! A block is a run of consecutive positions `start..start + len` of some
//! sequence, named by a [`BlockKey`] that hashes every token from position 0 to
//! the block's end (so equal keys mean equal prefixes). The index records which
//! cell holds each of its positions and *pins* those cells: they stay used after
//! every sequence holding them is gone, until the block is evicted. A new
//! sequence adopts a chain of indexed blocks by joining their cells (no copy),
//! as `copy_prefix` shares cells.
//!
//! Blocks form a forest: a block's parent is the block ending where it starts
//! ([`BlockKey::ROOT`] for blocks starting at 0). Eviction takes leaves only
//! (a child is useless without its parent), least recently used first, and
//! only those whose eviction frees a cell.
//!
//! The index is the one owner of everything about its blocks (vLLM's block
//! pool): their cells, their tokens, one recency clock, the longest-prefix
//! lookup, and the journal of what it stored and removed
//! ([`BlockIndex::drain_changes`]), written where the change is made so no
//! caller can forget to report one.
//!
//! A cache whose windows trim the positions a chain starts with keeps *tails*
//! instead ([`BlockIndex::tails`]): blocks of a chain near one of its ends,
//! each standing alone (its parent need not be indexed, and no block is
//! another's child), so every block is a leaf and eviction takes the least
//! recently used block, the oldest positions of a chain first. Which tails
//! make a prefix resumable is decided above this index, by the layer-group
//! cache that keeps a chain's whole run of blocks in its global group.
//!
//! Invariants ([`BlockIndex::check`]): every parent is indexed and ends where
//! its children start (a forest; tails: no children at all); each parent's
//! list of children is exactly the blocks naming it; every block holds as
//! many tokens as cells, and its key is the one its scope, parent and tokens
//! hash to (no block's tokens can go stale).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvcache_api::block_key::{BlockKey, Scope};
use kvcache_api::retention::{BlockChange, Prefix};
use kvcache_api::{Fingerprint, Namespace, Pos};

/// One indexed block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Block {
    /// The block ending where this one starts ([`BlockKey::ROOT`] at 0).
    pub parent: BlockKey,
    /// Its first position.
    pub start: Pos,
    /// The cell of each position `start..start + cells.len()`.
    pub cells: Vec<u32>,
    /// The token at each of those positions.
    pub tokens: Vec<u32>,
    /// The model and namespace its key was hashed under.
    pub fingerprint: Fingerprint,
    /// See `fingerprint`.
    pub namespace: Namespace,
    /// When it was last stored or adopted.
    used: Used,
}

/// A block's last use: the index's tick (orders uses, ties impossible) and
/// the time (ages blocks), always set together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Used {
    tick: u64,
    at: Instant,
}

impl Block {
    /// A block after `parent` from position `start`: the cell and the token of
    /// each position, and the scope its key was hashed in.
    pub fn new(
        parent: BlockKey,
        start: Pos,
        cells: Vec<u32>,
        tokens: Vec<u32>,
        fingerprint: Fingerprint,
        namespace: Namespace,
    ) -> Self {
        Block {
            parent,
            start,
            cells,
            tokens,
            fingerprint,
            namespace,
            used: Used {
                tick: 0,
                at: Instant::now(),
            },
        }
    }

    /// One past its last position.
    pub fn end(&self) -> Pos {
        self.start + self.cells.len() as Pos
    }
}

/// Indexed blocks by key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BlockIndex {
    /// Whether blocks stand alone (tails of chains) rather than form a forest.
    tails: bool,
    blocks: HashMap<BlockKey, Block>,
    /// Per parent (the root included), its children in the order indexed.
    children: HashMap<BlockKey, Vec<BlockKey>>,
    /// Cells pinned by blocks, counted with multiplicity.
    cells: usize,
    clock: u64,
    /// Blocks removed ever (tells a caller whether anything went).
    removed: u64,
    /// Changes since the last [`BlockIndex::drain_changes`].
    journal: Vec<BlockChange>,
}

impl BlockIndex {
    /// An empty index of chain tails: blocks that stand alone, each a leaf.
    pub fn tails() -> Self {
        BlockIndex {
            tails: true,
            ..BlockIndex::default()
        }
    }

    /// Whether blocks stand alone ([`BlockIndex::tails`]).
    pub fn keeps_tails(&self) -> bool {
        self.tails
    }

    /// How many blocks were removed since the index was made.
    pub fn removed(&self) -> u64 {
        self.removed
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Cells pinned, counted once per block holding them.
    pub fn cells(&self) -> usize {
        self.cells
    }

    /// The block named `key`.
    pub fn get(&self, key: &BlockKey) -> Option<&Block> {
        self.blocks.get(key)
    }

    /// The blocks following `parent` (the root for first blocks).
    pub fn children(&self, parent: &BlockKey) -> &[BlockKey] {
        self.children.get(parent).map_or(&[], Vec::as_slice)
    }

    fn has_children(&self, key: &BlockKey) -> bool {
        self.children.contains_key(key)
    }

    /// Indexes `block` as `key` after its parent (indexed, or the root), used
    /// now, and journals it. The caller pins the cells.
    pub fn insert(&mut self, key: BlockKey, mut block: Block) {
        let (parent, start) = (block.parent, block.start);
        assert!(!block.cells.is_empty(), "an empty block");
        assert_eq!(
            block.cells.len(),
            block.tokens.len(),
            "block {key:?}: a token per cell"
        );
        assert!(!self.blocks.contains_key(&key), "block {key:?} indexed twice");
        if self.tails {
            assert!(
                parent.is_root() || start > 0,
                "block {key:?}: a first block starts at 0"
            );
        } else if !parent.is_root() {
            let p = self.blocks.get(&parent).expect("the parent is indexed");
            assert_eq!(
                p.end(),
                start,
                "block {key:?} does not start where its parent ends"
            );
        } else {
            assert_eq!(start, 0, "a first block starts at 0");
        }
        if !self.tails {
            self.children.entry(parent).or_default().push(key);
        }
        self.cells += block.cells.len();
        block.used = self.tick();
        self.journal.push(BlockChange::Stored {
            key,
            parent,
            tokens: block.tokens.clone(),
            namespace: block.namespace.clone(),
        });
        self.blocks.insert(key, block);
    }

    fn tick(&mut self) -> Used {
        self.clock += 1;
        Used {
            tick: self.clock,
            at: Instant::now(),
        }
    }

    /// Marks `keys` used now.
    pub fn touch(&mut self, keys: &[BlockKey]) {
        let used = self.tick();
        for key in keys {
            if let Some(b) = self.blocks.get_mut(key) {
                b.used = used;
            }
        }
    }

    /// The least recently used leaf for which `frees` holds, where the
    /// blocks in `gone` count as removed already (a plan of evictions).
    pub fn lru_leaf(&self, gone: &[BlockKey], mut frees: impl FnMut(&Block) -> bool) -> Option<BlockKey> {
        let is_leaf = |key: &BlockKey| {
            self.children(key).iter().all(|child| gone.contains(child)) && !gone.contains(key)
        };
        self.blocks
            .iter()
            .filter(|(key, b)| is_leaf(key) && frees(b))
            .min_by_key(|(key, b)| (b.used.tick, **key))
            .map(|(key, _)| *key)
    }

    /// The blocks not used for `age` (each with every block below it, as a
    /// parent is used whenever its children are).
    pub fn unused_for(&self, age: Duration) -> Vec<BlockKey> {
        let mut old: Vec<(u64, BlockKey)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.used.at.elapsed() >= age)
            .map(|(key, b)| (b.used.tick, *key))
            .collect();
        old.sort_unstable();
        old.into_iter().map(|(_, key)| key).collect()
    }

    /// The longest prefix of `tokens`, at most `limit` of them, held in
    /// blocks of `scope`: down the chain of blocks whose tokens the prompt
    /// repeats, then as far into one more block as the prompt follows it.
    /// Among children matching equally far, the one indexed first.
    pub fn longest_prefix(&self, scope: Scope<'_>, tokens: &[u32], limit: usize) -> Prefix {
        let limit = limit.min(tokens.len());
        let mut found = Prefix::default();
        let mut parent = BlockKey::ROOT;
        while found.len < limit {
            let rest = &tokens[found.len..limit];
            let best = self
                .children(&parent)
                .iter()
                .filter_map(|key| {
                    let b = &self.blocks[key];
                    let in_scope = b.fingerprint == *scope.fingerprint && b.namespace == *scope.namespace;
                    let matched = b.tokens.iter().zip(rest).take_while(|(a, b)| a == b).count();
                    (in_scope && matched > 0).then_some((matched, key, b.tokens.len()))
                })
                .fold(None, |best: Option<(usize, &BlockKey, usize)>, c| match best {
                    Some(b) if b.0 >= c.0 => Some(b),
                    _ => Some(c),
                });
            let Some((matched, &key, len)) = best else {
                break;
            };
            found.keys.push(key);
            found.len += matched;
            if matched < len {
                break;
            }
            parent = key;
        }
        found
    }

    /// Changes since the last call, in order.
    pub fn drain_changes(&mut self) -> Vec<BlockChange> {
        std::mem::take(&mut self.journal)
    }

    /// Removes the leaf `key`; returns it (the caller unpins its cells).
    pub fn remove_leaf(&mut self, key: &BlockKey) -> Block {
        assert!(
            !self.has_children(key),
            "removing block {key:?}, which has children"
        );
        let block = self.blocks.remove(key).expect("an indexed block");
        if !self.tails {
            let siblings = self.children.get_mut(&block.parent).expect("listed");
            siblings.retain(|k| k != key);
            if siblings.is_empty() {
                self.children.remove(&block.parent);
            }
        }
        self.cells -= block.cells.len();
        self.removed += 1;
        self.journal.push(BlockChange::Removed {
            key: *key,
            len: block.cells.len(),
        });
        block
    }

    /// `key` and every block below it, leaves first.
    pub fn subtree_leaves_first(&self, key: &BlockKey) -> Vec<BlockKey> {
        let mut order = vec![*key];
        let mut i = 0;
        while i < order.len() {
            let parent = order[i];
            order.extend_from_slice(self.children(&parent));
            i += 1;
        }
        order.reverse();
        order
    }

    /// Every block, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockKey, &Block)> {
        self.blocks.iter()
    }

    /// Moves every block's cells to `new(cell)` (compaction).
    pub fn remap_cells(&mut self, mut new: impl FnMut(u32) -> u32) {
        for block in self.blocks.values_mut() {
            for cell in &mut block.cells {
                *cell = new(*cell);
            }
        }
    }

    /// Forgets every block, leaves first; returns the blocks (the caller
    /// unpins every cell).
    pub fn clear(&mut self) -> Vec<(BlockKey, Block)> {
        let mut order: Vec<BlockKey> = Vec::with_capacity(self.blocks.len());
        if self.tails {
            order.extend(self.unused_for(Duration::ZERO));
        }
        for root in self.children(&BlockKey::ROOT).to_vec() {
            order.extend(self.subtree_leaves_first(&root));
        }
        order
            .into_iter()
            .map(|key| {
                let block = self.remove_leaf(&key);
                (key, block)
            })
            .collect()
    }

    /// Bytes of heap memory held.
    pub fn capacity_bytes(&self) -> usize {
        self.blocks.capacity() * (std::mem::size_of::<(BlockKey, Block)>() + 8)
            + self
                .blocks
                .values()
                .map(|b| b.cells.capacity() * 4)
                .sum::<usize>()
            + self.children.capacity() * (std::mem::size_of::<BlockKey>() + 32)
            + self.children.values().map(|c| c.capacity() * 32).sum::<usize>()
    }

    /// Panics unless the forest is consistent.
    pub fn check(&self) {
        let mut children: HashMap<BlockKey, Vec<BlockKey>> = HashMap::new();
        let mut cells = 0;
        for (key, b) in &self.blocks {
            assert!(!b.cells.is_empty(), "block {key:?} is empty");
            assert_eq!(b.tokens.len(), b.cells.len(), "block {key:?}: a token per cell");
            assert_eq!(
                BlockKey::new(&Scope::new(&b.fingerprint, &b.namespace), &b.parent, &b.tokens),
                *key,
                "block {key:?} holds tokens its key does not name"
            );
            if b.parent.is_root() {
                assert_eq!(b.start, 0, "first block {key:?} starts at {}", b.start);
            } else if self.tails {
                assert!(b.start > 0, "block {key:?} follows another but starts at 0");
            } else {
                let parent = self
                    .blocks
                    .get(&b.parent)
                    .unwrap_or_else(|| panic!("block {key:?}: parent {:?} is not indexed", b.parent));
                assert_eq!(
                    parent.end(),
                    b.start,
                    "block {key:?} does not start where its parent ends"
                );
            }
            if !self.tails {
                children.entry(b.parent).or_default().push(*key);
            }
            cells += b.cells.len();
        }
        let sorted = |m: &HashMap<BlockKey, Vec<BlockKey>>| {
            let mut v: Vec<(BlockKey, Vec<BlockKey>)> = m
                .iter()
                .map(|(k, c)| {
                    let mut c = c.clone();
                    c.sort();
                    (*k, c)
                })
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            sorted(&children),
            sorted(&self.children),
            "children are misrecorded"
        );
        assert_eq!(cells, self.cells, "pinned cells are miscounted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Indexes a block of `tokens` after `parent` at `start` (cells named
    /// after the positions); returns its key.
    fn add(index: &mut BlockIndex, parent: BlockKey, start: Pos, tokens: &[u32]) -> BlockKey {
        let (fingerprint, namespace) = (Fingerprint([7; 32]), Namespace::shared());
        let key = BlockKey::new(&Scope::new(&fingerprint, &namespace), &parent, tokens);
        let cells = (0..tokens.len() as u32).map(|k| start as u32 + k).collect();
        index.insert(
            key,
            Block::new(parent, start, cells, tokens.to_vec(), fingerprint, namespace),
        );
        key
    }

    #[test]
    fn leaves_go_first_least_recently_used_first() {
        let mut index = BlockIndex::default();
        let k1 = add(&mut index, BlockKey::ROOT, 0, &[1, 2]);
        let k2 = add(&mut index, k1, 2, &[3, 4]);
        let k3 = add(&mut index, k1, 2, &[5]);
        index.check();
        assert_eq!(index.children(&k1), [k2, k3]);
        // k2 is older than k3, and k1 has children.
        assert_eq!(index.lru_leaf(&[], |_| true), Some(k2));
        // Planned away, k2 and k3 leave k1 a leaf.
        assert_eq!(index.lru_leaf(&[k2, k3], |_| true), Some(k1));
        index.touch(&[k1, k2]);
        assert_eq!(index.lru_leaf(&[], |_| true), Some(k3));
        index.remove_leaf(&k3);
        index.check();
        assert_eq!(index.children(&k1), [k2]);
        index.remove_leaf(&k2);
        assert_eq!(index.lru_leaf(&[], |_| true), Some(k1));
        assert_eq!(index.subtree_leaves_first(&k1), vec![k1]);
        index.remove_leaf(&k1);
        index.check();
        assert_eq!((index.len(), index.cells()), (0, 0));
    }

    #[test]
    fn a_subtree_lists_leaves_before_their_parents() {
        let mut index = BlockIndex::default();
        let k1 = add(&mut index, BlockKey::ROOT, 0, &[1]);
        let k2 = add(&mut index, k1, 1, &[2]);
        let k3 = add(&mut index, k2, 2, &[3]);
        let order = index.subtree_leaves_first(&k1);
        assert_eq!(order, vec![k3, k2, k1]);
        for k in &order {
            index.remove_leaf(k);
            index.check();
        }
    }

    #[test]
    fn the_journal_replays_to_the_index() {
        let mut index = BlockIndex::default();
        let k1 = add(&mut index, BlockKey::ROOT, 0, &[1, 2]);
        let k2 = add(&mut index, k1, 2, &[3, 4]);
        let k3 = add(&mut index, k1, 2, &[3, 9]);
        index.remove_leaf(&k2);
        let changes = index.drain_changes();
        assert_eq!(changes.len(), 4);
        assert_eq!(changes[3], BlockChange::Removed { key: k2, len: 2 });
        assert!(index.drain_changes().is_empty());
        let cleared = index.clear();
        let keys: Vec<BlockKey> = cleared.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, vec![k3, k1], "leaves first");
        assert_eq!(
            index.drain_changes(),
            vec![
                BlockChange::Removed { key: k3, len: 2 },
                BlockChange::Removed { key: k1, len: 2 }
            ]
        );
    }

    #[test]
    fn a_lookup_follows_the_prompt_into_a_block_and_stays_in_its_scope() {
        let mut index = BlockIndex::default();
        let k1 = add(&mut index, BlockKey::ROOT, 0, &[1, 2]);
        let k2 = add(&mut index, k1, 2, &[3, 4]);
        let (fp, ns) = (Fingerprint([7; 32]), Namespace::shared());
        let scope = Scope::new(&fp, &ns);
        let found = index.longest_prefix(scope, &[1, 2, 3, 5, 6], 5);
        assert_eq!(
            found,
            Prefix {
                keys: vec![k1, k2],
                len: 3
            }
        );
        assert_eq!(index.longest_prefix(scope, &[1, 2, 3, 4, 5], 3).len, 3, "limit");
        let other = Namespace::new("tenant").unwrap();
        assert_eq!(
            index.longest_prefix(Scope::new(&fp, &other), &[1, 2, 3], 3),
            Prefix::default()
        );
        let other_model = Fingerprint([8; 32]);
        assert_eq!(
            index.longest_prefix(Scope::new(&other_model, &ns), &[1, 2], 2),
            Prefix::default()
        );
    }
}
