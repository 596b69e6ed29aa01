//! Attention masks written row by row from runs of visible cells.
//!
//! A row lists the cells its token may attend to. They come from the token's
//! sequence index: the runs whose positions fall in the token's visible interval,
//! found by binary search. Each row is then written in one left-to-right pass, a
//! fill of `-inf` for every gap and of `0` for every run, so the cost is the bytes of
//! the mask plus one step per run, never a membership test per entry.

use std::ops::Range;

use half::{bf16, f16};
use kvcache_api::{Pos, SeqId};

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

/// A fully masked `[rows, cols]` mask (reserve passes).
pub(crate) fn masked<T: MaskValue>(rows: usize, cols: usize) -> Vec<T> {
    vec![T::MASKED; rows * cols]
}

/// The `[rows, range.len()]` mask of `queries` over the cells in `range`; rows past
/// the queries are padding and fully masked. `spans` is scratch space.
pub(crate) fn build<T: MaskValue>(
    cells: &Cells,
    attention: &Attention,
    queries: impl ExactSizeIterator<Item = Query>,
    rows: usize,
    range: Range<usize>,
    spans: &mut Vec<(u32, u32)>,
) -> Vec<T> {
    let width = range.len();
    let mut out = Vec::with_capacity(rows * width);
    debug_assert!(queries.len() <= rows);
    for query in queries {
        spans.clear();
        let (lo, hi) = attention.visible(query.pos, query.exempt);
        for run in cells.index(query.seq).visible(lo, hi) {
            debug_assert!(
                range.start <= run.cell as usize && run.end_cell() as usize <= range.end,
                "visible run {run:?} lies outside the pass range {range:?}"
            );
            spans.push((run.cell - range.start as u32, run.len));
        }
        push_row(&mut out, width, spans);
    }
    out.resize(rows * width, T::MASKED);
    out
}

/// Appends one row of `width` entries, visible exactly on `spans` (disjoint
/// `(start, len)` pairs in any order).
///
/// Few sorted spans (prefill) are written in one left-to-right pass; many short
/// spans (interleaved decode tokens) or unsorted ones are written over a masked row,
/// which costs less per span.
fn push_row<T: MaskValue>(out: &mut Vec<T>, width: usize, spans: &[(u32, u32)]) {
    let row = out.len();
    let few = spans.len() * 64 <= width;
    if few && spans.windows(2).all(|w| w[0].0 < w[1].0) {
        for &(start, len) in spans {
            out.resize(row + start as usize, T::MASKED);
            out.resize(row + (start + len) as usize, T::VISIBLE);
        }
        out.resize(row + width, T::MASKED);
    } else {
        out.resize(row + width, T::MASKED);
        let line = &mut out[row..];
        for &(start, len) in spans {
            match len {
                1 => line[start as usize] = T::VISIBLE,
                _ => line[start as usize..(start + len) as usize].fill(T::VISIBLE),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvcache_api::{CausalConfig, SlidingWindow};

    use super::*;

    fn grid(mask: &[f32], width: usize) -> Vec<String> {
        mask.chunks(width)
            .map(|row| row.iter().map(|&v| if v == 0.0 { '0' } else { 'x' }).collect())
            .collect()
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
        let mut spans = vec![];
        let mask = build::<f32>(&cells, &attention, queries.into_iter(), 5, 0..4, &mut spans);
        assert_eq!(grid(&mask, 4), vec!["00xx", "x0x0", "xx0x", "00x0", "xxxx"]);
        let half = build::<f16>(&cells, &attention, queries.into_iter(), 4, 0..4, &mut spans);
        assert_eq!(half[0], f16::ZERO);
        assert!(half[2].is_infinite() && half[2].is_sign_negative());
    }

    #[test]
    fn unsorted_spans_are_written_too() {
        let mut out = Vec::<f32>::new();
        push_row(&mut out, 6, &[(4, 2), (0, 1)]);
        assert_eq!(grid(&out, 6), vec!["0xxx00"]);
        push_row(&mut out, 6, &[]);
        assert_eq!(grid(&out, 6)[1], "xxxxxx");
        // Many short spans take the masked-row path.
        let spans: Vec<(u32, u32)> = (0..70).map(|i| (2 * i, 1)).collect();
        push_row(&mut out, 140, &spans);
        let row = &grid(&out[12..], 140)[0];
        assert_eq!(row.matches('0').count(), 70);
        assert!(row.starts_with("0x0x") && row.ends_with("0x"));
    }
}
