//! Portable scalar kernels: the reference path, and the fallback on CPUs
//! without the SIMD extensions.
//!
//! Each output is `sum_b (d_w * d_a) * isum_b` accumulated block by block in
//! f32 (separate multiply and add), plus, for Q4, the `m` term
//! `sum_b m_w * s_a` accumulated separately in the same way and added last.

use super::kernel::TileKernel;
use super::{Format, QActivations, QMatrix, BLOCK};
use half::f16;

/// Scalar tiles of the product of `w` and `a`.
pub(crate) struct ScalarTiles<'a> {
    w: &'a QMatrix,
    a: &'a QActivations,
}

impl<'a> ScalarTiles<'a> {
    /// Kernel for `a @ w^T` (inner dimensions already checked).
    pub(crate) fn new(w: &'a QMatrix, a: &'a QActivations) -> Self {
        ScalarTiles { w, a }
    }

    /// Output for activation row `i` and weight row `j`.
    fn dot(&self, i: usize, j: usize) -> f32 {
        let (w, a) = (self.w, self.a);
        let nb = w.blocks_per_row();
        let mut acc = 0f32;
        let mut acc_m = 0f32;
        for b in 0..nb {
            let wblk = j * nb + b;
            let ablk = i * nb + b;
            let aq = &a.quants[ablk * BLOCK..(ablk + 1) * BLOCK];
            let isum: i32 = match w.format {
                Format::Q8 => {
                    let wq = &w.quants[wblk * 32..(wblk + 1) * 32];
                    wq.iter()
                        .zip(aq)
                        .map(|(&x, &y)| (x as i8) as i32 * y as i32)
                        .sum()
                }
                Format::Q4 => {
                    let wq = &w.quants[wblk * 16..(wblk + 1) * 16];
                    let lo: i32 = wq
                        .iter()
                        .zip(&aq[..16])
                        .map(|(&x, &y)| (x & 15) as i32 * y as i32)
                        .sum();
                    let hi: i32 = wq
                        .iter()
                        .zip(&aq[16..])
                        .map(|(&x, &y)| (x >> 4) as i32 * y as i32)
                        .sum();
                    lo + hi
                }
            };
            let dw = f16::from_bits(w.scales[wblk]).to_f32();
            acc += (dw * a.scales[ablk]) * isum as f32;
            if w.format == Format::Q4 {
                acc_m += f16::from_bits(w.mins[wblk]).to_f32() * a.sums[ablk];
            }
        }
        acc + acc_m
    }
}

impl TileKernel for ScalarTiles<'_> {
    fn tile<const MR: usize, const NR: usize>(&self, i0: usize, j0: usize) -> [[f32; NR]; MR] {
        let mut out = [[0f32; NR]; MR];
        for (i, row) in out.iter_mut().enumerate() {
            for (r, v) in row.iter_mut().enumerate() {
                *v = self.dot(i0 + i, j0 + r);
            }
        }
        out
    }
}
