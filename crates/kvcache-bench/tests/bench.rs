//! E1 and E2 (`kvcache_bench::bench`): E2's two modes decode the same tokens
//! on the tiny random model; on SmolLM2-135M-Instruct (f32), E1's prefix trie
//! evaluates exactly the trace's minimum.
//!
//! The model comes from `$KVCACHE_MODEL` (set by `cargo xtask test`) or the
//! download cache. Without it the real-model test prints one line and passes,
//! unless `CI` is set, where a missing model is a failure.

use candle_core::Device;
use kvcache_bench::bench::{e1_chat_reuse, e2_batched_decode, E2Config};
use kvcache_bench::trace::Trace;
use kvcache_engine::chat::Reuse;
use kvcache_models::{paths, Llama, LlamaConfig, ModelFile, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};

fn prompt(id: usize) -> Vec<u32> {
    (0..3 + (id * 5) % 9)
        .map(|i| ((id * 13 + i * 7) % 64) as u32)
        .collect()
}

#[test]
fn e2_modes_decode_the_same_tokens() {
    let model = Llama::random(LlamaConfig::tiny(), 5, &Device::Cpu).unwrap();
    let prompts: Vec<Vec<u32>> = (0..8).map(prompt).collect();
    let cfg = E2Config { tokens: 5, runs: 2 };
    let mut lines = Vec::new();
    let report = e2_batched_decode(&model, &prompts, &cfg, &mut |l| lines.push(l.to_string())).unwrap();
    assert_eq!(report.sequences, 8);
    assert_eq!((report.together.len(), report.sequential.len()), (2, 2));
    assert!(report.together.iter().chain(&report.sequential).all(|t| *t > 0.0));
    assert_eq!(report.mismatched_sequences, 0);
    assert_eq!(lines.len(), 4);
    assert!(report.to_string().contains("speed-up"));
}

#[test]
fn prefix_trie_evaluates_the_minimum_on_the_e1_trace() {
    let Some(path) = model_file(TestModel::SmolLM2) else {
        return;
    };
    let model = ModelFile::open(&path)
        .unwrap()
        .load(&Device::Cpu, WeightMode::F32, &mut |_| {})
        .unwrap();
    let trace = Trace::load(paths::e1_trace_path()).unwrap();
    // Turn 1 of conversations 0 and 1: the second reuses the shared system prompt.
    let trie = e1_chat_reuse(&model, &trace, Reuse::Trie, 2, 2, 1 << 30, &mut |_| {}).unwrap();
    for (row, r) in trie.rows.iter().zip(&trace.requests) {
        assert_eq!(
            row.outcome.matched, r.best_prefix_with_earlier,
            "request {}",
            r.idx
        );
        assert_eq!(row.outcome.evaluated, r.min_prefill, "request {}", r.idx);
        assert_eq!(row.outcome.generated.len(), 2);
    }
    assert_eq!(trie.evaluated(), 372 + 69);
    assert_eq!(trie.evaluated(), trie.min_prefill());
}
