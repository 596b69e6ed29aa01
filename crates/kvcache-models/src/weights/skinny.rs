//! `y = x @ w^T` for a few rows of `x` (decode steps), streaming `w` from memory once.
//!
//! At decode sizes the product is bound by reading the weights (all of them, 540 MB
//! in f32, once per forward pass), so the kernel reads each weight row from memory
//! once for all rows of `x` and prefetches the weights well ahead: with 8 rows it
//! then costs about what 1 row does. Single-threaded: on a shared 2-core machine a
//! second thread that waits on a busy core costs more than it brings.

use candle_core::{DType, Tensor};

use crate::Result;

/// `x @ w^T` through [`matmul_nt`] when `x` has few rows (decode steps),
/// both are f32 on the CPU and `w` is contiguous; `None` otherwise.
///
/// candle's CPU matmul hands `x @ w^T` to `gemm`, which computes it transposed
/// (`w @ x^T`) and, `w` being row-major, repacks the whole weight matrix on every
/// call: at 8 rows that costs more than the multiply. A single-row `x` takes
/// `gemm`'s matrix-vector path instead, so batching 8 decode tokens cost over 2x
/// one. [`matmul_nt`] streams each weight row once for all rows of `x`.
pub(super) fn forward(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    use candle_core::Storage;
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if m == 0
        || m > MAX_ROWS
        || k != kw
        || !x.device().is_cpu()
        || x.dtype() != DType::F32
        || w.dtype() != DType::F32
        || !w.is_contiguous()
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (Storage::Cpu(xs), Storage::Cpu(ws)) = (&*xs, &*ws) else {
        return Ok(None);
    };
    let xv = &xs.as_slice::<f32>()?[xl.start_offset()..][..m * k];
    let wv = &ws.as_slice::<f32>()?[wl.start_offset()..][..n * k];
    let y = matmul_nt(xv, wv, m, n, k);
    Ok(Some(Tensor::from_vec(y, (m, n), x.device())?))
}

/// The most rows of `x` worth this path (beyond, `gemm`'s packing pays off).
const MAX_ROWS: usize = 16;

/// `y[i * n + j] = sum_q x[i * k + q] * w[j * k + q]`: `x` is `m x k`, `w` is
/// `n x k`, both row-major; returns `y`, `m x n` row-major.
fn matmul_nt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(x.len() == m * k && w.len() == n * k, "matmul_nt: bad lengths");
    let mut y = vec![0f32; m * n];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above), which is
        // all `avx2::matmul_nt` requires.
        unsafe { avx2::matmul_nt(x, w, m, n, k, &mut y) };
        return y;
    }
    for (j, wj) in w.chunks_exact(k).enumerate() {
        for (i, xi) in x.chunks_exact(k).enumerate() {
            y[i * n + j] = dot(xi, wj);
        }
    }
    y
}

