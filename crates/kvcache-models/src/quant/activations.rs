//! Activations quantized per row to 8 bits, in 32-value blocks.

use super::{QuantError, Spread, BLOCK};

/// Values from which quantizing rows is worth a pool (prefill sizes).
const PARALLEL_FROM: usize = 64 * 1024;

/// Where each row's blocks go, shared by the threads of one quantization
/// (each writes only its own rows).
#[derive(Clone, Copy)]
struct RowsOut {
    scales: *mut f32,
    sums: *mut f32,
    offsets: *mut i32,
    quants: *mut i8,
}

// SAFETY: the threads sharing a `RowsOut` write disjoint rows (see
// `quantize_with`), and the buffers outlive them.
unsafe impl Send for RowsOut {}
// SAFETY: as above; shared references only copy the pointers.
unsafe impl Sync for RowsOut {}

/// One row's blocks: `d = absmax / 127`, each value's `q` rounded to the
/// nearest integer (ties to even, by adding 1.5 * 2^23, whose float then holds
/// `q` in its low mantissa bits), `s = d * sum(q)` and the offset
/// `-128 * sum(q)`. Plain arithmetic written for the compiler to vectorize (a
/// maximum over sixteen lanes, integer quants from the float's bits, no
/// `round` call or saturating cast per value), and compiled for the widest
/// instructions the CPU has: the same operations, so the same bits, on each.
fn quantize_row(x: &[f32], scales: &mut [f32], sums: &mut [f32], offsets: &mut [i32], quants: &mut [i8]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has the features `quantize_row_avx512` enables.
            return unsafe { quantize_row_avx512(x, scales, sums, offsets, quants) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, all `quantize_row_avx2` enables.
            return unsafe { quantize_row_avx2(x, scales, sums, offsets, quants) };
        }
    }
    quantize_row_generic(x, scales, sums, offsets, quants);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_row_avx512(
    x: &[f32],
    scales: &mut [f32],
    sums: &mut [f32],
    offsets: &mut [i32],
    quants: &mut [i8],
) {
    quantize_row_generic(x, scales, sums, offsets, quants);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2(
    x: &[f32],
    scales: &mut [f32],
    sums: &mut [f32],
    offsets: &mut [i32],
    quants: &mut [i8],
) {
    quantize_row_generic(x, scales, sums, offsets, quants);
}

#[inline(always)]
fn quantize_row_generic(
    x: &[f32],
    scales: &mut [f32],
    sums: &mut [f32],
    offsets: &mut [i32],
    quants: &mut [i8],
) {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    const LANES: usize = 16;
    let (blocks, _) = x.as_chunks::<BLOCK>();
    let (quant_blocks, _) = quants.as_chunks_mut::<BLOCK>();
    for ((((xb, qb), d_out), s_out), o_out) in blocks
        .iter()
        .zip(quant_blocks)
        .zip(scales.iter_mut())
        .zip(sums.iter_mut())
        .zip(offsets.iter_mut())
    {
        // The largest magnitude (a NaN never wins a comparison: ignored, as
        // `f32::max` ignores it).
        let mut lanes = [0f32; LANES];
        for half in xb.chunks_exact(LANES) {
            for l in 0..LANES {
                let v = half[l].abs();
                lanes[l] = if v > lanes[l] { v } else { lanes[l] };
            }
        }
        let absmax = lanes.iter().fold(0f32, |a, &v| if v > a { v } else { a });
        let d = absmax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            let shifted = (v * id).clamp(-127.0, 127.0) + MAGIC;
            let i = shifted.to_bits() as i32 - MAGIC.to_bits() as i32;
            *q = i as i8;
            sum += i;
        }
        *d_out = d;
        *s_out = d * sum as f32;
        *o_out = -128 * sum;
    }
}

