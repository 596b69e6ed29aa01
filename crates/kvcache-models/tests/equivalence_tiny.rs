//! Property tests: for random schedules, logits through each cache equal a full
//! recompute without any cache, within 1e-5, on a tiny random-weight Llama.

mod common;

use candle_core::{Device, Tensor};
use common::check::{Checker, Op};
use common::simple_cache::SimpleCache;
use kvcache_api::{CausalCache, CausalConfig, DType, KeyShift, Placement, SlidingWindow, VLayout};
use kvcache_causal::{CausalKvCache, RopeLayout, RopeShift};
use kvcache_models::{Llama, LlamaConfig, WeightMode};
use proptest::prelude::*;

const SEQS: usize = 4;
const CAPACITY: usize = 24;
const MAX_BATCH: usize = 32;
const TOL: f32 = 1e-5;
/// The bound with weights in blocks, each mode against itself (the recompute
/// multiplies the same blocks). A row's products are bit-identical in any
/// batch (the kernels' invariant: `quant_invariance.rs`), but attention sums
/// in another order through a cache than in the recompute (within ~1e-6), and
/// an activation that close to a rounding boundary of its 8-bit block rounds
/// the other way: one step of that block (1/127 of its largest value, ~0.02
/// for the final hidden states here) times one row of the head (|w| < 0.3),
/// ~7e-3 a flip, a few flips at most over a schedule; a wrong cell or
/// position costs O(1).
const QUANT_TOL: f32 = 5e-2;

fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(), 11, &Device::Cpu).unwrap()
}

fn model_in(mode: WeightMode) -> Llama {
    Llama::random_in(LlamaConfig::tiny(), 11, mode, &Device::Cpu).unwrap()
}

fn quantized_mode() -> impl Strategy<Value = WeightMode> {
    prop::sample::select(vec![
        WeightMode::Candle,
        WeightMode::Q8,
        WeightMode::Q4,
        WeightMode::Gguf,
    ])
}

fn op(shifts: bool) -> impl Strategy<Value = Op> {
    let seq = 0..SEQS;
    let step = prop::collection::vec((0..SEQS, prop_oneof![3 => Just(1usize), 1 => 1usize..7]), 1..4)
        .prop_map(Op::Step);
    let shift_weight = if shifts { 2 } else { 0 };
    prop_oneof![
        8 => step,
        1 => seq.clone().prop_map(Op::Leave),
        1 => (seq.clone(), 0.0..1.0f64).prop_map(|(s, f)| Op::Truncate(s, f)),
        shift_weight => (seq.clone(), 0.0..1.0f64, 1usize..5).prop_map(|(s, f, n)| Op::RemoveShift(s, f, n)),
        2 => (seq.clone(), seq, 0.0..1.0f64).prop_map(|(a, b, f)| Op::CopyPrefix(a, b, f)),
    ]
}

fn rope_shift(model: &Llama) -> Box<dyn KeyShift<Tensor>> {
    Box::new(model.rope().clone())
}

fn check<C: CausalCache<Tensor = Tensor>>(model: &Llama, cache: &mut C, ops: &[Op]) {
    check_within(model, cache, ops, TOL);
}

fn check_within<C: CausalCache<Tensor = Tensor>>(model: &Llama, cache: &mut C, ops: &[Op], tol: f32) {
    let config = cache.config().clone();
    let mut checker = Checker::new(model, &config);
    let report = checker.run(cache, ops).unwrap();
    assert!(
        report.max_diff <= tol,
        "max |cached - recomputed| = {} over {} rows ({report:?})",
        report.max_diff,
        report.rows
    );
}

fn base() -> CausalConfig {
    CausalConfig::new(SEQS, CAPACITY, MAX_BATCH)
}

