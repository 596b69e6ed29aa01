//! Every conversion against the ggml dequantization reference.

mod quant_common;

use half::f16;
use kvcache_models::quant::{convert, dequantize_ggml, Format, GgmlType, QMatrix, QuantError, Target};
use quant_common::{random_ggml, weight_blocks, Rng};

const ROWS: usize = 3;
const COLS: usize = 512;

/// Asserts equal values (`-0.0 == 0.0`; every other value bit-identical).
fn assert_same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g == w && (g.to_bits() == w.to_bits() || *g == 0.0),
            "{what}: value {k}: {g} != {w}"
        );
    }
}

/// Asserts every value within half a step (`d`, plus the rounding of `m`) of the source.
fn assert_requantized(w: &QMatrix, src: &[f32], what: &str) {
    let got = w.dequantize();
    for (b, (d, m, _)) in weight_blocks(w).iter().enumerate() {
        let tol = 0.5 * d.abs() * (1.0 + 1e-3) + m.abs() * 2f64.powi(-10) + 1e-7;
        for k in b * 32..(b + 1) * 32 {
            let err = (got[k] as f64 - src[k] as f64).abs();
            assert!(
                err <= tol,
                "{what}: value {k}: {} vs {} (tol {tol})",
                got[k],
                src[k]
            );
        }
    }
}

#[test]
fn exact_conversions_match_ggml_dequantization() {
    let cases = [
        (GgmlType::Q8_0, Target::AsStored, Format::Q8),
        (GgmlType::Q8_0, Target::Q8, Format::Q8),
        (GgmlType::Q5_0, Target::AsStored, Format::Q8),
        (GgmlType::Q4_0, Target::Q8, Format::Q8),
        (GgmlType::Q4_0, Target::AsStored, Format::Q4),
        (GgmlType::Q4_1, Target::AsStored, Format::Q4),
        (GgmlType::Q4_1, Target::Q4, Format::Q4),
    ];
    for (seed, &(ty, target, format)) in cases.iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 1);
        let raw = random_ggml(&mut rng, ty, ROWS, COLS);
        let w = convert(ty, &raw, [ROWS, COLS], target).unwrap();
        assert_eq!(w.format(), format, "{ty:?} -> {target:?}");
        assert_eq!((w.rows(), w.cols()), (ROWS, COLS));
        let want = dequantize_ggml(ty, &raw, ROWS, COLS).unwrap();
        assert_same(&w.dequantize(), &want, &format!("{ty:?} -> {target:?}"));
    }
}

#[test]
fn q8_0_and_q4_1_round_trip_byte_for_byte() {
    let mut rng = Rng::new(11);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1] {
        let raw = random_ggml(&mut rng, ty, ROWS, COLS);
        let w = QMatrix::from_ggml(ty, &raw, ROWS, COLS, Target::AsStored).unwrap();
        assert_eq!(w.to_ggml_bytes(), (ty, raw));
    }
}

#[test]
fn q4_k_to_q4_within_scale_rounding() {
    let mut rng = Rng::new(21);
    let raw = random_ggml(&mut rng, GgmlType::Q4_K, ROWS, COLS);
    let w = convert(GgmlType::Q4_K, &raw, [ROWS, COLS], Target::AsStored).unwrap();
    assert_eq!(w.format(), Format::Q4);
    let want = dequantize_ggml(GgmlType::Q4_K, &raw, ROWS, COLS).unwrap();
    let got = w.dequantize();
    let mut inexact = 0;
    for (b, (d, m, _)) in weight_blocks(&w).iter().enumerate() {
        // d and m are the f16 roundings of the exact sub-block scale and min.
        let tol = (15.0 * d.abs() + m.abs()) * 2f64.powi(-11) * 1.01 + 1e-9;
        for k in b * 32..(b + 1) * 32 {
            let err = (got[k] as f64 - want[k] as f64).abs();
            assert!(err <= tol, "value {k}: {} vs {} (tol {tol})", got[k], want[k]);
            inexact += (err > 0.0) as usize;
        }
    }
    assert!(inexact > 0, "expected some f16 rounding of d * sc");
}

