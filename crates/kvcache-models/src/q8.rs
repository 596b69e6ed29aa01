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
use crate::{ModelError, Result};

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
    /// candle's dense product with the f32 matrix. Measured on Gemma's head
    /// (2 cores): 1 row 8.7 against 22.3 ms, 4 rows 32 against 61, 8 rows 67
    /// against 72, 16 rows 127 against 73: beyond a few rows the expansion of
    /// each weight, not reading it, bounds the time, and `gemm` wins.
    pub(crate) const MAX_ROWS: usize = 8;

    /// Bytes of quants and scales a product reads.
    pub(crate) fn bytes(&self) -> usize {
        self.quants.len() + 4 * self.scales.len()
    }

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
            return Err(ModelError::Format(format!(
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
            return Err(ModelError::InvalidArgument(format!(
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

    /// `y[r, j] = x_r . w_j` for the weight rows `j` in `range`, each weight
    /// row read from memory once (from cache for the rows of `x` after the first).
    fn rows_into(&self, range: std::ops::Range<usize>, x: &[f32], m: usize, y: &mut Columns<'_>) {
        let blocks = self.cols / BLOCK;
        for j in range {
            let quants = &self.quants[j * self.cols..][..self.cols];
            let scales = &self.scales[j * blocks..][..blocks];
            for r in 0..m {
                y.set(r, j, dot_q8(quants, scales, &x[r * self.cols..][..self.cols]));
            }
        }
    }
}

/// `sum_i (q[i] * scale of i's block) * x[i]`, through the widest
/// instructions the CPU has.
fn dot_q8(q: &[i8], scales: &[f32], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA, all that `dot_q8_avx2` needs.
        return unsafe { dot_q8_avx2(q, scales, x) };
    }
    dot_q8_generic(q, scales, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q8_avx2(q: &[i8], scales: &[f32], x: &[f32]) -> f32 {
    dot_q8_generic(q, scales, x)
}

#[inline(always)]
fn dot_q8_generic(q: &[i8], scales: &[f32], x: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    for ((qb, &d), xb) in q.chunks_exact(BLOCK).zip(scales).zip(x.chunks_exact(BLOCK)) {
        for (q8, x8) in qb.chunks_exact(LANES).zip(xb.chunks_exact(LANES)) {
            for i in 0..LANES {
                // `q * d` is exact in f32 (an 8-bit integer times an f16 scale).
                acc[i] += f32::from(q8[i]) * d * x8[i];
            }
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn the_product_equals_the_dequantized_matrixs() {
        let mut rng = crate::weights::SplitMix64(11);
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
            let diff = crate::testing::max_abs_diff(&got, &want);
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
