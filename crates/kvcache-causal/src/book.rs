//! The whole bookkeeping of a causal cache, without tensors: cells, the forward
//! pass in progress, and the operations that change them.
//!
//! Every operation that takes caller input is split in two: a validation step that
//! returns a typed error and changes nothing, and a commit step that cannot fail and
//! returns what the tensor storage must do (compaction moves, key shifts). The cache
//! and the layer-group wrapper both rely on that split to leave state untouched on
//! error.

use std::ops::Range;

use kvcache_api::{
    Batch, CacheError, CausalConfig, ForwardMode, Placement, Pos, PosRange, Result, RowRuns, SeqId,
};

use kvcache_api::block_key::BlockKey;

use crate::blocks::BlockIndex;
use crate::cells::Cells;
use crate::mask::{self, Plan, Query};
use crate::placement::{choose_cells, choose_cells_reserving, plan_compaction, Move, Reservations};
use crate::window::{self, Attention};

mod retention;
pub(crate) mod transfer;

/// The forward pass in progress.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Pass {
    /// `None` between passes.
    mode: Option<ForwardMode>,
    positions: Vec<Pos>,
    sequences: Vec<SeqId>,
    /// The cell of each token (empty in reserve passes).
    cells: Vec<u32>,
    /// Tokens exempt from causality.
    exempt: Vec<bool>,
    /// The cells the pass attends to, padded.
    range: Range<usize>,
    /// Each token's visible cells (absolute), in batch order: what the mask
    /// shows and the paged view hands out. Empty rows in reserve passes.
    runs: RowRuns,
}

impl Pass {
    /// The pass's mode, or `None` between passes.
    pub(crate) fn mode(&self) -> Option<ForwardMode> {
        self.mode
    }

    /// Tokens in the pass.
    pub(crate) fn len(&self) -> usize {
        self.positions.len()
    }

    /// Cell of each token, in batch order (empty in reserve passes).
    pub(crate) fn cells(&self) -> &[u32] {
        &self.cells
    }

    /// Cells the pass attends to (mask columns, key/value views).
    pub(crate) fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Tokens exempt from causality.
    pub(crate) fn exempt(&self) -> &[bool] {
        &self.exempt
    }

    /// Each token's visible cells, in batch order.
    pub(crate) fn runs(&self) -> &RowRuns {
        &self.runs
    }

    fn end(&mut self) {
        self.mode = None;
    }
}

/// Scratch space reused by every pass (not part of the cache's state).
#[derive(Debug, Clone, Default)]
struct Scratch {
    /// Per sequence, its lowest batch position, `Pos::MAX` when absent.
    lowest: Vec<Pos>,
    /// Per sequence, the lowest position it keeps in this pass.
    keep: Vec<Pos>,
    /// Mask row spans.
    spans: Vec<(u32, u32)>,
    /// Blocks the validated pass evicts to make room, least recently used
    /// first.
    evict: Vec<BlockKey>,
}

/// A validated shifting removal: the chunks of cells whose keys must be re-rotated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RemovePlan {
    seq: SeqId,
    start: Pos,
    end: Option<Pos>,
    /// Chunks of at most `max_batch` consecutive cells, each starting and ending at
    /// a shifted cell.
    pub chunks: Vec<ShiftChunk>,
    /// The position delta of every cell of every chunk, chunk after chunk.
    pub offsets: Vec<Pos>,
    /// Blocks whose cells move, and those below them, leaves first: the
    /// removal forgets them (their keys no longer match the cells' positions).
    unindex: Vec<BlockKey>,
}

impl RemovePlan {
    /// The position delta of each cell of `chunk` (0 for cells in between that
    /// belong to other sequences).
    pub(crate) fn offsets(&self, chunk: &ShiftChunk) -> &[Pos] {
        &self.offsets[chunk.offsets.clone()]
    }
}

/// Cells `first..first + offsets.len()` whose keys move; `offsets` indexes the
/// plan's deltas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShiftChunk {
    /// First cell of the chunk.
    pub first: usize,
    /// Where the chunk's deltas are in [`RemovePlan::offsets`].
    pub offsets: Range<usize>,
}

