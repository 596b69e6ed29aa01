//! Proves that mlx-rs builds, links and runs: real arrays, evaluated by MLX.
//!
//! On Linux this needs the set-up of `cargo xtask test` (patched mlx-sys, the
//! mlx-cpu wheel, `--cfg kvcache_mlx`); on macOS plain cargo builds it.
#![cfg(any(target_os = "macos", kvcache_mlx))]

use half::{bf16, f16};
use mlx_rs::{linalg, random::RandomState, with_stream, Array, Stream};

#[test]
fn adds_two_arrays() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
    let b = Array::from_slice(&[10.0f32, 20.0, 30.0], &[3]);
    let sum = a.add(&b).expect("add");
    sum.eval().expect("eval");
    assert_eq!(sum.shape(), &[3]);
    assert_eq!(sum.as_slice::<f32>(), &[11.0, 22.0, 33.0]);
}

/// f32 matmul and the inverse go through BLAS and LAPACK (OpenBLAS on Linux
/// once prepared): compare with plain loops.
#[test]
fn blas_and_lapack_give_exact_results() {
    let (m, k, n) = (33, 17, 9);
    let value = |i: usize, j: usize, salt: usize| ((i * 7 + j * 3 + salt) % 11) as f32 - 5.0;
    let a: Vec<f32> = (0..m * k).map(|x| value(x / k, x % k, 1)).collect();
    let b: Vec<f32> = (0..k * n).map(|x| value(x / n, x % n, 4)).collect();
    let product = Array::from_slice(&a, &[m as i32, k as i32])
        .matmul(Array::from_slice(&b, &[k as i32, n as i32]))
        .expect("matmul");
    product.eval().expect("eval");
    let expected: Vec<f32> = (0..m * n)
        .map(|x| (0..k).map(|t| a[(x / n) * k + t] * b[t * n + x % n]).sum())
        .collect();
    // Small integers: every partial sum is exact in f32.
    assert_eq!(product.as_slice::<f32>(), expected.as_slice());

    let inverse = with_stream(&Stream::cpu(), || {
        linalg::inv(Array::from_slice(&[4.0f32, 7.0, 2.0, 6.0], &[2, 2]))
    })
    .expect("inv");
    inverse.eval().expect("eval");
    let expected = [0.6f32, -0.7, -0.2, 0.4];
    for (got, want) in inverse.as_slice::<f32>().iter().zip(expected) {
        assert!((got - want).abs() < 1e-5, "inverse {got} != {want}");
    }
}

/// The 16-bit element types and the random seed exist off Apple only through
/// the patched mlx-sys (`half.h` typedefs, `mach_approximate_time` stand-in).
#[test]
fn half_types_and_random_state_work() {
    let halves = Array::from_slice(&[f16::from_f32(1.5), f16::from_f32(-2.0)], &[2]);
    let doubled = halves.add(&halves).expect("add");
    doubled.eval().expect("eval");
    assert_eq!(
        doubled.as_slice::<f16>(),
        &[f16::from_f32(3.0), f16::from_f32(-4.0)]
    );
    let brain = Array::from_slice(&[bf16::from_f32(0.25)], &[1]);
    assert_eq!(brain.item_exact::<bf16>(), bf16::from_f32(0.25));

    let mut state = RandomState::new().expect("random state");
    let key = state.next_key().expect("next key");
    key.eval().expect("eval");
    assert_eq!(key.shape(), &[2]);
}