#[test]
fn requantized_sources_within_half_a_step() {
    let cases = [
        (GgmlType::Q6_K, Target::AsStored, Format::Q8),
        (GgmlType::F32, Target::AsStored, Format::Q8),
        (GgmlType::F16, Target::AsStored, Format::Q8),
        (GgmlType::BF16, Target::AsStored, Format::Q8),
        (GgmlType::Q4_1, Target::Q8, Format::Q8),
        (GgmlType::Q4_K, Target::Q8, Format::Q8),
        (GgmlType::Q8_0, Target::Q4, Format::Q4),
        (GgmlType::F32, Target::Q4, Format::Q4),
        (GgmlType::Q6_K, Target::Q4, Format::Q4),
    ];
    for (seed, &(ty, target, format)) in cases.iter().enumerate() {
        let mut rng = Rng::new(100 + seed as u64);
        let raw = random_ggml(&mut rng, ty, ROWS, COLS);
        let w = convert(ty, &raw, [ROWS, COLS], target).unwrap();
        assert_eq!(w.format(), format, "{ty:?} -> {target:?}");
        let src = dequantize_ggml(ty, &raw, ROWS, COLS).unwrap();
        assert_requantized(&w, &src, &format!("{ty:?} -> {target:?}"));
    }
}

#[test]
fn quantize_from_f32_within_half_a_step() {
    let mut rng = Rng::new(5);
    for format in [Format::Q8, Format::Q4] {
        let mut x = rng.vec(7 * 96, 1.0);
        x[..32].fill(0.0); // an all-zero block
        x[32..64].fill(0.25); // a constant block (Q4: d = 0)
        let w = QMatrix::quantize(format, 7, 96, &x).unwrap();
        assert_requantized(&w, &x, &format!("{format:?}"));
        assert!(w.dequantize()[..32].iter().all(|&v| v == 0.0));
    }
}

#[test]
fn q8_scale_is_absmax_over_127() {
    let mut x = vec![0f32; 32];
    x[3] = -2.54;
    x[4] = 1.0;
    let w = QMatrix::quantize(Format::Q8, 1, 32, &x).unwrap();
    let (d, _, q) = &weight_blocks(&w)[0];
    assert_eq!(*d, f16::from_f32(2.54 / 127.0).to_f64());
    assert_eq!((q[3], q[4], q[0]), (-127, 50, 0));
}

#[test]
fn shape_and_length_errors() {
    assert!(matches!(
        QMatrix::quantize(Format::Q8, 2, 40, &[0.0; 80]),
        Err(QuantError::BadShape { cols: 40, .. })
    ));
    assert!(matches!(
        QMatrix::quantize(Format::Q4, 2, 32, &[0.0; 63]),
        Err(QuantError::BadLength {
            expected: 64,
            got: 63
        })
    ));
    // Q4_K needs whole 256-value super-blocks.
    assert!(matches!(
        convert(GgmlType::Q4_K, &[0; 144], [1, 32], Target::AsStored),
        Err(QuantError::BadShape { block: 256, .. })
    ));
    assert!(matches!(
        convert(GgmlType::Q8_0, &[0; 33], [1, 32], Target::AsStored),
        Err(QuantError::BadLength {
            expected: 34,
            got: 33
        })
    ));
    assert!(matches!(
        dequantize_ggml(GgmlType::F16, &[0; 4], 1, 3),
        Err(QuantError::BadLength { .. })
    ));
}

#[test]
fn q4_0_with_huge_scale_reports_overflow() {
    let mut raw = vec![0u8; 18];
    raw[..2].copy_from_slice(&f16::from_f32(10000.0).to_le_bytes());
    assert_eq!(
        convert(GgmlType::Q4_0, &raw, [1, 32], Target::Q4),
        Err(QuantError::ScaleOverflow)
    );
    // The Q8 target keeps d and needs no -8 d.
    assert!(convert(GgmlType::Q4_0, &raw, [1, 32], Target::Q8).is_ok());
}
