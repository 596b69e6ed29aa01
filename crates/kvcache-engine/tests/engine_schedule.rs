//! How a pass is filled: decode steps first, then prompt chunks in the
//! room left, the longest-waiting request first, whatever its slot.

use candle_core::{Device, Tensor};
use kvcache_api::{CausalConfig, KeyShift};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{Engine, EngineConfig, Event, Request};
use kvcache_models::{Llama, LlamaConfig};

#[test]
fn prompt_chunks_go_to_the_longest_waiting_request_first() {
    let model = Llama::random(LlamaConfig::tiny(), 5, &Device::Cpu).unwrap();
    let shift: Box<dyn KeyShift<Tensor>> = Box::new(model.rope().clone());
    let cache = CausalKvCache::new(CausalConfig::new(2, 64, 4), Device::Cpu, Some(shift)).unwrap();
    let mut engine = Engine::new(
        &model,
        cache,
        EngineConfig {
            max_batch: 4,
            prefill_chunk: 4,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let long = |seed: u32| (0..12).map(|i| (seed + i * 7) % 64).collect::<Vec<u32>>();
    // X takes sequence 0 and leaves after one pass; A takes sequence 1.
    engine.submit(Request::new(0, vec![1, 2], 1)).unwrap();
    engine.submit(Request::new(1, long(3), 2)).unwrap();
    let mut events = Vec::new();
    engine.step(&mut |e| events.push(e.clone())).unwrap();
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::Finished(f) if f.id == 0)));
    // B joins sequence 0, below A's; A has waited longer and gets the pass.
    engine.submit(Request::new(2, long(5), 2)).unwrap();
    events.clear();
    engine.step(&mut |e| events.push(e.clone())).unwrap();
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::Joined { id: 2, seq: 0, .. })));
    let prefilled: Vec<(usize, usize)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Prefilled { id, done, .. } => Some((*id, *done)),
            _ => None,
        })
        .collect();
    // A had 2 of 12 after the first pass (X's 2 tokens went first); now 4 more.
    assert_eq!(prefilled, vec![(1, 6)]);
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Pass {
            decode: 0,
            prefill: 4,
            ..
        }
    )));
}
