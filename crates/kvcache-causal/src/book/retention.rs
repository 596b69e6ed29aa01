//! Block retention in the bookkeeping: indexing a sequence's cells by block
//! ([`crate::blocks`]), adopting an indexed chain into a new sequence, and
//! evicting blocks when cells are needed (planned first, so a pass that
//! cannot be made room for changes nothing). Like every operation of the
//! book, each validates first and changes nothing on error.
//!
//! Whole chains are kept only where a sequence holds every position from 0
//! for as long as it lives: caches without a sliding window
//! ([`Book::indexes_blocks`]). A window trims a sequence's early positions, so
//! a cache with one keeps *tails* instead: the blocks of a chain within its
//! window memory before the chain's end ([`Book::prepare_retain_tail`]), which
//! a sequence adopts as a run of consecutive blocks that need not start at 0
//! ([`Book::prepare_adopt_tail`]). The layer-group cache decides from its
//! global group's chain and its window groups' tails where a prompt resumes.

use std::collections::HashMap;
use std::time::Duration;

use kvcache_api::block_key::{BlockKey, Scope};
use kvcache_api::retention::{BlockChain, BlockChange, Prefix};
use kvcache_api::{CacheError, Pos, Result, SeqId};

use super::Book;
use crate::blocks::Block;

/// A validated [`Book::prepare_retain`]: per block of the chain, its cells when
/// it is new (`None`: indexed already).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetainPlan {
    /// The first block of the chain kept (0 for a whole chain).
    from: usize,
    /// Per block from `from` on.
    new: Vec<Option<Vec<u32>>>,
}

impl RetainPlan {
    /// The indices, in the chain, of the blocks this plan keeps.
    pub(crate) fn kept(&self) -> std::ops::Range<usize> {
        self.from..self.from + self.new.len()
    }
}

impl Book {
    /// Whether this cache keeps blocks.
    pub(crate) fn indexes_blocks(&self) -> bool {
        !self.attention.bounded()
    }

    /// Refuses, as [`CacheError::NotSupported`], a cache that cannot keep
    /// whole chains on its own.
    pub(crate) fn blocks_supported(&self) -> Result<()> {
        if self.indexes_blocks() {
            return Ok(());
        }
        Err(CacheError::NotSupported(
            "block retention in a cache with a sliding window or chunked attention (it trims \
             the positions a chain of blocks starts with)"
                .into(),
        ))
    }

    /// The indexed blocks following `parent` and their lengths.
    pub(crate) fn block_children(&self, parent: &BlockKey) -> Vec<(BlockKey, usize)> {
        self.blocks
            .children(parent)
            .iter()
            .map(|k| (*k, self.blocks.get(k).expect("a listed child").cells.len()))
            .collect()
    }

    /// The block index.
    pub(crate) fn blocks(&self) -> &crate::blocks::BlockIndex {
        &self.blocks
    }

    /// The position a block keeps `cell` at, if one does (a scan: for
    /// inspection only).
    pub(crate) fn block_position(&self, cell: usize) -> Option<Pos> {
        if !self.cells.is_pinned(cell) {
            return None;
        }
        self.blocks.iter().find_map(|(_, b)| {
            let k = b.cells.iter().position(|&c| c as usize == cell)?;
            Some(b.start + k as Pos)
        })
    }

    /// Whether block `key` is indexed.
    pub(crate) fn holds_block(&self, key: &BlockKey) -> bool {
        self.blocks.get(key).is_some()
    }

    /// Blocks indexed and the cells they pin (counted once per block).
    pub(crate) fn indexed_blocks(&self) -> (usize, usize) {
        (self.blocks.len(), self.blocks.cells())
    }

    /// The longest prefix of `tokens` (at most `limit`) in blocks of `scope`.
    pub(crate) fn longest_prefix(&self, scope: Scope<'_>, tokens: &[u32], limit: usize) -> Prefix {
        self.blocks.longest_prefix(scope, tokens, limit)
    }

    /// Of a chain's blocks (`spans[i]`: the positions of block `i`), the first
    /// one a query at `at` needs from this cache: 0 in a cache that keeps
    /// whole chains (a sequence holds every position from 0 there).
    pub(crate) fn first_block_needed(&self, spans: &[(Pos, Pos)], at: Pos) -> usize {
        if !self.blocks.keeps_tails() {
            return 0;
        }
        let from = self.attention.visible(at, false).0;
        spans.partition_point(|s| s.1 <= from)
    }

