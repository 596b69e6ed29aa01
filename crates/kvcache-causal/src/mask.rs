//! Attention masks, planned as runs of visible cells and written as differences.
//!
//! A row lists the cells its token may attend to. They come from the token's
//! sequence index: the runs whose positions fall in the token's visible interval,
//! found by binary search, so planning a row costs a step per run, never a
//! membership test per entry. The plan of a whole mask is its visible entries as
//! sorted intervals of flat (row-major) indices: a [`Plan`].
//!
//! A buffer's content is described by the plan last written into it, so a new mask
//! is written as the difference between the two plans: `0` where an entry becomes
//! visible, `-inf` where it stops being visible, nothing elsewhere. A prefill pass
//! repeated at the same shape writes nothing; a decode step writes a few entries per
//! row; a fresh zeroed buffer (all visible) gets only its masked entries written.
//! No entry is written twice, so the worst case is the bytes of the mask.

use std::ops::Range;

use half::{bf16, f16};
use kvcache_api::{Pos, RowRuns, SeqId};

use crate::cells::Cells;
use crate::window::Attention;

/// An element type masks can be built in.
pub(crate) trait MaskValue: candle_core::WithDType + Copy {
    /// The value for "may attend": zero.
    const VISIBLE: Self;
    /// The value for "masked": negative infinity.
    const MASKED: Self;
}

impl MaskValue for f32 {
    const VISIBLE: Self = 0.0;
    const MASKED: Self = f32::NEG_INFINITY;
}

impl MaskValue for f16 {
    const VISIBLE: Self = f16::ZERO;
    const MASKED: Self = f16::NEG_INFINITY;
}

impl MaskValue for bf16 {
    const VISIBLE: Self = bf16::ZERO;
    const MASKED: Self = bf16::NEG_INFINITY;
}

/// One query row of the mask.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Query {
    /// The token's sequence.
    pub seq: SeqId,
    /// The token's position.
    pub pos: Pos,
    /// Whether the token is exempt from causality (sees later positions too).
    pub exempt: bool,
}

/// The visible entries of a mask of `len` entries, as sorted, disjoint, non-adjacent
/// `[start, end)` intervals of flat indices; every other entry is masked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    len: usize,
    visible: Vec<(usize, usize)>,
}

impl Plan {
    /// A plan of `len` entries, all visible (a zeroed buffer).
    pub(crate) fn all_visible(len: usize) -> Plan {
        let visible = if len == 0 { vec![] } else { vec![(0, len)] };
        Plan { len, visible }
    }

    /// Entries the plan covers.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Makes this an all-masked plan of `len` entries, keeping the allocation.
    pub(crate) fn reset(&mut self, len: usize) {
        self.len = len;
        self.visible.clear();
    }

    /// Keeps only the first `len` entries.
    pub(crate) fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        self.visible.retain(|&(a, _)| a < len);
        if let Some(last) = self.visible.last_mut() {
            last.1 = last.1.min(len);
        }
        self.len = len;
    }

    /// Grows the plan to `len` entries (at least its own), the new ones masked.
    pub(crate) fn extend_masked(&mut self, len: usize) {
        self.len = self.len.max(len);
    }

    /// Grows the plan to `older`'s length with `older`'s entries past its own: what
    /// a buffer that held `older` holds after this plan is written over its start.
    pub(crate) fn keep_tail_of(&mut self, older: &Plan) {
        if older.len <= self.len {
            return;
        }
        for &(a, b) in &older.visible {
            if b > self.len {
                let a = a.max(self.len);
                self.visible.push((a, b));
            }
        }
        self.len = older.len;
    }

    /// The visible intervals cut to the first `end` entries.
    fn visible_before(&self, end: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.visible
            .iter()
            .map(move |&(a, b)| (a, b.min(end)))
            .filter(|r| r.0 < r.1)
    }

    /// Appends the visible interval `[start, end)`, at or after every earlier one.
    fn push(&mut self, start: usize, end: usize) {
        debug_assert!(start < end && end <= self.len);
        match self.visible.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            Some(last) => {
                debug_assert!(last.1 < start, "intervals out of order");
                self.visible.push((start, end));
            }
            None => self.visible.push((start, end)),
        }
    }
}

/// Plans the `[rows, range.len()]` mask over the cells in `range` into `plan`,
/// row `r` visible on `runs.row(r)` (runs inside `range`); rows past the runs'
/// are padding, fully masked.
pub(crate) fn plan(runs: &RowRuns, rows: usize, range: Range<usize>, plan: &mut Plan) {
    let width = range.len();
    debug_assert!(runs.rows() <= rows);
    plan.reset(rows * width);
    for row in 0..runs.rows() {
        let base = row * width;
        for run in runs.row(row) {
            let (start, end) = (run.start as usize - range.start, run.end as usize - range.start);
            plan.push(base + start, base + end);
        }
    }
}