/// Cells, configuration and the current pass of one cache.
#[derive(Debug, Clone)]
pub(crate) struct Book {
    config: CausalConfig,
    attention: Attention,
    cells: Cells,
    /// Free cells set aside for sequences decoding side by side.
    reservations: Reservations,
    /// Cells kept by block for later sequences.
    blocks: BlockIndex,
    pass: Pass,
    scratch: Scratch,
}

impl Book {
    /// Empty bookkeeping for `config`.
    pub(crate) fn new(config: CausalConfig) -> Result<Self> {
        config.validate()?;
        let cells = config.num_cells();
        if u32::try_from(cells).is_err() {
            return Err(CacheError::InvalidArgument(format!(
                "{cells} cells exceed the supported 2^32"
            )));
        }
        Ok(Book {
            attention: Attention::new(&config),
            cells: Cells::new(cells, config.max_sequences),
            reservations: Reservations::new(config.max_sequences),
            // A window trims the positions a chain starts with: keep tails.
            blocks: if Attention::new(&config).bounded() {
                BlockIndex::tails()
            } else {
                BlockIndex::default()
            },
            // Room for a few runs per row from the start, so that a pass's runs
            // grow only when the cells are fragmented more than ever before.
            pass: Pass {
                runs: RowRuns::with_capacity(config.max_batch, 4 * config.max_batch),
                ..Pass::default()
            },
            scratch: Scratch {
                lowest: vec![Pos::MAX; config.max_sequences],
                ..Scratch::default()
            },
            config,
        })
    }

    /// The configuration.
    pub(crate) fn config(&self) -> &CausalConfig {
        &self.config
    }

    /// The cells.
    pub(crate) fn cells(&self) -> &Cells {
        &self.cells
    }

    /// The pass in progress (check its mode).
    pub(crate) fn pass(&self) -> &Pass {
        &self.pass
    }

    fn check_seq(&self, seq: SeqId) -> Result<()> {
        if seq >= self.config.max_sequences {
            return Err(CacheError::SequenceOutOfRange {
                seq,
                max_sequences: self.config.max_sequences,
            });
        }
        Ok(())
    }

    /// Validates a forward pass over `batch`; changes nothing (it plans the
    /// evictions of kept blocks the pass needs, if those make room). On
    /// success, [`Book::commit_forward`] with the same batch and mode cannot
    /// fail.
    pub(crate) fn prepare_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Result<()> {
        self.scratch.evict.clear();
        if batch.len() > self.config.max_batch {
            return Err(CacheError::InvalidBatch(format!(
                "{} tokens exceed the cache's max batch of {}",
                batch.len(),
                self.config.max_batch
            )));
        }
        for &seq in batch.sequences() {
            self.check_seq(seq)?;
        }
        if let Some(i) = batch.positions().iter().position(|&p| p == Pos::MAX) {
            return Err(CacheError::InvalidBatch(format!(
                "token {i} has position {}, past the last usable position",
                Pos::MAX
            )));
        }
        if mode == ForwardMode::Reserve {
            return Ok(());
        }
        for (seq, pos) in batch.tokens() {
            if self.cells.index(seq).cell_of(pos).is_some() {
                return Err(CacheError::InvalidBatch(format!(
                    "sequence {seq} already holds position {pos} (remove it first)"
                )));
            }
        }
        self.note_lowest(batch);
        window::keep_lines(
            &self.cells,
            &self.attention,
            &self.scratch.lowest,
            &mut self.scratch.keep,
        );
        self.forget_lowest(batch);
        let trimmed = window::cells_freed(&self.cells, &self.scratch.keep);
        let free = self.cells.occupancy().free() + trimmed;
        if free < batch.len() && self.blocks.len() > 0 {
            // Kept blocks give way to the pass, least recently used first,
            // if together they can.
            let (plan, enough) = self.eviction_plan(batch.len() - trimmed);
            if enough {
                self.scratch.evict = plan;
                return Ok(());
            }
        }
        if free < batch.len() {
            return Err(CacheError::Full {
                cells: self.cells.len(),
                used: self.cells.occupancy().used(),
                batch: batch.len(),
            });
        }
        Ok(())
    }

