//! The product drivers: how the output is cut into tiles and chunks, and the
//! public entry points on [`QMatrix`].
//!
//! An inner kernel computes one tile of `MR` activation rows by `NR` weight
//! rows, loading each weight block once for the whole tile. A single-threaded
//! call walks its weight rows in cache-sized chunks, and inside each chunk
//! walks all activation rows in tiles, so the chunk's weights stay in cache
//! while every activation row passes over them. The parallel driver hands
//! chunks of weight rows to a pool ([`Spread`]: rayon's, or any other). A Q4
//! product of many rows unpacks each chunk of weights once and runs the 8-bit
//! kernel over it. Each kernel computes every output value with the same
//! operations whatever the tile shape, so neither the batch size nor the
//! chunking changes a single bit of the result.

use super::{Format, Isa, QActivations, QMatrix, QuantError, BLOCK};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::OnceLock;

/// Computes tiles of the product for one (weights, activations) pair.
pub(crate) trait TileKernel: Sync {
    /// Outputs for activation rows `i0..i0 + MR` and weight rows `j0..j0 + NR`,
    /// indexed `[row][col]`. Panics if the tile is out of bounds.
    fn tile<const MR: usize, const NR: usize>(&self, i0: usize, j0: usize) -> [[f32; NR]; MR];
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
/// Chunk granularity in weight rows (a multiple of every kernel's `NR`).
const ROW_GRAIN: usize = 16;

/// Writes tiles for activation rows `i0..i0 + MR` and weight rows `cols`.
fn tile_row<K: TileKernel, const MR: usize, const NR: usize>(
    k: &K,
    i0: usize,
    cols: Range<usize>,
    out: OutPtr,
) {
    let write = |j0: usize, vals: &[f32], i: usize| {
        let at = (i0 + i) * out.ld + j0;
        // SAFETY: `drive` checked that the output holds `m x ld` values and that
        // `cols` lies within `0..ld`; `i0 + i < m`. This task owns `cols`.
        unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), out.ptr.add(at), vals.len()) };
    };
    let mut j = cols.start;
    while j + NR <= cols.end {
        let t = k.tile::<MR, NR>(i0, j);
        (0..MR).for_each(|i| write(j, &t[i], i));
        j += NR;
    }
    while j < cols.end {
        let t = k.tile::<MR, 1>(i0, j);
        (0..MR).for_each(|i| write(j, &t[i], i));
        j += 1;
    }
}

