//! Which sequences hold each cell: one fixed-width bitset per cell.
//!
//! All cells' sets live in one flat `Vec<u64>`, `words = ceil(max_sequences / 64)`
//! words per cell, so a membership test is one load and a mask, never a search.

use std::ops::Range;

use kvcache_api::SeqId;

/// The sequence set of every cell, stored as consecutive fixed-width bitsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SeqSets {
    words: usize,
    bits: Vec<u64>,
    /// Cells held by two or more sequences.
    shared: usize,
}

impl SeqSets {
    /// Empty sets for `cells` cells, each able to hold ids `0..max_sequences`.
    pub(crate) fn new(cells: usize, max_sequences: usize) -> Self {
        let words = max_sequences.div_ceil(64).max(1);
        SeqSets {
            words,
            bits: vec![0; cells * words],
            shared: 0,
        }
    }

    fn set(&self, cell: usize) -> &[u64] {
        &self.bits[cell * self.words..(cell + 1) * self.words]
    }

    /// Whether `seq` holds `cell`.
    pub(crate) fn contains(&self, cell: usize, seq: SeqId) -> bool {
        self.bits[cell * self.words + seq / 64] & (1 << (seq % 64)) != 0
    }

    /// Adds `seq` (not yet a member) to `cell`'s set; returns the new size.
    pub(crate) fn insert(&mut self, cell: usize, seq: SeqId) -> usize {
        self.bits[cell * self.words + seq / 64] |= 1 << (seq % 64);
        let count = self.count(cell);
        if count == 2 {
            self.shared += 1;
        }
        count
    }

    /// Removes `seq` (a member) from `cell`'s set; returns the new size.
    pub(crate) fn remove(&mut self, cell: usize, seq: SeqId) -> usize {
        self.bits[cell * self.words + seq / 64] &= !(1 << (seq % 64));
        let count = self.count(cell);
        if count == 1 {
            self.shared -= 1;
        }
        count
    }

    /// Adds `seq` (not yet a member) to every cell of `cells`.
    pub(crate) fn insert_run(&mut self, cells: Range<usize>, seq: SeqId) {
        if self.words != 1 {
            cells.for_each(|cell| {
                self.insert(cell, seq);
            });
            return;
        }
        // One word per cell: a cell becomes shared when it had exactly one member.
        let bit = 1u64 << seq;
        let mut newly_shared = 0;
        for word in &mut self.bits[cells] {
            newly_shared += word.is_power_of_two() as usize;
            *word |= bit;
        }
        self.shared += newly_shared;
    }

    /// Removes `seq` (a member) from every cell of `cells`; returns how many cells
    /// became empty.
    pub(crate) fn remove_run(&mut self, cells: Range<usize>, seq: SeqId) -> usize {
        if self.words != 1 {
            return cells.filter(|&cell| self.remove(cell, seq) == 0).count();
        }
        // One word per cell: a cell stops being shared when one member is left.
        let keep = !(1u64 << seq);
        let (mut emptied, mut unshared) = (0, 0);
        for word in &mut self.bits[cells] {
            *word &= keep;
            emptied += (*word == 0) as usize;
            unshared += word.is_power_of_two() as usize;
        }
        self.shared -= unshared;
        emptied
    }

    /// Number of cells held by two or more sequences.
    pub(crate) fn shared(&self) -> usize {
        self.shared
    }

    /// Number of sequences holding `cell`.
    pub(crate) fn count(&self, cell: usize) -> usize {
        self.set(cell).iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The sequences holding `cell`, in increasing id order.
    pub(crate) fn iter(&self, cell: usize) -> impl Iterator<Item = SeqId> + '_ {
        self.set(cell).iter().enumerate().flat_map(|(w, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                (rest != 0).then(|| {
                    let bit = rest.trailing_zeros() as usize;
                    rest &= rest - 1;
                    w * 64 + bit
                })
            })
        })
    }

    /// Copies the sets of cells `src..src + len` onto `dst..dst + len` (memmove).
    /// With [`SeqSets::clear_from`] this moves cells: the shared count is unchanged.
    pub(crate) fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        let w = self.words;
        self.bits.copy_within(src * w..(src + len) * w, dst * w);
    }

    /// Empties the sets of cells `from..`.
    pub(crate) fn clear_from(&mut self, from: usize) {
        let w = self.words;
        self.bits[from * w..].fill(0);
    }

    /// Bytes of heap memory held.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.bits.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_independent_per_cell_and_span_words() {
        let mut s = SeqSets::new(3, 130);
        s.insert(1, 0);
        s.insert(1, 64);
        s.insert(1, 129);
        s.insert(2, 5);
        assert_eq!(s.count(0), 0);
        assert_eq!(s.iter(1).collect::<Vec<_>>(), vec![0, 64, 129]);
        assert_eq!(s.count(1), 3);
        assert_eq!(s.shared(), 1);
        assert!(s.contains(2, 5) && !s.contains(1, 5));
        assert_eq!(s.remove(1, 64), 2);
        let mut one = SeqSets::new(6, 3);
        one.insert_run(0..4, 0);
        one.insert_run(2..6, 1);
        assert_eq!(one.shared(), 2);
        assert_eq!(one.remove_run(0..4, 0), 2);
        assert_eq!(one.shared(), 0);
        let mut wide = SeqSets::new(4, 100);
        wide.insert_run(0..4, 99);
        wide.insert_run(1..3, 5);
        assert_eq!(wide.shared(), 2);
        assert_eq!(wide.remove_run(0..4, 99), 2);
        assert_eq!((wide.shared(), wide.count(1), wide.count(0)), (0, 1, 0));
        assert_eq!(s.iter(1).collect::<Vec<_>>(), vec![0, 129]);
        s.copy_within(1, 0, 2);
        assert_eq!(s.iter(0).collect::<Vec<_>>(), vec![0, 129]);
        assert_eq!(s.iter(1).collect::<Vec<_>>(), vec![5]);
        s.clear_from(1);
        assert_eq!((s.count(1), s.count(2), s.count(0)), (0, 0, 2));
    }
}