    fn note_lowest(&mut self, batch: &Batch) {
        for (seq, pos) in batch.tokens() {
            let lowest = &mut self.scratch.lowest[seq];
            *lowest = (*lowest).min(pos);
        }
    }

    fn forget_lowest(&mut self, batch: &Batch) {
        for &seq in batch.sequences() {
            self.scratch.lowest[seq] = Pos::MAX;
        }
    }

    /// Starts the pass [`Book::prepare_forward`] validated: evicts the blocks it
    /// planned to, trims windows, places
    /// the tokens (compacting when needed) and fixes the cell range. Returns the
    /// compaction moves the stored tensors must apply, in order.
    pub(crate) fn commit_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Vec<Move> {
        let pass = &mut self.pass;
        pass.mode = Some(mode);
        pass.positions.clear();
        pass.positions.extend_from_slice(batch.positions());
        pass.sequences.clear();
        pass.sequences.extend_from_slice(batch.sequences());
        pass.exempt.clear();
        pass.exempt.resize(batch.len(), false);
        pass.cells.clear();
        if mode == ForwardMode::Reserve {
            pass.range = 0..self.cells.len();
            self.plan_runs();
            return Vec::new();
        }
        for key in std::mem::take(&mut self.scratch.evict) {
            self.drop_block(&key);
        }
        self.note_lowest(batch);
        window::keep_lines(
            &self.cells,
            &self.attention,
            &self.scratch.lowest,
            &mut self.scratch.keep,
        );
        for (seq, &line) in self.scratch.keep.iter().enumerate() {
            if line > Pos::MIN {
                self.cells.drop_below(seq, line);
            }
        }
        let mut moves = Vec::new();
        if !self.choose_cells(batch) {
            moves = self.compact();
            assert!(
                self.choose_cells(batch),
                "no room after compaction despite validation"
            );
        } else if self.too_many_holes() {
            moves = self.compact();
            self.pass.cells.clear();
            assert!(
                self.choose_cells(batch),
                "no room after compaction despite validation"
            );
        }
        for (i, (seq, pos)) in batch.tokens().enumerate() {
            let cell = self.pass.cells[i];
            self.cells.place(cell as usize, seq, pos);
        }
        let seqs = (0..self.cells.max_sequences()).filter(|&s| self.scratch.lowest[s] != Pos::MAX);
        let (lo, hi) = window::attended_cells(&self.cells, &self.attention, &self.scratch.lowest, seqs)
            .expect("the batch's own cells are attended");
        let pad = self.config.cache_padding;
        self.pass.range = lo / pad * pad..(hi + 1).div_ceil(pad) * pad;
        self.forget_lowest(batch);
        self.plan_runs();
        moves
    }

    /// Plans every token's visible cells into the pass's runs.
    fn plan_runs(&mut self) {
        let mut runs = std::mem::take(&mut self.pass.runs);
        plan_runs(
            &self.cells,
            &self.attention,
            &self.pass,
            &mut self.scratch.spans,
            &mut runs,
        );
        self.pass.runs = runs;
    }

    /// Chooses a cell for every token of `batch` into the pass's cells. Scattered
    /// placement keeps reservations unless the cache compacts holey ranges (the
    /// spare cells of reservations are holes).
    fn choose_cells(&mut self, batch: &Batch) -> bool {
        let config = &self.config;
        if config.placement == Placement::Scattered && config.compact_threshold.is_none() {
            return choose_cells_reserving(
                &mut self.cells,
                &mut self.reservations,
                batch,
                &mut self.pass.cells,
            );
        }
        choose_cells(
            self.cells.occupancy_mut(),
            config.placement,
            batch.len(),
            &mut self.pass.cells,
        )
    }

