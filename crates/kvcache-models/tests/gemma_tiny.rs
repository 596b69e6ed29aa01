//! The tiny random-weight Gemma (a window layer of 8 positions, then a global
//! layer): the cached path through a `LayerGroupCache` equals a from-scratch
//! recompute over a conversation longer than 3 windows, with a fork, a branch
//! switch, an eviction and a context shift. Milliseconds.

mod gemma_common;

use candle_core::{Device, IndexOp};
use gemma_common::{conversation, max_abs_diff, Pair};
use kvcache_api::{CausalCache, CausalConfig, VLayout};
use kvcache_models::gemma::{Gemma, GemmaConfig};
use kvcache_models::BatchToken;

fn tiny() -> Gemma {
    Gemma::random(GemmaConfig::tiny(), 11, &Device::Cpu).unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 11 + 5) % 64).collect()
}

#[test]
fn window_layers_see_only_the_window_and_global_layers_everything() {
    let model = tiny();
    let a = tokens(20, 1);
    let mut b = a.clone();
    b[0] = (b[0] + 1) % 64;
    let (fa, fb) = (model.forward_full(&a).unwrap(), model.forward_full(&b).unwrap());
    // The global layer carries token 0 to the last row.
    assert!(max_abs_diff(&fa.i(19).unwrap(), &fb.i(19).unwrap()) > 1e-3);
    // With every layer a window layer, token 0 is out of reach of row 19
    // (2 layers of window 8 reach 14 positions back).
    let mut windowed = model.config().clone();
    windowed.global_every = 1000;
    let w = model.with_choices(windowed).unwrap();
    let (wa, wb) = (w.forward_full(&a).unwrap(), w.forward_full(&b).unwrap());
    assert_eq!(max_abs_diff(&wa.i(19).unwrap(), &wb.i(19).unwrap()), 0.0);
    assert!(max_abs_diff(&wa.i(10).unwrap(), &wb.i(10).unwrap()) > 1e-3);
}

fn run_conversation(v_layout: VLayout) -> (f32, usize, f32) {
    let model = tiny();
    let base = CausalConfig::new(2, 64, 16).with_v_layout(v_layout);
    let cache = model.new_cache(&base, 16, &Device::Cpu).unwrap();
    let mut pair = Pair::new(&model, cache, 1);
    conversation(&mut pair, 8, &tokens(48, 2), &tokens(16, 3), 5, true)
}

#[test]
fn a_conversation_through_the_cache_equals_recompute() {
    for layout in [VLayout::Normal, VLayout::Permuted] {
        let (diff, rows, full) = run_conversation(layout);
        assert!(rows > 50, "{rows} rows compared");
        assert!(diff <= 1e-4, "{layout:?}: cached vs from scratch: {diff}");
        assert!(full <= 1e-4, "{layout:?}: reference vs full recompute: {full}");
    }
}

#[test]
fn window_layers_keep_only_their_memory() {
    let model = tiny();
    let cache = model
        .new_cache(&CausalConfig::new(1, 64, 16), 12, &Device::Cpu)
        .unwrap();
    let mut pair = Pair::new(&model, cache, 1);
    pair.feed(0, &tokens(40, 4), 10);
    let state = pair.cache.picture().unwrap();
    let used = |g: usize| state[g].cells.iter().flatten().count();
    // The window group keeps its memory (plus at most one batch), the global group all.
    assert!(used(0) <= 12 + 10, "window group holds {}", used(0));
    assert_eq!(used(1), 40);
    // Behind the memory a conversation cannot resume; inside it, it can.
    assert!(!pair.cache.can_resume(0, 20));
    assert!(pair.cache.can_resume(0, 38));
}

#[test]
fn bad_tokens_are_rejected_before_the_cache_changes() {
    let model = tiny();
    let mut cache = model
        .new_cache(&CausalConfig::new(1, 64, 16), 12, &Device::Cpu)
        .unwrap();
    let ok = BatchToken {
        seq: 0,
        pos: 0,
        token: 3,
    };
    model.forward(&[ok], &mut cache).unwrap();
    let before = cache.picture().unwrap();
    let bad = BatchToken {
        seq: 0,
        pos: 1,
        token: 64,
    };
    assert!(model.forward(&[bad], &mut cache).is_err());
    assert_eq!(cache.picture().unwrap(), before);
}