/// A portable dot product with eight independent partial sums.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Rows of `x` per tile: 2 x `TILE` accumulators, `2 + TILE` loads per
    /// `2 * TILE` FMAs (AVX2 has 16 vector registers).
    const TILE: usize = 4;
    /// How far ahead of the current read weights are prefetched, in floats (8 KiB).
    const PREFETCH: usize = 2048;

    /// See [`super::matmul_nt`]: weight rows go two at a time (a last odd one
    /// pairs with itself), rows of `x` up to [`TILE`] at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA (`is_x86_feature_detected!`).
    /// Nothing else: every access goes through bounds-checked slices, so
    /// lengths that disagree with `m`, `n` and `k` panic.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn matmul_nt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, y: &mut [f32]) {
        let mut j = 0;
        while j < n {
            let pair = (n - j).min(2);
            let w0 = &w[j * k..(j + 1) * k];
            let w1 = &w[(j + pair - 1) * k..(j + pair) * k];
            let mut i = 0;
            while i < m {
                let t = (m - i).min(TILE);
                let xs = &x[i * k..(i + t) * k];
                // SAFETY: this function's contract: the CPU supports AVX2 and
                // FMA, which is all `tile` requires (it checks the lengths).
                let s = unsafe {
                    match t {
                        4 => tile::<4>(xs, w0, w1, k),
                        3 => tile::<3>(xs, w0, w1, k),
                        2 => tile::<2>(xs, w0, w1, k),
                        _ => tile::<1>(xs, w0, w1, k),
                    }
                };
                for r in 0..t {
                    y[(i + r) * n + j] = s[0][r];
                    if pair == 2 {
                        y[(i + r) * n + j + 1] = s[1][r];
                    }
                }
                i += t;
            }
            j += pair;
        }
    }

    /// `[c][r] = x_r . w_c` for the `T <= TILE` rows of `x` (`T x k`).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA. The lengths are checked (`T <=
    /// TILE`, `x` at least `T * k` floats, `w0` and `w1` at least `k`): a
    /// short slice panics before any load.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const T: usize>(x: &[f32], w0: &[f32], w1: &[f32], k: usize) -> [[f32; TILE]; 2] {
        assert!(T <= TILE && x.len() >= T * k && w0.len() >= k && w1.len() >= k);
        let k8 = k / 8 * 8;
        let mut s = [[0f32; TILE]; 2];
        // SAFETY: the CPU supports AVX2 and FMA (this function's contract), as
        // the intrinsics and `hsum` require. Every load reads 8 floats at
        // `q + 8 <= k8 <= k` of a row of `k` floats: row `r < T` of `x`
        // (`x.len() >= T * k`), or `w0`/`w1` (`len >= k`), all asserted above.
        // Prefetches never fault, and `wrapping_add` makes no in-bounds
        // promise, so running past the end is harmless.
        unsafe {
            let mut a0 = [_mm256_setzero_ps(); T];
            let mut a1 = [_mm256_setzero_ps(); T];
            let mut q = 0;
            while q < k8 {
                _mm_prefetch::<_MM_HINT_T0>(w0.as_ptr().wrapping_add(q + PREFETCH).cast());
                _mm_prefetch::<_MM_HINT_T0>(w1.as_ptr().wrapping_add(q + PREFETCH).cast());
                let b0 = _mm256_loadu_ps(w0.as_ptr().add(q));
                let b1 = _mm256_loadu_ps(w1.as_ptr().add(q));
                for r in 0..T {
                    let a = _mm256_loadu_ps(x.as_ptr().add(r * k + q));
                    a0[r] = _mm256_fmadd_ps(a, b0, a0[r]);
                    a1[r] = _mm256_fmadd_ps(a, b1, a1[r]);
                }
                q += 8;
            }
            for r in 0..T {
                s[0][r] = hsum(a0[r]);
                s[1][r] = hsum(a1[r]);
            }
        }
        for r in 0..T {
            for q in k8..k {
                s[0][r] += x[r * k + q] * w0[q];
                s[1][r] += x[r * k + q] * w1[q];
            }
        }
        s
    }

    /// Sum of the 8 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA (the features this function is
    /// compiled with; its intrinsics need only AVX).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        // These intrinsics need only AVX, which this function is compiled
        // with: calling them here is safe (Rust 1.86, below the MSRV).
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::matmul_nt;
    use crate::weights::SplitMix64;

    #[test]
    fn skinny_matmul_matches_a_plain_product() {
        let mut rng = SplitMix64(7);
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 5, 17),
            (3, 7, 33),
            (8, 64, 576),
            (9, 3, 40),
            (16, 31, 100),
            (5, 2, 8),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.next_sym()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.next_sym()).collect();
            let y = matmul_nt(&x, &w, m, n, k);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|q| f64::from(x[i * k + q]) * f64::from(w[j * k + q]))
                        .sum();
                    let got = f64::from(y[i * n + j]);
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "m {m} n {n} k {k} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
