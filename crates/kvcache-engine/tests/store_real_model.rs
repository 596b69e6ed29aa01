//! The prefix store with SmolLM2: a conversation written by one engine is
//! continued by a brand-new one (an empty trie over a new store on the same
//! directory: what a restarted process sees), which restores all of the earlier
//! prompt from disk and computes the logits of a full recompute.
//!
//! Needs the model (`cargo xtask test` provides it); without it each test
//! prints one line and passes, unless `CI` is set.

mod common;

use std::path::Path;
use std::time::Duration;

use candle_core::{Device, IndexOp};
use common::testing::Trace;
use kvcache_api::{Fingerprint, Namespace};
use kvcache_causal::layer_cache::CandleKv;
use kvcache_engine::chat::{trie_turn, TurnOutcome};
use kvcache_engine::store::{self, StoreOptions};
use kvcache_models::{paths, Llama, ModelFile, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};
use kvcache_trie::PrefixCache;

const TOL: f32 = 1e-3;

/// One turn through a new trie over `dir`, generating one token; returns the
/// outcome and the logits of the last prompt token.
fn turn(
    model: &Llama,
    fingerprint: Fingerprint,
    dir: &Path,
    namespace: &Namespace,
    prompts: &[&[u32]],
) -> (Vec<TurnOutcome>, Vec<f32>) {
    let options = StoreOptions {
        dir: Some(dir.to_path_buf()),
        redis: None,
    };
    let store = store::open(fingerprint, store::kv_layout(model), &options).unwrap();
    let c = model.config();
    let caches: Vec<CandleKv> = (0..c.n_layers)
        .map(|_| CandleKv::new(c.n_kv_heads, c.head_dim, model.device()))
        .collect();
    let mut trie = PrefixCache::new(caches, 1 << 30).unwrap();
    trie.set_store(store.clone(), Duration::from_secs(30)).unwrap();
    let mut outcomes = Vec::new();
    let mut logits = Vec::new();
    for prompt in prompts {
        let outcome = trie_turn(
            &mut trie,
            namespace,
            prompt,
            1,
            None,
            |tokens, caches| {
                let h = model.hidden_layers(tokens, caches)?;
                Ok(h.narrow(0, tokens.len() - 1, 1)?)
            },
            |h| {
                logits = model.logits(h)?.squeeze(0)?.to_vec1::<f32>()?;
                Ok(kvcache_models::argmax(&logits))
            },
        )
        .unwrap();
        outcomes.push(outcome);
    }
    trie.check();
    store.flush();
    (outcomes, logits)
}

#[test]
fn a_restarted_engine_continues_a_conversation_from_the_disk_store() {
    let Some(path) = model_file(TestModel::SmolLM2) else {
        return;
    };
    let model = ModelFile::open(&path)
        .unwrap()
        .load(&Device::Cpu, WeightMode::F32, &mut |_| {})
        .unwrap();
    let fingerprint = store::model_fingerprint(&path, WeightMode::F32).unwrap();
    let trace = Trace::load(paths::e1_trace_path()).unwrap();
    // Conversation 0: turns 1 and 2 in the first engine, turn 3 in the second.
    let [first, second, third] = [0, 10, 20].map(|i| &trace.requests[i]);
    assert_eq!([first.conv, second.conv, third.conv], [0, 0, 0]);
    let dir = std::env::temp_dir().join(format!("kvcache-store-real-{}", std::process::id()));
    let shared = Namespace::shared();

    let (before, _) = turn(
        &model,
        fingerprint,
        &dir,
        &shared,
        &[&first.token_ids, &second.token_ids],
    );
    assert_eq!(before[0].restored, 0, "an empty store restores nothing");

    // A new engine: nothing in memory, the store's directory as the last one left it.
    let (after, logits) = turn(&model, fingerprint, &dir, &shared, &[&third.token_ids]);
    let restored = third.best_prefix_with_earlier;
    assert_eq!(restored, second.prompt_tokens, "turn 3 extends turn 2's prompt");
    assert_eq!(
        after[0].restored, restored,
        "all of turn 2's prompt, its partial last block too"
    );
    assert_eq!(after[0].tiers, vec![("disk", restored)]);
    assert_eq!(after[0].evaluated, third.prompt_tokens - restored);

    let full = model.forward_full(&third.token_ids, None).unwrap();
    let expected = full
        .i(third.token_ids.len() - 1)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let diff = expected
        .iter()
        .zip(&logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff <= TOL,
        "logits after a restore differ from full recompute by {diff}"
    );

    // Another tenant, or another model, restores nothing from the same directory.
    let tenant = Namespace::new("tenant-b").unwrap();
    let (other, _) = turn(&model, fingerprint, &dir, &tenant, &[&third.token_ids]);
    assert_eq!(other[0].restored, 0);
    let quantized = store::model_fingerprint(&path, WeightMode::Candle).unwrap();
    assert_ne!(quantized, fingerprint);
    let (other, _) = turn(&model, quantized, &dir, &shared, &[&third.token_ids]);
    assert_eq!(other[0].restored, 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
