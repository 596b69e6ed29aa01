//! The product drivers: how the output is cut into tiles and chunks, and the
//! public entry points on [`QMatrix`].
//!
//! An inner kernel computes one tile: `MR` activation rows against one group
//! of sixteen interleaved weight rows. A single-threaded call walks its
//! groups in cache-sized chunks, and inside each chunk walks all activation
//! rows in tiles of 8, then 4, 2 and 1, so the chunk's weights stay in cache
//! while every activation row passes over them. The parallel driver hands
//! chunks of groups to a pool ([`Spread`]: rayon's, or any other). Each
//! kernel computes every output value with the same operations whatever the
//! tile shape, so neither the batch size nor the chunking changes a single
//! bit of the result.

use super::{Isa, QActivations, QMatrix, QuantError, GROUP};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::OnceLock;

/// Computes tiles of the product for one (weights, activations) pair.
pub(crate) trait GroupKernel: Sync {
    /// Outputs of activation rows `i0..i0 + MR` against weight group `g`
    /// (weight rows `16g..16g + 16`, a padding row giving 0), indexed
    /// `[activation row][row in group]`. Panics if the tile is out of bounds.
    fn group<const MR: usize>(&self, i0: usize, g: usize) -> [[f32; GROUP]; MR];
}

/// Output matrix `m x ld` (row stride `ld`) shared by the tasks of one product.
#[derive(Clone, Copy)]
struct OutPtr {
    ptr: *mut f32,
    ld: usize,
}

// SAFETY: tasks sharing an `OutPtr` write disjoint column ranges of the output
// (see `drive`), and the buffer outlives them (it is borrowed by the caller of
// `drive`, which joins all tasks before returning).
unsafe impl Send for OutPtr {}
// SAFETY: as above; shared references only copy the pointer.
unsafe impl Sync for OutPtr {}

/// Weight bytes per cache chunk of a single-threaded walk.
const CHUNK_BYTES: usize = 128 * 1024;

/// Computes the `MR x 16` tiles of activation rows `i0..i0 + MR` against
/// groups `groups`, writing the columns inside `cols` only.
fn tile_row<K: GroupKernel, const MR: usize>(
    k: &K,
    i0: usize,
    groups: Range<usize>,
    cols: &Range<usize>,
    out: OutPtr,
) {
    for g in groups {
        let t = k.group::<MR>(i0, g);
        let first = (g * GROUP).max(cols.start);
        let last = ((g + 1) * GROUP).min(cols.end);
        for (i, vals) in t.iter().enumerate() {
            let vals = &vals[first - g * GROUP..last - g * GROUP];
            let at = (i0 + i) * out.ld + first;
            // SAFETY: `product` checked that the output holds `m x ld` values
            // and that `cols` lies within `0..ld`; `i0 + i < m`, and
            // `first..last` lies within `cols`, which this task owns.
            unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), out.ptr.add(at), vals.len()) };
        }
    }
}

/// Single-threaded walk over the groups covering `cols`, for all `m`
/// activation rows.
fn walk<K: GroupKernel>(k: &K, m: usize, cols: Range<usize>, group_bytes: usize, out: OutPtr) {
    let groups = cols.start / GROUP..cols.end.div_ceil(GROUP);
    let chunk = (CHUNK_BYTES / group_bytes.max(1)).max(1);
    let mut c0 = groups.start;
    while c0 < groups.end {
        let c1 = (c0 + chunk).min(groups.end);
        let mut i = 0;
        while i + 8 <= m {
            tile_row::<K, 8>(k, i, c0..c1, &cols, out);
            i += 8;
        }
        if m - i >= 4 {
            tile_row::<K, 4>(k, i, c0..c1, &cols, out);
            i += 4;
        }
        if m - i >= 2 {
            tile_row::<K, 2>(k, i, c0..c1, &cols, out);
            i += 2;
        }
        if m - i >= 1 {
            tile_row::<K, 1>(k, i, c0..c1, &cols, out);
        }
        c0 = c1;
    }
}

