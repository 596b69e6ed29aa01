//! How a request ends is the engine's to decide and to say (issue 22): a
//! stop token, a stop sequence matched on the request's text, or
//! `max_new_tokens`; a request ended by a stop sequence keeps its cells for
//! the next turn like any other finished request.

mod common;

use common::letters::{self, cache, model, Letters};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{greedy, Engine, EngineConfig, Event, FinishReason, Finished, Request};
use kvcache_engine::EngineError;
use kvcache_models::{Llama, Tokenizer};

/// The letters engine with prefix reuse on.
fn engine(model: &Llama, stop_tokens: Vec<u32>) -> Engine<'_, CausalKvCache> {
    let mut engine = letters::engine(model, stop_tokens);
    engine.set_prefix_reuse(true).unwrap();
    engine
}

fn run(engine: &mut Engine<'_, CausalKvCache>) -> Finished {
    let mut finished = None;
    engine
        .run(&mut |e| {
            if let Event::Finished(f) = e {
                finished = Some(f.clone());
            }
        })
        .unwrap();
    finished.expect("a request finished")
}

const PROMPT: [u32; 6] = [3, 1, 4, 1, 5, 9];

/// What the prompt generates alone, greedily, up to 16 tokens.
fn free_run(model: &Llama) -> Vec<u32> {
    greedy(model, &mut cache(model), 0, &PROMPT, 16, None).unwrap()
}

#[test]
fn a_stop_sequence_ends_the_request_on_the_token_that_completes_it() {
    let model = model();
    let free = free_run(&model);
    let text = Letters.decode_text(&free).unwrap();
    // A two-letter stop from the middle of the free run; the request ends at
    // its first occurrence.
    let stop = text[4..6].to_string();
    let end = text.find(&stop).unwrap() + stop.len();
    let mut engine = engine(&model, Vec::new());
    let mut request = Request::new(0, PROMPT.to_vec(), 16);
    request.stop = vec!["zzzz".into(), stop.clone()];
    engine.submit(request).unwrap();
    let done = run(&mut engine);
    assert_eq!(done.reason, FinishReason::StopSequence(1));
    assert_eq!(done.generated, free[..end]);
    assert_eq!(done.reason.openai(), "stop");

    // Its cells stay for the next turn: the prompt and every generated
    // token but the last (never fed back).
    assert_eq!(engine.idle_sequences(), 1);
    let mut next = PROMPT.to_vec();
    next.extend_from_slice(&done.generated);
    next.extend_from_slice(&[7, 7]);
    engine.submit(Request::new(1, next, 2)).unwrap();
    let again = run(&mut engine);
    assert_eq!(again.reused, PROMPT.len() + done.generated.len() - 1);
    assert_eq!(again.reason, FinishReason::Length);
    assert_eq!(engine.reuse_stats().cancelled, 0);
    engine.cache().check();
}

/// The free run, the index of its first token that is also its fourth, and
/// an engine that stops on that token with request 0 of the prompt queued.
fn ending_on_a_token(model: &Llama) -> (Vec<u32>, usize, Engine<'_, CausalKvCache>) {
    let free = free_run(model);
    let token = free[3];
    let first = free.iter().position(|&t| t == token).unwrap();
    let mut engine = engine(model, vec![token]);
    engine.submit(Request::new(0, PROMPT.to_vec(), 16)).unwrap();
    (free, first, engine)
}

#[test]
fn a_stop_token_or_the_length_ends_the_request() {
    let model = model();
    let (free, first, mut engine) = ending_on_a_token(&model);
    let done = run(&mut engine);
    assert_eq!(done.reason, FinishReason::StopToken);
    assert_eq!(done.generated, free[..=first]);

    let mut engine = self::engine(&model, Vec::new());
    engine.submit(Request::new(0, PROMPT.to_vec(), 5)).unwrap();
    let done = run(&mut engine);
    assert_eq!(
        (done.reason.clone(), done.generated.clone()),
        (FinishReason::Length, free[..5].to_vec())
    );
    assert_eq!(done.reason.openai(), "length");
}