    /// Whether free cells make up more than the compaction threshold of the range
    /// the pass would attend to with the cells just chosen.
    fn too_many_holes(&self) -> bool {
        let Some(threshold) = self.config.compact_threshold else {
            return false;
        };
        let seqs = (0..self.cells.max_sequences()).filter(|&s| self.scratch.lowest[s] != Pos::MAX);
        let mut bounds = window::attended_cells(&self.cells, &self.attention, &self.scratch.lowest, seqs);
        for &cell in &self.pass.cells {
            let c = cell as usize;
            bounds = Some(bounds.map_or((c, c), |(a, b)| (a.min(c), b.max(c))));
        }
        let Some((lo, hi)) = bounds else {
            return false;
        };
        // The chosen cells are still free but about to be used.
        let holes = self.cells.occupancy().free_in(lo..hi + 1) - self.pass.cells.len();
        holes as f64 > f64::from(threshold) * (hi + 1 - lo) as f64
    }

    /// Compacts the cells and returns the data moves.
    fn compact(&mut self) -> Vec<Move> {
        let (moves, runs) = plan_compaction(self.cells.occupancy());
        tracing::debug!(
            moves = moves.len(),
            used = self.cells.occupancy().used(),
            "compacting the KV cache"
        );
        self.cells.compact(&moves, &runs);
        self.blocks.remap_cells(|cell| {
            let i = runs.partition_point(|r| r.src + r.len <= cell);
            runs[i].dst + (cell - runs[i].src)
        });
        self.reservations.clear();
        moves
    }

    /// Mask rows: the batch padded to the batch padding.
    pub(crate) fn mask_rows(&self) -> usize {
        self.pass.len().div_ceil(self.config.batch_padding) * self.config.batch_padding
    }

    /// Entries of the pass's `[mask_rows, range.len()]` mask.
    #[cfg(test)]
    pub(crate) fn mask_len(&self) -> usize {
        self.mask_rows() * self.pass.range.len()
    }

    /// Plans the pass's `[mask_rows, range.len()]` mask into `plan`, from the
    /// pass's runs.
    pub(crate) fn plan_mask(&self, plan: &mut Plan) {
        mask::plan(&self.pass.runs, self.mask_rows(), self.pass.range.clone(), plan);
    }

    /// The mask columns row `row` of the pass's mask may see, as sorted,
    /// disjoint, non-adjacent ranges (the row's planned intervals, without the
    /// mask): empty for padding rows and in reserve passes.
    pub(crate) fn visible_cells(&self, row: usize) -> Result<Vec<Range<usize>>> {
        let pass = &self.pass;
        if pass.mode.is_none() {
            return Err(CacheError::InvalidState(
                "visible_cells needs a forward pass in progress".into(),
            ));
        }
        let rows = self.mask_rows();
        if row >= rows {
            return Err(CacheError::InvalidArgument(format!(
                "mask row {row} out of range: the pass's mask has {rows} rows"
            )));
        }
        if row >= pass.len() {
            return Ok(Vec::new());
        }
        let base = pass.range.start;
        Ok(pass
            .runs
            .row(row)
            .iter()
            .map(|r| r.start as usize - base..r.end as usize - base)
            .collect())
    }

    /// Validates `set_causal(except)`; returns whether the exemptions change.
    pub(crate) fn prepare_set_causal(&self, except: &[usize]) -> Result<bool> {
        if self.pass.mode.is_none() {
            return Err(CacheError::InvalidState(
                "set_causal needs a forward pass in progress".into(),
            ));
        }
        if let Some(&i) = except.iter().find(|&&i| i >= self.pass.len()) {
            return Err(CacheError::InvalidArgument(format!(
                "token {i} is not in the batch of {}",
                self.pass.len()
            )));
        }
        let wanted = |i: usize| except.contains(&i);
        Ok((0..self.pass.len()).any(|i| self.pass.exempt[i] != wanted(i)))
    }

    /// Applies validated exemptions.
    pub(crate) fn commit_set_causal(&mut self, except: &[usize]) {
        self.pass.exempt.fill(false);
        for &i in except {
            self.pass.exempt[i] = true;
        }
        self.plan_runs();
    }

