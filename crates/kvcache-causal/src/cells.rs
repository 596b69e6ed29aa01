//! The cells of a causal cache: each cell's position and sequence set, which cells
//! are used, and every sequence's sorted position index.
//!
//! Every mutation keeps four views in step: per-cell sequence sets, per-cell pins
//! (cells the block index keeps), the occupancy bitset and the per-sequence run
//! index. [`Cells::check`] verifies that they agree: a cell is used iff a
//! sequence holds it or a block pins it.

use kvcache_api::{Pos, SeqId};

use crate::occupancy::Occupancy;
use crate::placement::Move;
use crate::seq_index::{Run, SeqIndex};
use crate::seq_set::SeqSets;

/// All cell metadata of one cache.
///
/// A cell's position is not stored per cell: it lives in the index of every
/// sequence holding the cell (they agree, which [`Cells::check`] verifies), so
/// shifting a sequence's positions costs a step per run, not per cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cells {
    /// Sequences holding each cell.
    seqs: SeqSets,
    /// Used/free bitset.
    occupancy: Occupancy,
    /// Per sequence, its positions and their cells.
    index: Vec<SeqIndex>,
    /// Per cell, how many indexed blocks keep it ([`crate::blocks`]).
    pins: Vec<u16>,
    /// Cells with a pin.
    pinned: usize,
}

/// Frees `seq`'s hold on each cell of `run`; cells nobody else holds and no
/// block pins become free.
fn release(seqs: &mut SeqSets, occupancy: &mut Occupancy, pins: &[u16], pinned: usize, seq: SeqId, run: Run) {
    let cells = run.cells();
    let emptied = seqs.remove_run(cells.clone(), seq);
    if emptied == cells.len() && pinned == 0 {
        occupancy.mark_free_range(cells);
    } else if emptied > 0 {
        for cell in cells.filter(|&c| seqs.count(c) == 0 && pins[c] == 0) {
            occupancy.mark_free(cell);
        }
    }
}

impl Cells {
    /// `cells` free cells for sequences `0..max_sequences`.
    pub(crate) fn new(cells: usize, max_sequences: usize) -> Self {
        Cells {
            seqs: SeqSets::new(cells, max_sequences),
            occupancy: Occupancy::new(cells),
            index: vec![SeqIndex::default(); max_sequences],
            pins: vec![0; cells],
            pinned: 0,
        }
    }

    /// Number of cells.
    pub(crate) fn len(&self) -> usize {
        self.occupancy.cells()
    }

    /// Number of sequence ids.
    pub(crate) fn max_sequences(&self) -> usize {
        self.index.len()
    }

    /// The used/free bitset.
    pub(crate) fn occupancy(&self) -> &Occupancy {
        &self.occupancy
    }

    /// The used/free bitset, for searches that advance its hint.
    pub(crate) fn occupancy_mut(&mut self) -> &mut Occupancy {
        &mut self.occupancy
    }

    /// Position held by `cell`, `None` when free. Searches the index of one holder
    /// (a step per run): meant for inspection, not for hot paths.
    pub(crate) fn position_of(&self, cell: usize) -> Option<Pos> {
        let holder = self.seqs.iter(cell).next()?;
        let cell = cell as u32;
        self.index[holder]
            .runs()
            .iter()
            .find(|r| r.cell <= cell && cell < r.end_cell())
            .map(|r| r.pos + (cell - r.cell) as Pos)
    }

