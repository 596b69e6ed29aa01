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
//! Invariants ([`BlockIndex::check`]): every parent is indexed and ends where
//! its children start; each block's child count is right; the distinct child
//! lengths per parent are counted exactly.

use std::collections::{BTreeMap, HashMap};

use kvcache_api::block_key::BlockKey;
use kvcache_api::Pos;

/// One indexed block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Block {
    /// The block ending where this one starts ([`BlockKey::ROOT`] at 0).
    pub parent: BlockKey,
    /// Its first position.
    pub start: Pos,
    /// The cell of each position `start..start + cells.len()`.
    pub cells: Vec<u32>,
    /// Indexed blocks whose parent this is.
    children: u32,
    /// The index's clock when it was last stored or adopted.
    last_used: u64,
}

impl Block {
    /// One past its last position.
    pub fn end(&self) -> Pos {
        self.start + self.cells.len() as Pos
    }
}

/// Indexed blocks by key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BlockIndex {
    blocks: HashMap<BlockKey, Block>,
    /// Per parent (the root included), how many children of each length.
    lengths: HashMap<BlockKey, BTreeMap<u32, u32>>,
    /// Cells pinned by blocks, counted with multiplicity.
    cells: usize,
    clock: u64,
}

impl BlockIndex {
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

    /// The distinct lengths of the blocks following `parent`, longest first.
    pub fn child_lengths(&self, parent: &BlockKey) -> Vec<usize> {
        self.lengths
            .get(parent)
            .map(|lens| lens.keys().rev().map(|&l| l as usize).collect())
            .unwrap_or_default()
    }

    /// Indexes `key` after `parent` (indexed, or the root) at `start` in
    /// `cells`. The caller pins the cells.
    pub fn insert(&mut self, key: BlockKey, parent: BlockKey, start: Pos, cells: Vec<u32>) {
        assert!(!cells.is_empty(), "an empty block");
        assert!(!self.blocks.contains_key(&key), "block {key:?} indexed twice");
        if !parent.is_root() {
            let p = self.blocks.get_mut(&parent).expect("the parent is indexed");
            assert_eq!(
                p.end(),
                start,
                "block {key:?} does not start where its parent ends"
            );
            p.children += 1;
        } else {
            assert_eq!(start, 0, "a first block starts at 0");
        }
        *self
            .lengths
            .entry(parent)
            .or_default()
            .entry(cells.len() as u32)
            .or_default() += 1;
        self.cells += cells.len();
        self.clock += 1;
        self.blocks.insert(
            key,
            Block {
                parent,
                start,
                cells,
                children: 0,
                last_used: self.clock,
            },
        );
    }

    /// Marks `keys` used now.
    pub fn touch(&mut self, keys: &[BlockKey]) {
        self.clock += 1;
        for key in keys {
            if let Some(b) = self.blocks.get_mut(key) {
                b.last_used = self.clock;
            }
        }
    }

    /// The least recently used leaf for which `frees` holds.
    pub fn lru_leaf(&self, mut frees: impl FnMut(&Block) -> bool) -> Option<BlockKey> {
        self.blocks
            .iter()
            .filter(|(_, b)| b.children == 0 && frees(b))
            .min_by_key(|(key, b)| (b.last_used, **key))
            .map(|(key, _)| *key)
    }

    /// Removes the leaf `key`; returns it (the caller unpins its cells).
    pub fn remove_leaf(&mut self, key: &BlockKey) -> Block {
        let block = self.blocks.remove(key).expect("an indexed block");
        assert_eq!(block.children, 0, "removing block {key:?}, which has children");
        if !block.parent.is_root() {
            self.blocks
                .get_mut(&block.parent)
                .expect("the parent is indexed")
                .children -= 1;
        }
        let lens = self.lengths.get_mut(&block.parent).expect("counted");
        let n = lens.get_mut(&(block.cells.len() as u32)).expect("counted");
        *n -= 1;
        if *n == 0 {
            lens.remove(&(block.cells.len() as u32));
            if lens.is_empty() {
                self.lengths.remove(&block.parent);
            }
        }
        self.cells -= block.cells.len();
        block
    }

