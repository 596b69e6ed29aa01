//! Where a forward pass's tokens go, and compaction when they do not fit.
//!
//! Scattered placement takes the first free cells in index order; contiguous
//! placement takes the first run of free cells long enough for the whole batch.
//! Compaction slides every used cell down, keeping their order, so all free cells
//! end up in one run at the top; it is described as a list of [`Move`]s that the
//! metadata and the stored tensors apply in the same order.
//!
//! First free cells alone interleave sequences that decode side by side: every
//! step's tokens land next to each other, so each decoded token becomes a run of
//! one cell and everything that works per run (lookups, mask rows) costs more as
//! decoding goes on. So scattered placement also keeps [`Reservations`]: when a
//! sequence continues but the cell after its last one is taken, and the cache has
//! room to spare (at least [`MIN_RESERVATION`] free cells for every sequence of
//! the pass), it sets aside a run of free cells for the sequence's next positions
//! (half as many as it holds, at least [`MIN_RESERVATION`], at most its share of
//! the free cells), which its later tokens fill in order and other tokens avoid
//! while they can. Each sequence then holds a few long runs whatever it decodes.
//! Small or nearly full caches never reserve and keep the reference's layout.

use std::ops::Range;

use kvcache_api::{Batch, Placement, Pos, SeqId};

use crate::cells::Cells;
use crate::occupancy::Occupancy;

/// Cells `src..src + len` move to `dst..dst + len` (`dst <= src`).
///
/// Moves are listed in ascending order; applying them in that order with memmove
/// semantics (a move may overlap itself, never a later move's source) compacts the
/// cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// First source cell.
    pub src: u32,
    /// First destination cell.
    pub dst: u32,
    /// Number of cells.
    pub len: u32,
}

/// The order-preserving compaction of `occupancy`: every maximal used run with its
/// destination (including runs already in place), and the moves that shift data.
pub(crate) fn plan_compaction(occupancy: &Occupancy) -> (Vec<Move>, Vec<Move>) {
    let mut runs = Vec::new();
    let mut dst = 0u32;
    for run in occupancy.used_runs() {
        let len = run.len() as u32;
        runs.push(Move {
            src: run.start as u32,
            dst,
            len,
        });
        dst += len;
    }
    let moves = runs.iter().copied().filter(|m| m.src != m.dst).collect();
    (moves, runs)
}

/// Appends `n` free cells for a batch to `out` following `policy`; false when
/// they cannot be found without compacting first.
pub(crate) fn choose_cells(
    occupancy: &mut Occupancy,
    policy: Placement,
    n: usize,
    out: &mut Vec<u32>,
) -> bool {
    match policy {
        Placement::Scattered => {
            let start = out.len();
            let found = occupancy.first_free(n, out);
            if !found {
                out.truncate(start);
            }
            found
        }
        Placement::Contiguous => match occupancy.first_free_run(n) {
            Some(start) => {
                out.extend(start as u32..(start + n) as u32);
                true
            }
            None => false,
        },
    }
}

/// Free cells every sequence of a pass must be able to get for a reservation to
/// be made, and the least a reservation spares beyond the pass's own tokens.
pub(crate) const MIN_RESERVATION: usize = 64;

/// Free cells `next..end` set aside for the positions after a sequence's last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reservation {
    /// The cell for the position after the sequence's last.
    next: u32,
    /// One past the last reserved cell.
    end: u32,
}

/// Per sequence, the free cells set aside for its next positions.
///
/// Reservations are a placement preference, not a claim: cells stay free in the
/// occupancy, other placements (imports, passes with no unreserved room left) may
/// take them, and a reservation is dropped as soon as its next cell is taken or
/// no longer follows its sequence.
#[derive(Debug, Clone, Default)]
pub(crate) struct Reservations {
    by_seq: Vec<Option<Reservation>>,
    /// Scratch of a placement: per sequence, its last position and cell placed so
    /// far in the pass.
    placed: Vec<Option<(Pos, u32)>>,
    /// Scratch of a placement: per sequence, its tokens not yet placed.
    remaining: Vec<u32>,
    /// Scratch of a placement: cells taken so far, as ranges.
    claimed: Vec<Range<u32>>,
    /// Scratch of a placement: the tokens left to first-free placement.
    deferred: Vec<usize>,
    /// Scratch of a placement: the ranges first-free placement skips.
    skip: Vec<Range<u32>>,
    /// Scratch of a placement: the pass's sequences, each once.
    sequences: Vec<SeqId>,
}