    /// Sequences holding `cell`.
    pub(crate) fn sequences(&self, cell: usize) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.iter(cell)
    }

    /// Whether more than one sequence holds `cell`.
    pub(crate) fn is_shared(&self, cell: usize) -> bool {
        self.seqs.count(cell) > 1
    }

    /// Whether any cell is held by more than one sequence.
    pub(crate) fn any_shared(&self) -> bool {
        self.seqs.shared() > 0
    }

    /// `seq`'s position index.
    pub(crate) fn index(&self, seq: SeqId) -> &SeqIndex {
        &self.index[seq]
    }

    /// Stores position `pos` of `seq` in the free `cell`.
    pub(crate) fn place(&mut self, cell: usize, seq: SeqId, pos: Pos) {
        assert!(
            !self.occupancy.is_used(cell),
            "placing sequence {seq} in used cell {cell}"
        );
        self.seqs.insert(cell, seq);
        self.occupancy.mark_used(cell);
        self.index[seq].insert(pos, cell as u32);
    }

    /// Drops `seq`'s positions below `lo`.
    pub(crate) fn drop_below(&mut self, seq: SeqId, lo: Pos) {
        let Cells {
            seqs,
            occupancy,
            index,
            pins,
            pinned,
        } = self;
        index[seq].drop_below(lo, |run| release(seqs, occupancy, pins, *pinned, seq, run));
    }

    /// Drops `seq`'s positions `start..end` (to the end when `end` is `None`) and
    /// moves its later positions down by `end - start`. The caller has checked that
    /// no moved cell is shared.
    pub(crate) fn remove(&mut self, seq: SeqId, start: Pos, end: Option<Pos>) {
        let Cells {
            seqs,
            occupancy,
            index,
            pins,
            pinned,
        } = self;
        index[seq].remove(start, end, |run| {
            release(seqs, occupancy, pins, *pinned, seq, run)
        });
    }

    /// Drops every position of `seq`.
    pub(crate) fn clear(&mut self, seq: SeqId) {
        let Cells {
            seqs,
            occupancy,
            index,
            pins,
            pinned,
        } = self;
        index[seq].clear(|run| release(seqs, occupancy, pins, *pinned, seq, run));
    }

    /// Makes `seq` hold position `pos` in the pinned `cell` (adopting a block).
    pub(crate) fn hold(&mut self, cell: usize, seq: SeqId, pos: Pos) {
        assert!(self.pins[cell] > 0, "sequence {seq} adopts unpinned cell {cell}");
        self.seqs.insert(cell, seq);
        self.index[seq].insert(pos, cell as u32);
    }

    /// How many blocks keep `cell`.
    pub(crate) fn pins(&self, cell: usize) -> u16 {
        self.pins[cell]
    }

    /// Whether a block keeps `cell`.
    pub(crate) fn is_pinned(&self, cell: usize) -> bool {
        self.pins[cell] > 0
    }

    /// Whether any block keeps a cell.
    pub(crate) fn any_pinned(&self) -> bool {
        self.pinned > 0
    }

    /// Keeps the used `cell` for one more block.
    pub(crate) fn pin(&mut self, cell: usize) {
        assert!(self.occupancy.is_used(cell), "pinning free cell {cell}");
        let pins = &mut self.pins[cell];
        *pins = pins.checked_add(1).expect("fewer than 2^16 blocks per cell");
        if *pins == 1 {
            self.pinned += 1;
        }
    }

    /// Drops one block's pin of `cell`; it becomes free when nothing else keeps it.
    pub(crate) fn unpin(&mut self, cell: usize) {
        let pins = &mut self.pins[cell];
        assert!(*pins > 0, "unpinning cell {cell}, which has no pin");
        *pins -= 1;
        if *pins == 0 {
            self.pinned -= 1;
            if self.seqs.count(cell) == 0 {
                self.occupancy.mark_free(cell);
            }
        }
    }

    /// Makes empty sequence `dst` hold `src`'s positions below `len`, in the same cells.
    pub(crate) fn share_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) {
        assert!(
            self.index[dst].is_empty(),
            "sharing into non-empty sequence {dst}"
        );
        let prefix = self.index[src].prefix(len);
        for run in prefix.runs() {
            self.seqs.insert_run(run.cells(), dst);
        }
        self.index[dst] = prefix;
    }

    /// Applies compaction `moves` (ascending, memmove semantics) to the metadata:
    /// `used_runs` lists every maximal run of used cells as `(src, dst, len)`, moved
    /// or not, so each index run can find its new cells.
    pub(crate) fn compact(&mut self, moves: &[Move], used_runs: &[Move]) {
        for m in moves {
            self.seqs
                .copy_within(m.src as usize, m.dst as usize, m.len as usize);
            let (src, dst, len) = (m.src as usize, m.dst as usize, m.len as usize);
            self.pins.copy_within(src..src + len, dst);
        }
        let used = self.occupancy.used();
        self.seqs.clear_from(used);
        self.pins[used..].fill(0);
        self.occupancy.set_prefix_used(used);
        for index in &mut self.index {
            index.remap_cells(|cell| {
                let i = used_runs.partition_point(|r| r.src + r.len <= cell);
                let r = &used_runs[i];
                debug_assert!(r.src <= cell, "cell {cell} is in no used run");
                r.dst + (cell - r.src)
            });
        }
    }

    /// Bytes of heap memory held by the metadata.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.seqs.capacity_bytes()
            + self.occupancy.capacity_bytes()
            + self.pins.capacity() * 2
            + self.index.capacity() * std::mem::size_of::<SeqIndex>()
            + self.index.iter().map(SeqIndex::capacity_bytes).sum::<usize>()
    }

    /// Panics with a precise message unless every view of the cells agrees.
    pub(crate) fn check(&self) {
        self.occupancy.check();
        let cells = self.len();
        let mut holders = vec![0usize; cells];
        let mut position: Vec<Option<Pos>> = vec![None; cells];
        for (seq, index) in self.index.iter().enumerate() {
            index.check(seq);
            for run in index.runs() {
                assert!(
                    run.end_cell() as usize <= cells,
                    "sequence {seq}: run {run:?} goes past the last cell {cells}"
                );
                for (k, cell) in run.cells().enumerate() {
                    let p = run.pos + k as Pos;
                    assert!(
                        self.seqs.contains(cell, seq),
                        "sequence {seq} indexes position {p} in cell {cell}, whose set lacks it"
                    );
                    let recorded = *position[cell].get_or_insert(p);
                    assert_eq!(
                        recorded, p,
                        "cell {cell}: sequence {seq} says position {p}, another holder says {recorded}"
                    );
                    holders[cell] += 1;
                }
            }
        }
        let shared = holders.iter().filter(|&&h| h > 1).count();
        assert_eq!(
            self.seqs.shared(),
            shared,
            "{} cells counted as shared, {shared} are",
            self.seqs.shared()
        );
        for (cell, &held) in holders.iter().enumerate() {
            let members = self.seqs.count(cell);
            assert_eq!(
                members, held,
                "cell {cell}: {members} sequences in its set but {held} indexes point at it"
            );
            let pins = self.pins[cell];
            assert_eq!(
                self.occupancy.is_used(cell),
                members > 0 || pins > 0,
                "cell {cell}: used bit disagrees with its {members} sequences and {pins} pins"
            );
        }
        let pinned = self.pins.iter().filter(|&&p| p > 0).count();
        assert_eq!(
            self.pinned, pinned,
            "{} cells counted as pinned, {pinned} are",
            self.pinned
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn place_remove_share_keep_views_in_step() {
        let mut c = Cells::new(8, 2);
        for (i, p) in (0..4).enumerate() {
            c.place(i, 0, p);
        }
        c.check();
        c.share_prefix(0, 1, 2);
        c.check();
        assert!(c.is_shared(1) && !c.is_shared(2));
        c.remove(0, 1, Some(2));
        c.check();
        // Cell 1 stays for sequence 1; sequence 0's positions 2, 3 became 1, 2.
        assert_eq!(c.sequences(1).collect::<Vec<_>>(), vec![1]);
        assert_eq!((c.position_of(2), c.position_of(3)), (Some(1), Some(2)));
        c.drop_below(0, 2);
        c.check();
        assert_eq!(c.occupancy().used(), 3);
        assert_eq!(c.position_of(2), None);
        c.clear(1);
        c.check();
        assert_eq!(c.occupancy().used(), 1);
        assert_eq!(c.index(0).cell_of(2), Some(3));
    }
}
