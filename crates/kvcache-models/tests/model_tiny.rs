//! The tiny random-weight Llama: the cached path equals full recompute.

mod common;

use candle_core::{Device, IndexOp};
use common::{max_abs_diff, simple_cache::SimpleCache};
use kvcache_api::CausalConfig;
use kvcache_models::{BatchToken, Llama, LlamaConfig, WeightMode};

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

/// The logits of sequence 0's tokens, decoded one by one after a prefill of
/// 6, with `others` sequences stepping beside it in the same passes.
fn decode_beside(model: &Llama, others: usize) -> Vec<Vec<f32>> {
    use kvcache_causal::CausalKvCache;
    let config = CausalConfig::new(1 + others, 64, 32);
    let mut cache = CausalKvCache::new(config, Device::Cpu, None).unwrap();
    let tokens = |seq: usize| -> Vec<u32> { (0..14).map(|i| ((i * 7 + 3 + 11 * seq) % 64) as u32).collect() };
    let mut rows = Vec::new();
    for step in 0..8 {
        let (first, len) = if step == 0 { (0, 6) } else { (5 + step, 1) };
        let mut batch = Vec::new();
        for seq in 0..=others {
            batch.extend(BatchToken::run(
                seq,
                first as i32,
                &tokens(seq)[first..first + len],
            ));
        }
        let out = model.forward(&batch, &mut cache).unwrap();
        rows.push(out.i(len - 1).unwrap().to_vec1::<f32>().unwrap());
    }
    rows
}

/// In every quantized weight mode a sequence's logits are bit for bit the
/// same alone and beside others: the weights' products see each row on its
/// own (activations quantized per row) and the paged attention reads each
/// row's own cells. In f32 they agree within 1e-5 only: dense products of
/// more than a few rows go through `gemm`, which sums in another order.
#[test]
fn a_sequence_decodes_the_same_alone_and_beside_others() {
    for mode in WeightMode::ALL {
        let model = Llama::random_in(LlamaConfig::tiny(), 7, mode, &Device::Cpu).unwrap();
        let alone = decode_beside(&model, 0);
        for others in [1, 3] {
            let beside = decode_beside(&model, others);
            if mode == WeightMode::F32 {
                let d = alone
                    .iter()
                    .flatten()
                    .zip(beside.iter().flatten())
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(d <= 1e-5, "f32, {others} beside: {d}");
            } else {
                assert_eq!(alone, beside, "{mode}, {others} beside");
            }
        }
    }
}