impl Reservations {
    /// No reservations, for `max_sequences` sequences.
    pub(crate) fn new(max_sequences: usize) -> Self {
        Reservations {
            by_seq: vec![None; max_sequences],
            placed: vec![None; max_sequences],
            remaining: vec![0; max_sequences],
            ..Reservations::default()
        }
    }

    /// Drops every reservation (the cells moved).
    pub(crate) fn clear(&mut self) {
        self.by_seq.fill(None);
    }

    /// Drops `seq`'s reservation (its positions changed).
    pub(crate) fn drop_seq(&mut self, seq: SeqId) {
        self.by_seq[seq] = None;
    }

    /// The cells reserved for `seq`, if any.
    #[cfg(test)]
    pub(crate) fn of(&self, seq: SeqId) -> Option<Range<u32>> {
        self.by_seq[seq].map(|r| r.next..r.end)
    }

    /// Free cells reserved in all (other placements may have taken some).
    fn reserved(&self, occupancy: &Occupancy) -> usize {
        let free = |r: &Reservation| occupancy.free_in(r.next as usize..r.end as usize);
        self.by_seq.iter().flatten().map(free).sum()
    }

    /// Whether `cell` is reserved or already taken in this placement.
    fn is_claimed(&self, cell: u32) -> bool {
        let within = |r: &Range<u32>| r.contains(&cell);
        self.by_seq
            .iter()
            .flatten()
            .any(|r| (r.next..r.end).contains(&cell))
            || self.claimed.iter().any(within)
    }

    fn claim(&mut self, seq: SeqId, pos: Pos, cell: u32) {
        self.placed[seq] = Some((pos, cell));
        match self.claimed.last_mut() {
            Some(last) if last.end == cell => last.end += 1,
            _ => self.claimed.push(cell..cell + 1),
        }
    }

    /// The next cell of `seq`'s reservation when it follows `prev` and is free;
    /// drops a reservation that cannot be followed.
    fn follow(&mut self, seq: SeqId, prev: u32, occupancy: &Occupancy) -> Option<u32> {
        let r = self.by_seq[seq].as_mut()?;
        if r.next != prev + 1 || occupancy.is_used(r.next as usize) {
            self.by_seq[seq] = None;
            return None;
        }
        let cell = r.next;
        r.next += 1;
        if r.next == r.end {
            self.by_seq[seq] = None;
        }
        Some(cell)
    }

    /// A new reservation for `seq`, whose last position is in cell `prev`, when
    /// the cell after it is taken and the cache has room to spare: `tokens` cells
    /// for the pass's tokens of `seq` plus the spare, the first of them returned.
    /// `no_run_of` is the shortest run already looked for in vain in this pass.
    fn reserve(
        &mut self,
        cells: &mut Cells,
        seq: SeqId,
        prev: u32,
        tokens: usize,
        no_run_of: &mut usize,
    ) -> Option<u32> {
        let occupancy = cells.occupancy();
        let next = prev as usize + 1;
        if next < occupancy.cells() && !occupancy.is_used(next) && !self.is_claimed(next as u32) {
            // Not blocked: first-free placement may well continue the run.
            return None;
        }
        let taken = self.reserved(occupancy) + self.claimed.iter().map(|c| c.len()).sum::<usize>();
        // Shared among the pass's sequences that have no reservation (this one too).
        let waiting = self
            .sequences
            .iter()
            .filter(|&&s| self.by_seq[s].is_none())
            .count();
        let share = occupancy.free().saturating_sub(taken) / waiting.max(1);
        let spare = (cells.index(seq).len() / 2)
            .max(MIN_RESERVATION)
            .min(share.saturating_sub(tokens));
        let want = tokens + spare;
        if spare < MIN_RESERVATION || want >= *no_run_of {
            return None;
        }
        self.fill_skip(true);
        let Some(first) = cells.occupancy_mut().first_free_run_outside(want, &self.skip) else {
            *no_run_of = want;
            return None;
        };
        let first = first as u32;
        self.by_seq[seq] = Some(Reservation {
            next: first + 1,
            end: first + want as u32,
        });
        Some(first)
    }

    /// The ranges first-free placement avoids: reservations and cells taken,
    /// sorted; only the cells taken when `reserved` is false.
    fn fill_skip(&mut self, reserved: bool) {
        self.skip.clear();
        self.skip.extend(self.claimed.iter().cloned());
        if reserved {
            self.skip
                .extend(self.by_seq.iter().flatten().map(|r| r.next..r.end));
        }
        self.skip.sort_unstable_by_key(|r| r.start);
    }
}

