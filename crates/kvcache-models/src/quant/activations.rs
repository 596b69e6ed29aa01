//! Activations quantized per row to 8 bits, in 32-value blocks.

use super::{QuantError, BLOCK};

/// `m` rows of `k` values, each 32-value block quantized to `i8` with an f32
/// scale `d = absmax / 127` (0 for an all-zero block), quants rounded to
/// nearest, and the block sum `s = d * sum(q)`.
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
    /// Quants, `m * k`, row-major.
    pub(crate) quants: Vec<i8>,
}

impl QActivations {
    /// Quantizes the row-major `m x k` matrix `x` (`k` a multiple of 32).
    pub fn quantize(m: usize, k: usize, x: &[f32]) -> Result<QActivations, QuantError> {
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
            scales: Vec::with_capacity(blocks),
            sums: Vec::with_capacity(blocks),
            quants: vec![0; m * k],
        };
        for (xb, qb) in x.chunks_exact(BLOCK).zip(acts.quants.chunks_exact_mut(BLOCK)) {
            let absmax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = absmax / 127.0;
            let id = if d == 0.0 { 0.0 } else { 1.0 / d };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * id).round().clamp(-127.0, 127.0) as i8;
                sum += *q as i32;
            }
            acts.scales.push(d);
            acts.sums.push(d * sum as f32);
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
