//! The continuous-batching engine on the tiny random model: same tokens as
//! decoding each request alone, and context shifts equal to recomputation.

use candle_core::{Device, IndexOp, Tensor};
use kvcache_api::{CausalConfig, KeyShift};
use kvcache_causal::CausalKvCache;
use kvcache_demo::engine::{argmax, greedy, Engine, EngineConfig, Event, Request};
use kvcache_demo::{Llama, LlamaConfig};

fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(), 5, &Device::Cpu).unwrap()
}

fn cache(model: &Llama, config: CausalConfig) -> CausalKvCache {
    let shift: Box<dyn KeyShift<Tensor>> = Box::new(model.rope().clone());
    CausalKvCache::new(config, Device::Cpu, Some(shift)).unwrap()
}

fn prompt(id: usize) -> Vec<u32> {
    (0..3 + (id * 5) % 9)
        .map(|i| ((id * 13 + i * 7) % 64) as u32)
        .collect()
}

#[test]
fn continuous_batching_matches_decoding_alone() {
    let model = model();
    let requests: Vec<Request> = (0..7)
        .map(|id| Request {
            id,
            prompt: prompt(id),
            max_new_tokens: 2 + (id * 3) % 7,
        })
        .collect();
    let mut engine = Engine::new(
        &model,
        cache(&model, CausalConfig::new(3, 32, 8)),
        EngineConfig {
            max_batch: 8,
            prefill_chunk: 3,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    for r in &requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut events = Vec::new();
    let stats = engine.run(&mut |e| events.push(e.clone())).unwrap();

    let finished: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Finished(f) => Some(f.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(finished.len(), 7);
    for f in &finished {
        let r = &requests[f.id];
        let mut alone = cache(&model, CausalConfig::new(1, 32, 32));
        let expect = greedy(&model, &mut alone, 0, &r.prompt, r.max_new_tokens, None).unwrap();
        assert_eq!(f.generated, expect, "request {}", f.id);
        assert!(f.time_to_first_token <= f.total);
    }
    // Requests joined while others were running, and passes mixed decode and prefill.
    let first_finish = events
        .iter()
        .position(|e| matches!(e, Event::Finished(_)))
        .unwrap();
    assert!(events[first_finish..]
        .iter()
        .any(|e| matches!(e, Event::Joined { .. })));
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::Pass { decode, prefill, .. } if *decode > 0 && *prefill > 0)));
    let total_new: usize = requests.iter().map(|r| r.max_new_tokens).sum();
    let total_prompt: usize = requests.iter().map(|r| r.prompt.len()).sum();
    assert_eq!(stats.generated_tokens, total_new);
    assert_eq!(stats.prefill_tokens, total_prompt);
    assert_eq!(stats.decode_tokens, total_new - requests.len());
    assert_eq!(
        engine.cache().used_cells(),
        0,
        "finished sequences left the cache"
    );
}

#[test]
fn context_shift_equals_recomputing_the_shifted_tokens() {
    // One layer: a shifted key equals the key recomputed at its new position, so
    // the engine's tokens must equal greedy decoding by full recompute over the
    // same edited token list.
    let model = model().truncated(1);
    let (ctx, keep, new) = (12, 3, 30);
    let p = prompt(4);
    let mut engine = Engine::new(
        &model,
        cache(&model, CausalConfig::new(1, ctx + 1, 16)),
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 16,
            context: Some(ctx),
            keep,
            eos: None,
        },
    )
    .unwrap();
    engine
        .submit(Request {
            id: 0,
            prompt: p.clone(),
            max_new_tokens: new,
        })
        .unwrap();
    let mut events = Vec::new();
    let stats = engine.run(&mut |e| events.push(e.clone())).unwrap();
    let got = events
        .iter()
        .find_map(|e| match e {
            Event::Finished(f) => Some(f.generated.clone()),
            _ => None,
        })
        .unwrap();

    let mut tokens = p.clone();
    let mut expect = Vec::new();
    let mut shifts = 0;
    loop {
        let logits = model.forward_full(&tokens, None).unwrap();
        let t = argmax(&logits.i(tokens.len() - 1).unwrap().to_vec1::<f32>().unwrap());
        expect.push(t);
        if expect.len() == new {
            break;
        }
        tokens.push(t);
        // The engine shifts before feeding the pending token once `ctx` are cached.
        if tokens.len() > ctx {
            let discard = (tokens.len() - 1 - keep) / 2;
            tokens.drain(keep..keep + discard);
            shifts += 1;
        }
    }
    assert_eq!(got, expect);
    assert!(shifts >= 3, "{shifts}");
    assert_eq!(stats.context_shifts, shifts);
}

#[test]
fn e2_modes_decode_the_same_tokens() {
    let model = model();
    let prompts: Vec<Vec<u32>> = (0..8).map(prompt).collect();
    let cfg = kvcache_demo::bench::E2Config { tokens: 5, runs: 2 };
    let mut lines = Vec::new();
    let report =
        kvcache_demo::bench::e2_batched_decode(&model, &prompts, &cfg, &mut |l| lines.push(l.to_string()))
            .unwrap();
    assert_eq!(report.sequences, 8);
    assert_eq!((report.together.len(), report.sequential.len()), (2, 2));
    assert!(report.together.iter().chain(&report.sequential).all(|t| *t > 0.0));
    assert_eq!(report.mismatched_sequences, 0);
    assert_eq!(lines.len(), 4);
    assert!(report.to_string().contains("speed-up"));
}
