//! The prefix-trie chat on the tiny random model: every reuse policy produces the
//! tokens of evaluating from scratch, and the trie evaluates the least.

mod common;

use candle_core::{Device, IndexOp};
use common::max_abs_diff;
use kvcache_api::{LayerCache, SnapshotCache};
use kvcache_causal::layer_cache::CandleKv;
use kvcache_engine::chat::{Chat, Reuse};
use kvcache_models::{Llama, LlamaConfig};

fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(), 3, &Device::Cpu).unwrap()
}

#[test]
fn layer_caches_equal_full_recompute() {
    let model = model();
    let c = model.config().clone();
    let mut caches: Vec<CandleKv> = (0..c.n_layers)
        .map(|_| CandleKv::new(c.n_kv_heads, c.head_dim, &Device::Cpu))
        .collect();
    let tokens: Vec<u32> = (0..90).map(|i| (i * 11 % 64) as u32).collect();
    let full = model.logits(&model.hidden_full(&tokens, None).unwrap()).unwrap();
    // 70 tokens (past the first 64-row allocation), then one at a time.
    let h = model.hidden_layers(&tokens[..70], &mut caches).unwrap();
    let d = max_abs_diff(&model.logits(&h).unwrap(), &full.i(..70).unwrap());
    assert!(d <= 1e-5, "{d}");
    for i in 70..90 {
        let h = model.hidden_layers(&tokens[i..=i], &mut caches).unwrap();
        let d = max_abs_diff(&model.logits(&h).unwrap().i(0).unwrap(), &full.i(i).unwrap());
        assert!(d <= 1e-5, "token {i}: {d}");
    }
    assert_eq!(caches[1].offset(), 90);
    // Page out everything, then back in through split halves and a merge.
    let layer = &mut caches[0];
    let original = layer.state()[0].to_vec3::<f32>().unwrap();
    let all = layer.snapshot(0).unwrap().unwrap();
    assert_eq!(all.range(), 0..90);
    assert_eq!(all.size_bytes(), 2 * 90 * c.n_kv_heads * c.head_dim * 4);
    assert!(layer.snapshot(90).unwrap().is_none());
    let (a, b) = layer.split(all, 40).unwrap();
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!((a.range(), b.range()), (0..40, 40..90));
    layer.free();
    assert!(
        !layer.restore(Some(b.as_ref()), 90).unwrap(),
        "offset 0 is behind 40..90"
    );
    assert!(layer.restore(Some(a.as_ref()), 40).unwrap());
    assert!(layer.restore(Some(b.as_ref()), 90).unwrap());
    assert_eq!(layer.state()[0].to_vec3::<f32>().unwrap(), original);
    assert!(layer.restore(None, 25).unwrap());
    assert!(
        !layer.restore(None, 26).unwrap(),
        "cannot move forward without a snapshot"
    );
    let merged = layer.merge(Some(a), Some(b)).unwrap().unwrap();
    assert_eq!(merged.range(), 0..90);
    assert!(layer.restore(Some(merged.as_ref()), 90).unwrap());
    assert_eq!(layer.state()[0].to_vec3::<f32>().unwrap(), original);
}

#[test]
fn every_reuse_policy_generates_the_same_tokens() {
    let model = model();
    // Three conversations, three turns, interleaved round-robin, sharing a system
    // prompt; each turn's prompt extends the conversation's previous prompt.
    let system: Vec<u32> = (0..20).map(|i| (i * 7 % 60) as u32).collect();
    let mut convs: Vec<Vec<u32>> = vec![system.clone(); 3];
    let mut requests = Vec::new();
    for turn in 0..3 {
        for (c, conv) in convs.iter_mut().enumerate() {
            conv.extend((0..5 + c).map(|i| ((turn * 17 + c * 5 + i * 3) % 64) as u32));
            requests.push(conv.clone());
            conv.extend([61, 62, 63]); // a scripted reply
        }
    }
    let mut results = Vec::new();
    for reuse in [Reuse::None, Reuse::SingleEntry, Reuse::Trie] {
        let mut chat = Chat::new(&model, reuse, 1 << 30).unwrap();
        let outs: Vec<_> = requests
            .iter()
            .map(|p| chat.generate(p, 4, None).unwrap())
            .collect();
        results.push((reuse, outs, chat.trie_stats()));
    }
    let (_, base, _) = &results[0];
    for (reuse, outs, _) in &results {
        for (i, (a, b)) in outs.iter().zip(base).enumerate() {
            assert_eq!(a.generated, b.generated, "{reuse:?} request {i}");
            assert_eq!(a.matched + a.evaluated, a.prompt_tokens);
        }
    }
    let evaluated = |k: usize| results[k].1.iter().map(|o| o.evaluated).sum::<usize>();
    let total: usize = requests.iter().map(Vec::len).sum();
    assert_eq!(evaluated(0), total);
    assert!(evaluated(1) < evaluated(0));
    assert!(
        evaluated(2) < evaluated(1),
        "{} vs {}",
        evaluated(2),
        evaluated(1)
    );
    // The trie: the system prompt is shared from the second request on, and each
    // later turn restores its conversation's previous prompt.
    let trie = &results[2].1;
    assert_eq!(trie[1].matched, 20);
    assert_eq!(trie[3].matched, requests[0].len());
    let stats = results[2].2.clone().unwrap();
    assert_eq!(stats.evaluated_tokens as usize, evaluated(2));
    assert!(stats.page_outs > 0 && stats.page_ins > 0, "{stats:?}");
}
