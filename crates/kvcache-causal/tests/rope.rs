//! The ready RoPE shift against a direct rotation computed in f64, alone and
//! through a cache removal.

mod common;

use candle_core::{DType, Tensor};
use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode, KeyShift, Pos, PosRange};
use kvcache_causal::{CausalKvCache, RopeLayout, RopeShift};

const BASE: f64 = 10000.0;

/// Deterministic pseudo-random numbers in -1..1.
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 20001) as f32 / 10000.0 - 1.0
        })
        .collect()
}

/// Rotates one head vector by `pos` positions, in f64.
fn rotate(x: &[f32], pos: f64, layout: RopeLayout, dims: usize, scale: f64) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for i in 0..dims / 2 {
        let theta = pos * scale * BASE.powf(-2.0 * i as f64 / dims as f64);
        let (a, b) = match layout {
            RopeLayout::Normal => (2 * i, 2 * i + 1),
            RopeLayout::NeoX => (i, i + dims / 2),
        };
        let (x0, x1) = (f64::from(x[a]), f64::from(x[b]));
        out[a] = x0 * theta.cos() - x1 * theta.sin();
        out[b] = x0 * theta.sin() + x1 * theta.cos();
    }
    out
}

fn close(got: &[f32], want: &[f64], tol: f64) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(g) - w).abs() <= tol, "element {i}: {g} vs {w}");
    }
}

#[test]
fn shift_matches_a_direct_rotation() {
    let device = common::device();
    let (n, heads, head_dim) = (5, 3, 8);
    let shifts: [Pos; 5] = [0, -1, 7, -300, 12345];
    for layout in [RopeLayout::Normal, RopeLayout::NeoX] {
        for (dims, scale) in [(8, 1.0), (4, 0.25)] {
            let data = noise(n * heads * head_dim, dims as u64);
            let keys = Tensor::from_vec(data.clone(), (n, heads, head_dim), &device).unwrap();
            let rope = RopeShift::new(layout, dims, BASE as f32)
                .unwrap()
                .with_freq_scale(scale as f32);
            let out = rope.shift(3, &keys, &shifts).unwrap();
            assert_eq!(out.dims(), keys.dims());
            let got = common::host(&out);
            for (row, &shift) in shifts.iter().enumerate() {
                for h in 0..heads {
                    let at = (row * heads + h) * head_dim;
                    let want = rotate(&data[at..at + head_dim], f64::from(shift), layout, dims, scale);
                    close(&got[at..at + head_dim], &want, 1e-5);
                }
            }
            // Shift 0 is exact, and dimensions past `dims` never change.
            assert_eq!(&got[..heads * head_dim], &data[..heads * head_dim]);
        }
    }
}

#[test]
fn half_precision_keys_round_trip() {
    let device = common::device();
    let data = noise(2 * 4, 7);
    let keys = Tensor::from_vec(data.clone(), (2, 1, 4), &device)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let rope = RopeShift::new(RopeLayout::NeoX, 4, BASE as f32).unwrap();
    let out = rope.shift(0, &keys, &[3, -2]).unwrap();
    assert_eq!(out.dtype(), DType::F16);
    let back = rope.shift(0, &out, &[-3, 2]).unwrap();
    close(
        &common::host(&back),
        &data.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        5e-3,
    );
}

#[test]
fn bad_parameters_are_errors() {
    assert!(RopeShift::new(RopeLayout::Normal, 3, 1e4).is_err());
    assert!(RopeShift::new(RopeLayout::Normal, 0, 1e4).is_err());
    assert!(RopeShift::new(RopeLayout::Normal, 4, -1.0).is_err());
    let rope = RopeShift::new(RopeLayout::Normal, 16, 1e4).unwrap();
    let keys = Tensor::zeros((2, 1, 8), DType::F32, &common::device()).unwrap();
    assert!(rope.shift(0, &keys, &[1, 2]).is_err());
    let rope = RopeShift::new(RopeLayout::Normal, 8, 1e4).unwrap();
    assert!(rope.shift(0, &keys, &[1]).is_err());
}

#[test]
fn removal_re_rotates_later_keys_to_their_new_positions() {
    let device = common::device();
    let (heads, head_dim) = (2, 8);
    let layout = RopeLayout::Normal;
    let rope = RopeShift::new(layout, head_dim, BASE as f32).unwrap();
    let config = CausalConfig::new(1, 32, 16);
    let mut cache = CausalKvCache::new(config, device.clone(), Some(Box::new(rope))).unwrap();
    // Each position's raw key is random; the model stores it rotated for its position.
    let raw: Vec<Vec<f32>> = (0..10).map(|p| noise(heads * head_dim, 100 + p)).collect();
    let rotated: Vec<f32> = (0..10)
        .flat_map(|p| {
            raw[p]
                .chunks(head_dim)
                .flat_map(|h| rotate(h, p as f64, layout, head_dim, 1.0))
                .map(|v| v as f32)
                .collect::<Vec<_>>()
        })
        .collect();
    cache
        .start_forward(&Batch::sequence(0, 0, 10).unwrap(), ForwardMode::Compute)
        .unwrap();
    cache.set_layer(0);
    let keys = Tensor::from_vec(rotated, (10, heads, head_dim), &device).unwrap();
    cache.put(&keys, &keys).unwrap();
    cache.remove(0, PosRange::from(2..5)).unwrap();
    cache.check();
    // Positions 5..10 are now 2..7: their keys must be the raw keys rotated for the new position.
    for (pos, cell) in cache.positions(0) {
        let old = if pos < 2 { pos } else { pos + 3 } as usize;
        let want: Vec<f64> = raw[old]
            .chunks(head_dim)
            .flat_map(|h| rotate(h, f64::from(pos), layout, head_dim, 1.0))
            .collect();
        close(&cache.read_cell(0, cell).unwrap().keys, &want, 1e-5);
    }
}