    /// Of a chain's blocks, the first one a sequence resuming at `at` adopts
    /// from this cache: in a cache of tails, back from `at` as far as this
    /// cache keeps the chain's blocks within its window memory (so the
    /// sequence holds what it would have held had it computed them: a later
    /// turn may part from it up to the memory's margin before its end); 0 in
    /// a cache that keeps whole chains. At most
    /// [`first_block_needed`](Self::first_block_needed) when [`covers`](Self::covers) holds.
    pub(crate) fn first_block_adopted(&self, keys: &[BlockKey], spans: &[(Pos, Pos)], at: Pos) -> usize {
        if !self.blocks.keeps_tails() {
            return 0;
        }
        self.first_within_memory(spans, at, |i| {
            self.blocks
                .get(&keys[i])
                .is_some_and(|b| (b.start, b.end()) == spans[i])
        })
    }

    /// Of a chain's blocks (`spans[i]`: the positions of block `i`), the
    /// first of the run that ends with the block holding position `end - 1`
    /// and goes back while each block ends within this cache's window memory
    /// before `end` and `kept(i)` holds: what a cache of tails keeps, or
    /// adopts, for a sequence whose next position is `end`.
    fn first_within_memory(
        &self,
        spans: &[(Pos, Pos)],
        end: Pos,
        mut kept: impl FnMut(usize) -> bool,
    ) -> usize {
        let memory = self
            .config
            .effective_memory()
            .expect("a cache of tails has a window memory") as Pos;
        let mut first = spans.partition_point(|s| s.0 < end);
        while first > 0 && spans[first - 1].1 > end - memory + 1 && kept(first - 1) {
            first -= 1;
        }
        first
    }

    /// Whether this cache keeps every block of the chain `keys` (at
    /// `spans`) that a query at `at` needs.
    pub(crate) fn covers(&self, keys: &[BlockKey], spans: &[(Pos, Pos)], at: Pos) -> bool {
        let first = self.first_block_needed(spans, at);
        let last = spans.partition_point(|s| s.0 < at);
        (first..last).all(|i| {
            self.blocks
                .get(&keys[i])
                .is_some_and(|b| (b.start, b.end()) == spans[i])
        })
    }

    /// Validates indexing `seq`'s positions as `chain` (consecutive from
    /// position 0); changes nothing.
    pub(crate) fn prepare_retain(&self, seq: SeqId, chain: &BlockChain) -> Result<RetainPlan> {
        self.blocks_supported()?;
        self.plan_retain(seq, chain, 0)
    }

    /// Validates keeping, of `chain` (held by `seq` in this cache with a
    /// window), the blocks a resume near the chain's end needs: those ending
    /// within the window memory before the end that `seq` holds whole, as
    /// tails. Changes nothing; a plan that keeps no block is no error (the
    /// chain's end is then not resumable through this cache).
    pub(crate) fn prepare_retain_tail(&self, seq: SeqId, chain: &BlockChain) -> Result<RetainPlan> {
        assert!(
            self.blocks.keeps_tails(),
            "tails in a cache that keeps whole chains"
        );
        self.check_seq(seq)?;
        let spans: Vec<(Pos, Pos)> = chain
            .blocks()
            .iter()
            .scan(0, |start: &mut Pos, &(_, len)| {
                let span = (*start, *start + len as Pos);
                *start = span.1;
                Some(span)
            })
            .collect();
        let end = spans.last().map_or(0, |s| s.1);
        let index = self.cells.index(seq);
        let from = self.first_within_memory(&spans, end, |i| {
            (spans[i].0..spans[i].1).all(|p| index.cell_of(p).is_some())
        });
        self.plan_retain(seq, chain, from)
    }

    /// Validates `chain` and plans keeping its blocks from `from` on.
    fn plan_retain(&self, seq: SeqId, chain: &BlockChain, from: usize) -> Result<RetainPlan> {
        self.check_seq(seq)?;
        let blocks = chain.blocks();
        if !chain.keys_match() {
            return Err(CacheError::InvalidArgument(
                "the chain's keys are not the ones its scope and tokens hash to (or a block lacks \
                 its tokens)"
                    .into(),
            ));
        }
        let mut new = Vec::with_capacity(blocks.len() - from);
        let mut start: Pos = 0;
        for (i, &(key, len)) in blocks.iter().enumerate() {
            if len == 0 || key.is_root() {
                return Err(CacheError::InvalidArgument(format!(
                    "block {i} of the chain is empty or has the root's key"
                )));
            }
            if blocks[..i].iter().any(|(k, _)| *k == key) {
                return Err(CacheError::InvalidArgument(format!(
                    "block {i}'s key {key:?} appears twice in the chain"
                )));
            }
            let end = start + len as Pos;
            if i < from {
                start = end;
                continue;
            }
            match self.blocks.get(&key) {
                Some(b) if b.start != start || b.end() != end => {
                    return Err(CacheError::InvalidArgument(format!(
                        "block {i} ({key:?}) covers positions {start}..{end}, but the index has it \
                         at {}..{}",
                        b.start,
                        b.end()
                    )));
                }
                Some(_) => new.push(None),
                None => {
                    let ranges = self.cells_of_range(seq, start..end)?;
                    new.push(Some(ranges.into_iter().flatten().map(|c| c as u32).collect()));
                }
            }
            start = end;
        }
        Ok(RetainPlan { from, new })
    }