    /// Validates `remove(seq, range)`; `can_shift` says whether a shift function
    /// is available.
    pub(crate) fn prepare_remove(&self, seq: SeqId, range: PosRange, can_shift: bool) -> Result<RemovePlan> {
        self.check_seq(seq)?;
        if range.start < 0 {
            return Err(CacheError::InvalidArgument(format!(
                "removal starts at negative position {}",
                range.start
            )));
        }
        if let Some(end) = range.end.filter(|&e| e < range.start) {
            return Err(CacheError::InvalidArgument(format!(
                "removal range {}..{end} is inverted",
                range.start
            )));
        }
        let mut plan = RemovePlan {
            seq,
            start: range.start,
            end: range.end,
            chunks: Vec::new(),
            offsets: Vec::new(),
            unindex: Vec::new(),
        };
        let delta = range.shift();
        let Some(end) = range.end.filter(|_| delta != 0) else {
            return Ok(plan);
        };
        let index = self.cells.index(seq);
        let mut spans: Vec<(usize, usize)> = Vec::new();
        let any_shared = self.cells.any_shared();
        for run in index.visible(end, Pos::MAX) {
            if let Some(k) = run.cells().position(|c| any_shared && self.cells.is_shared(c)) {
                return Err(CacheError::SharedCellShift {
                    seq,
                    pos: run.pos + k as Pos,
                });
            }
            spans.push((run.cell as usize, run.end_cell() as usize));
        }
        if spans.is_empty() {
            return Ok(plan);
        }
        if !can_shift {
            return Err(CacheError::NotSupported(format!(
                "removing {}..{end} from sequence {seq} moves later positions, which needs a key shift \
                 function (give the cache one, or remove to the end instead)",
                range.start
            )));
        }
        spans.sort_unstable();
        if self.cells.any_pinned() {
            plan.unindex = self.blocks_over(&spans);
        }
        (plan.chunks, plan.offsets) = chunk_shifts(&spans, self.config.max_batch, delta);
        Ok(plan)
    }

    /// Applies a validated removal to the metadata; ends any pass in progress.
    pub(crate) fn commit_remove(&mut self, plan: &RemovePlan) {
        for key in &plan.unindex {
            self.drop_block(key);
        }
        self.cells.remove(plan.seq, plan.start, plan.end);
        self.reservations.drop_seq(plan.seq);
        self.pass.end();
    }

    /// Validates `copy_prefix(src, dst, len)`.
    pub(crate) fn prepare_copy_prefix(&self, src: SeqId, dst: SeqId, len: Pos) -> Result<()> {
        self.check_seq(src)?;
        self.check_seq(dst)?;
        if len < 0 {
            return Err(CacheError::InvalidArgument(format!(
                "prefix length {len} is negative"
            )));
        }
        Ok(())
    }

