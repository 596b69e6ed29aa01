//! The engine hands out the log-probabilities of the picks whose sampler
//! asked for them on their token events (`Event::Token::logprobs`), one per
//! token event of those requests, none for the others; asking changes no
//! greedy pick, and `logit_bias` steers the engine's picks.

use candle_core::{Device, Tensor};
use kvcache_api::{CausalConfig, KeyShift};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{Engine, EngineConfig, Event, Request};
use kvcache_engine::sampling::{Sampler, SamplingOptions, SamplingParams, TokenLogprobs};
use kvcache_models::{Llama, LlamaConfig};

fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(), 5, &Device::Cpu).unwrap()
}

fn engine(model: &Llama) -> Engine<'_, CausalKvCache> {
    let shift: Box<dyn KeyShift<Tensor>> = Box::new(model.rope().clone());
    let cache = CausalKvCache::new(CausalConfig::new(3, 64, 16), Device::Cpu, Some(shift)).unwrap();
    Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 4,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn prompt(id: usize) -> Vec<u32> {
    (0..5 + id).map(|i| ((id * 11 + i * 7) % 64) as u32).collect()
}

/// Runs requests 0 (with `options`), 1 and 2 (plain greedy) to the end:
/// each request's tokens, and the logprobs their events carried.
fn run(model: &Llama, options: SamplingOptions) -> (Vec<Vec<u32>>, Vec<(usize, TokenLogprobs)>) {
    let asked = options.logprobs.is_some();
    let mut engine = engine(model);
    let sampler = Sampler::with_options(SamplingParams::greedy(), options).unwrap();
    engine
        .submit_sampled(Request::new(0, prompt(0), 10), Some(sampler))
        .unwrap();
    engine.submit(Request::new(1, prompt(1), 10)).unwrap();
    let greedy = Sampler::new(SamplingParams::greedy()).unwrap();
    engine
        .submit_sampled(Request::new(2, prompt(2), 10), Some(greedy))
        .unwrap();
    let mut tokens = vec![Vec::new(); 3];
    let mut logprobs = Vec::new();
    loop {
        let mut step_tokens = Vec::new();
        let mut taken = Vec::new();
        let more = engine
            .step(&mut |e| {
                if let Event::Token {
                    id,
                    token,
                    logprobs: lp,
                    ..
                } = e
                {
                    step_tokens.push((*id, *token));
                    taken.extend(lp.clone().map(|lp| (*id, lp)));
                }
            })
            .unwrap();
        // This step's logprobs are exactly this step's tokens of request 0.
        let of_zero: Vec<(usize, u32)> = step_tokens.iter().copied().filter(|t| t.0 == 0).collect();
        let want = if asked { of_zero } else { Vec::new() };
        assert_eq!(
            taken.iter().map(|(id, lp)| (*id, lp.token)).collect::<Vec<_>>(),
            want
        );
        for &(id, token) in &step_tokens {
            tokens[id].push(token);
        }
        logprobs.extend(taken);
        if !more {
            break;
        }
    }
    (tokens, logprobs)
}

#[test]
fn logprobs_pair_with_their_tokens_and_change_no_greedy_pick() {
    let model = model();
    let (plain, none) = run(&model, SamplingOptions::default());
    assert!(none.is_empty(), "nothing asked, nothing handed out");
    let asked = SamplingOptions {
        logprobs: Some(3),
        ..SamplingOptions::default()
    };
    let (tokens, logprobs) = run(&model, asked);
    assert_eq!(tokens, plain, "asking for logprobs changes no pick");
    assert_eq!(logprobs.len(), 10);
    for (lp, &token) in logprobs.iter().map(|(_, lp)| lp).zip(&tokens[0]) {
        assert_eq!(lp.token, token);
        assert!(lp.logprob <= 0.0);
        assert_eq!(lp.top.len(), 3);
        // Greedy: the pick is the most likely token.
        assert_eq!(lp.top[0], (token, lp.logprob));
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
}

#[test]
fn logit_bias_steers_the_engine_and_leaves_the_neighbours_alone() {
    let model = model();
    let (plain, _) = run(&model, SamplingOptions::default());
    let forced = SamplingOptions {
        logit_bias: vec![(17, 100.0)],
        logprobs: Some(0),
        ..SamplingOptions::default()
    };
    let (tokens, logprobs) = run(&model, forced);
    assert_eq!(tokens[0], vec![17; 10]);
    assert!(logprobs
        .iter()
        .all(|(_, lp)| lp.logprob > -1e-3 && lp.top.is_empty()));
    assert_eq!(tokens[1..], plain[1..], "other requests keep their greedy picks");
}
