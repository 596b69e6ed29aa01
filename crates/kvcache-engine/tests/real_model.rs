//! SmolLM2-135M-Instruct (f32): tokenizer against the E1 trace, a sanity answer,
//! and cached logits equal to full recompute within 1e-3.
//!
//! The model comes from `$KVCACHE_MODEL` (set by `cargo xtask test`) or the
//! download cache. Without it each test prints one line and passes, unless `CI` is
//! set, where a missing model is a failure.

mod common;

use std::sync::OnceLock;

use candle_core::{Device, IndexOp};
use common::check::{Checker, Op};
use common::testing::Trace;
use kvcache_api::{CausalCache, CausalConfig, SlidingWindow};
use kvcache_causal::{CausalKvCache, RopeLayout, RopeShift};
use kvcache_engine::engine::greedy;
use kvcache_models::tokenizer::{chatml, Message, Role};
use kvcache_models::{paths, BatchToken, ChatTokenizer, Llama, LlamaConfig, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};

const TOL: f32 = 1e-3;

struct Loaded {
    model: Llama,
    tokenizer: ChatTokenizer,
}

fn loaded() -> Option<&'static Loaded> {
    static LOADED: OnceLock<Option<Loaded>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path = model_file(TestModel::SmolLM2)?;
            let file = kvcache_models::ModelFile::open(&path).unwrap();
            let model = file.load(&Device::Cpu, WeightMode::F32, &mut |_| {}).unwrap();
            let tokenizer = file.tokenizer().unwrap();
            Some(Loaded { model, tokenizer })
        })
        .as_ref()
}

fn cache_for(model: &Llama, config: CausalConfig) -> CausalKvCache {
    let c = model.config();
    let shift = RopeShift::new(RopeLayout::Normal, c.head_dim, c.rope_base as f32).unwrap();
    CausalKvCache::new(config, Device::Cpu, Some(Box::new(shift))).unwrap()
}

#[test]
fn header_gives_the_documented_config() {
    let Some(l) = loaded() else { return };
    assert_eq!(l.model.config(), &LlamaConfig::smollm2_135m());
    assert_eq!(l.tokenizer.vocab_size(), 49152);
    assert_eq!((l.tokenizer.bos_token_id(), l.tokenizer.eos_token_id()), (1, 2));
}

#[test]
fn tokenizer_reproduces_the_e1_trace() {
    let Some(l) = loaded() else { return };
    let trace = Trace::load(paths::e1_trace_path()).unwrap();
    assert_eq!(trace.requests.len(), 80);
    let mut total = 0;
    for r in &trace.requests {
        let ids = l.tokenizer.encode(&r.prompt).unwrap();
        assert_eq!(ids, r.token_ids, "request {} tokenizes differently", r.idx);
        assert_eq!(
            l.tokenizer.decode(&ids).unwrap(),
            r.prompt,
            "request {} does not round-trip",
            r.idx
        );
        total += ids.len();
    }
    assert_eq!(total, 62_211);
    // The trace's prompts are our ChatML template applied to its conversations.
    let r = &trace.requests[12]; // conversation 2, turn 2
    let turns = &trace.conversations[r.conv];
    let mut messages = vec![Message::new(Role::System, trace.system.clone())];
    for t in &turns[..r.turn - 1] {
        messages.push(Message::new(Role::User, t.user.clone()));
        messages.push(Message::new(Role::Assistant, t.assistant.clone()));
    }
    messages.push(Message::new(Role::User, turns[r.turn - 1].user.clone()));
    assert_eq!(chatml(&messages, true), r.prompt);
}

#[test]
fn answers_a_simple_question() {
    let Some(l) = loaded() else { return };
    let prompt = chatml(
        &[Message::new(Role::User, "What is the capital of France?")],
        true,
    );
    let ids = l.tokenizer.encode(&prompt).unwrap();
    let mut cache = cache_for(&l.model, CausalConfig::new(1, 128, 64));
    let out = greedy(
        &l.model,
        &mut cache,
        0,
        &ids,
        12,
        Some(l.tokenizer.eos_token_id()),
    )
    .unwrap();
    let text = l.tokenizer.decode(&out).unwrap();
    assert!(text.contains("Paris"), "reply: {text:?}");
    // The same tokens come out of full recomputation.
    let mut all = ids.clone();
    for &t in &out[..4] {
        let logits = l.model.forward_full(&all, None).unwrap();
        let row = logits.i(all.len() - 1).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(kvcache_models::argmax(&row), t);
        all.push(t);
    }
}

