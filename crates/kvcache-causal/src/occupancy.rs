//! Which cells are in use: a bitset with word-at-a-time searches for free cells.
//!
//! A cell is used when at least one sequence holds it. Searches scan 64 cells per
//! step and start from a hint below which every cell is known to be used, so decode
//! steps that refill the cells just freed do not rescan the whole cache.

use std::ops::Range;

/// Used/free state of every cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Occupancy {
    /// Bit `c % 64` of word `c / 64` is set when cell `c` is used. Bits past the
    /// last cell are permanently set so that free searches never return them.
    words: Vec<u64>,
    cells: usize,
    used: usize,
    /// Every word before this one is full.
    first_open_word: usize,
}

impl Occupancy {
    /// `cells` free cells.
    pub(crate) fn new(cells: usize) -> Self {
        let mut words = vec![0u64; cells.div_ceil(64)];
        if !cells.is_multiple_of(64) {
            *words.last_mut().expect("cells % 64 != 0 implies a word") = !0u64 << (cells % 64);
        }
        Occupancy {
            words,
            cells,
            used: 0,
            first_open_word: 0,
        }
    }

    /// Number of cells.
    pub(crate) fn cells(&self) -> usize {
        self.cells
    }

    /// Cells in use.
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// Cells free.
    pub(crate) fn free(&self) -> usize {
        self.cells - self.used
    }

    /// Whether `cell` is in use.
    pub(crate) fn is_used(&self, cell: usize) -> bool {
        self.words[cell / 64] & (1 << (cell % 64)) != 0
    }

    /// Marks a free `cell` used.
    pub(crate) fn mark_used(&mut self, cell: usize) {
        debug_assert!(!self.is_used(cell), "cell {cell} is already used");
        self.words[cell / 64] |= 1 << (cell % 64);
        self.used += 1;
    }

    /// Marks a used `cell` free.
    pub(crate) fn mark_free(&mut self, cell: usize) {
        debug_assert!(self.is_used(cell), "cell {cell} is already free");
        self.words[cell / 64] &= !(1 << (cell % 64));
        self.used -= 1;
        self.first_open_word = self.first_open_word.min(cell / 64);
    }

    /// Marks every cell of `cells` (all used) free.
    pub(crate) fn mark_free_range(&mut self, cells: Range<usize>) {
        if cells.is_empty() {
            return;
        }
        debug_assert_eq!(self.free_in(cells.clone()), 0, "freeing free cells in {cells:?}");
        let (first, last) = (cells.start / 64, (cells.end - 1) / 64);
        for w in first..=last {
            let mut bits = !0u64;
            if w == first {
                bits &= !0u64 << (cells.start % 64);
            }
            if w == last && !cells.end.is_multiple_of(64) {
                bits &= (1u64 << (cells.end % 64)) - 1;
            }
            self.words[w] &= !bits;
        }
        self.used -= cells.len();
        self.first_open_word = self.first_open_word.min(first);
    }

    /// Makes cells `0..count` used and the rest free (the layout after compaction).
    pub(crate) fn set_prefix_used(&mut self, count: usize) {
        let cells = self.cells;
        *self = Occupancy::new(cells);
        let full = count / 64;
        self.words[..full].fill(!0);
        if !count.is_multiple_of(64) {
            self.words[full] |= (1u64 << (count % 64)) - 1;
        }
        self.used = count;
        self.first_open_word = full;
    }

    /// Appends the first `n` free cells, in index order, to `out`; false (with
    /// `out` holding fewer) when there are not that many.
    pub(crate) fn first_free(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        let goal = out.len() + n;
        self.skip_full_words();
        for (w, &word) in self.words.iter().enumerate().skip(self.first_open_word) {
            let mut free = !word;
            while free != 0 && out.len() < goal {
                out.push((w * 64 + free.trailing_zeros() as usize) as u32);
                free &= free - 1;
            }
            if out.len() == goal {
                return true;
            }
        }
        out.len() == goal
    }