/// Single-threaded walk over weight rows `cols` for all `m` activation rows.
fn walk<K: TileKernel, const MR: usize, const NR: usize>(
    k: &K,
    m: usize,
    cols: Range<usize>,
    row_bytes: usize,
    out: OutPtr,
) {
    let chunk = (CHUNK_BYTES / row_bytes.max(1)).max(ROW_GRAIN) / ROW_GRAIN * ROW_GRAIN;
    let mut c0 = cols.start;
    while c0 < cols.end {
        let c1 = (c0 + chunk).min(cols.end);
        let mut i = 0;
        while i + MR <= m {
            tile_row::<K, MR, NR>(k, i, c0..c1, out);
            i += MR;
        }
        while i < m {
            tile_row::<K, 1, NR>(k, i, c0..c1, out);
            i += 1;
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

/// Runs kernel `k` over weight rows `cols`, spread over `pool` if given,
/// otherwise on the calling thread.
fn drive<K: TileKernel, const MR: usize, const NR: usize>(
    k: &K,
    w: &QMatrix,
    m: usize,
    cols: Range<usize>,
    out: OutPtr,
    pool: Option<&dyn Spread>,
) {
    let row_bytes = w.blocks_per_row() * w.format.block_bytes();
    let n = cols.len();
    let threads = pool.map_or(1, |p| p.threads());
    let pool = match pool {
        Some(pool) if threads > 1 && n > ROW_GRAIN => pool,
        _ => return walk::<K, MR, NR>(k, m, cols, row_bytes, out),
    };
    // About four chunks per thread for balance, in whole grains.
    let per = n.div_ceil(4 * threads).div_ceil(ROW_GRAIN) * ROW_GRAIN;
    let chunks = n.div_ceil(per);
    pool.spread(chunks, &|range| {
        for c in range {
            let start = cols.start + c * per;
            let end = (start + per).min(cols.end);
            walk::<K, MR, NR>(k, m, start..end, row_bytes, out);
        }
    });
}

/// Activation rows from which a Q4 product unpacks each chunk of weight rows
/// once (see [`drive_unpacked`]) instead of unpacking every block in every
/// tile: prefill sizes.
const UNPACK_FROM: usize = 16;

/// A Q4 product for many activation rows (prefill): each chunk of weight rows
/// is unpacked once into 8-bit blocks (the nibbles `q` as bytes, the same
/// scales), multiplied by the Q8 kernel, and the blocks' `m` term added after.
/// The Q8 kernel's integer block sums of `q >= 0` equal the Q4 kernel's, and
/// its float steps are the same, so every output is bit for bit what the Q4
/// tiles give (a row's result never depends on its batch; the invariance
/// tests hold both paths to it). Unpacking per tile cost Gemma's Q4_K
/// matrices a fifth of their prefill speed.
#[cfg(target_arch = "x86_64")]
fn drive_unpacked(
    w: &QMatrix,
    a: &QActivations,
    isa: Isa,
    cols: Range<usize>,
    out: OutPtr,
    pool: Option<&dyn Spread>,
) {
    let nb = w.blocks_per_row();
    let m = a.rows();
    let chunk = |c0: usize, c1: usize| {
        // The whole `OutPtr` (which is `Sync`), not its raw pointer field.
        let out: OutPtr = out;
        let rows = c1 - c0;
        let mut quants = vec![0u8; rows * nb * BLOCK];
        for (block, nibbles) in w.quants[c0 * nb * 16..c1 * nb * 16].chunks_exact(16).enumerate() {
            let q = &mut quants[block * BLOCK..(block + 1) * BLOCK];
            for (i, &byte) in nibbles.iter().enumerate() {
                q[i] = byte & 0x0f;
                q[i + 16] = byte >> 4;
            }
        }
        let bytes = QMatrix {
            rows,
            cols: w.cols,
            format: Format::Q8,
            scales: w.scales[c0 * nb..c1 * nb].to_vec(),
            mins: Vec::new(),
            quants,
        };
        let shifted = OutPtr {
            // SAFETY (of the writes through it): column `c0 + j` of the output,
            // in this chunk's columns only, as `drive` guarantees its chunks.
            ptr: out.ptr.wrapping_add(c0),
            ld: out.ld,
        };
        let row_bytes = nb * Format::Q8.block_bytes();
        match isa {
            Isa::Avx512 => {
                let k = super::x86_avx512::Avx512Tiles::new(&bytes, a).expect("checked by product");
                walk::<_, 4, 4>(&k, m, 0..rows, row_bytes, shifted);
            }
            _ => {
                let k = super::x86_avx2::Avx2Tiles::new(&bytes, a).expect("checked by product");
                walk::<_, 2, 4>(&k, m, 0..rows, row_bytes, shifted);
            }
        }
        for i in 0..m {
            let sums = &a.sums[i * nb..(i + 1) * nb];
            for j in c0..c1 {
                let mins = &w.mins[j * nb..(j + 1) * nb];
                // SAFETY: AVX2, FMA and F16C come with either ISA (checked by
                // `product`); both slices hold `nb` values. The element is this
                // chunk's, written by the walk above.
                unsafe {
                    let at = out.ptr.add(i * out.ld + j);
                    *at += super::x86_avx2::min_dot(mins.as_ptr(), sums.as_ptr(), nb);
                }
            }
        }
    };
    let n = cols.len();
    let threads = pool.map_or(1, |p| p.threads());
    let per = n.div_ceil(4 * threads).div_ceil(ROW_GRAIN) * ROW_GRAIN;
    let chunks = n.div_ceil(per.max(1));
    let run = |range: Range<usize>| {
        for c in range {
            let start = cols.start + c * per;
            chunk(start, (start + per).min(cols.end));
        }
    };
    match pool {
        Some(pool) if threads > 1 && chunks > 1 => pool.spread(chunks, &run),
        _ => run(0..chunks),
    }
}

/// Checks shapes and ISA, then dispatches to the kernel of `isa` and the format.
fn product(
    w: &QMatrix,
    a: &QActivations,
    isa: Isa,
    cols: Range<usize>,
    out: &mut [f32],
    pool: Option<&dyn Spread>,
) -> Result<(), QuantError> {
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
    assert!(
        cols.start <= cols.end && cols.end <= w.rows,
        "column range out of bounds"
    );
    let m = a.rows();
    let out = OutPtr {
        ptr: out.as_mut_ptr(),
        ld: w.rows,
    };
    match isa {
        Isa::Scalar => {
            let k = super::scalar::ScalarTiles::new(w, a);
            drive::<_, 2, 2>(&k, w, m, cols, out, pool);
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if w.format == Format::Q4 && m >= UNPACK_FROM => {
            if !isa.is_available() {
                return Err(QuantError::IsaUnavailable(isa));
            }
            drive_unpacked(w, a, isa, cols, out, pool);
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            let k = super::x86_avx2::Avx2Tiles::new(w, a).ok_or(QuantError::IsaUnavailable(isa))?;
            drive::<_, 2, 4>(&k, w, m, cols, out, pool);
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            let k = super::x86_avx512::Avx512Tiles::new(w, a).ok_or(QuantError::IsaUnavailable(isa))?;
            drive::<_, 4, 4>(&k, w, m, cols, out, pool);
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => return Err(QuantError::IsaUnavailable(isa)),
    }
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
