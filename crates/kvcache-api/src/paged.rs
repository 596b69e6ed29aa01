//! The paged view of a causal cache: for the pass in progress, each row's
//! visible cells as sorted runs, and the layer's keys and values as stored.
//!
//! [`CausalCache::get`](crate::CausalCache::get) hands an engine every cell of
//! the pass's range and a dense `[rows, cells]` mask, so attention costs rows x
//! range whatever each row may see. [`CausalCache::get_paged`](crate::CausalCache::get_paged)
//! hands it instead the cells each row may see, as [`RowRuns`] (CSR: one list
//! of [`CellRun`]s per row, in batch order), and the stored keys and values of
//! the whole layer ([`StoredKv`]: a float tensor, or `q8_0` integers and
//! scales), so a kernel walks exactly the cells a row sees, in the type they are
//! stored in, as vLLM's paged attention walks a sequence's blocks.
//!
//! The runs are the same cells the dense mask shows: row `r` may attend to cell
//! `c` exactly where `get`'s mask holds `0` at `[r, c - range.start]`.

use crate::VLayout;

/// A run of consecutive cells, `start..end` (absolute cell indices, `start <
/// end`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CellRun {
    /// First cell of the run.
    pub start: u32,
    /// One past the last cell of the run.
    pub end: u32,
}

impl CellRun {
    /// Cells in the run.
    pub fn len(&self) -> usize {
        (self.end - self.start) as usize
    }

    /// Whether the run holds no cell (never true of a run in [`RowRuns`]).
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    /// The run as a range of cell indices.
    pub fn cells(&self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// Each row's visible cells as sorted, disjoint, non-adjacent [`CellRun`]s, in
/// compressed sparse row form: row `r`'s runs are
/// `runs()[offsets()[r]..offsets()[r + 1]]`.
///
/// ```
/// use kvcache_api::{CellRun, RowRuns};
///
/// let mut runs = RowRuns::default();
/// runs.push_row([0..3, 3..4, 8..9]); // touching runs merge
/// runs.push_row([]); // a row that sees nothing (padding)
/// assert_eq!(runs.rows(), 2);
/// assert_eq!(runs.row(0), &[CellRun { start: 0, end: 4 }, CellRun { start: 8, end: 9 }]);
/// assert_eq!((runs.visible(0), runs.visible(1)), (5, 0));
/// assert_eq!(runs.offsets(), &[0, 2, 2]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowRuns {
    /// `rows + 1` entries, non-decreasing, the first 0, the last `runs.len()`.
    offsets: Vec<u32>,
    runs: Vec<CellRun>,
}

impl Default for RowRuns {
    fn default() -> Self {
        RowRuns {
            offsets: vec![0],
            runs: Vec::new(),
        }
    }
}

impl RowRuns {
    /// No rows yet, with room for `rows` rows of `runs` runs in all.
    pub fn with_capacity(rows: usize, runs: usize) -> Self {
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        RowRuns {
            offsets,
            runs: Vec::with_capacity(runs),
        }
    }

    /// Removes every row, keeping the allocations.
    pub fn clear(&mut self) {
        self.offsets.clear();
        self.offsets.push(0);
        self.runs.clear();
    }