    /// Appends the first `n` free cells outside `skip` (sorted, disjoint cell
    /// ranges), in index order, to `out`; false (with `out` holding fewer) when
    /// there are not that many. With no ranges to skip, [`Occupancy::first_free`].
    pub(crate) fn first_free_outside(&mut self, n: usize, skip: &[Range<u32>], out: &mut Vec<u32>) -> bool {
        if skip.is_empty() {
            return self.first_free(n, out);
        }
        let goal = out.len() + n;
        self.skip_full_words();
        let (mut at, mut k) = (self.first_open_word * 64, 0);
        while out.len() < goal {
            let cell = self.next_free(at);
            if cell >= self.cells {
                return false;
            }
            while k < skip.len() && skip[k].end as usize <= cell {
                k += 1;
            }
            match skip.get(k) {
                Some(r) if r.start as usize <= cell => at = r.end as usize,
                _ => {
                    out.push(cell as u32);
                    at = cell + 1;
                }
            }
        }
        true
    }

    /// Start of the first run of `n` consecutive free cells outside `skip`
    /// (sorted, disjoint cell ranges).
    pub(crate) fn first_free_run_outside(&mut self, n: usize, skip: &[Range<u32>]) -> Option<usize> {
        self.skip_full_words();
        let (mut at, mut k) = (self.first_open_word * 64, 0);
        loop {
            let start = self.next_free(at);
            if start >= self.cells {
                return None;
            }
            while k < skip.len() && skip[k].end as usize <= start {
                k += 1;
            }
            let skipped = skip.get(k).map(|r| (r.start as usize, r.end as usize));
            if let Some((lo, hi)) = skipped.filter(|&(lo, _)| lo <= start) {
                debug_assert!(lo <= start);
                at = hi;
                continue;
            }
            let end = self
                .next_used(start)
                .min(skipped.map_or(usize::MAX, |(lo, _)| lo));
            if end - start >= n {
                return Some(start);
            }
            at = end;
        }
    }

    /// Start of the first run of `n` consecutive free cells.
    pub(crate) fn first_free_run(&mut self, n: usize) -> Option<usize> {
        self.skip_full_words();
        let mut at = self.first_open_word * 64;
        while at < self.cells {
            let start = self.next_free(at);
            if start >= self.cells {
                return None;
            }
            let end = self.next_used(start);
            if end - start >= n {
                return Some(start);
            }
            at = end;
        }
        None
    }

    /// Free cells inside `range`.
    pub(crate) fn free_in(&self, range: Range<usize>) -> usize {
        if range.is_empty() {
            return 0;
        }
        let (first, last) = (range.start / 64, (range.end - 1) / 64);
        let mut used = 0;
        for w in first..=last {
            let mut word = self.words[w];
            if w == first {
                word &= !0u64 << (range.start % 64);
            }
            if w == last && !range.end.is_multiple_of(64) {
                word &= (1u64 << (range.end % 64)) - 1;
            }
            used += word.count_ones() as usize;
        }
        range.len() - used
    }