/// A thread pool a product spreads its chunks of weight rows over: `spread(n,
/// f)` calls `f` on ranges that together cover `0..n` once each, on any
/// threads, and returns when all are done. How many threads it has decides
/// only the chunk sizes, never a result.
pub trait Spread: Sync {
    /// Threads that take part (the calling one included).
    fn threads(&self) -> usize;
    /// Runs `f` over ranges covering `0..items`.
    fn spread(&self, items: usize, f: &(dyn Fn(Range<usize>) + Sync));
}

/// rayon's current pool (use `ThreadPool::install` to choose it).
#[derive(Debug, Clone, Copy, Default)]
pub struct Rayon;

impl Spread for Rayon {
    fn threads(&self) -> usize {
        rayon::current_num_threads()
    }

    fn spread(&self, items: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        (0..items).into_par_iter().for_each(|i| f(i..i + 1));
    }
}

/// Checks that `w` and `a` can be multiplied into `out` with `isa`.
fn check(w: &QMatrix, a: &QActivations, isa: Isa, out: &[f32]) -> Result<(), QuantError> {
    if a.cols() != w.cols {
        return Err(QuantError::InnerMismatch {
            weight_cols: w.cols,
            act_cols: a.cols(),
        });
    }
    let expected = a.rows() * w.rows;
    if out.len() != expected {
        return Err(QuantError::BadLength {
            expected,
            got: out.len(),
        });
    }
    if !isa.is_available() {
        return Err(QuantError::IsaUnavailable(isa));
    }
    Ok(())
}

/// Computes weight rows `cols` of `w` against every row of `a` on the calling
/// thread, with the kernel of `isa` (checked available).
fn walk_with(w: &QMatrix, a: &QActivations, isa: Isa, cols: Range<usize>, out: OutPtr) {
    let group_bytes = GROUP * w.blocks_per_row() * w.format.block_bytes();
    let m = a.rows();
    match isa {
        Isa::Scalar => walk(&super::scalar::ScalarGroups::new(w, a), m, cols, group_bytes, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            let k = super::x86_avx2::Avx2Groups::new(w, a).expect("checked available");
            walk(&k, m, cols, group_bytes, out);
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            let k = super::x86_avx512::Avx512Groups::new(w, a).expect("checked available");
            walk(&k, m, cols, group_bytes, out);
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => {
            let k = super::arm_neon::NeonGroups::new(w, a).expect("checked available");
            walk(&k, m, cols, group_bytes, out);
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("checked available"),
    }
}

/// One product of a (possibly shared) parallel section: weight rows `cols`
/// of `w` into `out`.
struct Part<'a> {
    w: &'a QMatrix,
    cols: Range<usize>,
    out: OutPtr,
}

/// Computes every part, spread over `pool` if given (in chunks of whole
/// groups, about four per thread, so no two tasks write the same column),
/// otherwise on the calling thread.
fn drive(parts: &[Part<'_>], a: &QActivations, isa: Isa, pool: Option<&dyn Spread>) {
    let threads = pool.map_or(1, |p| p.threads());
    let groups = |p: &Part<'_>| p.cols.end.div_ceil(GROUP) - p.cols.start / GROUP;
    let total: usize = parts.iter().map(groups).sum();
    let pool = match pool {
        Some(pool) if threads > 1 && total > 1 => pool,
        _ => {
            for p in parts {
                walk_with(p.w, a, isa, p.cols.clone(), p.out);
            }
            return;
        }
    };
    let per = total.div_ceil(4 * threads);
    // (part, first group, end group) of each chunk.
    let mut chunks = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        let (first, end) = (p.cols.start / GROUP, p.cols.end.div_ceil(GROUP));
        chunks.extend((first..end).step_by(per).map(|g0| (i, g0, (g0 + per).min(end))));
    }
    pool.spread(chunks.len(), &|range| {
        for &(i, g0, g1) in &chunks[range] {
            let p = &parts[i];
            let cols = (g0 * GROUP).max(p.cols.start)..(g1 * GROUP).min(p.cols.end);
            walk_with(p.w, a, isa, cols, p.out);
        }
    });
}

/// Checks shapes and ISA, then runs one product.
fn product(
    w: &QMatrix,
    a: &QActivations,
    isa: Isa,
    cols: Range<usize>,
    out: &mut [f32],
    pool: Option<&dyn Spread>,
) -> Result<(), QuantError> {
    check(w, a, isa, out)?;
    assert!(
        cols.start <= cols.end && cols.end <= w.rows,
        "column range out of bounds"
    );
    if cols.is_empty() {
        return Ok(());
    }
    let out = OutPtr {
        ptr: out.as_mut_ptr(),
        ld: w.rows,
    };
    drive(&[Part { w, cols, out }], a, isa, pool);
    Ok(())
}

/// The instruction set used when none is given: [`Isa::detect`], once per process.
pub fn default_isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(Isa::detect)
}