proptest! {
    // 32 cases each unless PROPTEST_CASES says otherwise.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(32),
        ..ProptestConfig::default()
    })]

    #[test]
    fn simple_reference_cache(ops in prop::collection::vec(op(false), 1..24)) {
        let model = model();
        let mut cache = SimpleCache::new(base(), &Device::Cpu, Some(rope_shift(&model)));
        check(&model, &mut cache, &ops);
    }

    #[test]
    fn causal_cache_two_layers(ops in prop::collection::vec(op(false), 1..24)) {
        let model = model();
        let mut cache = CausalKvCache::new(base(), Device::Cpu, Some(rope_shift(&model))).unwrap();
        check(&model, &mut cache, &ops);
        cache.check();
    }

    #[test]
    fn quantized_weights_through_the_cache(ops in prop::collection::vec(op(true), 1..24), mode in quantized_mode()) {
        let model = model_in(mode);
        let model = if ops.iter().any(|o| matches!(o, Op::RemoveShift(..))) { model.truncated(1) } else { model };
        let mut cache = CausalKvCache::new(base(), Device::Cpu, Some(rope_shift(&model))).unwrap();
        check_within(&model, &mut cache, &ops, QUANT_TOL);
        cache.check();
    }

    #[test]
    fn causal_cache_one_layer_with_shifts(ops in prop::collection::vec(op(true), 1..24)) {
        let model = model().truncated(1);
        let mut cache = CausalKvCache::new(base(), Device::Cpu, Some(rope_shift(&model))).unwrap();
        check(&model, &mut cache, &ops);
        cache.check();
    }

    #[test]
    fn causal_cache_contiguous_padded_permuted(ops in prop::collection::vec(op(true), 1..24)) {
        let model = model().truncated(1);
        let config = base()
            .with_placement(Placement::Contiguous)
            .with_padding(4, 8)
            .with_v_layout(VLayout::Permuted)
            .with_mask_dtype(DType::F16)
            .with_compact_threshold(Some(0.25));
        // kvcache-causal's own RoPE shift, in GGUF's (normal) layout.
        let c = model.config();
        let shift = RopeShift::new(RopeLayout::Normal, c.head_dim, c.rope_base as f32).unwrap();
        let mut cache = CausalKvCache::new(config, Device::Cpu, Some(Box::new(shift))).unwrap();
        check(&model, &mut cache, &ops);
        cache.check();
    }

    #[test]
    fn causal_cache_sliding_window(ops in prop::collection::vec(op(true), 1..24), window in 2usize..6) {
        let model = model();
        let model = if ops.iter().any(|o| matches!(o, Op::RemoveShift(..))) { model.truncated(1) } else { model };
        let config = base().with_window(SlidingWindow::new(window));
        let mut cache = CausalKvCache::new(config, Device::Cpu, Some(rope_shift(&model))).unwrap();
        check(&model, &mut cache, &ops);
        cache.check();
    }
}

/// A fixed schedule exercising every operation, with its counts checked, so a
/// generator change cannot silently stop covering them.
#[test]
fn fixed_schedule_covers_every_operation() {
    let model = model().truncated(1);
    let mut cache = CausalKvCache::new(base(), Device::Cpu, Some(rope_shift(&model))).unwrap();
    let ops = [
        Op::Step(vec![(0, 6)]),
        Op::Step(vec![(0, 1), (1, 4)]),
        Op::CopyPrefix(0, 2, 0.5),
        Op::Step(vec![(2, 2), (0, 1), (1, 1)]),
        Op::RemoveShift(0, 0.0, 2), // shared with sequence 2: refused
        Op::RemoveShift(1, 0.2, 2),
        Op::Step(vec![(1, 1), (2, 1)]),
        Op::Leave(0),
        Op::RemoveShift(2, 0.0, 2), // no longer shared
        Op::Truncate(1, 0.5),
        Op::Step(vec![(0, 3), (1, 1), (2, 1), (3, 5)]),
    ];
    let mut checker = Checker::new(&model, &base());
    let report = checker.run(&mut cache, &ops).unwrap();
    assert!(report.max_diff <= TOL, "{report:?}");
    assert_eq!(report.passes, 5);
    assert_eq!(report.rows, 6 + 5 + 4 + 2 + 10);
    assert_eq!((report.shifts, report.refused_shifts, report.copies), (2, 1, 1));
    assert_eq!(checker.tokens(0).len(), 3);
    cache.check();
}
