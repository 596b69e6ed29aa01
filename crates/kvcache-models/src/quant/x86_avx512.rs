//! AVX-512 VNNI kernels: two 32-value blocks per 512-bit register.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes and sums groups of four into
//! sixteen i32 lanes: lanes 0..8 belong to block `b`, lanes 8..16 to block
//! `b + 1`. Q4 nibbles are unsigned already; for Q8 x Q8 the activations go
//! in offset by 128 and each lane starts from minus 128 times its weights'
//! sum. Each lane is accumulated with `fma(d_w * d_a, isum, acc)`, the scale
//! vector holding block `b`'s product in the low half and block
//! `b + 1`'s in the high half. An odd last block is loaded with a byte mask
//! and given zero scales in the high half, where `fma(0, 0, acc)` leaves the
//! accumulator unchanged. The sixteen lanes are summed once at the end in a
//! fixed order; the Q4 `m` term reuses the AVX2 8-lane dot product.

use super::kernel::TileKernel;
use super::x86_avx2::{hsum256, min_dot, prefetch_ahead};
use super::{Format, Isa, QActivations, QMatrix, BLOCK};
use std::arch::x86_64::*;

/// AVX-512 tiles of the product of `w` and `a`; exists only where they run.
pub(crate) struct Avx512Tiles<'a> {
    w: &'a QMatrix,
    a: &'a QActivations,
}

impl<'a> Avx512Tiles<'a> {
    /// Kernel for `a @ w^T` (inner dimensions already checked), or `None` if
    /// this CPU lacks any of the needed extensions.
    pub(crate) fn new(w: &'a QMatrix, a: &'a QActivations) -> Option<Self> {
        Isa::Avx512.is_available().then_some(Avx512Tiles { w, a })
    }
}

impl TileKernel for Avx512Tiles<'_> {
    fn tile<const MR: usize, const NR: usize>(&self, i0: usize, j0: usize) -> [[f32; NR]; MR] {
        assert!(
            i0 + MR <= self.a.rows() && j0 + NR <= self.w.rows(),
            "tile out of bounds"
        );
        // SAFETY: `new` checked every extension the kernels enable; the tile
        // lies inside both operands (asserted above), inner dimensions agree.
        unsafe {
            match self.w.format {
                Format::Q8 => q8_tile::<MR, NR>(self.w, self.a, i0, j0),
                Format::Q4 => q4_tile::<MR, NR>(self.w, self.a, i0, j0),
            }
        }
    }
}

/// `[v[0]; 8] ++ [v[1]; 8]` from the two low lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f")]
fn split_two(v: __m128) -> __m512 {
    let index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(index, _mm512_castps128_ps512(v))
}

/// Sum of the sixteen lanes, always in the same order.
///
/// # Safety
/// Needs AVX-512F and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn hsum512(v: __m512) -> f32 {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        hsum256(_mm256_add_ps(lo, hi))
    }
}

/// Scale vector of blocks `blk` and `blk + 1` (zero for the second if `!pair`).
///
/// # Safety
/// Needs AVX-512F and F16C; `scales[blk]` (and `scales[blk + 1]` if `pair`) exist.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn weight_scales(scales: *const u16, blk: usize, pair: bool) -> __m512 {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let p = scales.add(blk);
        let bits = if pair {
            p.cast::<u32>().read_unaligned()
        } else {
            *p as u32
        };
        split_two(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
}

/// Scale vector of activation blocks `blk` and `blk + 1` (zero if `!pair`).
///
/// # Safety
/// Needs AVX-512F; `scales[blk]` (and `scales[blk + 1]` if `pair`) exist.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn act_scales(scales: *const f32, blk: usize, pair: bool) -> __m512 {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let p = scales.add(blk);
        let bits = if pair {
            p.cast::<u64>().read_unaligned()
        } else {
            (*p).to_bits() as u64
        };
        split_two(_mm_castsi128_ps(_mm_cvtsi64_si128(bits as i64)))
    }
}