    /// Maximal runs of used cells as `start..end`, in index order.
    pub(crate) fn used_runs(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            let start = self.next_used(at);
            (start < self.cells).then(|| {
                let end = self.next_free(start);
                at = end;
                start..end
            })
        })
    }

    /// First used cell at or after `from`, or the cell count.
    pub(crate) fn next_used(&self, from: usize) -> usize {
        self.next_with(from, |w| w)
    }

    /// First free cell at or after `from`, or the cell count.
    pub(crate) fn next_free(&self, from: usize) -> usize {
        self.next_with(from, |w| !w)
    }

    fn next_with(&self, from: usize, look: impl Fn(u64) -> u64) -> usize {
        if from >= self.cells {
            return self.cells;
        }
        let mut w = from / 64;
        let mut word = look(self.words[w]) & (!0u64 << (from % 64));
        loop {
            if word != 0 {
                return (w * 64 + word.trailing_zeros() as usize).min(self.cells);
            }
            w += 1;
            if w == self.words.len() {
                return self.cells;
            }
            word = look(self.words[w]);
        }
    }

    fn skip_full_words(&mut self) {
        while self.first_open_word < self.words.len() && self.words[self.first_open_word] == !0 {
            self.first_open_word += 1;
        }
    }

    /// Panics unless the counters agree with the bits.
    pub(crate) fn check(&self) {
        let counted = self.cells - self.free_in(0..self.cells);
        assert_eq!(
            counted, self.used,
            "occupancy: used counter {} but {counted} bits set",
            self.used
        );
        if !self.cells.is_multiple_of(64) {
            let tail = !0u64 << (self.cells % 64);
            let last = *self.words.last().expect("nonzero cells");
            assert_eq!(
                last & tail,
                tail,
                "occupancy: bits past the last cell must stay set"
            );
        }
        if let Some(w) = self.words[..self.first_open_word.min(self.words.len())]
            .iter()
            .position(|&w| w != !0)
        {
            panic!(
                "occupancy: word {w} has a free cell below the search hint {}",
                self.first_open_word
            );
        }
    }

    /// Bytes of heap memory held.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.words.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn occupancy(cells: usize, used: &[usize]) -> Occupancy {
        let mut o = Occupancy::new(cells);
        for &c in used {
            o.mark_used(c);
        }
        o.check();
        o
    }

    #[test]
    fn first_free_collects_cells_in_index_order() {
        let mut o = occupancy(130, &[0, 2, 3, 64, 65]);
        let mut out = vec![];
        assert!(o.first_free(3, &mut out));
        assert_eq!(out, vec![1, 4, 5]);
        let mut all = vec![];
        assert!(!o.first_free(200, &mut all));
        assert_eq!(all.len(), 125);
        assert_eq!(*all.last().unwrap(), 129);
    }

    #[test]
    fn free_runs_and_used_runs() {
        let mut o = occupancy(200, &[0, 1, 5, 70, 71, 72]);
        assert_eq!(o.first_free_run(3), Some(2));
        assert_eq!(o.first_free_run(4), Some(6));
        assert_eq!(o.first_free_run(127), Some(73));
        assert_eq!(o.first_free_run(128), None);
        assert_eq!(o.used_runs().collect::<Vec<_>>(), vec![0..2, 5..6, 70..73]);
        assert_eq!(o.free_in(0..200), 194);
        assert_eq!(o.free_in(1..71), 67);
        assert_eq!(o.free_in(64..128), 61);
        assert_eq!(o.free_in(3..3), 0);
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // slices of one range to skip, not ranges to collect
    fn searches_skip_ranges() {
        let mut o = occupancy(200, &[0, 1, 5, 70, 71, 72]);
        let mut out = vec![];
        assert!(o.first_free_outside(4, &[3..4, 6..66], &mut out));
        assert_eq!(out, vec![2, 4, 66, 67]);
        out.clear();
        assert!(!o.first_free_outside(200, &[2..200], &mut out));
        assert_eq!(out, Vec::<u32>::new());
        assert!(o.first_free_outside(1, &[], &mut out));
        assert_eq!(out, vec![2]);
        // Free runs: 2..5, 6..70, 73..200; skipping 10..20 splits the second.
        assert_eq!(o.first_free_run_outside(3, &[10..20]), Some(2));
        assert_eq!(o.first_free_run_outside(4, &[10..20]), Some(6));
        assert_eq!(o.first_free_run_outside(5, &[10..20]), Some(20));
        assert_eq!(o.first_free_run_outside(51, &[10..20]), Some(73));
        assert_eq!(o.first_free_run_outside(127, &[2..5, 100..101]), None);
        assert_eq!(o.first_free_run_outside(99, &[0..3, 100..101]), Some(101));
    }

    #[test]
    fn hint_follows_frees() {
        let cells: Vec<usize> = (0..128).collect();
        let mut o = occupancy(128, &cells);
        assert!(!o.first_free(1, &mut vec![]));
        o.mark_free(3);
        o.check();
        let mut out = vec![];
        assert!(o.first_free(1, &mut out));
        assert_eq!(out, vec![3]);
        o.mark_free_range(60..128);
        o.check();
        assert_eq!(o.used(), 60 - 1);
        assert_eq!(o.used_runs().collect::<Vec<_>>(), vec![0..3, 4..60]);
        o.set_prefix_used(70);
        o.check();
        assert_eq!(o.used(), 70);
        assert_eq!(o.next_free(0), 70);
        assert_eq!(o.used_runs().collect::<Vec<_>>(), vec![0..70]);
    }
}
