//! Micro-benchmark of the CPU paged-attention kernel on SmolLM2's and Gemma
//! 3's head shapes, f32 keys and values as the server stores them: a prefill
//! chunk of one sequence over a long cached prefix (E7's turns), and decode
//! rows of separate sequences.
//!
//! `cargo xtask bench -p kvcache-models --bench attention` prints the best
//! time of a few runs and the multiply-adds per second it reaches.

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use kvcache_api::{PagedKv, RowRuns, StoredKv, VLayout};
use kvcache_models::attention::paged_attention;

/// Deterministic values in `[-1, 1)`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

struct Shape {
    name: &'static str,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Best of `runs` timings of `f`.
fn best(runs: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn bench(shape: &Shape, label: &str, runs: &RowRuns, cells: usize) {
    let (h, kvh, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let n = runs.rows();
    let dev = Device::Cpu;
    let keys = Tensor::from_vec(values(cells * kvh * hd, 1), (cells, kvh, hd), &dev).unwrap();
    let vals = Tensor::from_vec(values(cells * kvh * hd, 2), (cells, kvh, hd), &dev).unwrap();
    let q = Tensor::from_vec(values(n * h * hd, 3), (n, h, hd), &dev).unwrap();
    let view = PagedKv {
        keys: StoredKv::Float(keys),
        values: StoredKv::Float(vals),
        v_layout: VLayout::Normal,
        runs,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let t = best(20, || {
        paged_attention(&q, &view, scale).unwrap().unwrap();
    });
    let macs = runs.total_visible() * h * 2 * hd;
    println!(
        "{:<8} {:<28} {:>9.3} ms {:>7.2} GMAC/s",
        shape.name,
        label,
        t.as_secs_f64() * 1e3,
        macs as f64 / t.as_secs_f64() / 1e9
    );
}

fn main() {
    let shapes = [
        Shape {
            name: "smollm2",
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        },
        Shape {
            name: "gemma3",
            heads: 4,
            kv_heads: 1,
            head_dim: 256,
        },
    ];
    for shape in &shapes {
        // A prefill chunk of 112 rows after 900 cached cells.
        let (prefix, chunk) = (900, 112);
        let mut runs = RowRuns::default();
        for r in 0..chunk {
            runs.push_row(std::iter::once(0..(prefix + r + 1) as u32));
        }
        bench(shape, "prefill 112 after 900", &runs, prefix + chunk);
        // Ten sequences decoding, 1,000 cells each, side by side.
        let mut runs = RowRuns::default();
        for s in 0..10u32 {
            runs.push_row(std::iter::once(s * 1000..s * 1000 + 1000));
        }
        bench(shape, "decode 10 x 1000", &runs, 10_000);
        let mut runs = RowRuns::default();
        runs.push_row(std::iter::once(0..1000));
        bench(shape, "decode 1 x 1000", &runs, 1000);
    }
}
