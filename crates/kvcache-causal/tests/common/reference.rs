//! A naive model of the causal cache: each sequence's history as a plain sorted
//! list, with the same trimming, visibility, removal and sharing rules, and the
//! errors the cache must return. Cells are not modelled, only token identity (so
//! shared tokens are counted once when deciding whether a batch fits).

use std::collections::{BTreeMap, BTreeSet};

use kvcache_api::block_key::BlockKey;
use kvcache_api::retention::BlockChain;
use kvcache_api::{CacheError, CausalConfig, Pos, SeqId};
use kvcache_api::{Fingerprint, Namespace};

/// One stored token of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Position in the sequence.
    pub pos: Pos,
    /// The value it was written with.
    pub val: f32,
    /// Sum of the shifts applied to its key.
    pub delta: f32,
    /// Identity of the physical token (shared by `copy_prefix`).
    pub id: u64,
}

impl Entry {
    /// Key and value in `layer`: layer 0 stores `val`, layer 1 stores `-val`;
    /// keys also carry the shifts.
    pub fn kv(&self, layer: usize) -> (f32, f32) {
        let v = if layer == 0 { self.val } else { -self.val };
        (v + self.delta, v)
    }
}

/// The model.
#[derive(Debug, Clone)]
pub struct Reference {
    max_sequences: usize,
    max_batch: usize,
    cells: usize,
    window: Option<Pos>,
    memory: Option<Pos>,
    chunk: Option<Pos>,
    has_shift: bool,
    /// Per sequence, its tokens sorted by position.
    pub seqs: Vec<Vec<Entry>>,
    next_id: u64,
    /// Retained blocks by key (the model of the block index).
    pub blocks: BTreeMap<BlockKey, RefBlock>,
    clock: u64,
}

/// A retained block: the entries it keeps, its parent and when it was used.
#[derive(Debug, Clone, PartialEq)]
pub struct RefBlock {
    /// The block before it, [`BlockKey::ROOT`] for a first block.
    pub parent: BlockKey,
    /// The entries it keeps, by position.
    pub entries: Vec<Entry>,
    last_used: u64,
}

