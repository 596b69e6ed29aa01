//! One sequence's positions and the cells holding them, as sorted runs.
//!
//! A run maps consecutive positions to consecutive cells. Prefill chunks become one
//! run each, so lookups, sliding-window trims, removals and mask rows cost a step per
//! run rather than per token. Runs are kept sorted by position, non-overlapping and
//! maximal (two neighbours never continue each other in both position and cell).

use std::collections::VecDeque;

use kvcache_api::Pos;

/// Positions `pos..pos + len` of one sequence, held by cells `cell..cell + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    /// First position.
    pub pos: Pos,
    /// Cell holding `pos`.
    pub cell: u32,
    /// Number of positions (and cells); at least 1.
    pub len: u32,
}

impl Run {
    /// One past the last position.
    pub(crate) fn end_pos(&self) -> Pos {
        self.pos + self.len as Pos
    }

    /// One past the last cell.
    pub(crate) fn end_cell(&self) -> u32 {
        self.cell + self.len
    }

    /// The cells as a `usize` range.
    pub(crate) fn cells(&self) -> std::ops::Range<usize> {
        self.cell as usize..self.end_cell() as usize
    }

    /// Whether `next` continues this run in both position and cell.
    fn continues_into(&self, next: &Run) -> bool {
        self.end_pos() == next.pos && self.end_cell() == next.cell
    }

    /// The part of this run with positions in `lo..=hi`, if any.
    pub(crate) fn clip(&self, lo: Pos, hi: Pos) -> Option<Run> {
        let start = self.pos.max(lo);
        let end = self.end_pos().min(hi.saturating_add(1));
        (start < end).then(|| Run {
            pos: start,
            cell: self.cell + (start - self.pos) as u32,
            len: (end - start) as u32,
        })
    }
}

/// The positions one sequence holds, sorted, as maximal runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SeqIndex {
    runs: VecDeque<Run>,
    tokens: usize,
    /// Lowest and highest cell held (meaningless when empty), kept so that a pass
    /// over a whole sequence finds its cell range without visiting its runs.
    cell_bounds: (u32, u32),
}

impl SeqIndex {
    /// Number of positions held.
    pub(crate) fn len(&self) -> usize {
        self.tokens
    }

    /// Whether the sequence holds nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The runs, in position order.
    pub(crate) fn runs(&self) -> &VecDeque<Run> {
        &self.runs
    }

    /// Lowest position held.
    pub(crate) fn first_pos(&self) -> Option<Pos> {
        self.runs.front().map(|r| r.pos)
    }

    /// Highest position held.
    pub(crate) fn last_pos(&self) -> Option<Pos> {
        self.runs.back().map(|r| r.end_pos() - 1)
    }

    /// Lowest and highest cell held, inclusive.
    pub(crate) fn cell_bounds(&self) -> Option<(u32, u32)> {
        (!self.is_empty()).then_some(self.cell_bounds)
    }

    fn refresh_bounds(&mut self) {
        self.cell_bounds = self.runs.iter().fold((u32::MAX, 0), |(lo, hi), r| {
            (lo.min(r.cell), hi.max(r.end_cell() - 1))
        });
    }

    /// Index of the first run that ends after `pos`.
    fn first_run_ending_after(&self, pos: Pos) -> usize {
        match self.runs.back() {
            Some(last) if last.end_pos() <= pos => self.runs.len(),
            _ => self.runs.partition_point(|r| r.end_pos() <= pos),
        }
    }

    /// The cell holding `pos`.
    pub(crate) fn cell_of(&self, pos: Pos) -> Option<u32> {
        let run = self.runs.get(self.first_run_ending_after(pos))?;
        (run.pos <= pos).then(|| run.cell + (pos - run.pos) as u32)
    }

