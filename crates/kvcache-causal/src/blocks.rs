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
//! its children start; each parent's list of children is exactly the blocks
//! naming it.

use std::collections::HashMap;

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
    /// Per parent (the root included), its children in the order indexed.
    children: HashMap<BlockKey, Vec<BlockKey>>,
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

    /// The blocks following `parent` (the root for first blocks).
    pub fn children(&self, parent: &BlockKey) -> &[BlockKey] {
        self.children.get(parent).map_or(&[], Vec::as_slice)
    }

    fn has_children(&self, key: &BlockKey) -> bool {
        self.children.contains_key(key)
    }

    /// Indexes `key` after `parent` (indexed, or the root) at `start` in
    /// `cells`. The caller pins the cells.
    pub fn insert(&mut self, key: BlockKey, parent: BlockKey, start: Pos, cells: Vec<u32>) {
        assert!(!cells.is_empty(), "an empty block");
        assert!(!self.blocks.contains_key(&key), "block {key:?} indexed twice");
        if !parent.is_root() {
            let p = self.blocks.get(&parent).expect("the parent is indexed");
            assert_eq!(
                p.end(),
                start,
                "block {key:?} does not start where its parent ends"
            );
        } else {
            assert_eq!(start, 0, "a first block starts at 0");
        }
        self.children.entry(parent).or_default().push(key);
        self.cells += cells.len();
        self.clock += 1;
        self.blocks.insert(
            key,
            Block {
                parent,
                start,
                cells,
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
            .filter(|(key, b)| !self.has_children(key) && frees(b))
            .min_by_key(|(key, b)| (b.last_used, **key))
            .map(|(key, _)| *key)
    }

    /// Removes the leaf `key`; returns it (the caller unpins its cells).
    pub fn remove_leaf(&mut self, key: &BlockKey) -> Block {
        assert!(
            !self.has_children(key),
            "removing block {key:?}, which has children"
        );
        let block = self.blocks.remove(key).expect("an indexed block");
        let siblings = self.children.get_mut(&block.parent).expect("listed");
        siblings.retain(|k| k != key);
        if siblings.is_empty() {
            self.children.remove(&block.parent);
        }
        self.cells -= block.cells.len();
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

    /// Forgets every block; returns their keys (the caller unpins every cell).
    pub fn clear(&mut self) -> Vec<BlockKey> {
        let keys = self.blocks.keys().copied().collect();
        self.blocks.clear();
        self.children.clear();
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
            + self.children.capacity() * (std::mem::size_of::<BlockKey>() + 32)
            + self.children.values().map(|c| c.capacity() * 32).sum::<usize>()
    }

    /// Panics unless the forest is consistent.
    pub fn check(&self) {
        let mut children: HashMap<BlockKey, Vec<BlockKey>> = HashMap::new();
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
            }
            children.entry(b.parent).or_default().push(*key);
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
        assert_eq!(index.children(&key(1)), [key(2), key(3)]);
        // Key 2 is older than key 3, and key 1 has children.
        assert_eq!(index.lru_leaf(|_| true), Some(key(2)));
        index.touch(&[key(1), key(2)]);
        assert_eq!(index.lru_leaf(|_| true), Some(key(3)));
        index.remove_leaf(&key(3));
        index.check();
        assert_eq!(index.children(&key(1)), [key(2)]);
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