/// `m` rows of `k` values, each 32-value block quantized to `i8` with an f32
/// scale `d = absmax / 127` (0 for an all-zero block), quants rounded to
/// nearest, the block sum `s = d * sum(q)`, and the block's offset
/// `-128 * sum(q)` (what the 8-bit kernels start each block's integer sum
/// from: they multiply weights stored plus 128).
///
/// Each row is quantized on its own: a row's blocks never depend on other rows.
#[derive(Clone, Debug, PartialEq)]
pub struct QActivations {
    m: usize,
    k: usize,
    /// Scale of each block, `m * k / 32` entries, row-major.
    pub(crate) scales: Vec<f32>,
    /// `d * sum(q)` of each block, same indexing as `scales`.
    pub(crate) sums: Vec<f32>,
    /// `-128 * sum(q)` of each block, same indexing as `scales`.
    pub(crate) offsets: Vec<i32>,
    /// Quants, `m * k`, row-major.
    pub(crate) quants: Vec<i8>,
}

impl QActivations {
    /// Quantizes the row-major `m x k` matrix `x` (`k` a multiple of 32).
    pub fn quantize(m: usize, k: usize, x: &[f32]) -> Result<QActivations, QuantError> {
        Self::quantize_with(m, k, x, None)
    }

    /// [`quantize`](Self::quantize) with the rows spread over `pool` (each row
    /// on its own, so the result is the same on any pool).
    pub fn quantize_on(m: usize, k: usize, x: &[f32], pool: &dyn Spread) -> Result<QActivations, QuantError> {
        Self::quantize_with(m, k, x, Some(pool))
    }

    fn quantize_with(
        m: usize,
        k: usize,
        x: &[f32],
        pool: Option<&dyn Spread>,
    ) -> Result<QActivations, QuantError> {
        if !k.is_multiple_of(BLOCK) {
            return Err(QuantError::BadShape {
                rows: m,
                cols: k,
                block: BLOCK,
            });
        }
        if x.len() != m * k {
            return Err(QuantError::BadLength {
                expected: m * k,
                got: x.len(),
            });
        }
        let blocks = m * k / BLOCK;
        let mut acts = QActivations {
            m,
            k,
            scales: vec![0.0; blocks],
            sums: vec![0.0; blocks],
            offsets: vec![0; blocks],
            quants: vec![0; m * k],
        };
        let per_row = k / BLOCK;
        let rows = RowsOut {
            scales: acts.scales.as_mut_ptr(),
            sums: acts.sums.as_mut_ptr(),
            offsets: acts.offsets.as_mut_ptr(),
            quants: acts.quants.as_mut_ptr(),
        };
        let quantize_rows = |range: std::ops::Range<usize>| {
            let rows: RowsOut = rows;
            for i in range {
                // SAFETY: row `i < m` of each output, whose lengths are `m`
                // rows of `per_row` blocks (of `k` quants); each row index is
                // handed out once, so no two threads write the same row, and
                // the vectors outlive this call.
                let (scales, sums, offsets, quants) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(rows.scales.add(i * per_row), per_row),
                        std::slice::from_raw_parts_mut(rows.sums.add(i * per_row), per_row),
                        std::slice::from_raw_parts_mut(rows.offsets.add(i * per_row), per_row),
                        std::slice::from_raw_parts_mut(rows.quants.add(i * k), k),
                    )
                };
                quantize_row(&x[i * k..(i + 1) * k], scales, sums, offsets, quants);
            }
        };
        match pool {
            Some(pool) if pool.threads() > 1 && m * k >= PARALLEL_FROM => pool.spread(m, &quantize_rows),
            _ => quantize_rows(0..m),
        }
        Ok(acts)
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.k
    }

    /// Blocks per row, `k / 32`.
    pub fn blocks_per_row(&self) -> usize {
        self.k / BLOCK
    }

    /// Scale `d` of block `b` of row `i`.
    pub fn scale(&self, i: usize, b: usize) -> f32 {
        self.scales[i * self.blocks_per_row() + b]
    }

    /// Block sum `s = d * sum(q)` of block `b` of row `i`.
    pub fn block_sum(&self, i: usize, b: usize) -> f32 {
        self.sums[i * self.blocks_per_row() + b]
    }

    /// The 32 quants of block `b` of row `i`.
    pub fn block_quants(&self, i: usize, b: usize) -> &[i8] {
        let at = (i * self.blocks_per_row() + b) * BLOCK;
        &self.quants[at..at + BLOCK]
    }

    /// Dequantized values `d * q`, row-major `m x k`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.m * self.k);
        for (q, &d) in self.quants.chunks_exact(BLOCK).zip(&self.scales) {
            out.extend(q.iter().map(|&v| d * v as f32));
        }
        out
    }
}
