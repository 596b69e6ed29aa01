//! AVX2 kernels: one 32-value block per 256-bit register.
//!
//! The integer block dot product is `maddubs` (unsigned x signed bytes into
//! pairs of i16) then `madd` by ones (into eight i32). `maddubs` wants one
//! unsigned operand: Q4 nibbles are unsigned already; for Q8 x Q8 the sign of
//! each weight is moved onto the activation (`|w| * sign(w) a`). The eight
//! partial sums are converted to f32 and accumulated per lane with
//! `fma(d_w * d_a, isum, acc)`; the lanes are summed once at the end in a
//! fixed order. The Q4 `m` term is an 8-lane f32 dot product over blocks.

use super::kernel::TileKernel;
use super::{Format, Isa, QActivations, QMatrix, BLOCK};
use std::arch::x86_64::*;

/// AVX2 tiles of the product of `w` and `a`; exists only where AVX2 runs.
pub(crate) struct Avx2Tiles<'a> {
    w: &'a QMatrix,
    a: &'a QActivations,
}

impl<'a> Avx2Tiles<'a> {
    /// Kernel for `a @ w^T` (inner dimensions already checked), or `None` if
    /// this CPU lacks AVX2, FMA or F16C.
    pub(crate) fn new(w: &'a QMatrix, a: &'a QActivations) -> Option<Self> {
        Isa::Avx2.is_available().then_some(Avx2Tiles { w, a })
    }
}

impl TileKernel for Avx2Tiles<'_> {
    fn tile<const MR: usize, const NR: usize>(&self, i0: usize, j0: usize) -> [[f32; NR]; MR] {
        assert!(
            i0 + MR <= self.a.rows() && j0 + NR <= self.w.rows(),
            "tile out of bounds"
        );
        // SAFETY: `new` checked AVX2/FMA/F16C; the tile lies inside both
        // operands (asserted above) and their inner dimensions agree.
        unsafe {
            match self.w.format {
                Format::Q8 => q8_tile::<MR, NR>(self.w, self.a, i0, j0),
                Format::Q4 => q4_tile::<MR, NR>(self.w, self.a, i0, j0),
            }
        }
    }
}

/// Prefetches the weights [`PREFETCH_BYTES`] past `quants` (and the scales
/// as far past `scales`, in blocks) into the caches. Weight rows are short
/// (SmolLM2's 576 values: 288 bytes in Q4) and read a few at a time, too
/// short a stream for the hardware prefetcher: without this, decode waited
/// on loads (perf: the first use of each nibble load held half the kernel's
/// samples). A prefetch never faults and changes no result.
#[inline]
pub(crate) fn prefetch_ahead(quants: *const u8, scales: *const u16) {
    // SAFETY: `_mm_prefetch` is a hint: it never faults, whatever the address
    // (`wrapping_add` makes no in-bounds claim either), and needs only SSE.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(quants.wrapping_add(PREFETCH_BYTES).cast());
        _mm_prefetch::<_MM_HINT_T0>(scales.wrapping_add(PREFETCH_BYTES / 16).cast());
    }
}

/// How far ahead of its reads a kernel prefetches weights (4 KiB: a few
/// tiles of rows ahead, measured on E9's decode).
pub(crate) const PREFETCH_BYTES: usize = 4096;

/// f16 bits to f32 with F16C.
///
/// # Safety
/// Needs F16C.
#[inline]
#[target_feature(enable = "f16c")]
pub(crate) unsafe fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Sum of the eight lanes, always in the same order.
///
/// # Safety
/// Needs AVX.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    _mm_cvtss_f32(s1)
}

/// The Q4 `m` term `sum_b m_w[b] * s_a[b]` over `nb` blocks: eight lanes of
/// fma, then the lane sum, then the remaining blocks one by one.
///
/// # Safety
/// Needs AVX2, FMA, F16C; `mins` and `sums` must hold `nb` values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn min_dot(mins: *const u16, sums: *const f32, nb: usize) -> f32 {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let mut b = 0;
        while b + 8 <= nb {
            let m = _mm256_cvtph_ps(_mm_loadu_si128(mins.add(b).cast()));
            acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums.add(b)), acc);
            b += 8;
        }
        let mut total = hsum256(acc);
        while b < nb {
            total += f16_to_f32(*mins.add(b)) * *sums.add(b);
            b += 1;
        }
        total
    }
}

