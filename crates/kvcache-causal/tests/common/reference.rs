//! A naive model of the causal cache: each sequence's history as a plain sorted
//! list, with the same trimming, visibility, removal and sharing rules, and the
//! errors the cache must return. Cells are not modelled, only token identity (so
//! shared tokens are counted once when deciding whether a batch fits).

use std::collections::BTreeSet;

use kvcache_api::{CacheError, CausalConfig, Pos, SeqId};

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

    fn live(&self, keep: &[Pos]) -> usize {
        let mut ids = BTreeSet::new();
        for (s, entries) in self.seqs.iter().enumerate() {
            ids.extend(entries.iter().filter(|e| e.pos >= keep[s]).map(|e| e.id));
        }
        ids.len()
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