/// Q8 weights x Q8 activations for an `MR x NR` tile.
///
/// # Safety
/// Needs AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C; rows `i0..i0+MR` of `a` and
/// `j0..j0+NR` of `w` must exist, and `a.cols() == w.cols()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_tile<const MR: usize, const NR: usize>(
    w: &QMatrix,
    a: &QActivations,
    i0: usize,
    j0: usize,
) -> [[f32; NR]; MR] {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let nb = w.blocks_per_row();
        let (wq, aq) = (w.quants.as_ptr(), a.quants.as_ptr());
        let zero = _mm512_setzero_si512();
        let ones = _mm512_set1_epi8(1);
        let bias = _mm512_set1_epi8(-128);
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut b = 0;
        while b < nb {
            let pair = b + 1 < nb;
            let bytes: u64 = if pair { !0 } else { 0xffff_ffff };
            // `dpbusd` takes its first factor unsigned: the activations go in
            // as `a + 128` (`a ^ 0x80`), and each lane starts from `-128` times
            // its four weights' sum, so the lane ends at `sum(a * w)` exactly
            // (no saturation). One correction per weight block, none per pair.
            let mut wv = [zero; NR];
            let mut corr = [zero; NR];
            let mut dw = [_mm512_setzero_ps(); NR];
            for r in 0..NR {
                let blk = (j0 + r) * nb + b;
                prefetch_ahead(wq.wrapping_add(blk * 32), w.scales.as_ptr().wrapping_add(blk));
                wv[r] = _mm512_maskz_loadu_epi8(bytes, wq.add(blk * 32).cast());
                let lane_sums = _mm512_dpbusd_epi32(zero, ones, wv[r]);
                corr[r] = _mm512_sub_epi32(zero, _mm512_slli_epi32::<7>(lane_sums));
                dw[r] = weight_scales(w.scales.as_ptr(), blk, pair);
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                let blk = (i0 + i) * nb + b;
                let av = _mm512_maskz_loadu_epi8(bytes, aq.add(blk * BLOCK));
                let au = _mm512_xor_si512(av, bias);
                let da = act_scales(a.scales.as_ptr(), blk, pair);
                for r in 0..NR {
                    let isum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr[r], au, wv[r]));
                    acc_row[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[r], da), isum, acc_row[r]);
                }
            }
            b += 2;
        }
        let mut out = [[0f32; NR]; MR];
        for (o, a_acc) in out.iter_mut().zip(&acc) {
            for r in 0..NR {
                o[r] = hsum512(a_acc[r]);
            }
        }
        out
    }
}

/// Q4 weights x Q8 activations for an `MR x NR` tile.
///
/// # Safety
/// As for [`q8_tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_tile<const MR: usize, const NR: usize>(
    w: &QMatrix,
    a: &QActivations,
    i0: usize,
    j0: usize,
) -> [[f32; NR]; MR] {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let nb = w.blocks_per_row();
        let (wq, aq) = (w.quants.as_ptr(), a.quants.as_ptr());
        let zero = _mm512_setzero_si512();
        let low4 = _mm256_set1_epi8(0x0f);
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut b = 0;
        while b < nb {
            let pair = b + 1 < nb;
            let bytes: u64 = if pair { !0 } else { 0xffff_ffff };
            let nibble_bytes: u32 = if pair { !0 } else { 0xffff };
            let mut wv = [zero; NR];
            let mut dw = [_mm512_setzero_ps(); NR];
            for r in 0..NR {
                let blk = (j0 + r) * nb + b;
                prefetch_ahead(wq.wrapping_add(blk * 16), w.scales.as_ptr().wrapping_add(blk));
                let nib = _mm256_maskz_loadu_epi8(nibble_bytes, wq.add(blk * 16).cast());
                let lo = _mm256_and_si256(nib, low4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(nib), low4);
                // [lo b, lo b+1, hi b, hi b+1] -> [lo b, hi b, lo b+1, hi b+1]
                let t = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                wv[r] = _mm512_shuffle_i64x2::<0b11_01_10_00>(t, t);
                dw[r] = weight_scales(w.scales.as_ptr(), blk, pair);
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                let blk = (i0 + i) * nb + b;
                let av = _mm512_maskz_loadu_epi8(bytes, aq.add(blk * BLOCK));
                let da = act_scales(a.scales.as_ptr(), blk, pair);
                for r in 0..NR {
                    let isum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wv[r], av));
                    acc_row[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[r], da), isum, acc_row[r]);
                }
            }
            b += 2;
        }
        let mut out = [[0f32; NR]; MR];
        for (i, (o, a_acc)) in out.iter_mut().zip(&acc).enumerate() {
            let sums = a.sums.as_ptr().add((i0 + i) * nb);
            for r in 0..NR {
                let mins = w.mins.as_ptr().add((j0 + r) * nb);
                o[r] = hsum512(a_acc[r]) + min_dot(mins, sums, nb);
            }
        }
        out
    }
}
