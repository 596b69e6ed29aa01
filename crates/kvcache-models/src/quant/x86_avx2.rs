//! AVX2 kernels: a group's sixteen interleaved weight rows as two halves of
//! eight, one row per 32-bit lane of a 256-bit register.
//!
//! The integer sums are `maddubs` (unsigned x signed bytes into pairs of i16)
//! then `madd` by ones (into i32), against four activation quants broadcast
//! to every lane. `maddubs` wants one unsigned operand: Q4 nibbles are
//! unsigned already (and their pairs small enough to add up all four
//! segments in i16 before one `madd`); for Q8 the stored offset is taken
//! off and the sign of each weight moved onto the activation
//! (`|w| * sign(w) a`). The float steps are the AVX-512 kernels' own, so the
//! two give the same bits.

use super::kernel::GroupKernel;
use super::{Format, Isa, QActivations, QMatrix, BLOCK, GROUP};
use std::arch::x86_64::*;

/// AVX2 tiles of the product of `w` and `a`; exists only where AVX2 runs.
pub(crate) struct Avx2Groups<'a> {
    w: &'a QMatrix,
    a: &'a QActivations,
}

impl<'a> Avx2Groups<'a> {
    /// Kernel for `a @ w^T` (inner dimensions already checked), or `None` if
    /// this CPU lacks AVX2, FMA or F16C.
    pub(crate) fn new(w: &'a QMatrix, a: &'a QActivations) -> Option<Self> {
        Isa::Avx2.is_available().then_some(Avx2Groups { w, a })
    }
}

impl GroupKernel for Avx2Groups<'_> {
    fn group<const MR: usize>(&self, i0: usize, g: usize) -> [[f32; GROUP]; MR] {
        assert!(
            i0 + MR <= self.a.rows() && g < self.w.groups(),
            "tile out of bounds"
        );
        let mut out = [[0f32; GROUP]; MR];
        for half in 0..2 {
            // SAFETY: `new` checked AVX2/FMA/F16C; the tile lies inside both
            // operands (asserted above) and their inner dimensions agree.
            let lanes = unsafe {
                match self.w.format {
                    Format::Q8 => q8_half::<MR>(self.w, self.a, i0, g, half),
                    Format::Q4 => q4_half::<MR>(self.w, self.a, i0, g, half),
                }
            };
            for (o, l) in out.iter_mut().zip(&lanes) {
                o[8 * half..8 * half + 8].copy_from_slice(l);
            }
        }
        out
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

/// Four activation quants (bytes `at..at + 4`) broadcast to every lane.
///
/// # Safety
/// Needs AVX; `at + 4` bytes must be readable.
#[inline]
#[target_feature(enable = "avx")]
unsafe fn broadcast4(q: *const i8, at: usize) -> __m256i {
    // SAFETY: the caller guarantees the four bytes are readable.
    unsafe { _mm256_set1_epi32(q.add(at).cast::<i32>().read_unaligned()) }
}

/// The lanes of each accumulator as arrays.
///
/// # Safety
/// Needs AVX.
#[inline]
#[target_feature(enable = "avx")]
unsafe fn lanes<const MR: usize>(acc: &[__m256; MR]) -> [[f32; 8]; MR] {
    let mut out = [[0f32; 8]; MR];
    for (o, v) in out.iter_mut().zip(acc) {
        // SAFETY: `o` holds eight f32, what one unaligned store writes.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *v) };
    }
    out
}

/// Q8 weights x Q8 activations: activation rows `i0..i0 + MR` against rows
/// `8 * half..8 * half + 8` of group `g`.
///
/// # Safety
/// Needs AVX2, FMA, F16C; rows `i0..i0+MR` of `a` and group `g` of `w` must
/// exist, `half < 2`, and `a.cols() == w.cols()`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_half<const MR: usize>(
    w: &QMatrix,
    a: &QActivations,
    i0: usize,
    g: usize,
    half: usize,
) -> [[f32; 8]; MR] {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let nb = w.blocks_per_row();
        let (aq, ascale) = (a.quants.as_ptr(), a.scales.as_ptr());
        let ones = _mm256_set1_epi16(1);
        let offset = _mm256_set1_epi8(-128);
        let mut acc = [_mm256_setzero_ps(); MR];
        for b in 0..nb {
            let at = w.group_block(g, b);
            let wq = w.quants.as_ptr().add(at * GROUP * 32 + 32 * half);
            let ws = w.scales.as_ptr().add(at * GROUP + 8 * half);
            prefetch_ahead(wq, ws);
            let mut isum = [_mm256_setzero_si256(); MR];
            for seg in 0..8 {
                let wv = _mm256_xor_si256(_mm256_loadu_si256(wq.add(seg * 64).cast()), offset);
                let wabs = _mm256_sign_epi8(wv, wv);
                for (i, s) in isum.iter_mut().enumerate() {
                    let av = broadcast4(aq, ((i0 + i) * nb + b) * BLOCK + 4 * seg);
                    let pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(av, wv));
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(pairs, ones));
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.cast()));
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let da = _mm256_set1_ps(*ascale.add((i0 + i) * nb + b));
                *acc_i = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(isum[i]), *acc_i);
            }
        }
        lanes(&acc)
    }
}

/// Q4 weights x Q8 activations: as [`q8_half`].
///
/// # Safety
/// As for [`q8_half`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_half<const MR: usize>(
    w: &QMatrix,
    a: &QActivations,
    i0: usize,
    g: usize,
    half: usize,
) -> [[f32; 8]; MR] {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let nb = w.blocks_per_row();
        let (aq, ascale, asum) = (a.quants.as_ptr(), a.scales.as_ptr(), a.sums.as_ptr());
        let ones = _mm256_set1_epi16(1);
        let low4 = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); MR];
        for b in 0..nb {
            let at = w.group_block(g, b);
            let wq = w.quants.as_ptr().add(at * GROUP * 16 + 32 * half);
            let ws = w.scales.as_ptr().add(at * GROUP + 8 * half);
            prefetch_ahead(wq, ws);
            // Pairs of nibble x activation products, at most 2 * 15 * 127
            // each: all four segments add up in i16 (30,480 < 32,767).
            let mut pairs = [_mm256_setzero_si256(); MR];
            for seg in 0..4 {
                let nib = _mm256_loadu_si256(wq.add(seg * 64).cast());
                let lo = _mm256_and_si256(nib, low4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(nib), low4);
                for (i, p) in pairs.iter_mut().enumerate() {
                    let blk = ((i0 + i) * nb + b) * BLOCK;
                    let plo = _mm256_maddubs_epi16(lo, broadcast4(aq, blk + 4 * seg));
                    let phi = _mm256_maddubs_epi16(hi, broadcast4(aq, blk + 16 + 4 * seg));
                    *p = _mm256_add_epi16(*p, _mm256_add_epi16(plo, phi));
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.cast()));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(w.mins.as_ptr().add(at * GROUP + 8 * half).cast()));
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let blk = (i0 + i) * nb + b;
                let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[i], ones));
                let da = _mm256_set1_ps(*ascale.add(blk));
                let t = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), isum, *acc_i);
                *acc_i = _mm256_fmadd_ps(mw, _mm256_set1_ps(*asum.add(blk)), t);
            }
        }
        lanes(&acc)
    }
}
