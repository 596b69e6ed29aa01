//! Portable scalar kernels: the reference path, and the fallback on CPUs
//! without the SIMD extensions.
//!
//! Each output is accumulated block by block with the same fused steps as the
//! SIMD kernels (`acc = fma(d_w * d_a, isum_b, acc)`, then for Q4
//! `acc = fma(m_w, s_a, acc)`), so it gives their bits exactly.

use super::kernel::GroupKernel;
use super::{Format, QActivations, QMatrix, BLOCK, GROUP};
use half::f16;

/// Scalar tiles of the product of `w` and `a`.
pub(crate) struct ScalarGroups<'a> {
    w: &'a QMatrix,
    a: &'a QActivations,
}

impl<'a> ScalarGroups<'a> {
    /// Kernel for `a @ w^T` (inner dimensions already checked).
    pub(crate) fn new(w: &'a QMatrix, a: &'a QActivations) -> Self {
        ScalarGroups { w, a }
    }

    /// The exact integer dot product of block `b` of row `r` of group `g`
    /// with block `b` of activation row `i`.
    fn isum(&self, i: usize, g: usize, r: usize, b: usize) -> i32 {
        let (w, a) = (self.w, self.a);
        let nb = w.blocks_per_row();
        let qb = w.format.quant_bytes();
        let base = w.group_block(g, b) * GROUP * qb + r * 4;
        let aq = &a.quants[(i * nb + b) * BLOCK..(i * nb + b + 1) * BLOCK];
        let mut sum = 0i32;
        for s in 0..qb / 4 {
            for t in 0..4 {
                let v = w.quants[base + s * GROUP * 4 + t];
                let k = 4 * s + t;
                sum += match w.format {
                    Format::Q8 => (v ^ 0x80) as i8 as i32 * aq[k] as i32,
                    Format::Q4 => (v & 0x0f) as i32 * aq[k] as i32 + (v >> 4) as i32 * aq[k + 16] as i32,
                };
            }
        }
        sum
    }
}

impl GroupKernel for ScalarGroups<'_> {
    fn group<const MR: usize>(&self, i0: usize, g: usize) -> [[f32; GROUP]; MR] {
        let (w, a) = (self.w, self.a);
        assert!(i0 + MR <= a.rows() && g < w.groups(), "tile out of bounds");
        let nb = w.blocks_per_row();
        let mut out = [[0f32; GROUP]; MR];
        for (i, row) in out.iter_mut().enumerate() {
            let ai = i0 + i;
            for b in 0..nb {
                let at = w.group_block(g, b) * GROUP;
                let (da, sa) = (a.scales[ai * nb + b], a.sums[ai * nb + b]);
                for (r, acc) in row.iter_mut().enumerate() {
                    let dw = f16::from_bits(w.scales[at + r]).to_f32();
                    *acc = (dw * da).mul_add(self.isum(ai, g, r, b) as f32, *acc);
                    if w.format == Format::Q4 {
                        *acc = f16::from_bits(w.mins[at + r]).to_f32().mul_add(sa, *acc);
                    }
                }
            }
        }
        out
    }
}