    /// `key` and every block below it, leaves first.
    pub fn subtree_leaves_first(&self, key: &BlockKey) -> Vec<BlockKey> {
        // Children are found by scanning: subtrees are removed only when a
        // shifting removal moves a pinned cell, which is rare.
        let mut order = vec![*key];
        let mut i = 0;
        while i < order.len() {
            let parent = order[i];
            if self.blocks[&parent].children > 0 {
                order.extend(
                    self.blocks
                        .iter()
                        .filter(|(_, b)| b.parent == parent)
                        .map(|(k, _)| *k),
                );
            }
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

    /// Forgets every block; returns their keys (the caller unpins every cell).
    pub fn clear(&mut self) -> Vec<BlockKey> {
        let keys = self.blocks.keys().copied().collect();
        self.blocks.clear();
        self.lengths.clear();
        self.cells = 0;
        keys
    }

    /// Bytes of heap memory held.
    pub fn capacity_bytes(&self) -> usize {
        self.blocks.capacity() * (std::mem::size_of::<(BlockKey, Block)>() + 8)
            + self
                .blocks
                .values()
                .map(|b| b.cells.capacity() * 4)
                .sum::<usize>()
            + self.lengths.capacity() * (std::mem::size_of::<BlockKey>() + 32)
    }

    /// Panics unless the forest is consistent.
    pub fn check(&self) {
        let mut children: HashMap<BlockKey, u32> = HashMap::new();
        let mut lengths: HashMap<BlockKey, BTreeMap<u32, u32>> = HashMap::new();
        let mut cells = 0;
        for (key, b) in &self.blocks {
            assert!(!b.cells.is_empty(), "block {key:?} is empty");
            if b.parent.is_root() {
                assert_eq!(b.start, 0, "first block {key:?} starts at {}", b.start);
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
                *children.entry(b.parent).or_default() += 1;
            }
            *lengths
                .entry(b.parent)
                .or_default()
                .entry(b.cells.len() as u32)
                .or_default() += 1;
            cells += b.cells.len();
        }
        for (key, b) in &self.blocks {
            let n = children.get(key).copied().unwrap_or(0);
            assert_eq!(
                b.children, n,
                "block {key:?} counts {} children, has {n}",
                b.children
            );
        }
        assert_eq!(lengths, self.lengths, "child lengths are miscounted");
        assert_eq!(cells, self.cells, "pinned cells are miscounted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> BlockKey {
        BlockKey([n; 32])
    }

    #[test]
    fn leaves_go_first_least_recently_used_first() {
        let mut index = BlockIndex::default();
        index.insert(key(1), BlockKey::ROOT, 0, vec![0, 1]);
        index.insert(key(2), key(1), 2, vec![2, 3]);
        index.insert(key(3), key(1), 2, vec![4]);
        index.check();
        assert_eq!(index.child_lengths(&key(1)), vec![2, 1]);
        // Key 2 is older than key 3, and key 1 has children.
        assert_eq!(index.lru_leaf(|_| true), Some(key(2)));
        index.touch(&[key(1), key(2)]);
        assert_eq!(index.lru_leaf(|_| true), Some(key(3)));
        index.remove_leaf(&key(3));
        index.check();
        assert_eq!(index.child_lengths(&key(1)), vec![2]);
        index.remove_leaf(&key(2));
        assert_eq!(index.lru_leaf(|_| true), Some(key(1)));
        assert_eq!(index.subtree_leaves_first(&key(1)), vec![key(1)]);
        index.remove_leaf(&key(1));
        index.check();
        assert_eq!((index.len(), index.cells()), (0, 0));
    }

    #[test]
    fn a_subtree_lists_leaves_before_their_parents() {
        let mut index = BlockIndex::default();
        index.insert(key(1), BlockKey::ROOT, 0, vec![0]);
        index.insert(key(2), key(1), 1, vec![1]);
        index.insert(key(3), key(2), 2, vec![2]);
        let order = index.subtree_leaves_first(&key(1));
        assert_eq!(order, vec![key(3), key(2), key(1)]);
        for k in &order {
            index.remove_leaf(k);
            index.check();
        }
    }
}
