//! Where a forward pass's tokens go, and compaction when they do not fit.
//!
//! Scattered placement takes the first free cells in index order; contiguous
//! placement takes the first run of free cells long enough for the whole batch.
//! Compaction slides every used cell down, keeping their order, so all free cells
//! end up in one run at the top; it is described as a list of [`Move`]s that the
//! metadata and the stored tensors apply in the same order.

use kvcache_api::Placement;

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

#[cfg(test)]
mod tests {
    use super::*;

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
