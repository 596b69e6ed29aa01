//! Runs schedules of cache operations (batches joining and leaving, removals with
//! and without shift, `copy_prefix`) through a [`CausalCache`] and checks every
//! logit row against [`Llama::forward_full`] of the sequence's current tokens.
//!
//! The reference keeps, per sequence, its tokens and an abstract id per stored
//! token, so it knows when cells are shared and a shifting removal must fail with
//! [`CacheError::SharedCellShift`].
//!
//! A shifting removal keeps the moved tokens' keys and values as computed in their
//! old context (only re-rotated). That equals recomputation exactly when keys and
//! values depend on the token and its position alone, i.e. with one layer: use
//! shifts with a one-layer model ([`Llama::truncated`]).

use candle_core::{IndexOp, Tensor};
use kvcache_api::{CacheError, CausalCache, CausalConfig, Pos, PosRange, SeqId};
use kvcache_models::{BatchToken, Llama, ModelError, Result};

use super::testing::max_abs_diff;

/// One operation of a schedule. Fractions pick positions relative to the
/// sequence's length, so any schedule is valid for any state.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// One forward pass: `(sequence, tokens)` per entry, tokens interleaved
    /// round-robin across entries (a sequence listed twice counts once).
    Step(Vec<(SeqId, usize)>),
    /// `remove(seq, ..)`: the sequence leaves.
    Leave(SeqId),
    /// `remove(seq, keep..)` with `keep = frac * len`.
    Truncate(SeqId, f64),
    /// `remove(seq, a..a + n)`, `a = frac * len`: later positions shift down.
    RemoveShift(SeqId, f64, usize),
    /// `copy_prefix(src, dst, frac * len(src))`.
    CopyPrefix(SeqId, SeqId, f64),
}

/// Cell id of a position that sliding-window trimming dropped.
const TRIMMED: u64 = u64::MAX;

#[derive(Debug, Clone, Default)]
struct SeqKv {
    tokens: Vec<u32>,
    /// Abstract identity of the cell holding each position ([`TRIMMED`] once a
    /// sliding window's memory dropped it).
    cells: Vec<u64>,
}

/// What a schedule did: the largest logit difference and the counts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CheckReport {
    /// Largest absolute difference between a cached and a recomputed logit.
    pub max_diff: f32,
    /// Logit rows compared.
    pub rows: usize,
    /// Forward passes run.
    pub passes: usize,
    /// Shifting removals done.
    pub shifts: usize,
    /// Shifting removals correctly refused because cells were shared.
    pub refused_shifts: usize,
    /// Prefix copies done.
    pub copies: usize,
}

/// Drives one cache through schedules and compares against recomputation.
#[derive(Debug)]
pub struct Checker<'m> {
    model: &'m Llama,
    window: Option<usize>,
    memory: Option<usize>,
    capacity: usize,
    seqs: Vec<SeqKv>,
    next_cell: u64,
    rng: u64,
    report: CheckReport,
}

impl<'m> Checker<'m> {
    /// A checker for a cache configured with `config` (its sequences, capacity,
    /// sliding window and memory).
    pub fn new(model: &'m Llama, config: &CausalConfig) -> Self {
        Checker {
            model,
            window: config.window.map(|w| w.window()),
            memory: config.effective_memory(),
            capacity: config.capacity,
            seqs: vec![SeqKv::default(); config.max_sequences],
            next_cell: 0,
            rng: 0x2545_F491_4F6C_DD1D,
            report: CheckReport::default(),
        }
    }

    /// The report so far.
    pub fn report(&self) -> CheckReport {
        self.report
    }

    /// The current tokens of `seq`.
    pub fn tokens(&self, seq: SeqId) -> &[u32] {
        &self.seqs[seq].tokens
    }

