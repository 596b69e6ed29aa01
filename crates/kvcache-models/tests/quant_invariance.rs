//! Batch invariance: a row's outputs are bit-identical alone, in any batch,
//! at any tile position, with any thread count and in every ISA.

mod quant_common;

use kvcache_models::quant::{Format, Isa, QActivations, QMatrix};
use proptest::prelude::*;
use quant_common::{reference_product, Rng};

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// Bits of each row's outputs computed alone (m = 1) on one thread.
fn rows_alone(w: &QMatrix, x: &[f32], m: usize, isa: Isa) -> Vec<u32> {
    let k = w.cols();
    let mut bits = Vec::with_capacity(m * w.rows());
    for i in 0..m {
        let a = QActivations::quantize(1, k, &x[i * k..(i + 1) * k]).unwrap();
        let mut out = vec![0f32; w.rows()];
        w.matmul_range_isa(&a, isa, 0..w.rows(), &mut out).unwrap();
        bits.extend(out.iter().map(|v| v.to_bits()));
    }
    bits
}

/// Bits of the outputs of rows `x` computed in consecutive batches of `batch`
/// rows, on a pool of `threads`.
fn rows_batched(w: &QMatrix, x: &[f32], m: usize, batch: usize, isa: Isa, threads: usize) -> Vec<u32> {
    let k = w.cols();
    let mut bits = Vec::with_capacity(m * w.rows());
    pool(threads).install(|| {
        for start in (0..m).step_by(batch) {
            let n = batch.min(m - start);
            let a = QActivations::quantize(n, k, &x[start * k..(start + n) * k]).unwrap();
            let mut out = vec![0f32; n * w.rows()];
            w.matmul_into_isa(&a, isa, &mut out).unwrap();
            bits.extend(out.iter().map(|v| v.to_bits()));
        }
    });
    bits
}

#[test]
fn rows_alone_equal_rows_in_every_batch_size_and_thread_count() {
    let mut rng = Rng::new(7);
    let m = 17;
    for (rows, cols) in [(67, 96), (300, 576), (5, 32)] {
        let x = rng.vec(m * cols, 1.0);
        for format in [Format::Q8, Format::Q4] {
            let w = QMatrix::quantize(format, rows, cols, &rng.vec(rows * cols, 0.05)).unwrap();
            for isa in Isa::available() {
                let alone = rows_alone(&w, &x, m, isa);
                for batch in 1..=m {
                    let threads = 1 + batch % 4;
                    let got = rows_batched(&w, &x, m, batch, isa, threads);
                    assert!(
                        got == alone,
                        "{isa:?} {format:?} {rows}x{cols} batch {batch} threads {threads}"
                    );
                }
            }
        }
    }
}

#[test]
fn column_splits_do_not_change_results() {
    let mut rng = Rng::new(8);
    let (m, rows, cols) = (6, 53, 160);
    let x = rng.vec(m * cols, 1.0);
    let a = QActivations::quantize(m, cols, &x).unwrap();
    for format in [Format::Q8, Format::Q4] {
        let w = QMatrix::quantize(format, rows, cols, &rng.vec(rows * cols, 0.05)).unwrap();
        for isa in Isa::available() {
            let mut whole = vec![0f32; m * rows];
            w.matmul_range_isa(&a, isa, 0..rows, &mut whole).unwrap();
            let mut pieces = vec![0f32; m * rows];
            for range in [0..1, 1..6, 6..7, 7..30, 30..53] {
                w.matmul_range_isa(&a, isa, range, &mut pieces).unwrap();
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&whole), bits(&pieces), "{isa:?} {format:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random shapes: each ISA is batch invariant, gives the scalar kernel's
    /// bits, and agrees with the f64 reference of the same quantized values.
    #[test]
    fn batch_invariance_and_isa_agreement(
        rows in 1usize..40,
        blocks in 1usize..20,
        m in 1usize..12,
        batch in 1usize..12,
        threads in 1usize..4,
        q4 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let cols = blocks * 32;
        let mut rng = Rng::new(seed);
        let format = if q4 { Format::Q4 } else { Format::Q8 };
        let w = QMatrix::quantize(format, rows, cols, &rng.vec(rows * cols, 0.05)).unwrap();
        let x = rng.vec(m * cols, 1.0);
        let a = QActivations::quantize(m, cols, &x).unwrap();
        let (want, mag) = reference_product(&w, &a);
        let scalar = rows_alone(&w, &x, m, Isa::Scalar);
        for isa in Isa::available() {
            let alone = rows_alone(&w, &x, m, isa);
            prop_assert_eq!(&rows_batched(&w, &x, m, batch, isa, threads), &alone, "{:?}", isa);
            // Every ISA takes the same float steps as the scalar reference.
            prop_assert_eq!(&alone, &scalar, "{:?} against scalar", isa);
            for (k, &b) in alone.iter().enumerate() {
                let g = f32::from_bits(b) as f64;
                prop_assert!((g - want[k]).abs() <= 4e-6 * mag[k], "{:?} out {}: {} vs {}", isa, k, g, want[k]);
            }
        }
    }
}

/// Rows quantized on a pool equal rows quantized one by one (each row on its
/// own), at prefill sizes where the pool is used.
#[test]
fn activations_quantized_on_a_pool_equal_row_by_row() {
    let mut rng = Rng::new(77);
    let (m, k) = (300, 640);
    let x: Vec<f32> = (0..m * k).map(|_| rng.normal(2.0)).collect();
    let alone = QActivations::quantize(m, k, &x).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let spread = pool.install(|| QActivations::quantize_on(m, k, &x, &kvcache_models::quant::Rayon).unwrap());
    assert_eq!(alone, spread);
    for i in [0, 1, 299] {
        let row = QActivations::quantize(1, k, &x[i * k..(i + 1) * k]).unwrap();
        assert_eq!(row.block_quants(0, 3), alone.block_quants(i, 3));
        assert_eq!(row.scale(0, 7), alone.scale(i, 7));
    }
}

/// Matrices multiplied together in one parallel section give each one's
/// own product, bit for bit.
#[test]
fn products_sharing_their_input_equal_each_alone() {
    let mut rng = Rng::new(5);
    let (m, k) = (11, 96);
    let shapes = [(67, Format::Q8), (16, Format::Q4), (5, Format::Q8)];
    let ws: Vec<QMatrix> = shapes
        .iter()
        .map(|&(rows, f)| QMatrix::quantize(f, rows, k, &rng.vec(rows * k, 0.05)).unwrap())
        .collect();
    let a = QActivations::quantize(m, k, &rng.vec(m * k, 1.0)).unwrap();
    for isa in Isa::available() {
        for threads in [1, 2, 3] {
            let pool = pool(threads);
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; m * w.rows()]).collect();
            {
                let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                let refs: Vec<&QMatrix> = ws.iter().collect();
                pool.install(|| {
                    QMatrix::matmul_many_on(&refs, &a, isa, &mut slices, &kvcache_models::quant::Rayon)
                        .unwrap()
                });
            }
            for (w, got) in ws.iter().zip(&outs) {
                let mut alone = vec![0f32; m * w.rows()];
                w.matmul_range_isa(&a, isa, 0..w.rows(), &mut alone).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&alone), "{isa:?}, {threads} threads");
            }
        }
    }
}
