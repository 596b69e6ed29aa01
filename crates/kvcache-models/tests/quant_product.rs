//! The product of every available ISA against f64 references.

mod quant_common;

use kvcache_models::quant::{Format, GgmlType, Isa, QActivations, QMatrix, QuantError, Target};
use quant_common::{random_ggml, reference_product, Rng};

/// Weights whose quants cover the whole range (Q8 includes -128), from raw ggml blocks.
fn raw_weights(rng: &mut Rng, format: Format, rows: usize, cols: usize) -> QMatrix {
    let ty = match format {
        Format::Q8 => GgmlType::Q8_0,
        Format::Q4 => GgmlType::Q4_1,
    };
    let raw = random_ggml(rng, ty, rows, cols);
    QMatrix::from_ggml(ty, &raw, rows, cols, Target::AsStored).unwrap()
}

fn product(w: &QMatrix, a: &QActivations, isa: Isa) -> Vec<f32> {
    let mut out = vec![f32::NAN; a.rows() * w.rows()];
    w.matmul_into_isa(a, isa, &mut out).unwrap();
    out
}

#[test]
fn every_isa_matches_the_f64_reference_on_odd_sizes() {
    let isas = Isa::available();
    assert!(isas.contains(&Isa::Scalar));
    let mut rng = Rng::new(1);
    let mut checked = 0;
    for format in [Format::Q8, Format::Q4] {
        for rows in [1, 3, 7, 65] {
            for cols in [32, 96, 576] {
                let w = raw_weights(&mut rng, format, rows, cols);
                let x = rng.vec(17 * cols, 1.0);
                for m in 1..=17 {
                    let a = QActivations::quantize(m, cols, &x[..m * cols]).unwrap();
                    let (want, mag) = reference_product(&w, &a);
                    for &isa in &isas {
                        let got = product(&w, &a, isa);
                        for (k, ((&g, &r), &s)) in got.iter().zip(&want).zip(&mag).enumerate() {
                            let tol = 4e-6 * s + 1e-30;
                            assert!(
                                (g as f64 - r).abs() <= tol,
                                "{isa:?} {format:?} rows {rows} cols {cols} m {m} out {k}: {g} vs {r}"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, isas.len() * 2 * 4 * 3 * 17);
}

#[test]
fn product_is_close_to_the_f32_product_of_dequantized_weights() {
    let mut rng = Rng::new(2);
    let (m, rows, cols) = (5, 33, 576);
    let x = rng.vec(m * cols, 1.0);
    let a = QActivations::quantize(m, cols, &x).unwrap();
    for format in [Format::Q8, Format::Q4] {
        let w = QMatrix::quantize(format, rows, cols, &rng.vec(rows * cols, 0.05)).unwrap();
        let wd = w.dequantize();
        for isa in Isa::available() {
            let got = product(&w, &a, isa);
            for i in 0..m {
                for j in 0..rows {
                    let (mut exact, mut bound) = (0f64, 0f64);
                    for k in 0..cols {
                        let wv = wd[j * cols + k] as f64;
                        exact += wv * x[i * cols + k] as f64;
                        // Activation rounding: at most half a step per value.
                        bound += wv.abs() * 0.5 * a.scale(i, k / 32) as f64 * 1.001;
                        bound += 1e-6 * (wv * x[i * cols + k] as f64).abs();
                    }
                    let g = got[i * rows + j] as f64;
                    assert!(
                        (g - exact).abs() <= bound,
                        "{isa:?} {format:?} ({i},{j}): {g} vs {exact} (bound {bound})"
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_range_writes_only_its_columns() {
    let mut rng = Rng::new(3);
    let (m, rows, cols) = (3, 40, 96);
    let a = QActivations::quantize(m, cols, &rng.vec(m * cols, 1.0)).unwrap();
    for format in [Format::Q8, Format::Q4] {
        let w = raw_weights(&mut rng, format, rows, cols);
        for isa in Isa::available() {
            let full = product(&w, &a, isa);
            let mut out = vec![f32::NAN; m * rows];
            w.matmul_range_isa(&a, isa, 5..23, &mut out).unwrap();
            for i in 0..m {
                for j in 0..rows {
                    let v = out[i * rows + j];
                    if (5..23).contains(&j) {
                        assert_eq!(v.to_bits(), full[i * rows + j].to_bits());
                    } else {
                        assert!(v.is_nan(), "column {j} written");
                    }
                }
            }
        }
    }
}

#[test]
fn zero_activations_give_zero() {
    let mut rng = Rng::new(4);
    let w = raw_weights(&mut rng, Format::Q4, 9, 64);
    let a = QActivations::quantize(2, 64, &[0.0; 128]).unwrap();
    for isa in Isa::available() {
        assert!(product(&w, &a, isa).iter().all(|&v| v == 0.0), "{isa:?}");
    }
}

#[test]
fn mismatched_shapes_are_errors() {
    let mut rng = Rng::new(5);
    let w = raw_weights(&mut rng, Format::Q8, 4, 64);
    let a = QActivations::quantize(2, 96, &rng.vec(192, 1.0)).unwrap();
    let mut out = vec![0.0; 8];
    assert_eq!(
        w.matmul_into(&a, &mut out),
        Err(QuantError::InnerMismatch {
            weight_cols: 64,
            act_cols: 96
        })
    );
    let a = QActivations::quantize(2, 64, &rng.vec(128, 1.0)).unwrap();
    assert_eq!(
        w.matmul_into(&a, &mut out[..7]),
        Err(QuantError::BadLength { expected: 8, got: 7 })
    );
    assert!(QActivations::quantize(1, 33, &[0.0; 33]).is_err());
}

#[test]
fn isa_names_and_detection() {
    assert_eq!(Isa::from_name("AVX512"), Some(Isa::Avx512));
    assert_eq!(Isa::from_name("scalar"), Some(Isa::Scalar));
    assert_eq!(Isa::from_name("Neon"), Some(Isa::Neon));
    assert_eq!(Isa::from_name("sve"), None);
    // Each ISA exists on its own architecture only.
    let available = Isa::available();
    assert_eq!(available.contains(&Isa::Neon), cfg!(target_arch = "aarch64"));
    assert!(!cfg!(target_arch = "aarch64") || !available.contains(&Isa::Avx2));
    let best = *Isa::available().last().unwrap();
    if std::env::var(kvcache_models::quant::ISA_ENV).is_err() {
        assert_eq!(Isa::detect(), best);
    }
}

/// Activations quantized block by block as the plain formula says: `d =
/// absmax / 127`, `q = round_ties_even(clamp(v / d))`, `s = d * sum(q)`;
/// rows with zeros, ties and values far apart in size.
#[test]
fn activations_quantize_to_the_plain_formula() {
    let mut rng = Rng::new(91);
    let k = 96;
    let mut x = rng.vec(5 * k, 3.0);
    x[k..2 * k].fill(0.0); // an all-zero row: d = 0, every q = 0
    for (i, v) in x[2 * k..3 * k].iter_mut().enumerate() {
        // Exact halves after scaling: absmax 127 gives d = 1.
        *v = if i % 32 == 0 { 127.0 } else { (i % 7) as f32 - 3.5 };
    }
    x[3 * k] = 1e6; // one huge value: the rest of its block rounds to 0
    let a = QActivations::quantize(5, k, &x).unwrap();
    for i in 0..5 {
        for b in 0..k / 32 {
            let block = &x[i * k + 32 * b..i * k + 32 * b + 32];
            let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = absmax / 127.0;
            let id = if d == 0.0 { 0.0 } else { 1.0 / d };
            let want: Vec<i8> = block
                .iter()
                .map(|&v| (v * id).clamp(-127.0, 127.0).round_ties_even() as i8)
                .collect();
            assert_eq!(a.block_quants(i, b), &want[..], "row {i} block {b}");
            assert_eq!(a.scale(i, b).to_bits(), d.to_bits(), "row {i} block {b}");
            let sum: i32 = want.iter().map(|&q| q as i32).sum();
            assert_eq!(a.block_sum(i, b).to_bits(), (d * sum as f32).to_bits());
        }
    }
}