    /// Applies a validated `copy_prefix`; ends any pass in progress. Copying a
    /// sequence onto itself keeps its first `len` positions.
    pub(crate) fn commit_copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) {
        if src == dst {
            self.cells.remove(src, len, None);
        } else {
            self.cells.clear(dst);
            self.cells.share_prefix(src, dst, len);
        }
        self.reservations.drop_seq(dst);
        self.pass.end();
    }

    /// Whether `seq` can continue at `pos` with its whole window stored.
    pub(crate) fn can_resume(&self, seq: SeqId, pos: Pos) -> bool {
        if !self.attention.bounded() {
            return true;
        }
        if seq >= self.config.max_sequences {
            return false;
        }
        let index = self.cells.index(seq);
        self.attention
            .can_resume(index.first_pos(), index.last_pos(), pos)
    }

    /// Bytes of heap memory held by the bookkeeping (scratch included).
    pub(crate) fn capacity_bytes(&self) -> usize {
        let p = &self.pass;
        let s = &self.scratch;
        self.cells.capacity_bytes()
            + self.blocks.capacity_bytes()
            + p.positions.capacity() * 4
            + p.sequences.capacity() * 8
            + p.cells.capacity() * 4
            + p.exempt.capacity()
            + p.runs.capacity_bytes()
            + (s.lowest.capacity() + s.keep.capacity()) * 4
            + s.spans.capacity() * 8
    }

    /// Panics with a precise message unless every invariant holds.
    pub(crate) fn check(&self) {
        self.cells.check();
        self.check_blocks();
        assert!(
            self.scratch.lowest.iter().all(|&p| p == Pos::MAX),
            "scratch: lowest batch positions were left behind"
        );
        let pass = &self.pass;
        let Some(mode) = pass.mode else {
            return;
        };
        let n = pass.len();
        assert!(n > 0 && n <= self.config.max_batch, "pass of {n} tokens");
        assert_eq!(
            pass.sequences.len(),
            n,
            "pass: sequences and positions differ in length"
        );
        assert_eq!(
            pass.exempt.len(),
            n,
            "pass: exemptions and positions differ in length"
        );
        let pad = self.config.cache_padding;
        assert!(
            pass.range.start.is_multiple_of(pad)
                && pass.range.end.is_multiple_of(pad)
                && pass.range.end <= self.cells.len(),
            "pass: range {:?} is not aligned to {pad} within {} cells",
            pass.range,
            self.cells.len()
        );
        let mut planned = RowRuns::default();
        plan_runs(&self.cells, &self.attention, pass, &mut Vec::new(), &mut planned);
        assert_eq!(
            planned, pass.runs,
            "pass: the rows' visible runs disagree with the cells"
        );
        match mode {
            ForwardMode::Reserve => {
                assert!(pass.cells.is_empty(), "reserve pass placed cells");
                assert_eq!(
                    pass.range,
                    0..self.cells.len(),
                    "reserve pass must span every cell"
                );
            }
            ForwardMode::Compute => {
                assert_eq!(pass.cells.len(), n, "pass: a cell for every token");
                for i in 0..n {
                    let (seq, pos, cell) = (pass.sequences[i], pass.positions[i], pass.cells[i]);
                    assert_eq!(
                        self.cells.index(seq).cell_of(pos),
                        Some(cell),
                        "pass: token {i} (sequence {seq}, position {pos}) should be in cell {cell}"
                    );
                    assert!(
                        pass.range.contains(&(cell as usize)),
                        "pass: token {i}'s cell {cell} is outside the range {:?}",
                        pass.range
                    );
                }
            }
        }
    }
}

/// Plans every token of `pass` its visible cells into `runs` (a step per run of
/// the token's sequence that it sees, found by binary search); rows of a reserve
/// pass see nothing. `spans` is scratch.
fn plan_runs(
    cells: &Cells,
    attention: &Attention,
    pass: &Pass,
    spans: &mut Vec<(u32, u32)>,
    runs: &mut RowRuns,
) {
    runs.clear();
    let base = pass.range.start as u32;
    for i in 0..pass.positions.len() {
        spans.clear();
        if pass.mode == Some(ForwardMode::Compute) {
            let query = Query {
                seq: pass.sequences[i],
                pos: pass.positions[i],
                exempt: pass.exempt[i],
            };
            mask::row_spans(cells, attention, query, pass.range.clone(), spans);
        }
        runs.push_row(spans.iter().map(|&(start, len)| base + start..base + start + len));
    }
}

/// Splits the shifted cells (`spans`, sorted disjoint `start..end` cell ranges) into
/// chunks of at most `max_batch` cells, each starting and ending at a shifted cell,
/// so stretches of unshifted cells are skipped.
fn chunk_shifts(spans: &[(usize, usize)], max_batch: usize, delta: Pos) -> (Vec<ShiftChunk>, Vec<Pos>) {
    let mut chunks: Vec<ShiftChunk> = Vec::new();
    let (first, last) = (spans[0].0, spans[spans.len() - 1].1);
    let mut offsets: Vec<Pos> = Vec::with_capacity(last - first);
    for &(start, end) in spans {
        let mut at = start;
        while at < end {
            let fits = chunks.last().is_some_and(|c| at < c.first + max_batch);
            if !fits {
                chunks.push(ShiftChunk {
                    first: at,
                    offsets: offsets.len()..offsets.len(),
                });
            }
            let chunk = chunks.last_mut().expect("pushed above");
            let stop = end.min(chunk.first + max_batch);
            // Zeros for the unshifted cells since the chunk's last shifted cell.
            let base = chunk.offsets.start;
            offsets.resize(base + (at - chunk.first), 0);
            offsets.resize(base + (stop - chunk.first), delta);
            chunk.offsets.end = offsets.len();
            at = stop;
        }
    }
    (chunks, offsets)
}

