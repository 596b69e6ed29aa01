//! The bookkeeping of sequence export and import, without tensors: which cells hold
//! a range of a sequence, and where imported positions go.
//!
//! An import is placed like a forward pass over the imported positions: every
//! sequence is trimmed to its sliding-window memory first (the importing one as a
//! pass ending at the last imported position would trim it), then the kept
//! positions take free cells by the cache's placement, compacting when needed.
//! Imported positions that trimming would drop are never stored.

use std::ops::Range;

use kvcache_api::{CacheError, Pos, Result, SeqId};

use super::Book;
use crate::placement::{choose_cells, Move};
use crate::window;

/// A validated import into one sequence: what [`Book::commit_import`] stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImportPlan {
    seq: SeqId,
    /// Positions stored: the imported positions the sequence keeps.
    kept: Range<Pos>,
    /// The rows of the imported state that are stored (`kept`, counted from the
    /// first imported position).
    pub rows: Range<usize>,
}

/// Where a committed import went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placed {
    /// Compaction moves the stored tensors must apply first, in order.
    pub moves: Vec<Move>,
    /// The cell of each stored row, in row order.
    pub cells: Vec<u32>,
}

impl Book {
    /// The cells holding positions `range` of `seq`, as cell ranges in position
    /// order. Every position of the non-empty `range` must be held.
    pub(crate) fn cells_of_range(&self, seq: SeqId, range: Range<Pos>) -> Result<Vec<Range<usize>>> {
        self.check_seq(seq)?;
        if range.start < 0 || range.start >= range.end {
            return Err(CacheError::InvalidArgument(format!(
                "export range {}..{} is empty or negative",
                range.start, range.end
            )));
        }
        let index = self.cells.index(seq);
        let missing = |pos: Pos| {
            let held = match (index.first_pos(), index.last_pos()) {
                (Some(a), Some(b)) => format!("it holds {} positions within {a}..={b}", index.len()),
                _ => "it is empty".to_string(),
            };
            CacheError::InvalidArgument(format!(
                "sequence {seq} does not hold position {pos} of {}..{} ({held})",
                range.start, range.end
            ))
        };
        let mut out = Vec::new();
        let mut next = range.start;
        for run in index.visible(range.start, range.end - 1) {
            if run.pos != next {
                return Err(missing(next));
            }
            out.push(run.cells());
            next = run.end_pos();
        }
        if next != range.end {
            return Err(missing(next));
        }
        Ok(out)
    }

    /// Validates importing `positions` into `seq`; changes nothing. On success,
    /// [`Book::commit_import`] with the plan cannot fail.
    pub(crate) fn prepare_import(&mut self, seq: SeqId, positions: Range<Pos>) -> Result<ImportPlan> {
        self.check_seq(seq)?;
        if positions.start < 0 || positions.start >= positions.end {
            return Err(CacheError::InvalidArgument(format!(
                "import positions {}..{} are empty or negative",
                positions.start, positions.end
            )));
        }
        if let Some(last) = self.cells.index(seq).last_pos() {
            if last + 1 != positions.start {
                return Err(CacheError::InvalidArgument(format!(
                    "sequence {seq} ends at position {last}: an import into it must start at {} \
                     (or go into an empty sequence), not at {}",
                    last + 1,
                    positions.start
                )));
            }
        }
        let line = self.import_keep_lines(seq, positions.end);
        let kept = line.max(positions.start)..positions.end;
        let needed = kept.len();
        let free = self.cells.occupancy().free() + window::cells_freed(&self.cells, &self.scratch.keep);
        if free < needed {
            return Err(CacheError::Full {
                cells: self.cells.len(),
                used: self.cells.occupancy().used(),
                batch: needed,
            });
        }
        let skip = (kept.start - positions.start) as usize;
        Ok(ImportPlan {
            seq,
            rows: skip..skip + needed,
            kept,
        })
    }

    /// Fills the scratch keep lines for an import into `seq` ending before `end`
    /// (as a pass whose lowest token of `seq` is `end - 1`; idle sequences as in any
    /// pass) and returns `seq`'s line.
    fn import_keep_lines(&mut self, seq: SeqId, end: Pos) -> Pos {
        self.scratch.lowest[seq] = end - 1;
        window::keep_lines(
            &self.cells,
            &self.attention,
            &self.scratch.lowest,
            &mut self.scratch.keep,
        );
        self.scratch.lowest[seq] = Pos::MAX;
        self.scratch.keep[seq]
    }