impl QMatrix {
    /// Single-threaded product over the weight rows `cols` only: writes
    /// `out[i * rows + j]` for every activation row `i` and every `j` in
    /// `cols`, leaving the other entries of `out` (`m x rows`) untouched.
    ///
    /// # Panics
    /// If `cols` is not within `0..rows`.
    pub fn matmul_range_isa(
        &self,
        acts: &QActivations,
        isa: Isa,
        cols: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        product(self, acts, isa, cols, out, None)
    }

    /// [`QMatrix::matmul_range_isa`] with the default instruction set.
    pub fn matmul_range(
        &self,
        acts: &QActivations,
        cols: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        product(self, acts, default_isa(), cols, out, None)
    }

    /// `out = acts @ self^T` (`m x rows`, row-major), computed on the current
    /// rayon pool (use `ThreadPool::install` to choose the thread count).
    pub fn matmul_into_isa(&self, acts: &QActivations, isa: Isa, out: &mut [f32]) -> Result<(), QuantError> {
        product(self, acts, isa, 0..self.rows, out, Some(&Rayon))
    }

    /// `out = acts @ self^T` (`m x rows`, row-major), computed on `pool`.
    pub fn matmul_on(
        &self,
        acts: &QActivations,
        isa: Isa,
        out: &mut [f32],
        pool: &dyn Spread,
    ) -> Result<(), QuantError> {
        product(self, acts, isa, 0..self.rows, out, Some(pool))
    }

    /// `outs[i] = acts @ ws[i]^T` for matrices that share their input (a
    /// layer's query, key and value projections; its gate and up), in one
    /// parallel section on `pool`: one wake-up of the pool's threads, not
    /// one per matrix. Each output is what [`QMatrix::matmul_on`] gives.
    pub fn matmul_many_on(
        ws: &[&QMatrix],
        acts: &QActivations,
        isa: Isa,
        outs: &mut [&mut [f32]],
        pool: &dyn Spread,
    ) -> Result<(), QuantError> {
        assert_eq!(ws.len(), outs.len(), "one output per matrix");
        let mut parts = Vec::with_capacity(ws.len());
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            check(w, acts, isa, out)?;
            let out = OutPtr {
                ptr: out.as_mut_ptr(),
                ld: w.rows,
            };
            parts.push(Part {
                w,
                cols: 0..w.rows,
                out,
            });
        }
        drive(&parts, acts, isa, Some(pool));
        Ok(())
    }

    /// [`QMatrix::matmul_into_isa`] with the default instruction set.
    pub fn matmul_into(&self, acts: &QActivations, out: &mut [f32]) -> Result<(), QuantError> {
        product(self, acts, default_isa(), 0..self.rows, out, Some(&Rayon))
    }

    /// `acts @ self^T` as a new `m x rows` row-major vector (default instruction set).
    pub fn matmul(&self, acts: &QActivations) -> Result<Vec<f32>, QuantError> {
        let mut out = vec![0f32; acts.rows() * self.rows];
        self.matmul_into(acts, &mut out)?;
        Ok(out)
    }
}
