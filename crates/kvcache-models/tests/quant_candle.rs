//! The block kernels against candle's own dequantization: for every GGUF type
//! the models read, a matrix quantized by candle, taken into `quant`'s blocks
//! from candle's bytes, multiplied against activations quantized per row,
//! equals `x @ W^T` with candle's dequantized `W` within the error of the
//! 8-bit activations (and of the requantization, for the types held as 8-bit
//! blocks). A misread block layout (a nibble order, a scale's place) costs
//! O(1) relative error, far past these bounds.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvcache_models::quant::{GgmlType, Isa, QActivations, QMatrix, Target};

/// Rows of `W`, its columns (a multiple of 256 for the k-quants), rows of `x`.
const OUT: usize = 48;
const IN: usize = 512;
const M: usize = 5;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

/// `max |got - want|` relative to the largest `|want|`.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
    let diff = got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs()));
    diff / scale
}

#[test]
fn every_gguf_type_multiplies_as_candle_dequantizes_it() {
    let device = Device::Cpu;
    let w = Tensor::from_vec(values(OUT * IN, 1), (OUT, IN), &device).unwrap();
    let x = values(M * IN, 2);
    let xt = Tensor::from_vec(x.clone(), (M, IN), &device).unwrap();
    // (candle's type, ours, the bound on relative error): 8-bit activations
    // cost ~1% of a row's largest product at most; types requantized to 8-bit
    // blocks (Q6_K) add their own rounding.
    for (candle_type, ours, bound) in [
        (GgmlDType::Q8_0, GgmlType::Q8_0, 0.02),
        (GgmlDType::Q4_0, GgmlType::Q4_0, 0.02),
        (GgmlDType::Q4_1, GgmlType::Q4_1, 0.02),
        (GgmlDType::Q5_0, GgmlType::Q5_0, 0.02),
        (GgmlDType::Q4K, GgmlType::Q4_K, 0.02),
        (GgmlDType::Q6K, GgmlType::Q6_K, 0.03),
    ] {
        let q = QTensor::quantize(&w, candle_type).unwrap();
        let dequantized = q.dequantize(&device).unwrap();
        let want: Vec<f32> = xt
            .matmul(&dequantized.t().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let packed = QMatrix::from_ggml(ours, &q.data().unwrap(), OUT, IN, Target::AsStored).unwrap();
        let acts = QActivations::quantize(M, IN, &x).unwrap();
        for isa in Isa::available() {
            let mut got = vec![f32::NAN; M * OUT];
            packed.matmul_into_isa(&acts, isa, &mut got).unwrap();
            let err = relative_error(&got, &want);
            assert!(err <= bound, "{candle_type:?} on {isa:?}: relative error {err}");
        }
        // The blocks hold what candle dequantizes, exactly where the
        // conversion is exact. Q4_K: its `d` and `m` each rounded to f16
        // (2^-11 relative), so a value `d q + m` moves by up to 2^-11 of
        // `|d q| + |m|`, at most twice the matrix's largest value.
        let mine = packed.dequantize();
        let theirs: Vec<f32> = dequantized.flatten_all().unwrap().to_vec1().unwrap();
        let exact = matches!(
            ours,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0
        );
        let err = relative_error(&mine, &theirs);
        let limit = if exact {
            0.0
        } else if ours == GgmlType::Q4_K {
            2e-3
        } else {
            0.01
        };
        assert!(
            err <= limit,
            "{candle_type:?}: blocks differ from candle's values by {err}"
        );
    }
}