impl Reference {
    /// An empty model of a cache with `config`.
    pub fn new(config: &CausalConfig, has_shift: bool) -> Self {
        Reference {
            max_sequences: config.max_sequences,
            max_batch: config.max_batch,
            cells: config.num_cells(),
            window: config.window.map(|w| w.window() as Pos),
            memory: config.effective_memory().map(|m| m as Pos),
            chunk: config.chunk_size.map(|c| c as Pos),
            has_shift,
            seqs: vec![Vec::new(); config.max_sequences],
            next_id: 0,
            blocks: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Next position after `seq`'s last (0 when empty).
    pub fn next_pos(&self, seq: SeqId) -> Pos {
        self.seqs[seq].last().map_or(0, |e| e.pos + 1)
    }

    fn seq_check(&self, seq: SeqId) -> Result<(), CacheError> {
        if seq >= self.max_sequences {
            return Err(CacheError::SequenceOutOfRange {
                seq,
                max_sequences: self.max_sequences,
            });
        }
        Ok(())
    }

    /// Tokens held by sequences (those at or past `keep`) or kept by blocks.
    pub fn live(&self, keep: &[Pos]) -> usize {
        let mut ids = self.block_ids();
        for (s, entries) in self.seqs.iter().enumerate() {
            ids.extend(entries.iter().filter(|e| e.pos >= keep[s]).map(|e| e.id));
        }
        ids.len()
    }

    /// Tokens kept by blocks.
    pub fn block_ids(&self) -> BTreeSet<u64> {
        self.blocks
            .values()
            .flat_map(|b| b.entries.iter().map(|e| e.id))
            .collect()
    }

    fn blocks_supported(&self) -> Result<(), CacheError> {
        match self.memory {
            None => Ok(()),
            Some(_) => Err(CacheError::NotSupported("windows trim".into())),
        }
    }

    /// The chain `seq` is retained as in blocks of `block` tokens: the
    /// entries' ids (a token's identity, 32 bits of it) as its tokens. `None`
    /// when `seq` does not hold every position from 0 to its end.
    pub fn chain(&self, seq: SeqId, block: usize) -> Option<BlockChain> {
        let entries = &self.seqs[seq];
        if entries.iter().enumerate().any(|(i, e)| e.pos != i as Pos) {
            return None;
        }
        let ids: Vec<u32> = entries.iter().map(|e| e.id as u32).collect();
        Some(BlockChain::new(
            Fingerprint([3; 32]),
            Namespace::shared(),
            block,
            &ids,
        ))
    }

    /// `retain_blocks(seq, chain)`: the indices newly indexed.
    pub fn retain(&mut self, seq: SeqId, chain: &BlockChain) -> Result<Vec<usize>, CacheError> {
        self.seq_check(seq)?;
        self.blocks_supported()?;
        let held = self.seqs[seq].len();
        let blocks = chain.blocks();
        if blocks.iter().map(|b| b.1).sum::<usize>() > held || !chain.keys_match() {
            return Err(CacheError::InvalidArgument("positions not held".into()));
        }
        let mut added = Vec::new();
        let mut start = 0;
        for (i, &(key, len)) in blocks.iter().enumerate() {
            self.clock += 1;
            match self.blocks.get_mut(&key) {
                Some(b) => b.last_used = self.clock,
                None => {
                    let parent = if i == 0 { BlockKey::ROOT } else { blocks[i - 1].0 };
                    let entries = self.seqs[seq][start..start + len].to_vec();
                    self.blocks.insert(
                        key,
                        RefBlock {
                            parent,
                            entries,
                            last_used: self.clock,
                        },
                    );
                    added.push(i);
                }
            }
            start += len;
        }
        Ok(added)
    }

    /// `adopt_blocks(seq, keys, len)`.
    pub fn adopt(&mut self, seq: SeqId, keys: &[BlockKey], len: Pos) -> Result<(), CacheError> {
        self.seq_check(seq)?;
        self.blocks_supported()?;
        if !self.seqs[seq].is_empty() {
            return Err(CacheError::InvalidArgument("not empty".into()));
        }
        let mut parent = BlockKey::ROOT;
        let (mut start, mut end) = (0, 0);
        for key in keys {
            match self.blocks.get(key) {
                Some(b) if b.parent == parent => {
                    parent = *key;
                    start = b.entries[0].pos;
                    end = start + b.entries.len() as Pos;
                }
                _ => return Err(CacheError::InvalidArgument("not a chain".into())),
            }
        }
        if len <= start || len > end {
            return Err(CacheError::InvalidArgument(
                "length outside the last block".into(),
            ));
        }
        self.clock += 1;
        for key in keys {
            let b = self.blocks.get_mut(key).expect("checked");
            b.last_used = self.clock;
            self.seqs[seq].extend(b.entries.iter().filter(|e| e.pos < len).cloned());
        }
        Ok(())
    }

    /// `forget_blocks(keys)`: the keys forgotten (sorted).
    pub fn forget(&mut self, keys: &[BlockKey]) -> Vec<BlockKey> {
        let mut gone: BTreeSet<BlockKey> = keys
            .iter()
            .filter(|k| self.blocks.contains_key(k))
            .copied()
            .collect();
        loop {
            let below: Vec<BlockKey> = self
                .blocks
                .iter()
                .filter(|(k, b)| gone.contains(&b.parent) && !gone.contains(*k))
                .map(|(k, _)| *k)
                .collect();
            if below.is_empty() {
                break;
            }
            gone.extend(below);
        }
        self.blocks.retain(|k, _| !gone.contains(k));
        gone.into_iter().collect()
    }

    /// `evict_blocks(cells)`: the keys evicted, in order.
    pub fn evict(&mut self, cells: usize) -> Vec<BlockKey> {
        let mut out = Vec::new();
        loop {
            let no_trim = vec![Pos::MIN; self.max_sequences];
            if self.cells - self.live(&no_trim) >= cells {
                return out;
            }
            let held: BTreeSet<u64> = self.seqs.iter().flatten().map(|e| e.id).collect();
            let mut kept: BTreeMap<u64, usize> = BTreeMap::new();
            for b in self.blocks.values() {
                for e in &b.entries {
                    *kept.entry(e.id).or_default() += 1;
                }
            }
            let parents: BTreeSet<BlockKey> = self.blocks.values().map(|b| b.parent).collect();
            let victim = self
                .blocks
                .iter()
                .filter(|(k, b)| {
                    !parents.contains(*k)
                        && b.entries
                            .iter()
                            .any(|e| kept[&e.id] == 1 && !held.contains(&e.id))
                })
                .min_by_key(|(k, b)| (b.last_used, **k))
                .map(|(k, _)| *k);
            let Some(key) = victim else { return out };
            self.blocks.remove(&key);
            out.push(key);
        }
    }

    /// `clear_blocks()`.
    pub fn clear_blocks(&mut self) -> Vec<BlockKey> {
        let keys = self.blocks.keys().copied().collect();
        self.blocks.clear();
        keys
    }

    /// A forward pass over `(seq, pos, val)` tokens.
    pub fn forward(&mut self, tokens: &[(SeqId, Pos, f32)]) -> Result<(), CacheError> {
        if tokens.len() > self.max_batch {
            return Err(CacheError::InvalidBatch("too large".into()));
        }
        for &(seq, _, _) in tokens {
            self.seq_check(seq)?;
        }
        for &(seq, pos, _) in tokens {
            if self.seqs[seq].iter().any(|e| e.pos == pos) {
                return Err(CacheError::InvalidBatch("already held".into()));
            }
        }
        let keep: Vec<Pos> = (0..self.max_sequences)
            .map(|s| {
                let Some(m) = self.memory else { return Pos::MIN };
                let lowest = tokens.iter().filter(|t| t.0 == s).map(|t| t.1).min();
                match (lowest, self.seqs[s].last()) {
                    (Some(n), _) => n - m + 1,
                    (None, Some(last)) => last.pos + 1 - m + 1,
                    (None, None) => Pos::MIN,
                }
            })
            .collect();
        let no_trim = vec![Pos::MIN; self.max_sequences];
        let used = self.live(&no_trim);
        if self.cells - self.live(&keep) < tokens.len() && !self.blocks.is_empty() {
            // Kept blocks give way, least recently used first, if together
            // they make room (no window: blocks are kept only without one).
            let mut evicted = self.clone();
            evicted.evict(tokens.len());
            if evicted.cells - evicted.live(&keep) >= tokens.len() {
                *self = evicted;
            }
        }
        if self.cells - self.live(&keep) < tokens.len() {
            return Err(CacheError::Full {
                cells: self.cells,
                used,
                batch: tokens.len(),
            });
        }
        for (s, entries) in self.seqs.iter_mut().enumerate() {
            entries.retain(|e| e.pos >= keep[s]);
        }
        for &(seq, pos, val) in tokens {
            let entry = Entry {
                pos,
                val,
                delta: 0.0,
                id: self.next_id,
            };
            self.next_id += 1;
            let at = self.seqs[seq].partition_point(|e| e.pos < pos);
            self.seqs[seq].insert(at, entry);
        }
        Ok(())
    }

    /// What a query `(seq, pos)` sees in `layer`: `(pos, key, value)` by position.
    pub fn visible(&self, seq: SeqId, pos: Pos, exempt: bool, layer: usize) -> Vec<(Pos, f32, f32)> {
        let mut lo = 0;
        if let Some(w) = self.window {
            lo = lo.max(pos - w + 1);
        }
        if let Some(c) = self.chunk {
            lo = lo.max(pos - pos % c);
        }
        self.seqs[seq]
            .iter()
            .filter(|e| e.pos >= lo && (exempt || e.pos <= pos))
            .map(|e| {
                let (k, v) = e.kv(layer);
                (e.pos, k, v)
            })
            .collect()
    }

    /// Removes `start..end` (to the end when `None`) from `seq`.
    pub fn remove(&mut self, seq: SeqId, start: Pos, end: Option<Pos>) -> Result<(), CacheError> {
        self.seq_check(seq)?;
        if start < 0 || end.is_some_and(|e| e < start) {
            return Err(CacheError::InvalidArgument("bad range".into()));
        }
        let delta = end.map_or(0, |e| start - e);
        if let (Some(end), true) = (end, delta != 0) {
            let moved: Vec<&Entry> = self.seqs[seq].iter().filter(|e| e.pos >= end).collect();
            let shared = moved.iter().find(|e| {
                self.seqs
                    .iter()
                    .enumerate()
                    .any(|(s, other)| s != seq && other.iter().any(|o| o.id == e.id))
            });
            if let Some(e) = shared {
                return Err(CacheError::SharedCellShift { seq, pos: e.pos });
            }
            if !moved.is_empty() && !self.has_shift {
                return Err(CacheError::NotSupported("no shift".into()));
            }
        }
        if let (Some(end), true) = (end, delta != 0) {
            let moved: BTreeSet<u64> = self.seqs[seq]
                .iter()
                .filter(|e| e.pos >= end)
                .map(|e| e.id)
                .collect();
            let over: Vec<BlockKey> = self
                .blocks
                .iter()
                .filter(|(_, b)| b.entries.iter().any(|e| moved.contains(&e.id)))
                .map(|(k, _)| *k)
                .collect();
            self.forget(&over);
        }
        let entries = &mut self.seqs[seq];
        entries.retain(|e| e.pos < start || end.is_some_and(|end| e.pos >= end));
        if let Some(end) = end {
            for e in entries.iter_mut().filter(|e| e.pos >= end) {
                e.pos += delta;
                e.delta += delta as f32;
            }
        }
        Ok(())
    }

    /// Makes `dst` share `src`'s positions below `len`.
    pub fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) -> Result<(), CacheError> {
        self.seq_check(src)?;
        self.seq_check(dst)?;
        if len < 0 {
            return Err(CacheError::InvalidArgument("negative length".into()));
        }
        let prefix: Vec<Entry> = self.seqs[src].iter().filter(|e| e.pos < len).cloned().collect();
        self.seqs[dst] = prefix;
        Ok(())
    }

    /// Whether `seq` can continue at `pos`.
    pub fn can_resume(&self, seq: SeqId, pos: Pos) -> bool {
        if self.memory.is_none() {
            return true;
        }
        if seq >= self.max_sequences {
            return false;
        }
        let (Some(first), Some(last)) = (self.seqs[seq].first(), self.seqs[seq].last()) else {
            return false;
        };
        let w = self.window.expect("a bounded memory implies a window");
        (pos - w + 1).max(0) >= first.pos && pos <= last.pos + 1
    }

    /// Every `(seq, pos, key, value)` in `layer`, sorted.
    pub fn contents(&self, layer: usize) -> Vec<(SeqId, Pos, f32, f32)> {
        let mut out = Vec::new();
        for (s, entries) in self.seqs.iter().enumerate() {
            for e in entries {
                let (k, v) = e.kv(layer);
                out.push((s, e.pos, k, v));
            }
        }
        out
    }
}

/// Whether two errors are the same kind (and, where the cache promises exact
/// numbers, the same numbers).
pub fn same_error(got: &CacheError, want: &CacheError) -> bool {
    use CacheError::*;
    match (got, want) {
        (Full { .. }, Full { .. }) | (SharedCellShift { .. }, SharedCellShift { .. }) => got == want,
        (SequenceOutOfRange { .. }, SequenceOutOfRange { .. }) => got == want,
        _ => std::mem::discriminant(got) == std::mem::discriminant(want),
    }
}
