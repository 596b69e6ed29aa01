//! A weight matrix kept as GGUF's Q8_0 blocks (32 int8 values and one scale
//! each) and multiplied exactly: each weight is expanded to the f32 it stands
//! for (`scale * q`, exact in f32) just before use, so `x @ W^T` equals the
//! product with the dequantized f32 matrix up to summation order, while
//! reading about a quarter of its bytes.
//!
//! It exists for few-row products bound by reading the weights: Gemma's tied
//! 262,144 x 640 output head streams 671 MB in f32 for every token it
//! scores, 178 MB here.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};

use crate::kernels::{for_columns, Columns};
use crate::{EngineError, Result};

/// Values per Q8_0 block.
const BLOCK: usize = 32;

/// A `rows x cols` matrix in Q8_0, scales widened to f32.
#[derive(Debug, Clone)]
pub(crate) struct Q8Matrix {
    rows: usize,
    cols: usize,
    /// `rows * cols / 32` block scales, row by row.
    scales: Vec<f32>,
    /// `rows * cols` quantized values, row-major.
    quants: Vec<i8>,
}

impl Q8Matrix {
    /// The most rows of `x` for which [`matmul_t`](Self::matmul_t) beats
    /// candle's dense product (beyond, the product is compute-bound and
    /// `gemm`'s blocking wins).
    pub(crate) const MAX_ROWS: usize = 16;

    /// The matrix of a 2-D Q8_0 tensor whose rows are whole blocks; `None`
    /// for any other tensor.
    pub(crate) fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        let &[rows, cols] = q.shape().dims() else {
            return Ok(None);
        };
        if q.dtype() != GgmlDType::Q8_0 || cols % BLOCK != 0 {
            return Ok(None);
        }
        let data = q.data()?;
        let block_bytes = 2 + BLOCK;
        if data.len() != rows * cols / BLOCK * block_bytes {
            return Err(EngineError::Format(format!(
                "Q8_0 tensor {rows}x{cols} holds {} bytes",
                data.len()
            )));
        }
        let mut scales = Vec::with_capacity(rows * cols / BLOCK);
        let mut quants = Vec::with_capacity(rows * cols);
        for block in data.chunks_exact(block_bytes) {
            scales.push(half::f16::from_le_bytes([block[0], block[1]]).to_f32());
            quants.extend(block[2..].iter().map(|&b| b as i8));
        }
        Ok(Some(Q8Matrix {
            rows,
            cols,
            scales,
            quants,
        }))
    }

    /// `x @ self^T`: `x: [m, cols]` (f32, CPU) to `[m, rows]`; `None` for a
    /// tensor on another device or of another dtype.
    pub(crate) fn matmul_t(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let (m, cols) = x.dims2()?;
        if cols != self.cols {
            return Err(EngineError::InvalidArgument(format!(
                "x has {cols} columns, the matrix {}",
                self.cols
            )));
        }
        if !x.device().is_cpu() || x.dtype() != DType::F32 {
            return Ok(None);
        }
        let x = x.flatten_all()?.to_vec1::<f32>()?;
        let mut y = vec![0f32; m * self.rows];
        // Weight rows in chunks, each thread writing only its columns of `y`.
        for_columns(&mut y, self.rows, |range, y| self.rows_into(range, &x, m, y));
        Ok(Some(Tensor::from_vec(
            y,
            (m, self.rows),
            &candle_core::Device::Cpu,
        )?))
    }

    /// `y[r, j] = x_r . w_j` for the weight rows `j` in `range`.
    fn rows_into(&self, range: std::ops::Range<usize>, x: &[f32], m: usize, y: &mut Columns<'_>) {
        let mut w = vec![0f32; self.cols];
        for j in range {
            self.expand_row(j, &mut w);
            for r in 0..m {
                y.set(r, j, dot(&w, &x[r * self.cols..][..self.cols]));
            }
        }
    }

    /// Row `j` as the f32 values it stands for.
    fn expand_row(&self, j: usize, w: &mut [f32]) {
        let quants = &self.quants[j * self.cols..][..self.cols];
        let scales = &self.scales[j * self.cols / BLOCK..][..self.cols / BLOCK];
        expand(w, quants, scales);
    }
}

/// `w[i] = q[i] * scale of i's block`, through the widest instructions the CPU has.
fn expand(w: &mut [f32], q: &[i8], scales: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA, all that `expand_avx2` needs.
        unsafe { expand_avx2(w, q, scales) };
        return;
    }
    expand_generic(w, q, scales);
}

/// The dot product of two rows of one length, through the widest instructions the CPU has.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA, all that `dot_avx2` needs.
        return unsafe { dot_avx2(a, b) };
    }
    dot_generic(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn expand_avx2(w: &mut [f32], q: &[i8], scales: &[f32]) {
    expand_generic(w, q, scales);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

#[inline(always)]
fn expand_generic(w: &mut [f32], q: &[i8], scales: &[f32]) {
    for ((wb, qb), &d) in w.chunks_exact_mut(BLOCK).zip(q.chunks_exact(BLOCK)).zip(scales) {
        for i in 0..BLOCK {
            wb[i] = f32::from(qb[i]) * d;
        }
    }
}

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    let (a8, b8) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn the_product_equals_the_dequantized_matrixs() {
        let mut rng = crate::model::SplitMix64(11);
        let (rows, cols) = (1000, 96);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.next_sym()).collect();
        let w = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let dense = q.dequantize(&Device::Cpu).unwrap();
        let q8 = Q8Matrix::from_qtensor(&q).unwrap().unwrap();
        for m in [1, 3, Q8Matrix::MAX_ROWS] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.next_sym()).collect();
            let x = Tensor::from_vec(x, (m, cols), &Device::Cpu).unwrap();
            let got = q8.matmul_t(&x).unwrap().unwrap();
            let want = x.matmul(&dense.t().unwrap()).unwrap();
            assert_eq!(got.dims(), &[m, rows]);
            let diff: f32 = (got - want)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar()
                .unwrap();
            // Summation order only: the weights are the same f32 values.
            assert!(diff < 1e-5, "m = {m}: {diff}");
        }
    }

    #[test]
    fn only_q8_0_matrices_of_whole_blocks_qualify() {
        let w = Tensor::ones((4, 64), DType::F32, &Device::Cpu).unwrap();
        let q4 = QTensor::quantize(&w, GgmlDType::Q4_0).unwrap();
        assert!(Q8Matrix::from_qtensor(&q4).unwrap().is_none());
        let q8 = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let m = Q8Matrix::from_qtensor(&q8).unwrap().unwrap();
        // A row of the wrong width is an error, not a silent product.
        let x = Tensor::ones((1, 32), DType::F32, &Device::Cpu).unwrap();
        assert!(m.matmul_t(&x).is_err());
    }
}