    /// The runs clipped to positions `lo..=hi`, in position order.
    pub(crate) fn visible(&self, lo: Pos, hi: Pos) -> impl Iterator<Item = Run> + '_ {
        let first = self.first_run_ending_after(lo);
        self.runs
            .range(first..)
            .take_while(move |r| r.pos <= hi)
            .filter_map(move |r| r.clip(lo, hi))
    }

    /// Records that `cell` holds `pos`, which the sequence must not hold yet.
    pub(crate) fn insert(&mut self, pos: Pos, cell: u32) {
        let at = self.first_run_ending_after(pos);
        debug_assert!(
            self.runs.get(at).is_none_or(|r| r.pos > pos),
            "position {pos} is already held"
        );
        let single = Run { pos, cell, len: 1 };
        let joins_prev = at > 0 && self.runs[at - 1].continues_into(&single);
        let joins_next = self.runs.get(at).is_some_and(|next| single.continues_into(next));
        match (joins_prev, joins_next) {
            (true, true) => {
                let next = self.runs.remove(at).expect("joins_next implies a run");
                self.runs[at - 1].len += 1 + next.len;
            }
            (true, false) => self.runs[at - 1].len += 1,
            (false, true) => {
                let next = &mut self.runs[at];
                next.pos = pos;
                next.cell = cell;
                next.len += 1;
            }
            (false, false) => self.runs.insert(at, single),
        }
        self.cell_bounds = match self.tokens {
            0 => (cell, cell),
            _ => (self.cell_bounds.0.min(cell), self.cell_bounds.1.max(cell)),
        };
        self.tokens += 1;
    }

    /// Drops every position below `lo`, handing each dropped piece to `dropped`.
    pub(crate) fn drop_below(&mut self, lo: Pos, mut dropped: impl FnMut(Run)) {
        while let Some(front) = self.runs.front_mut() {
            if front.end_pos() <= lo {
                let run = *front;
                self.runs.pop_front();
                self.tokens -= run.len as usize;
                dropped(run);
            } else {
                if front.pos < lo {
                    let cut = (lo - front.pos) as u32;
                    dropped(Run {
                        pos: front.pos,
                        cell: front.cell,
                        len: cut,
                    });
                    front.pos = lo;
                    front.cell += cut;
                    front.len -= cut;
                    self.tokens -= cut as usize;
                }
                break;
            }
        }
        self.refresh_bounds();
    }

    /// Splits the run containing `pos` so that a run starts exactly there; returns
    /// the index of the first run starting at or after `pos`.
    fn split_at(&mut self, pos: Pos) -> usize {
        let at = self.first_run_ending_after(pos);
        if let Some(run) = self.runs.get_mut(at) {
            if run.pos < pos {
                let head = (pos - run.pos) as u32;
                let tail = Run {
                    pos,
                    cell: run.cell + head,
                    len: run.len - head,
                };
                run.len = head;
                self.runs.insert(at + 1, tail);
                return at + 1;
            }
        }
        at
    }

    /// Drops positions `start..end` (to the end when `end` is `None`), handing each
    /// dropped piece to `dropped`, and moves every later position down by
    /// `end - start`.
    pub(crate) fn remove(&mut self, start: Pos, end: Option<Pos>, mut dropped: impl FnMut(Run)) {
        let from = self.split_at(start);
        let to = match end {
            Some(end) => self.split_at(end),
            None => self.runs.len(),
        };
        for run in self.runs.drain(from..to) {
            self.tokens -= run.len as usize;
            dropped(run);
        }
        if let Some(end) = end {
            let delta = start - end;
            for run in self.runs.range_mut(from..) {
                run.pos += delta;
            }
            self.merge_at(from);
        }
        self.refresh_bounds();
    }

    /// Merges run `at` into run `at - 1` when the second continues the first.
    fn merge_at(&mut self, at: usize) {
        if at > 0 && at < self.runs.len() && self.runs[at - 1].continues_into(&self.runs[at]) {
            let next = self.runs.remove(at).expect("checked index");
            self.runs[at - 1].len += next.len;
        }
    }

    /// Drops everything, handing each run to `dropped`.
    pub(crate) fn clear(&mut self, dropped: impl FnMut(Run)) {
        self.runs.drain(..).for_each(dropped);
        self.tokens = 0;
    }

    /// The positions below `len`, as a new index over the same cells.
    pub(crate) fn prefix(&self, len: Pos) -> SeqIndex {
        let mut out = SeqIndex::default();
        out.extend_prefix_of(self, len);
        out
    }

    /// Replaces this (empty) index's content with `src`'s positions below `len`.
    pub(crate) fn extend_prefix_of(&mut self, src: &SeqIndex, len: Pos) {
        debug_assert!(self.is_empty());
        for run in src.runs.iter().take_while(|r| r.pos < len) {
            let run = run.clip(Pos::MIN, len - 1).expect("run starts below len");
            self.tokens += run.len as usize;
            self.runs.push_back(run);
        }
        self.refresh_bounds();
    }

    /// Rewrites every run's cells through `new_start` (the new first cell of a run
    /// that moved as a whole), then merges runs that became continuous.
    pub(crate) fn remap_cells(&mut self, mut new_start: impl FnMut(u32) -> u32) {
        for run in self.runs.iter_mut() {
            run.cell = new_start(run.cell);
        }
        let mut merged: usize = 0;
        for i in 1..self.runs.len() {
            if self.runs[merged].continues_into(&self.runs[i]) {
                self.runs[merged].len += self.runs[i].len;
            } else {
                merged += 1;
                self.runs[merged] = self.runs[i];
            }
        }
        self.runs.truncate((merged + 1).min(self.runs.len()));
        self.refresh_bounds();
    }

    /// Bytes of heap memory held.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<Run>()
    }

    /// Panics unless runs are non-empty, sorted, non-overlapping and maximal, and
    /// the token count matches.
    pub(crate) fn check(&self, seq: usize) {
        let mut tokens = 0;
        for (i, run) in self.runs.iter().enumerate() {
            assert!(run.len > 0, "sequence {seq}: run {i} is empty");
            assert!(
                run.pos >= 0,
                "sequence {seq}: run {i} has negative position {}",
                run.pos
            );
            tokens += run.len as usize;
            if i > 0 {
                let prev = &self.runs[i - 1];
                assert!(
                    prev.end_pos() <= run.pos,
                    "sequence {seq}: runs {} and {i} overlap or are unsorted ({prev:?}, {run:?})",
                    i - 1
                );
                assert!(
                    !prev.continues_into(run),
                    "sequence {seq}: runs {} and {i} should be one run ({prev:?}, {run:?})",
                    i - 1
                );
            }
        }
        assert_eq!(tokens, self.tokens, "sequence {seq}: token count is stale");
        if !self.is_empty() {
            let mut fresh = self.clone();
            fresh.refresh_bounds();
            assert_eq!(
                self.cell_bounds, fresh.cell_bounds,
                "sequence {seq}: cell bounds are stale"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pos: Pos, cell: u32, len: u32) -> Run {
        Run { pos, cell, len }
    }

    fn index(tokens: &[(Pos, u32)]) -> SeqIndex {
        let mut ix = SeqIndex::default();
        for &(p, c) in tokens {
            ix.insert(p, c);
            ix.check(0);
        }
        ix
    }

    fn runs(ix: &SeqIndex) -> Vec<Run> {
        ix.runs().iter().copied().collect()
    }

    #[test]
    fn inserts_merge_with_both_neighbours() {
        let ix = index(&[(0, 10), (1, 11), (3, 13), (2, 12), (7, 3), (5, 1)]);
        assert_eq!(runs(&ix), vec![run(0, 10, 4), run(5, 1, 1), run(7, 3, 1)]);
        assert_eq!(ix.len(), 6);
        let ix = index(&[(6, 2), (4, 0), (5, 1)]);
        assert_eq!(runs(&ix), vec![run(4, 0, 3)]);
        assert_eq!(ix.cell_of(5), Some(1));
        assert_eq!(ix.cell_of(7), None);
        assert_eq!(ix.cell_of(3), None);
        assert_eq!((ix.first_pos(), ix.last_pos()), (Some(4), Some(6)));
    }

    #[test]
    fn visible_clips_runs() {
        let ix = index(&[(0, 0), (1, 1), (2, 2), (3, 9), (4, 10), (6, 4)]);
        let v: Vec<Run> = ix.visible(1, 4).collect();
        assert_eq!(v, vec![run(1, 1, 2), run(3, 9, 2)]);
        assert_eq!(ix.visible(5, 5).count(), 0);
        assert_eq!(ix.visible(5, Pos::MAX).collect::<Vec<_>>(), vec![run(6, 4, 1)]);
    }

    #[test]
    fn drop_below_cuts_the_front() {
        let mut ix = index(&[(0, 0), (1, 1), (2, 2), (3, 9), (4, 10)]);
        let mut dropped = vec![];
        ix.drop_below(2, |r| dropped.push(r));
        assert_eq!(dropped, vec![run(0, 0, 2)]);
        assert_eq!(runs(&ix), vec![run(2, 2, 1), run(3, 9, 2)]);
        ix.drop_below(4, |r| dropped.push(r));
        assert_eq!(dropped[1..], [run(2, 2, 1), run(3, 9, 1)]);
        assert_eq!(runs(&ix), vec![run(4, 10, 1)]);
        ix.check(0);
    }

    #[test]
    fn remove_middle_shifts_and_merges() {
        // 0..3 in cells 0..3, 3..5 in cells 7..9, 5..8 in cells 3..6.
        let mut ix = index(&[(0, 0), (1, 1), (2, 2), (3, 7), (4, 8), (5, 3), (6, 4), (7, 5)]);
        let mut dropped = vec![];
        ix.remove(3, Some(5), |r| dropped.push(r));
        assert_eq!(dropped, vec![run(3, 7, 2)]);
        // 5..8 becomes 3..6 in cells 3..6, continuing 0..3 in cells 0..3.
        assert_eq!(runs(&ix), vec![run(0, 0, 6)]);
        ix.check(0);
        ix.remove(2, None, |r| dropped.push(r));
        assert_eq!(dropped[1..], [run(2, 2, 4)]);
        assert_eq!(runs(&ix), vec![run(0, 0, 2)]);
        ix.remove(5, Some(9), |_| panic!("nothing there"));
        assert_eq!(runs(&ix), vec![run(0, 0, 2)]);
        ix.check(0);
    }

    #[test]
    fn prefix_and_remap() {
        let ix = index(&[(0, 4), (1, 5), (2, 6), (3, 0)]);
        assert_eq!(runs(&ix.prefix(2)), vec![run(0, 4, 2)]);
        assert_eq!(ix.prefix(0).len(), 0);
        assert_eq!(ix.prefix(10), ix);
        let mut moved = ix.clone();
        moved.remap_cells(|c| if c == 4 { 0 } else { 3 });
        assert_eq!(runs(&moved), vec![run(0, 0, 4)]);
        moved.check(0);
        let mut cleared = vec![];
        moved.clear(|r| cleared.push(r));
        assert!(moved.is_empty() && cleared == vec![run(0, 0, 4)]);
    }
}