    /// Carries out a validated retention; returns the indices of the blocks
    /// newly indexed.
    pub(crate) fn commit_retain(&mut self, chain: &BlockChain, plan: RetainPlan) -> Vec<usize> {
        let blocks = chain.blocks();
        let mut added = Vec::new();
        let mut start: Pos = blocks[..plan.from].iter().map(|b| b.1 as Pos).sum();
        for ((i, (key, len)), cells) in blocks.iter().enumerate().skip(plan.from).zip(plan.new) {
            match cells {
                Some(cells) => {
                    let parent = if i == 0 { BlockKey::ROOT } else { blocks[i - 1].0 };
                    for &cell in &cells {
                        self.cells.pin(cell as usize);
                    }
                    let tokens = chain.block_tokens(i).to_vec();
                    let (fingerprint, namespace) = (*chain.fingerprint(), chain.namespace().clone());
                    self.blocks.insert(
                        *key,
                        Block::new(parent, start, cells, tokens, fingerprint, namespace),
                    );
                    added.push(i);
                }
                None => self.blocks.touch(&[*key]),
            }
            start += *len as Pos;
        }
        added
    }

    /// Validates adopting the first `len` positions of the chain `blocks`
    /// into the empty `seq` (its last block in part, none of it unused);
    /// changes nothing. In a cache of tails, `blocks` is a run of the chain
    /// that need not start at 0 (the window before `len`).
    pub(crate) fn prepare_adopt(&self, seq: SeqId, blocks: &[BlockKey], len: Pos) -> Result<()> {
        self.check_seq(seq)?;
        if !self.cells.index(seq).is_empty() {
            return Err(CacheError::InvalidArgument(format!(
                "sequence {seq} must be empty to adopt blocks"
            )));
        }
        let mut parent = BlockKey::ROOT;
        let (mut start, mut end): (Pos, Pos) = (0, 0);
        for (i, key) in blocks.iter().enumerate() {
            let Some(b) = self.blocks.get(key) else {
                return Err(CacheError::InvalidArgument(format!(
                    "block {i} of the chain ({key:?}) is not indexed"
                )));
            };
            let first_tail = i == 0 && self.blocks.keeps_tails();
            if b.parent != parent && !first_tail {
                return Err(CacheError::InvalidArgument(format!(
                    "block {i} of the chain ({key:?}) does not follow the block before it"
                )));
            }
            parent = *key;
            (start, end) = (b.start, b.end());
        }
        if len <= start || len > end {
            return Err(CacheError::InvalidArgument(format!(
                "adopting {len} positions of a chain whose last block covers {start}..{end}"
            )));
        }
        Ok(())
    }

    /// Carries out a validated adoption; ends any pass in progress.
    pub(crate) fn commit_adopt(&mut self, seq: SeqId, blocks: &[BlockKey], len: Pos) {
        for key in blocks {
            let b = self.blocks.get(key).expect("validated");
            let start = b.start;
            let cells = b.cells.clone();
            for (k, cell) in cells.into_iter().enumerate() {
                let pos = start + k as Pos;
                if pos < len {
                    self.cells.hold(cell as usize, seq, pos);
                }
            }
        }
        self.blocks.touch(blocks);
        self.reservations.drop_seq(seq);
        self.pass.end();
    }

    /// Forgets `keys` (those indexed) and every block below them; returns
    /// what was forgotten, leaves first.
    pub(crate) fn forget_blocks(&mut self, keys: &[BlockKey]) -> Vec<BlockKey> {
        let mut gone = Vec::new();
        for key in keys {
            if self.blocks.get(key).is_some() {
                for k in self.blocks.subtree_leaves_first(key) {
                    self.drop_block(&k);
                    gone.push(k);
                }
            }
        }
        gone
    }

