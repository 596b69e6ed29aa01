//! Micro-benchmark of the quantized products against an f32 baseline.
//!
//! `cargo xtask bench -p kvcache-models --bench quant [-- quick]` prints, per matrix, batch
//! size `m` and thread count, the best time of a few runs and the effective
//! weight bandwidth (weight bytes / time). `quick` skips the big heads.

use kvcache_models::quant::{Format, Isa, QActivations, QMatrix};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Straightforward f32 `x @ W^T`: four accumulators of eight lanes per dot
/// product, weight rows split over the pool.
mod baseline {
    use super::*;

    pub fn matmul(w: &[f32], rows: usize, k: usize, x: &[f32], m: usize, out: &mut [f32]) {
        let mut y_t = vec![0f32; rows * m]; // transposed: chunks of weight rows are contiguous
        y_t.par_chunks_mut(64 * m).enumerate().for_each(|(c, yc)| {
            for (jj, yrow) in yc.chunks_mut(m).enumerate() {
                let j = c * 64 + jj;
                let wrow = &w[j * k..(j + 1) * k];
                for (i, y) in yrow.iter_mut().enumerate() {
                    *y = dot(wrow, &x[i * k..(i + 1) * k]);
                }
            }
        });
        for j in 0..rows {
            for i in 0..m {
                out[i * rows + j] = y_t[j * m + i];
            }
        }
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.is_available() && a.len().is_multiple_of(32) {
            // SAFETY: AVX2 and FMA checked above; lengths are equal multiples of 32.
            return unsafe { dot_avx2(a, b) };
        }
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// # Safety
    /// Needs AVX2 and FMA; `a.len() == b.len()`, a multiple of 32.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); 4];
        for k in (0..a.len()).step_by(32) {
            for (u, acc_u) in acc.iter_mut().enumerate() {
                let (wa, wb) = (&a[k + 8 * u..k + 8 * u + 8], &b[k + 8 * u..k + 8 * u + 8]);
                // SAFETY: AVX is this function's contract; each load reads the
                // 8 floats of a bounds-checked slice.
                let (va, vb) = unsafe { (_mm256_loadu_ps(wa.as_ptr()), _mm256_loadu_ps(wb.as_ptr())) };
                *acc_u = _mm256_fmadd_ps(va, vb, *acc_u);
            }
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        // SAFETY: stores 8 floats into an array of 8.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
        lanes.iter().sum()
    }
}

/// Best time of `f` over runs lasting about `budget` (at least 2, at most 20).
fn time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f(); // warm-up
    let (mut best, start, mut runs) = (Duration::MAX, Instant::now(), 0);
    while runs < 2 || (start.elapsed() < budget && runs < 20) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        runs += 1;
    }
    best
}

struct Rng(u64);
impl Rng {
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let mut shapes = vec![
        ("smol attn 576x576", 576, 576),
        ("smol kv 192x576", 192, 576),
        ("smol up 1536x576", 1536, 576),
        ("smol down 576x1536", 576, 1536),
    ];
    if !quick {
        shapes.push(("smol head 49152x576", 49152, 576));
        shapes.push(("gemma head 262144x640", 262144, 640));
    }
    let pools: Vec<_> = [1, 2]
        .iter()
        .map(|&t| (t, rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()))
        .collect();
    let isas = Isa::available();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    println!(
        "{:<22} {:>4} {:>2} {:<12} {:>9} {:>7}",
        "matrix", "m", "t", "kernel", "ms", "GB/s"
    );
    for (name, rows, k) in shapes {
        let w = rng.vec(rows * k, 0.1);
        let q8 = QMatrix::quantize(Format::Q8, rows, k, &w).unwrap();
        let q4 = QMatrix::quantize(Format::Q4, rows, k, &w).unwrap();
        let head = rows > 10_000;
        for m in [1usize, 4, 10, 512] {
            if rows >= 200_000 && m == 512 {
                continue; // minutes per configuration on this machine
            }
            let x = rng.vec(m * k, 1.0);
            let acts = QActivations::quantize(m, k, &x).unwrap();
            let mut out = vec![0f32; m * rows];
            let budget = Duration::from_millis(if head { 300 } else { 150 });
            for (threads, pool) in &pools {
                let report = |label: &str, bytes: usize, t: Duration| {
                    let s = t.as_secs_f64();
                    let gbs = bytes as f64 / s / 1e9;
                    println!(
                        "{name:<22} {m:>4} {threads:>2} {label:<12} {:>9.3} {gbs:>7.1}",
                        s * 1e3
                    );
                };
                let t = pool.install(|| time(budget, || baseline::matmul(&w, rows, k, &x, m, &mut out)));
                report("f32", rows * k * 4, t);
                for &isa in &isas {
                    if isa == Isa::Scalar && (m > 10 || (head && m > 1)) {
                        continue; // the reference path is far too slow there
                    }
                    for (label, q) in [("q8", &q8), ("q4", &q4)] {
                        let run = || q.matmul_into_isa(&acts, isa, &mut out).unwrap();
                        let t = pool.install(|| time(budget, run));
                        report(&format!("{label} {isa:?}"), q.weight_bytes(), t);
                    }
                }
            }
        }
    }
}