#[test]
fn cached_logits_equal_full_recompute() {
    let Some(l) = loaded() else { return };
    let config = CausalConfig::new(3, 32, 32);
    let mut cache = cache_for(&l.model, config.clone());
    let ops = [
        Op::Step(vec![(0, 10)]),
        Op::Step(vec![(0, 1), (1, 6)]),
        Op::CopyPrefix(0, 2, 0.5),
        Op::Step(vec![(2, 2), (0, 1), (1, 1)]),
        Op::Truncate(1, 0.5),
        Op::Step(vec![(1, 2), (2, 1)]),
        Op::Leave(0),
        Op::Step(vec![(0, 3), (2, 1)]),
    ];
    let mut checker = Checker::new(&l.model, &config);
    let report = checker.run(&mut cache, &ops).unwrap();
    println!("30 layers, full attention: {report:?}");
    assert!(report.max_diff <= TOL, "{report:?}");
    assert_eq!(
        (report.passes, report.rows, report.copies),
        (5, 10 + 7 + 4 + 3 + 4, 1)
    );
    cache.check();
}

#[test]
fn cached_logits_equal_full_recompute_with_a_sliding_window() {
    let Some(l) = loaded() else { return };
    let config = CausalConfig::new(2, 32, 16).with_window(SlidingWindow::new(4));
    let mut cache = cache_for(&l.model, config.clone());
    let ops = [
        Op::Step(vec![(0, 7)]),
        Op::Step(vec![(0, 1), (1, 3)]),
        Op::Step(vec![(0, 1), (1, 1)]),
        Op::Step(vec![(0, 1), (1, 1)]),
    ];
    let mut checker = Checker::new(&l.model, &config);
    let report = checker.run(&mut cache, &ops).unwrap();
    println!("30 layers, window 4: {report:?}");
    assert!(report.max_diff <= TOL, "{report:?}");
    assert_eq!(report.rows, 7 + 4 + 2 + 2);
    // Trimmed to the window's memory: sequence 0 holds 10 tokens but keeps few cells.
    assert!(cache.positions(0).len() < 10, "{:?}", cache.positions(0));
}

#[test]
fn shifted_removals_equal_recompute_on_one_real_layer() {
    let Some(l) = loaded() else { return };
    // With one layer, a shifted key is exactly the key recomputed at its new
    // position, so kvcache-causal's RoPE shift is checked at SmolLM2's head size
    // and frequency base.
    let model = l.model.truncated(1);
    let config = CausalConfig::new(2, 48, 48);
    let mut cache = cache_for(&model, config.clone());
    let ops = [
        Op::Step(vec![(0, 20), (1, 8)]),
        Op::RemoveShift(0, 0.25, 6),
        Op::Step(vec![(0, 2), (1, 1)]),
        Op::RemoveShift(1, 0.0, 3),
        Op::RemoveShift(0, 0.5, 4),
        Op::Step(vec![(0, 1), (1, 2)]),
    ];
    let mut checker = Checker::new(&model, &config);
    let report = checker.run(&mut cache, &ops).unwrap();
    println!("1 layer with shifts: {report:?}");
    assert!(report.max_diff <= TOL, "{report:?}");
    assert_eq!(report.shifts, 3);
}

#[test]
fn quantized_weights_pick_the_same_next_token() {
    let Some(_) = loaded() else { return };
    let path = paths::model_path().unwrap();
    let file = kvcache_models::ModelFile::open(&path).unwrap();
    let q = file.load(&Device::Cpu, WeightMode::Candle, &mut |_| {}).unwrap();
    let l = loaded().unwrap();
    let ids = l.tokenizer.encode("The capital of France is").unwrap();
    let batch: Vec<BatchToken> = ids
        .iter()
        .enumerate()
        .map(|(i, &token)| BatchToken {
            seq: 0,
            pos: i as i32,
            token,
        })
        .collect();
    let mut cache = cache_for(&q, CausalConfig::new(1, 16, 16));
    let lq = q.forward(&batch, &mut cache).unwrap();
    let lf = l.model.forward_full(&ids, None).unwrap();
    let last = ids.len() - 1;
    let rq = lq.i(last).unwrap().to_vec1::<f32>().unwrap();
    let rf = lf.i(last).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(kvcache_models::argmax(&rq), kvcache_models::argmax(&rf));
    assert_eq!(cache.config().max_sequences, 1);
}