    /// Forgets the blocks not used for `age` and the blocks below them;
    /// returns what was forgotten.
    pub(crate) fn forget_blocks_unused_for(&mut self, age: Duration) -> Vec<BlockKey> {
        let old = self.blocks.unused_for(age);
        self.forget_blocks(&old)
    }

    /// Evicts least recently used leaves whose eviction frees a cell until
    /// `cells` cells are free or none is left; returns their keys in order.
    pub(crate) fn evict_blocks(&mut self, cells: usize) -> Vec<BlockKey> {
        let (plan, _) = self.eviction_plan(cells);
        for key in &plan {
            self.drop_block(key);
        }
        plan
    }

    /// The leaves [`Book::evict_blocks`] would evict, in order, to have
    /// `free` cells free, and whether that is enough. Changes nothing.
    pub(crate) fn eviction_plan(&self, free: usize) -> (Vec<BlockKey>, bool) {
        let mut have = self.cells.occupancy().free();
        let mut plan: Vec<BlockKey> = Vec::new();
        // Pins the plan takes off each cell.
        let mut taken: HashMap<u32, u16> = HashMap::new();
        let unheld = |c: u32| self.cells.sequences(c as usize).next().is_none();
        while have < free {
            let frees = |b: &crate::blocks::Block| {
                b.cells.iter().any(|&c| {
                    self.cells.pins(c as usize) - taken.get(&c).copied().unwrap_or(0) == 1 && unheld(c)
                })
            };
            let Some(key) = self.blocks.lru_leaf(&plan, frees) else {
                return (plan, false);
            };
            for &c in &self.blocks.get(&key).expect("a planned leaf").cells {
                let n = taken.entry(c).or_insert(0);
                *n += 1;
                if *n == self.cells.pins(c as usize) && unheld(c) {
                    have += 1;
                }
            }
            plan.push(key);
        }
        (plan, true)
    }

    /// Forgets every block; returns their keys, leaves first.
    pub(crate) fn clear_blocks(&mut self) -> Vec<BlockKey> {
        let gone = self.blocks.clear();
        for (_, block) in &gone {
            for &cell in &block.cells {
                self.cells.unpin(cell as usize);
            }
        }
        gone.into_iter().map(|(key, _)| key).collect()
    }

    /// What the index stored and removed since the last call.
    pub(crate) fn drain_block_changes(&mut self) -> Vec<BlockChange> {
        self.blocks.drain_changes()
    }

    /// Every block holding one of `cells` (sorted) and the blocks below them,
    /// leaves first: what a shifting removal of those cells must forget.
    pub(crate) fn blocks_over(&self, cells: &[(usize, usize)]) -> Vec<BlockKey> {
        let moved = |c: u32| {
            let c = c as usize;
            let i = cells.partition_point(|&(_, end)| end <= c);
            i < cells.len() && cells[i].0 <= c
        };
        let mut out: Vec<BlockKey> = Vec::new();
        for (key, b) in self.blocks.iter() {
            if b.cells.iter().any(|&c| moved(c)) {
                for k in self.blocks.subtree_leaves_first(key) {
                    if !out.contains(&k) {
                        out.push(k);
                    }
                }
            }
        }
        out
    }

    /// Forgets the leaf `key` and unpins its cells.
    pub(crate) fn drop_block(&mut self, key: &BlockKey) {
        let block = self.blocks.remove_leaf(key);
        for cell in block.cells {
            self.cells.unpin(cell as usize);
        }
    }

    /// Panics unless the index agrees with the cells: pins counted per block,
    /// and every sequence holding a block's cell at the block's position.
    pub(crate) fn check_blocks(&self) {
        self.blocks.check();
        let mut pins = vec![0u16; self.cells.len()];
        for (key, b) in self.blocks.iter() {
            for (k, &cell) in b.cells.iter().enumerate() {
                pins[cell as usize] += 1;
                let pos = b.start + k as Pos;
                for seq in self.cells.sequences(cell as usize) {
                    assert_eq!(
                        self.cells.index(seq).cell_of(pos),
                        Some(cell),
                        "block {key:?} keeps position {pos} in cell {cell}, which sequence {seq} holds \
                         at another position"
                    );
                }
            }
        }
        for (cell, &n) in pins.iter().enumerate() {
            assert_eq!(
                self.cells.pins(cell),
                n,
                "cell {cell}: pins disagree with the blocks"
            );
        }
    }
}