/// Scattered placement with reservations: appends a cell for every token of
/// `batch` to `out`, in batch order; false when there are not enough free cells.
///
/// A token whose sequence holds (or this pass placed) the previous position in
/// cell `c` takes the sequence's reserved cell `c + 1`; failing that, when cell
/// `c + 1` is taken, the sequence gets a new reservation if the cache has room to
/// spare. Every other token takes the first free cell outside reservations (any
/// free cell when those run out), as plain scattered placement does.
pub(crate) fn choose_cells_reserving(
    cells: &mut Cells,
    reservations: &mut Reservations,
    batch: &Batch,
    out: &mut Vec<u32>,
) -> bool {
    let start = out.len();
    let r = reservations;
    r.claimed.clear();
    r.deferred.clear();
    r.sequences.clear();
    for &seq in batch.sequences() {
        if r.remaining[seq] == 0 {
            r.sequences.push(seq);
        }
        r.placed[seq] = None;
        r.remaining[seq] += 1;
    }
    let no_room = cells.occupancy().free() < (MIN_RESERVATION + 1) * r.sequences.len();
    if no_room && r.by_seq.iter().all(Option::is_none) {
        // Nothing reserved and nothing to reserve: plain first free cells.
        for &seq in &r.sequences {
            r.remaining[seq] = 0;
        }
        let found = cells.occupancy_mut().first_free(batch.len(), out);
        if !found {
            out.truncate(start);
        }
        return found;
    }
    // The shortest run found missing in this pass, so failed searches are not repeated.
    let mut no_run_of = usize::MAX;
    for (i, (seq, pos)) in batch.tokens().enumerate() {
        r.remaining[seq] -= 1;
        let cell = match r.placed[seq] {
            Some((p, cell)) if p + 1 == pos => Some(cell),
            Some(_) => None,
            None if pos > 0 => cells.index(seq).cell_of(pos - 1),
            None => None,
        }
        .and_then(|prev| {
            r.follow(seq, prev, cells.occupancy()).or_else(|| {
                let tokens = r.remaining[seq] as usize + 1;
                r.reserve(cells, seq, prev, tokens, &mut no_run_of)
            })
        });
        match cell {
            Some(cell) => {
                out.push(cell);
                r.claim(seq, pos, cell);
            }
            None => {
                out.push(u32::MAX);
                r.placed[seq] = None;
                r.deferred.push(i);
            }
        }
    }
    for &seq in batch.sequences() {
        r.remaining[seq] = 0;
    }
    if r.deferred.is_empty() {
        return true;
    }
    let mut first_free = Vec::with_capacity(r.deferred.len());
    r.fill_skip(true);
    let occupancy = cells.occupancy_mut();
    if !occupancy.first_free_outside(r.deferred.len(), &r.skip, &mut first_free) {
        first_free.clear();
        r.fill_skip(false);
        if !occupancy.first_free_outside(r.deferred.len(), &r.skip, &mut first_free) {
            out.truncate(start);
            return false;
        }
    }
    for (&i, cell) in r.deferred.iter().zip(first_free) {
        out[start + i] = cell;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cells::Cells;

    #[test]
    fn compaction_slides_used_runs_down_in_order() {
        let mut o = Occupancy::new(12);
        for c in [1, 2, 5, 6, 7, 11] {
            o.mark_used(c);
        }
        let (moves, runs) = plan_compaction(&o);
        assert_eq!(
            moves,
            vec![
                Move {
                    src: 1,
                    dst: 0,
                    len: 2
                },
                Move {
                    src: 5,
                    dst: 2,
                    len: 3
                },
                Move {
                    src: 11,
                    dst: 5,
                    len: 1
                },
            ]
        );
        assert_eq!(runs, moves);
        // Each move's destination ends before the next move's source.
        for w in moves.windows(2) {
            assert!(w[0].dst + w[0].len <= w[1].src);
        }
    }

    /// Places `batch` with reservations and records its tokens in `cells`.
    fn place(cells: &mut Cells, r: &mut Reservations, batch: &Batch) -> Vec<u32> {
        let mut out = vec![];
        assert!(choose_cells_reserving(cells, r, batch, &mut out));
        for ((seq, pos), &cell) in batch.tokens().zip(&out) {
            cells.place(cell as usize, seq, pos);
        }
        cells.check();
        out
    }

    fn decode_step(n: usize, pos: Pos) -> Batch {
        Batch::from_tokens((0..n).map(|s| (s, pos))).unwrap()
    }

    #[test]
    fn interleaved_decode_keeps_runs_long() {
        // Four sequences of 200 tokens packed one after another in 4,096 cells.
        let mut cells = Cells::new(4096, 4);
        let mut r = Reservations::new(4);
        for seq in 0..4 {
            let out = place(&mut cells, &mut r, &Batch::sequence(seq, 0, 200).unwrap());
            assert_eq!(
                out,
                (200 * seq as u32..200 * (seq as u32 + 1)).collect::<Vec<_>>()
            );
        }
        // Sequence 3 may run on; 0, 1 and 2 are blocked and reserve 1 + 100 cells
        // each (half what they hold) from the first free cell on.
        let out = place(&mut cells, &mut r, &decode_step(4, 200));
        assert_eq!(out, vec![800, 901, 1002, 1103]);
        assert_eq!(r.of(0), Some(801..901));
        assert_eq!(r.of(3), Some(1104..1204));
        for pos in 201..=300 {
            let out = place(&mut cells, &mut r, &decode_step(4, pos));
            let k = (pos - 200) as u32;
            assert_eq!(out, vec![800 + k, 901 + k, 1002 + k, 1103 + k]);
        }
        // The reservations are used up: new ones, then on.
        assert_eq!(r.of(0), None);
        for pos in 301..600 {
            place(&mut cells, &mut r, &decode_step(4, pos));
        }
        for seq in 0..4 {
            assert!(
                cells.index(seq).runs().len() <= 4,
                "sequence {seq}: {:?}",
                cells.index(seq).runs()
            );
        }
    }

    #[test]
    fn small_caches_keep_first_free_cells() {
        // 4 sequences and 200 free cells: 50 each, too few to reserve.
        let mut cells = Cells::new(1000, 4);
        let mut r = Reservations::new(4);
        for seq in 0..4 {
            place(&mut cells, &mut r, &Batch::sequence(seq, 0, 200).unwrap());
        }
        let out = place(&mut cells, &mut r, &decode_step(4, 200));
        assert_eq!(out, vec![800, 801, 802, 803]);
        assert_eq!((0..4).filter_map(|s| r.of(s)).count(), 0);
        // A sequence that can run on is not given a reservation either.
        let mut cells = Cells::new(4096, 2);
        let mut r = Reservations::new(2);
        place(&mut cells, &mut r, &Batch::sequence(0, 0, 10).unwrap());
        assert_eq!(place(&mut cells, &mut r, &decode_step(1, 10)), vec![10]);
        assert_eq!(r.of(0), None);
    }

    #[test]
    fn other_tokens_avoid_reservations_until_they_must() {
        let mut cells = Cells::new(400, 3);
        let mut r = Reservations::new(3);
        place(&mut cells, &mut r, &Batch::sequence(0, 0, 100).unwrap());
        place(&mut cells, &mut r, &Batch::sequence(1, 0, 10).unwrap());
        // 290 free cells for 3 sequences: blocked sequences 0 and 1 reserve 1 + 64
        // cells each; new sequence 2 takes the first cell outside them.
        let batch = Batch::from_tokens([(0, 100), (1, 10), (2, 0)]).unwrap();
        assert_eq!(place(&mut cells, &mut r, &batch), vec![110, 175, 240]);
        assert_eq!((r.of(0), r.of(1)), (Some(111..175), Some(176..240)));
        // 200 tokens find 159 free cells outside reservations: they take the
        // reserved ones too, in index order.
        let out = place(&mut cells, &mut r, &Batch::sequence(2, 1, 200).unwrap());
        let expected: Vec<u32> = (111..175).chain(176..240).chain(241..313).collect();
        assert_eq!(out, expected);
        // Sequence 0's reserved cells are gone: it reserves anew where there is room.
        assert_eq!(place(&mut cells, &mut r, &decode_step(1, 101)), vec![313]);
        assert_eq!(r.of(0), Some(314..378));
        r.drop_seq(0);
        assert_eq!(r.of(0), None);
        r.clear();
        assert_eq!(r.of(1), None);
    }

    #[test]
    fn contiguous_needs_a_long_enough_run() {
        let mut o = Occupancy::new(8);
        for c in [2, 5] {
            o.mark_used(c);
        }
        let mut out = vec![];
        assert!(choose_cells(&mut o, Placement::Scattered, 3, &mut out));
        assert_eq!(out, vec![0, 1, 3]);
        out.clear();
        assert!(choose_cells(&mut o, Placement::Contiguous, 2, &mut out));
        assert_eq!(out, vec![0, 1]);
        out.clear();
        assert!(!choose_cells(&mut o, Placement::Contiguous, 3, &mut out));
        assert!(out.is_empty());
        assert!(!choose_cells(&mut o, Placement::Scattered, 7, &mut out));
        assert!(out.is_empty());
    }
}
