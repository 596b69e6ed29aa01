//! The request fields vLLM adds to OpenAI's, as the engine honours them:
//! `ignore_eos`, `min_tokens`, `stop_token_ids`, and the sampler's `top_k`.

mod common;

use common::letters::{cache, engine, model, Letters};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{greedy, Engine, Event, FinishReason, Finished, Request};
use kvcache_engine::sampling::{Sampler, SamplingOptions, SamplingParams};
use kvcache_engine::EngineError;
use kvcache_models::{Llama, Tokenizer};

const PROMPT: [u32; 6] = [3, 1, 4, 1, 5, 9];
const MAX: usize = 16;

/// What the prompt generates alone, greedily, up to [`MAX`] tokens.
fn free_run(model: &Llama) -> Vec<u32> {
    greedy(model, &mut cache(model), 0, &PROMPT, MAX, None).unwrap()
}

/// Runs `request` alone (greedy unless `sampler`) to its end: how it
/// finished and the text its token events carried.
fn run(
    engine: &mut Engine<'_, CausalKvCache>,
    request: Request,
    sampler: Option<Sampler>,
) -> (Finished, String) {
    engine.submit_sampled(request, sampler).unwrap();
    let (mut finished, mut text) = (None, String::new());
    engine
        .run(&mut |e| match e {
            Event::Token { text: t, .. } => text.push_str(t),
            Event::Finished(f) => finished = Some(f.clone()),
            _ => {}
        })
        .unwrap();
    engine.cache().check();
    (finished.expect("the request finished"), text)
}

fn request(edit: impl FnOnce(&mut Request)) -> Request {
    let mut request = Request::new(0, PROMPT.to_vec(), MAX);
    edit(&mut request);
    request
}

/// The free run's fourth token, which the tests make a stop token, and the
/// index of its first occurrence (where a plain request ends).
fn stop_token_of(free: &[u32]) -> (u32, usize) {
    let token = free[3];
    (token, free.iter().position(|&t| t == token).unwrap())
}

#[test]
fn ignore_eos_runs_past_the_stop_tokens_to_the_length() {
    let model = model();
    let free = free_run(&model);
    let (token, first) = stop_token_of(&free);
    let mut engine = engine(&model, vec![token]);

    let (plain, _) = run(&mut engine, request(|_| {}), None);
    assert_eq!(plain.reason, FinishReason::StopToken);
    assert_eq!(plain.generated, free[..=first]);

    let (ignoring, text) = run(&mut engine, request(|r| r.ignore_eos = true), None);
    assert_eq!(ignoring.reason, FinishReason::Length);
    assert_eq!(ignoring.generated, free, "nothing masked: the free run");
    // The ignored stop token is an ordinary token now, text and all.
    assert_eq!(text, Letters.decode_text(&free).unwrap());
}

#[test]
fn stop_token_ids_end_the_request_ignore_eos_or_not() {
    let model = model();
    let free = free_run(&model);
    let (token, first) = stop_token_of(&free);
    let mut engine = engine(&model, Vec::new());
    for ignore_eos in [false, true] {
        let (done, text) = run(
            &mut engine,
            request(|r| {
                r.stop_token_ids = vec![token];
                r.ignore_eos = ignore_eos;
            }),
            None,
        );
        assert_eq!(done.reason, FinishReason::StopToken, "ignore_eos {ignore_eos}");
        assert_eq!(done.generated, free[..=first]);
        // Its text is left out, as an engine stop token's is.
        assert_eq!(text, Letters.decode_text(&free[..first]).unwrap());
    }
}

#[test]
fn min_tokens_masks_the_stop_tokens_until_it_is_reached() {
    let model = model();
    let free = free_run(&model);
    let (token, first) = stop_token_of(&free);
    let min_tokens = first + 3;
    let mut engine = engine(&model, vec![token]);
    let (done, _) = run(&mut engine, request(|r| r.min_tokens = min_tokens), None);
    // Up to the stop token's first place the picks are the free run's; there
    // the stop token could not be picked, nor in the tokens after, up to
    // min_tokens.
    assert_eq!(done.generated[..first], free[..first]);
    assert_ne!(done.generated[first], token);
    assert!(done.generated.len() > min_tokens, "{done:?}");
    assert!(!done.generated[..min_tokens].contains(&token), "{done:?}");
    match done.reason {
        FinishReason::StopToken => assert_eq!(done.generated.last(), Some(&token)),
        FinishReason::Length => assert_eq!(done.generated.len(), MAX),
        other => panic!("{other:?}"),
    }
}

#[test]
fn min_tokens_lets_no_stop_sequence_end_the_request_before_it() {
    let model = model();
    let free = free_run(&model);
    let text = Letters.decode_text(&free).unwrap();
    // One letter of the free run (one token each) as the stop sequence.
    let stop = text[3..4].to_string();
    let at = text.find(&stop).unwrap();
    let mut engine = engine(&model, Vec::new());

    let (plain, told) = run(&mut engine, request(|r| r.stop = vec![stop.clone()]), None);
    assert_eq!(plain.reason, FinishReason::StopSequence(0));
    assert_eq!(told, text[..at]);

    // min_tokens past the first occurrence: the stop is looked for from the
    // min_tokens-th letter on, and the text before it all goes out.
    let min_tokens = at + 2;
    let (held, told) = run(
        &mut engine,
        request(|r| {
            r.stop = vec![stop.clone()];
            r.min_tokens = min_tokens;
        }),
        None,
    );
    match text[min_tokens - 1..].find(&stop) {
        Some(i) => {
            let end = min_tokens - 1 + i;
            assert_eq!(held.reason, FinishReason::StopSequence(0));
            assert_eq!(held.generated, free[..=end]);
            assert_eq!(told, text[..end]);
        }
        None => {
            assert_eq!(held.reason, FinishReason::Length);
            assert_eq!(told, text);
        }
    }
    assert!(told.len() >= min_tokens - 1 && told[..at + 1].ends_with(&stop));
}

#[test]
fn min_tokens_beyond_max_tokens_is_refused_and_leaves_nothing_queued() {
    let model = model();
    let mut engine = engine(&model, Vec::new());
    let refused = engine.submit(request(|r| r.min_tokens = MAX + 1));
    assert!(
        matches!(&refused, Err(EngineError::InvalidArgument(m)) if m.contains("min_tokens")),
        "{refused:?}"
    );
    assert_eq!((engine.queued(), engine.active()), (0, 0));
}

#[test]
fn top_k_of_one_is_greedy_at_any_temperature() {
    let model = model();
    let free = free_run(&model);
    let mut engine = engine(&model, Vec::new());
    for seed in [1, 2, 3] {
        let hot = SamplingParams {
            temperature: 1.5,
            top_p: 1.0,
            seed: Some(seed),
        };
        let top1 = SamplingOptions {
            top_k: Some(1),
            ..SamplingOptions::default()
        };
        let sampler = Sampler::with_options(hot, top1).unwrap();
        let (done, _) = run(&mut engine, request(|_| {}), Some(sampler));
        assert_eq!(done.generated, free, "seed {seed}");
    }
    // Without it, a hot sampler leaves the greedy path (so the test can fail).
    let leaves = [1, 2, 3].into_iter().any(|seed| {
        let hot = SamplingParams {
            temperature: 1.5,
            top_p: 1.0,
            seed: Some(seed),
        };
        let (done, _) = run(&mut engine, request(|_| {}), Some(Sampler::new(hot).unwrap()));
        done.generated != free
    });
    assert!(leaves);
}