#[cfg(test)]
mod tests {
    use kvcache_api::SlidingWindow;

    use super::*;

    fn forward(book: &mut Book, batch: &Batch) -> Result<Vec<Move>> {
        book.prepare_forward(batch, ForwardMode::Compute)?;
        let moves = book.commit_forward(batch, ForwardMode::Compute);
        book.check();
        Ok(moves)
    }

    fn grid(book: &mut Book) -> Vec<String> {
        let width = book.pass().range().len();
        let mut plan = Plan::default();
        book.plan_mask(&mut plan);
        let mut mask = vec![0.0f32; book.mask_len()];
        mask::write(&Plan::default(), &plan, &mut mask);
        mask.chunks(width)
            .map(|row| row.iter().map(|&v| if v == 0.0 { '0' } else { 'x' }).collect())
            .collect()
    }

    #[test]
    fn sliding_window_trims_and_narrows_the_range() {
        // SCENARIOS S2.
        let mut book = Book::new(CausalConfig::new(1, 16, 16).with_window(SlidingWindow::new(2))).unwrap();
        forward(&mut book, &Batch::sequence(0, 0, 4).unwrap()).unwrap();
        assert_eq!(grid(&mut book), vec!["0xxx", "00xx", "x00x", "xx00"]);
        forward(&mut book, &Batch::sequence(0, 4, 2).unwrap()).unwrap();
        assert_eq!(book.pass().cells(), &[0, 1]);
        assert_eq!(book.pass().range(), 0..4);
        assert_eq!(grid(&mut book), vec!["0xx0", "00xx"]);
    }

    #[test]
    fn idle_sequences_are_trimmed_too() {
        let config = CausalConfig::new(2, 16, 4).with_window(SlidingWindow::new(2));
        let mut book = Book::new(config).unwrap();
        forward(&mut book, &Batch::sequence(1, 0, 4).unwrap()).unwrap();
        // Memory is 3 with two sequences: idle sequence 1 (next 4) keeps 2..=3.
        forward(&mut book, &Batch::sequence(0, 0, 1).unwrap()).unwrap();
        assert_eq!(book.cells().index(1).first_pos(), Some(2));
        assert_eq!(book.cells().occupancy().used(), 3);
    }

    #[test]
    fn full_is_reported_before_anything_changes() {
        let config = CausalConfig::new(1, 4, 4);
        let mut book = Book::new(config).unwrap();
        forward(&mut book, &Batch::sequence(0, 0, 3).unwrap()).unwrap();
        let err = forward(&mut book, &Batch::sequence(0, 3, 2).unwrap()).unwrap_err();
        assert_eq!(
            err,
            CacheError::Full {
                cells: 4,
                used: 3,
                batch: 2
            }
        );
        book.check();
        let dup = forward(&mut book, &Batch::sequence(0, 2, 1).unwrap()).unwrap_err();
        assert!(matches!(dup, CacheError::InvalidBatch(m) if m.contains("already holds")));
        book.check();
    }

