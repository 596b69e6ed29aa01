//! The tiny random-weight Llama: the cached path equals full recompute.

mod common;

use candle_core::{Device, IndexOp};
use common::{max_abs_diff, simple_cache::SimpleCache};
use kvcache_api::CausalConfig;
use kvcache_models::{BatchToken, Llama, LlamaConfig};

fn tiny() -> Llama {
    Llama::random(LlamaConfig::tiny(), 7, &Device::Cpu).unwrap()
}

#[test]
fn full_recompute_is_causal() {
    let model = tiny();
    let tokens = [3u32, 9, 27, 1, 60, 5];
    let all = model.forward_full(&tokens, None).unwrap();
    assert_eq!(all.dims(), &[6, 64]);
    // Row i depends only on tokens ..=i.
    let prefix = model.forward_full(&tokens[..3], None).unwrap();
    let d = max_abs_diff(&all.i(0..3).unwrap(), &prefix);
    assert!(d < 1e-5, "prefix rows differ by {d}");
    // And it does depend on earlier tokens.
    let other = model.forward_full(&[4u32, 9, 27], None).unwrap();
    assert!(max_abs_diff(&other.i(2).unwrap(), &prefix.i(2).unwrap()) > 1e-3);
}

#[test]
fn decode_through_a_cache_equals_full_recompute() {
    let model = tiny();
    let tokens: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % 64).collect();
    let full = model.forward_full(&tokens, None).unwrap();
    let mut cache = SimpleCache::new(CausalConfig::new(2, 64, 16), &Device::Cpu, None);
    // Prefill 5, then decode one by one.
    let batch: Vec<BatchToken> = (0..5)
        .map(|i| BatchToken {
            seq: 1,
            pos: i as i32,
            token: tokens[i],
        })
        .collect();
    let out = model.forward(&batch, &mut cache).unwrap();
    assert!(max_abs_diff(&out, &full.i(0..5).unwrap()) <= 1e-5);
    for (i, &token) in tokens.iter().enumerate().skip(5) {
        let t = BatchToken {
            seq: 1,
            pos: i as i32,
            token,
        };
        let out = model.forward(&[t], &mut cache).unwrap();
        let d = max_abs_diff(&out.i(0).unwrap(), &full.i(i).unwrap());
        assert!(d <= 1e-5, "token {i}: diff {d}");
    }
}