/// The cells `query` may see as `(first, len)` spans of columns (cells relative
/// to `range.start`), sorted by column, into `spans`: one row of a [`plan`].
/// Spans of consecutive runs may touch; they never overlap.
pub(crate) fn row_spans(
    cells: &Cells,
    attention: &Attention,
    query: Query,
    range: Range<usize>,
    spans: &mut Vec<(u32, u32)>,
) {
    spans.clear();
    let (lo, hi) = attention.visible(query.pos, query.exempt);
    for run in cells.index(query.seq).visible(lo, hi) {
        debug_assert!(
            range.start <= run.cell as usize && run.end_cell() as usize <= range.end,
            "visible run {run:?} lies outside the pass range {range:?}"
        );
        spans.push((run.cell - range.start as u32, run.len));
    }
    if !spans.is_sorted_by_key(|&(start, _)| start) {
        spans.sort_unstable_by_key(|&(start, _)| start);
    }
}

/// Makes `out` hold the mask `new`, given that its first `old.len()` entries hold
/// the mask `old` (entries past that are unknown and written in full).
pub(crate) fn write<T: MaskValue>(old: &Plan, new: &Plan, out: &mut [T]) {
    assert_eq!(out.len(), new.len, "mask buffer and plan disagree");
    changes(old, new, |run, visible| {
        out[run].fill(if visible { T::VISIBLE } else { T::MASKED });
    });
}

/// The runs of entries a buffer holding `old` in its first `old.len()` entries
/// must change to hold `new` in its first `new.len()`: `emit(run, visible)` in
/// increasing order, disjoint. Where `old` is known, the symmetric difference of
/// the two visible sets; past it (unknown), every entry, visible exactly on `new`.
pub(crate) fn changes(old: &Plan, new: &Plan, mut emit: impl FnMut(Range<usize>, bool)) {
    let known = old.len.min(new.len);
    let (mut old_runs, mut new_runs) = (old.visible_before(known), new.visible_before(known));
    let (mut o, mut n) = (old_runs.next(), new_runs.next());
    loop {
        match (o, n) {
            (None, None) => break,
            (Some((a, b)), None) => {
                emit(a..b, false);
                o = old_runs.next();
            }
            (None, Some((a, b))) => {
                emit(a..b, true);
                n = new_runs.next();
            }
            (Some((oa, ob)), Some((na, _))) if oa < na => {
                // Visible only before: masked now.
                emit(oa..ob.min(na), false);
                o = if ob <= na { old_runs.next() } else { Some((na, ob)) };
            }
            (Some((oa, _)), Some((na, nb))) if na < oa => {
                // Visible only now.
                emit(na..nb.min(oa), true);
                n = if nb <= oa { new_runs.next() } else { Some((oa, nb)) };
            }
            (Some((_, ob)), Some((_, nb))) => {
                // Both start together: their overlap is already right.
                o = if ob <= nb { old_runs.next() } else { Some((nb, ob)) };
                n = if nb <= ob { new_runs.next() } else { Some((ob, nb)) };
            }
        }
    }
    // Unknown region: every entry, visible exactly on the new plan.
    let mut at = known;
    for &(a, b) in &new.visible {
        if b <= known {
            continue;
        }
        let a = a.max(known);
        if at < a {
            emit(at..a, false);
        }
        emit(a..b, true);
        at = b;
    }
    if at < new.len {
        emit(at..new.len, false);
    }
}

#[cfg(test)]
mod tests {
    use kvcache_api::{CausalConfig, SlidingWindow};
    use proptest::prelude::*;

    use super::*;

    fn grid(mask: &[f32], width: usize) -> Vec<String> {
        mask.chunks(width)
            .map(|row| row.iter().map(|&v| if v == 0.0 { '0' } else { 'x' }).collect())
            .collect()
    }

    /// The plan of `queries`' rows, each planned by [`row_spans`].
    fn plan_queries(
        cells: &Cells,
        attention: &Attention,
        queries: &[Query],
        rows: usize,
        range: Range<usize>,
    ) -> Plan {
        let (mut spans, mut runs, mut planned) = (vec![], RowRuns::default(), Plan::default());
        let base = range.start as u32;
        for &query in queries {
            row_spans(cells, attention, query, range.clone(), &mut spans);
            runs.push_row(spans.iter().map(|&(a, len)| base + a..base + a + len));
        }
        plan(&runs, rows, range, &mut planned);
        planned
    }

    /// The mask `plan` describes, entry by entry.
    fn dense(plan: &Plan) -> Vec<f32> {
        let mut out = vec![f32::MASKED; plan.len];
        for &(a, b) in &plan.visible {
            out[a..b].fill(f32::VISIBLE);
        }
        out
    }