    #[test]
    fn contiguous_placement_compacts_in_order() {
        let config = CausalConfig::new(2, 4, 4).with_placement(Placement::Contiguous);
        let mut book = Book::new(config).unwrap();
        forward(
            &mut book,
            &Batch::from_tokens([(0, 0), (1, 0), (0, 1), (1, 1)]).unwrap(),
        )
        .unwrap();
        forward(
            &mut book,
            &Batch::from_tokens([(0, 2), (1, 2), (0, 3), (1, 3)]).unwrap(),
        )
        .unwrap();
        book.commit_copy_prefix(1, 1, 0);
        book.check();
        // Sequence 0 holds cells 0, 2, 4, 6; a run of 3 needs compaction.
        let moves = forward(&mut book, &Batch::sequence(1, 0, 3).unwrap()).unwrap();
        assert_eq!(
            moves,
            vec![
                Move {
                    src: 2,
                    dst: 1,
                    len: 1
                },
                Move {
                    src: 4,
                    dst: 2,
                    len: 1
                },
                Move {
                    src: 6,
                    dst: 3,
                    len: 1
                }
            ]
        );
        assert_eq!(book.pass().cells(), &[4, 5, 6]);
        assert_eq!(book.cells().index(0).cell_of(3), Some(3));
    }

    #[test]
    fn threshold_compacts_holey_ranges() {
        let config = CausalConfig::new(2, 8, 8).with_compact_threshold(Some(0.25));
        let mut book = Book::new(config).unwrap();
        forward(&mut book, &Batch::sequence(1, 0, 6).unwrap()).unwrap();
        forward(&mut book, &Batch::sequence(0, 0, 2).unwrap()).unwrap();
        book.commit_copy_prefix(1, 1, 0);
        // Cells 0..6 are free, sequence 0 is in 6..8: a 1-token batch would attend to
        // cells 0..=7 with 5 holes, so the cache compacts first.
        let moves = forward(&mut book, &Batch::sequence(0, 2, 1).unwrap()).unwrap();
        assert_eq!(
            moves,
            vec![Move {
                src: 6,
                dst: 0,
                len: 2
            }]
        );
        assert_eq!(book.pass().cells(), &[2]);
        assert_eq!(book.pass().range(), 0..3);
    }

    /// Each chunk as (first cell, deltas).
    fn chunked(spans: &[(usize, usize)], max_batch: usize, delta: Pos) -> Vec<(usize, Vec<Pos>)> {
        let (chunks, offsets) = chunk_shifts(spans, max_batch, delta);
        chunks
            .iter()
            .map(|c| (c.first, offsets[c.offsets.clone()].to_vec()))
            .collect()
    }

    #[test]
    fn shift_chunks_skip_unshifted_stretches() {
        assert_eq!(
            chunked(&[(2, 5), (6, 7), (20, 23)], 4, -1),
            vec![(2, vec![-1; 3]), (6, vec![-1]), (20, vec![-1; 3])]
        );
        assert_eq!(
            chunked(&[(0, 2), (3, 9)], 4, -2),
            vec![(0, vec![-2, -2, 0, -2]), (4, vec![-2; 4]), (8, vec![-2])]
        );
    }

    #[test]
    fn removal_validates_before_changing_anything() {
        let mut book = Book::new(CausalConfig::new(2, 8, 8)).unwrap();
        forward(&mut book, &Batch::sequence(0, 0, 4).unwrap()).unwrap();
        book.commit_copy_prefix(0, 1, 3);
        assert_eq!(
            book.prepare_remove(0, PosRange::from(0..1), true).unwrap_err(),
            CacheError::SharedCellShift { seq: 0, pos: 1 }
        );
        assert!(matches!(
            book.prepare_remove(0, PosRange::from(3..4), false),
            Ok(RemovePlan { ref chunks, .. }) if chunks.is_empty()
        ));
        assert!(matches!(
            book.prepare_remove(0, PosRange::from(2..3), false),
            Err(CacheError::NotSupported(_))
        ));
        assert!(matches!(
            book.prepare_remove(
                0,
                PosRange {
                    start: 3,
                    end: Some(2)
                },
                true
            ),
            Err(CacheError::InvalidArgument(_))
        ));
        let plan = book.prepare_remove(0, PosRange::from(2..3), true).unwrap();
        assert_eq!(plan.chunks.len(), 1);
        assert_eq!(
            (plan.chunks[0].first, plan.offsets(&plan.chunks[0])),
            (3, &[-1][..])
        );
        book.commit_remove(&plan);
        book.check();
        assert_eq!(book.cells().index(0).cell_of(2), Some(3));
    }
}
