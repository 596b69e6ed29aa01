//! Which positions a query sees and which positions a sequence keeps: sliding
//! windows, their memory, and chunked attention.
//!
//! A window of `W` shows a query at `p` the positions `p - W + 1 ..= p`; a memory
//! of `M` keeps the positions `n - M + 1 ..` of a sequence whose next position is
//! `n`; a chunk of `c` shows `p - p % c ..= p`. Before every forward pass each
//! sequence is trimmed to its memory: sequences in the batch with `n` = their lowest
//! batch position, the others with `n` = their last position + 1, so idle sequences
//! do not hold cells the batch needs (Ollama issue #10127).

use kvcache_api::{CausalConfig, Pos};

use crate::cells::Cells;

/// The attention pattern of a cache, in positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Attention {
    window: Option<Pos>,
    memory: Option<Pos>,
    chunk: Option<Pos>,
}

fn to_pos(n: usize) -> Pos {
    Pos::try_from(n).unwrap_or(Pos::MAX)
}

impl Attention {
    /// The pattern `config` describes (the config must be valid).
    pub(crate) fn new(config: &CausalConfig) -> Self {
        Attention {
            window: config.window.map(|w| to_pos(w.window())),
            memory: config.effective_memory().map(to_pos),
            chunk: config.chunk_size.map(to_pos),
        }
    }

    /// Whether sequences are trimmed (a bounded sliding-window memory).
    pub(crate) fn bounded(&self) -> bool {
        self.memory.is_some()
    }

    /// Lowest position a sequence keeps when its next position is `next`.
    pub(crate) fn keep_from(&self, next: Pos) -> Pos {
        self.memory.map_or(Pos::MIN, |m| next.saturating_sub(m - 1))
    }

    /// Lowest position a query at `pos` sees through the window alone.
    pub(crate) fn window_start(&self, pos: Pos) -> Pos {
        self.window.map_or(Pos::MIN, |w| pos.saturating_sub(w - 1))
    }

    /// Positions `lo..=hi` that a query at `pos` sees; `exempt` lifts causality
    /// (but neither the window nor the chunk).
    pub(crate) fn visible(&self, pos: Pos, exempt: bool) -> (Pos, Pos) {
        let chunk_start = self.chunk.map_or(Pos::MIN, |c| pos - pos % c);
        let lo = self.window_start(pos).max(chunk_start).max(0);
        (lo, if exempt { Pos::MAX } else { pos })
    }

    /// Whether a sequence can continue at `pos`: every position the window needs
    /// is still stored and `pos` follows on from what is stored.
    pub(crate) fn can_resume(&self, first: Option<Pos>, last: Option<Pos>, pos: Pos) -> bool {
        if !self.bounded() {
            return true;
        }
        match (first, last) {
            (Some(first), Some(last)) => self.window_start(pos).max(0) >= first && pos <= last + 1,
            _ => false,
        }
    }
}

/// For each sequence, the lowest position it keeps in this pass (`Pos::MIN` when
/// nothing is trimmed); `lowest[s]` is sequence `s`'s lowest batch position or
/// `Pos::MAX` when it is not in the batch.
pub(crate) fn keep_lines(cells: &Cells, attention: &Attention, lowest: &[Pos], out: &mut Vec<Pos>) {
    out.clear();
    out.extend((0..cells.max_sequences()).map(|seq| {
        if !attention.bounded() {
            return Pos::MIN;
        }
        let next = match (lowest[seq], cells.index(seq).last_pos()) {
            (Pos::MAX, Some(last)) => last + 1,
            (Pos::MAX, None) => return Pos::MIN,
            (n, _) => n,
        };
        attention.keep_from(next)
    }));
}

/// How many cells trimming to `keep` frees: a cell is freed when every sequence
/// holding it drops it.
pub(crate) fn cells_freed(cells: &Cells, keep: &[Pos]) -> usize {
    let mut freed = 0;
    for (seq, &line) in keep.iter().enumerate() {
        for run in cells.index(seq).visible(Pos::MIN, line.saturating_sub(1)) {
            for (k, cell) in run.cells().enumerate() {
                let pos = run.pos + k as Pos;
                let mut holders = cells.sequences(cell);
                // Count each cell once, from its lowest holder.
                if holders.next() == Some(seq)
                    && holders.all(|other| pos < keep[other])
                    && !cells.is_pinned(cell)
                {
                    freed += 1;
                }
            }
        }
    }
    freed
}

