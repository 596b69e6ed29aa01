//! Shared helpers for the integration tests: a small deterministic RNG,
//! random raw ggml tensors, and an f64 reference of the quantized product.
#![allow(dead_code)]

use half::{bf16, f16};
use kvcache_models::quant::{Format, GgmlType, QActivations, QMatrix};

/// xorshift64* generator; deterministic per seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn byte(&mut self) -> u8 {
        (self.next_u64() >> 56) as u8
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    /// Roughly normal (sum of uniforms), scaled.
    pub fn normal(&mut self, scale: f32) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform(-1.0, 1.0)).sum();
        s * scale * 0.87
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal(scale)).collect()
    }
    /// f16 bits of a value of magnitude in [lo, hi), random sign if `signed`.
    pub fn f16_scale(&mut self, lo: f32, hi: f32, signed: bool) -> [u8; 2] {
        let mut v = self.uniform(lo, hi);
        if signed && self.byte() & 1 == 1 {
            v = -v;
        }
        f16::from_f32(v).to_le_bytes()
    }
}

/// Random raw bytes of a `[rows, cols]` tensor of type `ty` with valid scales.
pub fn random_ggml(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n_blocks = rows * cols / ty.block_values();
    let mut out = Vec::with_capacity(n_blocks * ty.block_bytes());
    for _ in 0..n_blocks {
        let mut b: Vec<u8> = (0..ty.block_bytes()).map(|_| rng.byte()).collect();
        match ty {
            GgmlType::F32 => b.copy_from_slice(&rng.normal(1.0).to_le_bytes()),
            GgmlType::F16 => b.copy_from_slice(&f16::from_f32(rng.normal(1.0)).to_le_bytes()),
            GgmlType::BF16 => b.copy_from_slice(&bf16::from_f32(rng.normal(1.0)).to_le_bytes()),
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
                b[..2].copy_from_slice(&rng.f16_scale(1e-3, 0.1, true))
            }
            GgmlType::Q4_1 => {
                b[..2].copy_from_slice(&rng.f16_scale(1e-3, 0.1, false));
                b[2..4].copy_from_slice(&rng.f16_scale(1e-3, 1.0, true));
            }
            GgmlType::Q4_K => {
                b[..2].copy_from_slice(&rng.f16_scale(1e-3, 0.05, false));
                b[2..4].copy_from_slice(&rng.f16_scale(1e-3, 0.05, false));
            }
            GgmlType::Q6_K => b[208..210].copy_from_slice(&rng.f16_scale(1e-4, 0.01, false)),
        }
        out.extend_from_slice(&b);
    }
    out
}

/// Per-block (d, m, quants as i32) of a matrix, read back through its ggml bytes.
pub fn weight_blocks(w: &QMatrix) -> Vec<(f64, f64, Vec<i32>)> {
    let (_, bytes) = w.to_ggml_bytes();
    let bb = w.format().block_bytes();
    bytes
        .chunks_exact(bb)
        .map(|b| {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f64();
            match w.format() {
                Format::Q8 => (d, 0.0, b[2..34].iter().map(|&q| q as i8 as i32).collect()),
                Format::Q4 => {
                    let m = f16::from_le_bytes([b[2], b[3]]).to_f64();
                    let q = &b[4..20];
                    let mut v: Vec<i32> = q.iter().map(|&x| (x & 15) as i32).collect();
                    v.extend(q.iter().map(|&x| (x >> 4) as i32));
                    (d, m, v)
                }
            }
        })
        .collect()
}

/// f64 reference of the quantized product, and the sum of |terms| per output
/// (the scale of the f32 rounding error).
pub fn reference_product(w: &QMatrix, a: &QActivations) -> (Vec<f64>, Vec<f64>) {
    let blocks = weight_blocks(w);
    let nb = w.blocks_per_row();
    let (m, rows) = (a.rows(), w.rows());
    let mut y = vec![0f64; m * rows];
    let mut mag = vec![0f64; m * rows];
    for i in 0..m {
        for j in 0..rows {
            for b in 0..nb {
                let (dw, mw, qw) = &blocks[j * nb + b];
                let qa = a.block_quants(i, b);
                let isum: i64 = qw.iter().zip(qa).map(|(&x, &y)| x as i64 * y as i64).sum();
                let iabs: i64 = qw
                    .iter()
                    .zip(qa)
                    .map(|(&x, &y)| (x as i64 * y as i64).abs())
                    .sum();
                let scale = dw * a.scale(i, b) as f64;
                let t2 = mw * a.block_sum(i, b) as f64;
                y[i * rows + j] += scale * isum as f64 + t2;
                // Partial sums never exceed the sum without cancellation.
                mag[i * rows + j] += scale.abs() * iabs as f64 + t2.abs();
            }
        }
    }
    (y, mag)
}

/// Random weights of `format` and shape, quantized from normal values.
pub fn random_weights(rng: &mut Rng, format: Format, rows: usize, cols: usize) -> QMatrix {
    QMatrix::quantize(format, rows, cols, &rng.vec(rows * cols, 0.05)).unwrap()
}
