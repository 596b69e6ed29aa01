//! AVX-512 VNNI kernels: sixteen interleaved weight rows per 512-bit register.
//!
//! A 64-byte segment of a group holds four quants of each of its sixteen
//! rows, one row per 32-bit lane. `vpdpbusd` multiplies them (unsigned) by
//! four activation quants broadcast to every lane (signed) and adds the four
//! products to each lane: eight segments (Q8) or four segments of two nibbles
//! (Q4) make the block's exact integer sums of all sixteen rows. Q8 weights
//! are stored offset by 128, so each row's sum starts from the activation
//! block's `-128 * sum(q)`; Q4 nibbles are unsigned already. Then one
//! convert and one `fma(d_w * d_a, isum, acc)` per block serve sixteen
//! outputs (and for Q4 one `fma(m_w, s_a, acc)`).

use super::kernel::GroupKernel;
use super::x86_avx2::prefetch_ahead;
use super::{Format, Isa, QActivations, QMatrix, BLOCK, GROUP};
use std::arch::x86_64::*;

/// AVX-512 tiles of the product of `w` and `a`; exists only where they run.
pub(crate) struct Avx512Groups<'a> {
    w: &'a QMatrix,
    a: &'a QActivations,
}

impl<'a> Avx512Groups<'a> {
    /// Kernel for `a @ w^T` (inner dimensions already checked), or `None` if
    /// this CPU lacks any of the needed extensions.
    pub(crate) fn new(w: &'a QMatrix, a: &'a QActivations) -> Option<Self> {
        Isa::Avx512.is_available().then_some(Avx512Groups { w, a })
    }
}

impl GroupKernel for Avx512Groups<'_> {
    fn group<const MR: usize>(&self, i0: usize, g: usize) -> [[f32; GROUP]; MR] {
        assert!(
            i0 + MR <= self.a.rows() && g < self.w.groups(),
            "tile out of bounds"
        );
        // SAFETY: `new` checked every extension the kernels enable; the tile
        // lies inside both operands (asserted above), inner dimensions agree.
        unsafe {
            match self.w.format {
                Format::Q8 => q8_group::<MR>(self.w, self.a, i0, g),
                Format::Q4 => q4_group::<MR>(self.w, self.a, i0, g),
            }
        }
    }
}

/// Four activation quants (bytes `at..at + 4`) broadcast to every lane.
///
/// # Safety
/// Needs AVX-512F; `at + 4` bytes must be readable.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn broadcast4(q: *const i8, at: usize) -> __m512i {
    // SAFETY: the caller guarantees the four bytes are readable.
    unsafe { _mm512_set1_epi32(q.add(at).cast::<i32>().read_unaligned()) }
}

/// The lanes of each accumulator as arrays.
///
/// # Safety
/// Needs AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn lanes<const MR: usize>(acc: &[__m512; MR]) -> [[f32; GROUP]; MR] {
    let mut out = [[0f32; GROUP]; MR];
    for (o, v) in out.iter_mut().zip(acc) {
        // SAFETY: `o` holds sixteen f32, what one unaligned store writes.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *v) };
    }
    out
}

/// Q8 weights x Q8 activations: activation rows `i0..i0 + MR`, group `g`.
///
/// # Safety
/// Needs AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C; rows `i0..i0+MR` of `a` and
/// group `g` of `w` must exist, and `a.cols() == w.cols()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_group<const MR: usize>(
    w: &QMatrix,
    a: &QActivations,
    i0: usize,
    g: usize,
) -> [[f32; GROUP]; MR] {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let nb = w.blocks_per_row();
        let (aq, ascale, aoff) = (a.quants.as_ptr(), a.scales.as_ptr(), a.offsets.as_ptr());
        let mut acc = [_mm512_setzero_ps(); MR];
        for b in 0..nb {
            let at = w.group_block(g, b);
            let wq = w.quants.as_ptr().add(at * GROUP * 32);
            let ws = w.scales.as_ptr().add(at * GROUP);
            prefetch_ahead(wq, ws);
            let mut isum = [_mm512_setzero_si512(); MR];
            for (i, s) in isum.iter_mut().enumerate() {
                *s = _mm512_set1_epi32(*aoff.add((i0 + i) * nb + b));
            }
            for seg in 0..8 {
                let wv = _mm512_loadu_si512(wq.add(seg * 64).cast());
                for (i, s) in isum.iter_mut().enumerate() {
                    let av = broadcast4(aq, ((i0 + i) * nb + b) * BLOCK + 4 * seg);
                    *s = _mm512_dpbusd_epi32(*s, wv, av);
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ws.cast()));
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let da = _mm512_set1_ps(*ascale.add((i0 + i) * nb + b));
                *acc_i = _mm512_fmadd_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(isum[i]), *acc_i);
            }
        }
        lanes(&acc)
    }
}

/// Q4 weights x Q8 activations: activation rows `i0..i0 + MR`, group `g`.
///
/// # Safety
/// As for [`q8_group`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_group<const MR: usize>(
    w: &QMatrix,
    a: &QActivations,
    i0: usize,
    g: usize,
) -> [[f32; GROUP]; MR] {
    // SAFETY: the caller upholds this function's contract (its `# Safety`
    // section), which is what the intrinsics and pointer reads below need.
    unsafe {
        let nb = w.blocks_per_row();
        let (aq, ascale, asum) = (a.quants.as_ptr(), a.scales.as_ptr(), a.sums.as_ptr());
        let low4 = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); MR];
        for b in 0..nb {
            let at = w.group_block(g, b);
            let wq = w.quants.as_ptr().add(at * GROUP * 16);
            let ws = w.scales.as_ptr().add(at * GROUP);
            prefetch_ahead(wq, ws);
            let mut isum = [_mm512_setzero_si512(); MR];
            for seg in 0..4 {
                let nib = _mm512_loadu_si512(wq.add(seg * 64).cast());
                let lo = _mm512_and_si512(nib, low4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(nib), low4);
                for (i, s) in isum.iter_mut().enumerate() {
                    let blk = ((i0 + i) * nb + b) * BLOCK;
                    *s = _mm512_dpbusd_epi32(*s, lo, broadcast4(aq, blk + 4 * seg));
                    *s = _mm512_dpbusd_epi32(*s, hi, broadcast4(aq, blk + 16 + 4 * seg));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ws.cast()));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(w.mins.as_ptr().add(at * GROUP).cast()));
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let blk = (i0 + i) * nb + b;
                let da = _mm512_set1_ps(*ascale.add(blk));
                let t = _mm512_fmadd_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(isum[i]), *acc_i);
                *acc_i = _mm512_fmadd_ps(mw, _mm512_set1_ps(*asum.add(blk)), t);
            }
        }
        lanes(&acc)
    }
}