/// Lowest and highest cell (inclusive) that the batch's sequences may attend to:
/// for a sequence whose lowest batch position is `n`, its cells at positions from
/// the window start of `n` on. `None` when those sequences hold nothing.
pub(crate) fn attended_cells(
    cells: &Cells,
    attention: &Attention,
    lowest: &[Pos],
    batch_seqs: impl Iterator<Item = usize>,
) -> Option<(usize, usize)> {
    let mut bounds: Option<(usize, usize)> = None;
    let mut widen = |lo: usize, hi: usize| {
        bounds = Some(bounds.map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
    };
    for seq in batch_seqs {
        let index = cells.index(seq);
        let from = attention.window_start(lowest[seq]);
        match (index.first_pos(), index.cell_bounds()) {
            // The whole sequence is attended: its cell bounds are known.
            (Some(first), Some((lo, hi))) if first >= from => widen(lo as usize, hi as usize),
            _ => {
                for run in index.visible(from, Pos::MAX) {
                    widen(run.cell as usize, run.end_cell() as usize - 1);
                }
            }
        }
    }
    bounds
}

#[cfg(test)]
mod tests {
    use kvcache_api::SlidingWindow;

    use super::*;

    #[test]
    fn window_memory_and_chunk_bounds() {
        let config = CausalConfig::new(1, 16, 16).with_window(SlidingWindow::new(2));
        let a = Attention::new(&config);
        assert!(a.bounded());
        // S2: before placing position 4, positions below 4 - 2 + 1 = 3 go.
        assert_eq!(a.keep_from(4), 3);
        assert_eq!(a.visible(5, false), (4, 5));
        assert_eq!(a.visible(0, true), (0, Pos::MAX));
        let chunked = Attention::new(&CausalConfig::new(1, 16, 16).with_chunk_size(2));
        assert!(!chunked.bounded());
        assert_eq!(chunked.visible(7, false), (6, 7));
        assert_eq!(chunked.keep_from(7), Pos::MIN);
    }

    #[test]
    fn resume_needs_the_whole_window() {
        let a = Attention::new(&CausalConfig::new(1, 100, 8).with_window(SlidingWindow::new(4)));
        // Stored 10..=20: a query at 13 needs 10..=13.
        assert!(a.can_resume(Some(10), Some(20), 13));
        assert!(!a.can_resume(Some(10), Some(20), 12));
        assert!(a.can_resume(Some(10), Some(20), 21));
        assert!(!a.can_resume(Some(10), Some(20), 22));
        assert!(!a.can_resume(None, None, 0));
        let unbounded = Attention::new(&CausalConfig::new(1, 100, 8));
        assert!(unbounded.can_resume(None, None, 50));
    }

    #[test]
    fn trimming_counts_shared_cells_once() {
        let config = CausalConfig::new(2, 16, 4).with_window(SlidingWindow::new(2));
        let a = Attention::new(&config);
        let mut cells = Cells::new(config.num_cells(), 2);
        for p in 0..4 {
            cells.place(p as usize, 0, p);
        }
        cells.share_prefix(0, 1, 2);
        // Sequence 0 continues at 4 (keeps 2..), sequence 1 idles (next 2, keeps 0..).
        let mut keep = vec![];
        keep_lines(&cells, &a, &[4, Pos::MAX], &mut keep);
        assert_eq!(keep, vec![2, 0]);
        assert_eq!(cells_freed(&cells, &keep), 0);
        // Both continue at 4: cells 0 and 1 are freed once each.
        keep_lines(&cells, &a, &[4, 4], &mut keep);
        assert_eq!(cells_freed(&cells, &keep), 2);
        assert_eq!(attended_cells(&cells, &a, &[4, 4], [0].into_iter()), Some((3, 3)));
        assert_eq!(
            attended_cells(&cells, &a, &[2, 4], [0, 1].into_iter()),
            Some((1, 3))
        );
    }
}
