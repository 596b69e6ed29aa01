//! NEON kernels (AArch64): a group's sixteen interleaved weight rows as four
//! quarters of four, one row per 32-bit lane of a 128-bit register.
//!
//! Four activation quants are broadcast to every lane; `vmull_s8` and
//! `vmull_high_s8` multiply them by a quarter's weights into sixteen `i16`
//! products, and `vpadalq_s16` adds neighbouring pairs into `i32` (every
//! product fits `i16`: `|w|, |a| <= 128`); at the block's end one pairwise
//! add per two quarters leaves each row's exact integer sum. (`sdot` would
//! do this in one instruction, but its intrinsic is not stable Rust.) Q8
//! weights have their stored offset taken off (`q ^ 0x80`); Q4 nibbles are
//! small enough to multiply as signed bytes. The float steps are the other
//! kernels' own, `fma(d_w * d_a, isum, acc)` then the Q4 `m` term, so NEON
//! gives the scalar kernel's bits.

use super::kernel::GroupKernel;
use super::{Format, Isa, QActivations, QMatrix, BLOCK, GROUP};
use half::f16;
use std::arch::aarch64::*;

/// NEON tiles of the product of `w` and `a`; exists only where NEON runs.
pub(crate) struct NeonGroups<'a> {
    w: &'a QMatrix,
    a: &'a QActivations,
}

impl<'a> NeonGroups<'a> {
    /// Kernel for `a @ w^T` (inner dimensions already checked), or `None` if
    /// this CPU lacks NEON.
    pub(crate) fn new(w: &'a QMatrix, a: &'a QActivations) -> Option<Self> {
        Isa::Neon.is_available().then_some(NeonGroups { w, a })
    }
}

impl GroupKernel for NeonGroups<'_> {
    fn group<const MR: usize>(&self, i0: usize, g: usize) -> [[f32; GROUP]; MR] {
        assert!(
            i0 + MR <= self.a.rows() && g < self.w.groups(),
            "tile out of bounds"
        );
        let mut out = [[0f32; GROUP]; MR];
        for quarter in 0..4 {
            // SAFETY: `new` checked NEON; the tile lies inside both operands
            // (asserted above) and their inner dimensions agree.
            let lanes = unsafe { quarter_tile::<MR>(self.w, self.a, i0, g, quarter) };
            for (o, l) in out.iter_mut().zip(&lanes) {
                o[4 * quarter..4 * quarter + 4].copy_from_slice(l);
            }
        }
        out
    }
}

/// Four activation quants (bytes `at..at + 4`) in every 32-bit lane.
///
/// # Safety
/// Needs NEON; `at + 4` bytes must be readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn broadcast4(q: *const i8, at: usize) -> int8x16_t {
    // SAFETY: the caller guarantees the four bytes are readable.
    unsafe { vreinterpretq_s8_s32(vdupq_n_s32(q.add(at).cast::<i32>().read_unaligned())) }
}

/// `acc` plus the products of four rows' four quants (`w`, one row per lane)
/// with the four activation quants in every lane, as pair sums: lanes
/// `[r0 (0+1), r0 (2+3), r1 (0+1), r1 (2+3)]` in `lo`, rows 2 and 3 in `hi`.
#[inline]
#[target_feature(enable = "neon")]
fn mul_pairs(lo: int32x4_t, hi: int32x4_t, w: int8x16_t, a: int8x16_t) -> (int32x4_t, int32x4_t) {
    (
        vpadalq_s16(lo, vmull_s8(vget_low_s8(w), vget_low_s8(a))),
        vpadalq_s16(hi, vmull_high_s8(w, a)),
    )
}

/// The four rows' scales (f16 bits at `bits`) as f32.
///
/// # Safety
/// `bits` must point to four readable values.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn scales4(bits: *const u16) -> float32x4_t {
    // SAFETY: the caller guarantees four readable values.
    let v: [f32; 4] = std::array::from_fn(|r| f16::from_bits(unsafe { *bits.add(r) }).to_f32());
    // SAFETY: `v` holds four floats.
    unsafe { vld1q_f32(v.as_ptr()) }
}

/// Activation rows `i0..i0 + MR` against rows `4 * quarter..4 * quarter + 4`
/// of group `g`.
///
/// # Safety
/// Needs NEON; rows `i0..i0+MR` of `a` and group `g` of `w` must exist,
/// `quarter < 4`, and `a.cols() == w.cols()`.
#[target_feature(enable = "neon")]
unsafe fn quarter_tile<const MR: usize>(
    w: &QMatrix,
    a: &QActivations,
    i0: usize,
    g: usize,
    quarter: usize,
) -> [[f32; 4]; MR] {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let nb = w.blocks_per_row();
        let q4 = w.format == Format::Q4;
        let qb = w.format.quant_bytes();
        let (aq, ascale, asum) = (a.quants.as_ptr(), a.scales.as_ptr(), a.sums.as_ptr());
        let offset = vdupq_n_u8(0x80);
        let low4 = vdupq_n_u8(0x0f);
        let mut acc = [vdupq_n_f32(0.0); MR];
        for b in 0..nb {
            let at = w.group_block(g, b);
            let wq = w.quants.as_ptr().add(at * GROUP * qb + 16 * quarter);
            let mut lo = [vdupq_n_s32(0); MR];
            let mut hi = [vdupq_n_s32(0); MR];
            for seg in 0..qb / 4 {
                let raw = vld1q_u8(wq.add(seg * GROUP * 4));
                if q4 {
                    let low = vreinterpretq_s8_u8(vandq_u8(raw, low4));
                    let high = vreinterpretq_s8_u8(vshrq_n_u8::<4>(raw));
                    for i in 0..MR {
                        let blk = ((i0 + i) * nb + b) * BLOCK;
                        (lo[i], hi[i]) = mul_pairs(lo[i], hi[i], low, broadcast4(aq, blk + 4 * seg));
                        (lo[i], hi[i]) = mul_pairs(lo[i], hi[i], high, broadcast4(aq, blk + 16 + 4 * seg));
                    }
                } else {
                    let wv = vreinterpretq_s8_u8(veorq_u8(raw, offset));
                    for i in 0..MR {
                        let blk = ((i0 + i) * nb + b) * BLOCK;
                        (lo[i], hi[i]) = mul_pairs(lo[i], hi[i], wv, broadcast4(aq, blk + 4 * seg));
                    }
                }
            }
            let dw = scales4(w.scales.as_ptr().add(at * GROUP + 4 * quarter));
            let mw = if q4 {
                scales4(w.mins.as_ptr().add(at * GROUP + 4 * quarter))
            } else {
                vdupq_n_f32(0.0)
            };
            for i in 0..MR {
                let blk = (i0 + i) * nb + b;
                let isum = vcvtq_f32_s32(vpaddq_s32(lo[i], hi[i]));
                let da = vdupq_n_f32(*ascale.add(blk));
                acc[i] = vfmaq_f32(acc[i], vmulq_f32(dw, da), isum);
                if q4 {
                    acc[i] = vfmaq_f32(acc[i], mw, vdupq_n_f32(*asum.add(blk)));
                }
            }
        }
        let mut out = [[0f32; 4]; MR];
        for (o, v) in out.iter_mut().zip(&acc) {
            vst1q_f32(o.as_mut_ptr(), *v);
        }
        out
    }
}