/// Q8 weights x Q8 activations for an `MR x NR` tile.
///
/// # Safety
/// Needs AVX2, FMA, F16C; rows `i0..i0+MR` of `a` and `j0..j0+NR` of `w` must
/// exist, and `a.cols() == w.cols()`.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let (wq, ws) = (w.quants.as_ptr(), w.scales.as_ptr());
        let (aq, as_) = (a.quants.as_ptr(), a.scales.as_ptr());
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); NR]; MR];
        for b in 0..nb {
            let mut wv = [_mm256_setzero_si256(); NR];
            let mut wabs = [_mm256_setzero_si256(); NR];
            let mut dw = [0f32; NR];
            for r in 0..NR {
                let blk = (j0 + r) * nb + b;
                prefetch_ahead(wq.wrapping_add(blk * 32), ws.wrapping_add(blk));
                wv[r] = _mm256_loadu_si256(wq.add(blk * 32).cast());
                wabs[r] = _mm256_sign_epi8(wv[r], wv[r]);
                dw[r] = f16_to_f32(*ws.add(blk));
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                let blk = (i0 + i) * nb + b;
                let av = _mm256_loadu_si256(aq.add(blk * BLOCK).cast());
                let da = *as_.add(blk);
                for r in 0..NR {
                    let prod = _mm256_maddubs_epi16(wabs[r], _mm256_sign_epi8(av, wv[r]));
                    let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
                    acc_row[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[r] * da), isum, acc_row[r]);
                }
            }
        }
        let mut out = [[0f32; NR]; MR];
        for (o, a) in out.iter_mut().zip(&acc) {
            for r in 0..NR {
                o[r] = hsum256(a[r]);
            }
        }
        out
    }
}

/// Q4 weights x Q8 activations for an `MR x NR` tile.
///
/// # Safety
/// As for [`q8_tile`].
#[target_feature(enable = "avx2,fma,f16c")]
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
        let (wq, ws) = (w.quants.as_ptr(), w.scales.as_ptr());
        let (aq, as_) = (a.quants.as_ptr(), a.scales.as_ptr());
        let ones = _mm256_set1_epi16(1);
        let low4 = _mm_set1_epi8(0x0f);
        let mut acc = [[_mm256_setzero_ps(); NR]; MR];
        for b in 0..nb {
            let mut wv = [_mm256_setzero_si256(); NR];
            let mut dw = [0f32; NR];
            for r in 0..NR {
                let blk = (j0 + r) * nb + b;
                prefetch_ahead(wq.wrapping_add(blk * 16), ws.wrapping_add(blk));
                let nib = _mm_loadu_si128(wq.add(blk * 16).cast());
                let lo = _mm_and_si128(nib, low4);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(nib), low4);
                wv[r] = _mm256_set_m128i(hi, lo);
                dw[r] = f16_to_f32(*ws.add(blk));
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                let blk = (i0 + i) * nb + b;
                let av = _mm256_loadu_si256(aq.add(blk * BLOCK).cast());
                let da = *as_.add(blk);
                for r in 0..NR {
                    let prod = _mm256_maddubs_epi16(wv[r], av);
                    let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
                    acc_row[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[r] * da), isum, acc_row[r]);
                }
            }
        }
        let mut out = [[0f32; NR]; MR];
        for (i, (o, a_acc)) in out.iter_mut().zip(&acc).enumerate() {
            let sums = a.sums.as_ptr().add((i0 + i) * nb);
            for r in 0..NR {
                let mins = w.mins.as_ptr().add((j0 + r) * nb);
                o[r] = hsum256(a_acc[r]) + min_dot(mins, sums, nb);
            }
        }
        out
    }
}