    fn next_token(&mut self) -> u32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % self.model.config().vocab_size as u64) as u32
    }

    /// Runs `ops` in order.
    pub fn run<C>(&mut self, cache: &mut C, ops: &[Op]) -> Result<CheckReport>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        for op in ops {
            self.apply(cache, op)?;
        }
        Ok(self.report)
    }

    /// Runs one operation; a mismatch with the reference is an error.
    pub fn apply<C>(&mut self, cache: &mut C, op: &Op) -> Result<()>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        let n_seqs = self.seqs.len();
        match *op {
            Op::Step(ref entries) => {
                let mut plan: Vec<(SeqId, Vec<u32>)> = Vec::new();
                for &(seq, count) in entries {
                    let seq = seq % n_seqs;
                    let room = self.capacity - self.seqs[seq].tokens.len();
                    let count = count.min(room);
                    if count == 0 || plan.iter().any(|(s, _)| *s == seq) {
                        continue;
                    }
                    let toks = (0..count).map(|_| self.next_token()).collect();
                    plan.push((seq, toks));
                }
                if !plan.is_empty() {
                    self.step(cache, &plan)?;
                }
            }
            Op::Leave(seq) => {
                let seq = seq % n_seqs;
                cache.remove(seq, PosRange::from(0..))?;
                self.seqs[seq] = SeqKv::default();
            }
            Op::Truncate(seq, frac) => {
                let seq = seq % n_seqs;
                let keep = pick(frac, self.seqs[seq].tokens.len());
                if self.window.is_some() && !cache.can_resume(seq, keep as Pos) {
                    return Ok(());
                }
                cache.remove(seq, PosRange::from(keep as Pos..))?;
                self.seqs[seq].tokens.truncate(keep);
                self.seqs[seq].cells.truncate(keep);
            }
            Op::RemoveShift(seq, frac, n) => {
                let seq = seq % n_seqs;
                let len = self.seqs[seq].tokens.len();
                let start = pick(frac, len);
                let end = (start + n.max(1)).min(len);
                if start >= end {
                    return Ok(());
                }
                let shared = self.seqs[seq].cells[end..]
                    .iter()
                    .any(|c| self.cell_shared(seq, *c));
                let range = PosRange::from(start as Pos..end as Pos);
                match cache.remove(seq, range) {
                    Err(CacheError::SharedCellShift { .. }) if shared => {
                        self.report.refused_shifts += 1;
                        return Ok(());
                    }
                    Err(e) => return Err(e.into()),
                    Ok(()) if shared => {
                        return Err(ModelError::InvalidArgument(format!(
                            "remove({seq}, {start}..{end}) shifted shared cells"
                        )))
                    }
                    Ok(()) => {}
                }
                let s = &mut self.seqs[seq];
                s.tokens.drain(start..end);
                s.cells.drain(start..end);
                self.report.shifts += 1;
                self.drop_if_stale(cache, seq)?;
            }
            Op::CopyPrefix(src, dst, frac) => {
                let (src, dst) = (src % n_seqs, dst % n_seqs);
                if src == dst {
                    return Ok(());
                }
                let len = pick(frac, self.seqs[src].tokens.len());
                if self.window.is_some() && !cache.can_resume(src, len as Pos) {
                    return Ok(());
                }
                cache.copy_prefix(src, dst, len as Pos)?;
                let prefix = SeqKv {
                    tokens: self.seqs[src].tokens[..len].to_vec(),
                    cells: self.seqs[src].cells[..len].to_vec(),
                };
                self.seqs[dst] = prefix;
                self.report.copies += 1;
            }
        }
        Ok(())
    }

    /// With a sliding window, a shift can pull positions that were already trimmed
    /// back into the window: such a sequence cannot continue and is dropped.
    fn drop_if_stale<C>(&mut self, cache: &mut C, seq: SeqId) -> Result<()>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        let len = self.seqs[seq].tokens.len() as Pos;
        if self.window.is_some() && !cache.can_resume(seq, len) {
            cache.remove(seq, PosRange::from(0..))?;
            self.seqs[seq] = SeqKv::default();
        }
        Ok(())
    }

    fn cell_shared(&self, seq: SeqId, cell: u64) -> bool {
        cell != TRIMMED
            && self
                .seqs
                .iter()
                .enumerate()
                .any(|(s, st)| s != seq && st.cells.contains(&cell))
    }

    fn step<C>(&mut self, cache: &mut C, plan: &[(SeqId, Vec<u32>)]) -> Result<()>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        // Before the pass the cache drops, from every sequence whose next position
        // is `n`, the positions below `n - memory + 1`.
        if let Some(m) = self.memory {
            for s in &mut self.seqs {
                let keep_from = (s.cells.len() + 1).saturating_sub(m);
                s.cells[..keep_from].fill(TRIMMED);
            }
        }
        // Round-robin interleaving: token 0 of every entry, then token 1, ...
        let mut batch = Vec::new();
        let longest = plan.iter().map(|(_, t)| t.len()).max().unwrap_or(0);
        for i in 0..longest {
            for (seq, toks) in plan {
                if let Some(&token) = toks.get(i) {
                    let pos = (self.seqs[*seq].tokens.len() + i) as Pos;
                    batch.push(BatchToken {
                        seq: *seq,
                        pos,
                        token,
                    });
                }
            }
        }
        let logits = self.model.forward(&batch, cache)?;
        self.report.passes += 1;
        for (seq, toks) in plan {
            let s = &mut self.seqs[*seq];
            s.tokens.extend_from_slice(toks);
            for _ in toks {
                s.cells.push(self.next_cell);
                self.next_cell += 1;
            }
            let full = self.model.forward_full(&self.seqs[*seq].tokens, self.window)?;
            for (row, t) in batch.iter().enumerate().filter(|(_, t)| t.seq == *seq) {
                let diff = max_abs_diff(&logits.i(row)?, &full.i(t.pos as usize)?);
                self.report.max_diff = self.report.max_diff.max(diff);
                self.report.rows += 1;
            }
        }
        Ok(())
    }
}

fn pick(frac: f64, len: usize) -> usize {
    ((frac.clamp(0.0, 1.0) * len as f64) as usize).min(len)
}