    /// Appends a row of `ranges` of cells, sorted by start and disjoint; ranges
    /// that touch are merged and empty ones skipped.
    ///
    /// # Panics
    /// If the ranges are out of order or overlap (a caller's broken invariant).
    pub fn push_row<I>(&mut self, ranges: I)
    where
        I: IntoIterator<Item = std::ops::Range<u32>>,
    {
        let first = self.runs.len();
        for range in ranges {
            if range.start >= range.end {
                continue;
            }
            match self.runs[first..].last_mut() {
                Some(last) if last.end == range.start => last.end = range.end,
                Some(last) => {
                    assert!(
                        last.end < range.start,
                        "runs of a row out of order: {last:?} then {range:?}"
                    );
                    self.runs.push(CellRun {
                        start: range.start,
                        end: range.end,
                    });
                }
                None => self.runs.push(CellRun {
                    start: range.start,
                    end: range.end,
                }),
            }
        }
        let end = u32::try_from(self.runs.len()).expect("fewer than 2^32 runs");
        self.offsets.push(end);
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Row `row`'s runs, sorted by cell.
    ///
    /// # Panics
    /// If `row >= rows()`.
    pub fn row(&self, row: usize) -> &[CellRun] {
        &self.runs[self.offsets[row] as usize..self.offsets[row + 1] as usize]
    }

    /// Cells row `row` may see.
    pub fn visible(&self, row: usize) -> usize {
        self.row(row).iter().map(CellRun::len).sum()
    }

    /// Cells every row may see, added up: the work of one attention head.
    pub fn total_visible(&self) -> usize {
        self.runs.iter().map(CellRun::len).sum()
    }

    /// The CSR offsets: `rows() + 1` entries.
    pub fn offsets(&self) -> &[u32] {
        &self.offsets
    }

    /// Every row's runs, one after another.
    pub fn runs(&self) -> &[CellRun] {
        &self.runs
    }

    /// Bytes of heap memory held.
    pub fn capacity_bytes(&self) -> usize {
        self.offsets.capacity() * 4 + self.runs.capacity() * std::mem::size_of::<CellRun>()
    }
}

/// One layer's keys or values as the cache stores them, for every cell (not
/// only the pass's range), so that a kernel reads them in their stored type.
///
/// The *logical* shape is the float tensor they stand for: keys
/// `[cells, kv_heads, head_dim]`; values `[cells, kv_heads, head_dim_v]`, or
/// `[kv_heads, head_dim_v, cells]` with [`VLayout::Permuted`].
#[derive(Debug, Clone)]
pub enum StoredKv<T> {
    /// One tensor in the storage dtype (f32, f16 or bf16), the logical shape.
    Float(T),
    /// ggml's `q8_0`: blocks of 32 consecutive values along the head dimension,
    /// each read as `(quants - 128) * scale`.
    Q8_0 {
        /// `u8` holding `q + 128`, the logical shape.
        quants: T,
        /// `f16`, the logical shape with the head dimension divided by 32.
        scales: T,
    },
}

impl<T> StoredKv<T> {
    /// The tensor holding the values (the float tensor, or the quants).
    pub fn data(&self) -> &T {
        match self {
            StoredKv::Float(t) => t,
            StoredKv::Q8_0 { quants, .. } => quants,
        }
    }
}

/// What [`CausalCache::get_paged`](crate::CausalCache::get_paged) returns for
/// the current layer and forward pass: the cells each row may see and the
/// stored keys and values they index.
///
/// The tensors are views of cache storage that the cache overwrites in place,
/// and the runs borrow the cache: valid until the next `start_forward`,
/// `set_causal` or `put` on the same layer, as [`KvView`](crate::KvView) is.
#[derive(Debug, Clone)]
pub struct PagedKv<'a, T> {
    /// Keys of every cell, as stored: logical shape `[cells, kv_heads, head_dim]`.
    pub keys: StoredKv<T>,
    /// Values of every cell, as stored: logical shape
    /// `[cells, kv_heads, head_dim_v]`, or `[kv_heads, head_dim_v, cells]` when
    /// `v_layout` is [`VLayout::Permuted`].
    pub values: StoredKv<T>,
    /// The layout of `values`.
    pub v_layout: VLayout,
    /// One row per token of the batch, in batch order (no padding rows): the
    /// cells (absolute indices into the first axis of `keys`) it may attend to.
    pub runs: &'a RowRuns,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_merge_touching_runs_and_skip_empty_ones() {
        let mut runs = RowRuns::default();
        assert_eq!((runs.rows(), runs.total_visible()), (0, 0));
        runs.push_row([2..2, 2..5, 5..6, 9..12]);
        runs.push_row(std::iter::once(0..1));
        assert_eq!(runs.rows(), 2);
        assert_eq!(
            runs.row(0).iter().map(CellRun::cells).collect::<Vec<_>>(),
            vec![2..6, 9..12]
        );
        assert_eq!(runs.row(1), &[CellRun { start: 0, end: 1 }]);
        assert_eq!(runs.total_visible(), 8);
        runs.clear();
        assert_eq!((runs.rows(), runs.offsets()), (0, &[0u32][..]));
    }

    #[test]
    #[should_panic(expected = "out of order")]
    fn overlapping_runs_are_a_broken_invariant() {
        RowRuns::default().push_row([3..6, 4..8]);
    }
}