    /// Carries out a validated import: trims every sequence, places the kept
    /// positions (compacting first when they do not fit) and ends any pass in
    /// progress. Returns the moves and cells the stored tensors must follow.
    pub(crate) fn commit_import(&mut self, plan: &ImportPlan) -> Placed {
        self.import_keep_lines(plan.seq, plan.kept.end);
        for (seq, &line) in self.scratch.keep.iter().enumerate() {
            if line > Pos::MIN {
                self.cells.drop_below(seq, line);
            }
        }
        let n = plan.kept.len();
        let placement = self.config.placement;
        let mut cells = Vec::with_capacity(n);
        let mut moves = Vec::new();
        if !choose_cells(self.cells.occupancy_mut(), placement, n, &mut cells) {
            moves = self.compact();
            assert!(
                choose_cells(self.cells.occupancy_mut(), placement, n, &mut cells),
                "no room for an import after compaction despite validation"
            );
        }
        for (pos, &cell) in plan.kept.clone().zip(&cells) {
            self.cells.place(cell as usize, plan.seq, pos);
        }
        self.pass.end();
        Placed { moves, cells }
    }
}

#[cfg(test)]
mod tests {
    use kvcache_api::{Batch, CausalConfig, ForwardMode, Placement, SlidingWindow};

    use super::*;

    fn forward(book: &mut Book, batch: &Batch) {
        book.prepare_forward(batch, ForwardMode::Compute).unwrap();
        book.commit_forward(batch, ForwardMode::Compute);
    }

    #[test]
    fn ranges_must_be_held_whole() {
        let mut book = Book::new(CausalConfig::new(2, 16, 4)).unwrap();
        forward(
            &mut book,
            &Batch::from_tokens([(0, 0), (1, 0), (0, 1), (0, 2)]).unwrap(),
        );
        assert_eq!(book.cells_of_range(0, 0..3).unwrap(), vec![0..1, 2..4]);
        assert_eq!(book.cells_of_range(0, 1..3).unwrap(), vec![2..4]);
        for bad in [0..4, 2..2, -1..1, 3..5] {
            assert!(matches!(
                book.cells_of_range(0, bad),
                Err(CacheError::InvalidArgument(_))
            ));
        }
        assert!(matches!(
            book.cells_of_range(2, 0..1),
            Err(CacheError::SequenceOutOfRange { .. })
        ));
    }

    #[test]
    fn imports_trim_like_a_pass_and_place_contiguously() {
        // Window 2, memory 3 (two sequences): an import of 0..10 keeps 7..10.
        let config = CausalConfig::new(2, 16, 4)
            .with_window(SlidingWindow::new(2))
            .with_placement(Placement::Contiguous);
        let mut book = Book::new(config).unwrap();
        forward(&mut book, &Batch::from_tokens([(1, 0), (0, 0), (1, 1)]).unwrap());
        let plan = book.prepare_import(0, 1..11).unwrap();
        assert_eq!((plan.kept.clone(), plan.rows.clone()), (8..11, 7..10));
        let before = book.cells().clone();
        assert!(matches!(
            book.prepare_import(0, 2..4),
            Err(CacheError::InvalidArgument(_))
        ));
        assert_eq!(book.cells(), &before);
        let placed = book.commit_import(&plan);
        book.check();
        // Sequence 0's position 0 was trimmed; a run of 3 free cells follows cell 2.
        assert_eq!(placed.cells, vec![3, 4, 5]);
        assert_eq!(book.cells().index(0).first_pos(), Some(8));
        assert_eq!(book.cells().index(0).cell_of(10), Some(5));
    }

    #[test]
    fn full_imports_change_nothing() {
        let mut book = Book::new(CausalConfig::new(1, 4, 4)).unwrap();
        forward(&mut book, &Batch::sequence(0, 0, 3).unwrap());
        let before = book.cells().clone();
        assert_eq!(
            book.prepare_import(0, 3..5).unwrap_err(),
            CacheError::Full {
                cells: 4,
                used: 3,
                batch: 2
            }
        );
        assert_eq!(book.cells(), &before);
        book.check();
    }
}