#[test]
fn stop_sequences_need_a_tokenizer_and_must_not_be_empty() {
    let model = model();
    let config = EngineConfig {
        max_batch: 16,
        ..EngineConfig::default()
    };
    let mut bare = Engine::new(&model, cache(&model), config).unwrap();
    let mut request = Request::new(0, PROMPT.to_vec(), 4);
    request.stop = vec!["ab".into()];
    assert!(matches!(
        bare.submit(request.clone()),
        Err(EngineError::InvalidArgument(_))
    ));
    let mut engine = engine(&model, Vec::new());
    request.stop = vec![String::new()];
    assert!(matches!(
        engine.submit(request),
        Err(EngineError::InvalidArgument(_))
    ));
    assert_eq!((bare.queued(), engine.queued()), (0, 0));
}

/// Runs the engine to the end: every event of request `id`, cloned.
fn events_of(engine: &mut Engine<'_, CausalKvCache>, id: usize) -> Vec<Event> {
    let mut events = Vec::new();
    engine
        .run(&mut |e| {
            let of = match e {
                Event::Joined { id, .. } | Event::Token { id, .. } | Event::Failed { id, .. } => *id,
                Event::Finished(f) => f.id,
                _ => return,
            };
            if of == id {
                events.push(e.clone());
            }
        })
        .unwrap();
    events
}

/// The texts of the token events among `events`.
fn texts(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn the_token_events_carry_the_answer_and_a_split_stop_is_cut_once() {
    let model = model();
    let free = free_run(&model);
    let text = Letters.decode_text(&free).unwrap();
    // Two letters, one token each: the stop spans two tokens.
    let stop = text[4..6].to_string();
    let at = text.find(&stop).unwrap();
    let mut engine = engine(&model, Vec::new());
    let mut request = Request::new(0, PROMPT.to_vec(), 16);
    request.stop = vec![stop.clone()];
    engine.submit(request).unwrap();
    let events = events_of(&mut engine, 0);
    let texts = texts(&events);
    // One token event per token up to the one completing the stop, then the end.
    assert_eq!(texts.len(), at + stop.len());
    assert_eq!(texts.concat(), text[..at]);
    // The stop's first letter was held back (it could start the stop), and
    // neither of its letters ever went out.
    assert_eq!(texts[at..], [String::new(), String::new()]);
    assert!(texts[..at].iter().all(|t| t.len() == 1), "{texts:?}");
    let ends: Vec<&Event> = events
        .iter()
        .filter(|e| matches!(e, Event::Finished(_)))
        .collect();
    assert_eq!(ends.len(), 1);
    assert!(matches!(ends[0], Event::Finished(f) if f.reason == FinishReason::StopSequence(0)));
    assert!(
        matches!(events.last(), Some(Event::Finished(_))),
        "nothing after the end"
    );

    // Without a stop, the texts are the whole answer; the last carries what
    // was held for a stop that never came.
    let mut request = Request::new(1, PROMPT.to_vec(), 8);
    request.stop = vec![format!("{}zz", &text[7..8])];
    engine.submit(request).unwrap();
    let texts = self::texts(&events_of(&mut engine, 1));
    assert_eq!(texts.concat(), text[..8]);
}

#[test]
fn a_stop_token_adds_no_text_and_joined_counts_the_reuse() {
    let model = model();
    let (free, first, mut engine) = ending_on_a_token(&model);
    let events = events_of(&mut engine, 0);
    // The stop token is a letter here, yet its text never shows.
    assert_eq!(
        texts(&events).concat(),
        Letters.decode_text(&free[..first]).unwrap()
    );
    assert!(matches!(
        &events[0],
        Event::Joined {
            reused: 0,
            restored: 0,
            ..
        }
    ));
    // The next turn reuses the first one's cells, and says so when it joins.
    let mut next = PROMPT.to_vec();
    next.extend_from_slice(&free[..=first]);
    next.push(7);
    engine.submit(Request::new(1, next, 2)).unwrap();
    let events = events_of(&mut engine, 1);
    let Event::Finished(done) = events.last().unwrap() else {
        panic!("{events:?}")
    };
    assert_eq!(done.reused, PROMPT.len() + first);
    assert!(
        matches!(&events[0], Event::Joined { reused, restored: 0, restored_from, .. }
            if *reused == done.reused && restored_from.is_empty()),
        "{:?}",
        events[0]
    );
}