    #[test]
    fn rows_follow_sequence_window_and_exemptions() {
        let config = CausalConfig::new(2, 16, 8).with_window(SlidingWindow::new(2));
        let attention = Attention::new(&config);
        let mut cells = Cells::new(8, 2);
        // Sequence 0 at cells 0, 1, 3; sequence 1 at cell 2.
        for (cell, seq, pos) in [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 0, 2)] {
            cells.place(cell, seq, pos);
        }
        let q = |seq, pos, exempt| Query { seq, pos, exempt };
        let queries = [q(0, 1, false), q(0, 2, false), q(1, 0, false), q(0, 1, true)];
        let planned = plan_queries(&cells, &attention, &queries, 5, 0..4);
        // Stale content must not survive: write over an all-visible buffer.
        let mut mask = vec![0.0f32; 5 * 4];
        write(&Plan::all_visible(20), &planned, &mut mask);
        assert_eq!(grid(&mask, 4), vec!["00xx", "x0x0", "xx0x", "00x0", "xxxx"]);
        let mut half = vec![f16::ONE; 5 * 4];
        write(&Plan::default(), &planned, &mut half);
        assert_eq!(half[0], f16::ZERO);
        assert!(half[2].is_infinite() && half[2].is_sign_negative());
        assert_eq!(
            planned.visible,
            vec![(0, 2), (5, 6), (7, 8), (10, 11), (12, 14), (15, 16)]
        );
    }

    #[test]
    fn adjacent_spans_merge_and_unsorted_runs_are_sorted() {
        let mut plan = Plan::default();
        plan.reset(8);
        plan.push(0, 2);
        plan.push(2, 3);
        plan.push(5, 6);
        assert_eq!(plan.visible, vec![(0, 3), (5, 6)]);
        // Cells out of position order in a row still plan sorted.
        let config = CausalConfig::new(1, 16, 8);
        let attention = Attention::new(&config);
        let mut cells = Cells::new(8, 1);
        for (cell, pos) in [(3, 0), (1, 1), (5, 2)] {
            cells.place(cell, 0, pos);
        }
        let query = Query {
            seq: 0,
            pos: 2,
            exempt: false,
        };
        let planned = plan_queries(&cells, &attention, &[query], 1, 0..8);
        assert_eq!(planned.visible, vec![(1, 2), (3, 4), (5, 6)]);
    }

    /// A random plan of up to `max_len` entries.
    fn any_plan(max_len: usize) -> impl Strategy<Value = Plan> {
        (0..=max_len).prop_flat_map(|len| {
            proptest::collection::vec(any::<bool>(), len).prop_map(move |bits| {
                let mut plan = Plan::default();
                plan.reset(len);
                for (i, &visible) in bits.iter().enumerate() {
                    if visible {
                        plan.push(i, i + 1);
                    }
                }
                plan
            })
        })
    }

    #[test]
    fn tails_are_kept_and_extended_masked() {
        let mut older = Plan::default();
        older.reset(10);
        older.push(1, 3);
        older.push(5, 9);
        let mut newer = Plan::default();
        newer.reset(6);
        newer.push(0, 1);
        newer.keep_tail_of(&older);
        assert_eq!((newer.len, &newer.visible[..]), (10, &[(0, 1), (6, 9)][..]));
        newer.extend_masked(12);
        newer.extend_masked(4);
        assert_eq!(newer.len(), 12);
        newer.truncate(7);
        assert_eq!((newer.len, &newer.visible[..]), (7, &[(0, 1), (6, 7)][..]));
        newer.truncate(6);
        assert_eq!((newer.len, &newer.visible[..]), (6, &[(0, 1)][..]));
        // What the buffer holds after `newer`'s first 6 entries are written over `older`.
        let mut buffer = dense(&older);
        let mut first = Plan::default();
        first.reset(6);
        first.push(0, 1);
        write(&older, &first, &mut buffer[..6]);
        let mut kept = first.clone();
        kept.keep_tail_of(&older);
        assert_eq!(buffer, dense(&kept));
    }

    proptest! {
        /// Writing the difference over a buffer that holds `old` gives exactly the
        /// mask of `new`, whatever the lengths and whatever lies past `old`.
        #[test]
        fn writing_a_difference_equals_writing_in_full(old in any_plan(64), new in any_plan(64), junk: bool) {
            let mut buffer = vec![if junk { 0.0 } else { f32::MASKED }; old.len.max(new.len)];
            buffer[..old.len].copy_from_slice(&dense(&old));
            write(&old, &new, &mut buffer[..new.len]);
            prop_assert_eq!(&buffer[..new.len], &dense(&new)[..]);
        }
    }
}
