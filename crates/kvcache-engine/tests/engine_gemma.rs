//! The batching engine over a model with window layers (the tiny random
//! Gemma: a window layer of 8 positions, then a global one) through its
//! `LayerGroupCache`, written once over the `Model` trait: batched requests
//! generate what each generates alone, a conversation's next turn continues
//! its finished sequence, and a sequence whose window layers no longer hold
//! what a prompt needs is not resumed (the prompt is evaluated whole). With
//! blocks of `block_tokens`, finished requests are kept by block per layer
//! group, beyond the sequence ids, and reported to a router.

use candle_core::Device;
use kvcache_api::CausalConfig;
use kvcache_causal::LayerGroupCache;
use kvcache_engine::engine::{greedy, Engine, EngineConfig, Event, Finished, Request};
use kvcache_models::gemma::{Gemma, GemmaConfig};

fn model() -> Gemma {
    Gemma::random(GemmaConfig::tiny(), 9, &Device::Cpu).unwrap()
}

fn cache(model: &Gemma, sequences: usize, batch: usize, window_memory: usize) -> LayerGroupCache {
    model
        .new_cache(
            &CausalConfig::new(sequences, 48, batch),
            window_memory,
            &Device::Cpu,
        )
        .unwrap()
}

fn prompt(id: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((id * 17 + i * 5 + 3) % 64) as u32).collect()
}

/// What `prompt` generates alone, in a fresh cache.
fn alone(model: &Gemma, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut fresh = cache(model, 1, 48, 8);
    greedy(model, &mut fresh, 0, prompt, n, None).unwrap()
}

fn run(engine: &mut Engine<'_, LayerGroupCache, Gemma>) -> Vec<Finished> {
    let mut finished = Vec::new();
    engine
        .run(&mut |e| {
            if let Event::Finished(f) = e {
                finished.push(f.clone());
            }
        })
        .unwrap();
    finished
}

fn engine(model: &Gemma, sequences: usize, window_memory: usize) -> Engine<'_, LayerGroupCache, Gemma> {
    Engine::new(
        model,
        cache(model, sequences, 16, window_memory),
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 5,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// An engine over `cache` keeping finished requests by blocks of 4 tokens.
fn by_block(model: &Gemma, cache: LayerGroupCache) -> Engine<'_, LayerGroupCache, Gemma> {
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 5,
            block_tokens: Some(4),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    engine.set_prefix_reuse(true).unwrap();
    engine
}

#[test]
fn batched_requests_past_the_window_generate_what_each_generates_alone() {
    let model = model();
    let mut engine = engine(&model, 3, 8);
    // Prompts of 4 to 19 tokens and up to 9 new ones: most run past the window.
    let requests: Vec<Request> = (0..6)
        .map(|id| Request::new(id, prompt(id, 4 + id * 3), 3 + id))
        .collect();
    for r in &requests {
        engine.submit(r.clone()).unwrap();
    }
    let finished = run(&mut engine);
    assert_eq!(finished.len(), requests.len());
    for f in &finished {
        let r = &requests[f.id];
        assert_eq!(
            f.generated,
            alone(&model, &r.prompt, r.max_new_tokens),
            "request {}",
            f.id
        );
    }
    engine.cache().check();
}

#[test]
fn a_next_turn_continues_its_finished_sequence() {
    let model = model();
    // Window layers keep 4 positions beyond the window: room for the answer.
    let mut engine = engine(&model, 4, 12);
    engine.set_prefix_reuse(true).unwrap();
    let first = prompt(1, 10);
    engine.submit(Request::new(0, first.clone(), 3)).unwrap();
    let answer = run(&mut engine).remove(0).generated;
    assert_eq!(engine.idle_sequences(), 1);

    // The next turn: the history (the answer's first two tokens, as a
    // client would send them back) and a new message.
    let mut second = first.clone();
    second.extend_from_slice(&answer[..2]);
    second.extend_from_slice(&prompt(2, 5));
    engine.submit(Request::new(1, second.clone(), 4)).unwrap();
    let done = run(&mut engine).remove(0);
    // The cache held the prompt and the answer's first two tokens (the last
    // one was never fed back).
    assert_eq!(done.reused, first.len() + 2);
    assert_eq!(done.generated, alone(&model, &second, 4));
    // Continued in place: one sequence, not the old turn kept beside the new.
    assert_eq!(engine.idle_sequences(), 1);
    assert_eq!(
        engine.reuse_stats().evaluated_tokens,
        first.len() + second.len() - (first.len() + 2)
    );
    engine.cache().check();
}

#[test]
fn a_sequence_its_window_layers_no_longer_hold_is_not_resumed() {
    let model = model();
    // Window layers keep only the window: a 20-token sequence holds its
    // last 8 positions there, so a prompt parting from it at 15 cannot
    // resume it (positions 7..15 are gone).
    let mut engine = engine(&model, 4, 8);
    engine.set_prefix_reuse(true).unwrap();
    let first = prompt(3, 20);
    engine.submit(Request::new(0, first.clone(), 2)).unwrap();
    run(&mut engine);
    let mut branch = first[..15].to_vec();
    branch.extend_from_slice(&prompt(4, 3));
    engine.submit(Request::new(1, branch.clone(), 3)).unwrap();
    let done = run(&mut engine).remove(0);
    assert_eq!(done.reused, 0);
    assert_eq!(done.generated, alone(&model, &branch, 3));
    // A prompt extending the whole sequence still resumes it.
    let mut next = first.clone();
    next.extend_from_slice(&prompt(5, 2));
    engine.submit(Request::new(2, next.clone(), 2)).unwrap();
    let done = run(&mut engine).remove(0);
    assert!(done.reused >= first.len(), "reused {}", done.reused);
    assert_eq!(done.generated, alone(&model, &next, 2));
    engine.cache().check();
}

#[test]
fn the_chat_runs_gemma_through_the_trie_as_from_scratch() {
    use kvcache_engine::chat::{Chat, Reuse};
    let model = model();
    // Two conversations of three turns, interleaved, past the 8-position
    // window; each turn extends the conversation's previous prompt with a
    // scripted reply and a new message.
    let mut convs: Vec<Vec<u32>> = vec![prompt(7, 6), prompt(8, 6)];
    let mut requests = Vec::new();
    for turn in 0..3 {
        for (c, conv) in convs.iter_mut().enumerate() {
            conv.extend(prompt(10 + turn * 2 + c, 4));
            requests.push(conv.clone());
            conv.extend([61, 62]);
        }
    }
    let mut answers = Vec::new();
    for reuse in [Reuse::None, Reuse::Trie] {
        let mut chat: Chat<'_, Gemma> = Chat::new(&model, reuse, 1 << 30).unwrap();
        let outs: Vec<_> = requests
            .iter()
            .map(|p| chat.generate(p, 3, None).unwrap())
            .collect();
        if let Some(trie) = chat.trie() {
            trie.check();
        }
        answers.push(outs);
    }
    for (i, (scratch, trie)) in answers[0].iter().zip(&answers[1]).enumerate() {
        assert_eq!(trie.generated, scratch.generated, "request {i}");
    }
    // Later turns resume at the previous prompt's end (its restore point),
    // though the window has moved past the conversation's start.
    for (i, out) in answers[1].iter().enumerate().skip(2) {
        assert_eq!(out.matched, requests[i - 2].len(), "request {i}");
    }
}

/// What a finished request's sequence keeps: its prompt and every generated
/// token but the last, which is never fed back.
fn kept(prompt: &[u32], done: &Finished) -> Vec<u32> {
    [prompt, &done.generated[..done.generated.len() - 1]].concat()
}

/// The names a router is told for the full blocks of `tokens` (4 tokens
/// each, the shared namespace, the engine's model fingerprint).
fn names(tokens: &[u32]) -> Vec<u64> {
    use kvcache_api::block_key::{KeyChain, Scope};
    use kvcache_api::events::block_hash;
    let (fingerprint, namespace) = (
        kvcache_api::Fingerprint::default(),
        kvcache_api::Namespace::shared(),
    );
    KeyChain::new(Scope::new(&fingerprint, &namespace), 4, tokens)
        .map(|(_, key)| block_hash(&key.0))
        .collect()
}

fn stored(names: &[u64], parent: Option<u64>, tokens: &[u32]) -> kvcache_api::KvEvent {
    kvcache_api::KvEvent::BlockStored {
        block_hashes: names.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: 4,
        medium: kvcache_api::Medium::Device,
        namespace: kvcache_api::Namespace::shared(),
    }
}

#[test]
fn kept_prefixes_are_reported_to_a_router_by_block_a_shared_prefix_once() {
    let model = model();
    let mut engine = by_block(&model, cache(&model, 4, 16, 12));
    assert!(engine.keeps_blocks(), "Gemma keeps finished requests by block");
    let log = std::sync::Arc::new(kvcache_api::EventLog::new());
    engine.set_event_sink(log.clone());

    // Two conversations sharing their first 8 tokens (2 blocks).
    let shared = prompt(1, 8);
    let a = [&shared[..], &prompt(2, 5)].concat();
    engine.submit(Request::new(0, a.clone(), 3)).unwrap();
    let a_kept = kept(&a, &run(&mut engine)[0]);
    let a_names = names(&a_kept);
    assert_eq!(a_names.len(), 3, "15 tokens kept: 3 blocks and a tail");
    assert_eq!(log.take(), [stored(&a_names, None, &a_kept[..12])]);

    let b = [&shared[..], &prompt(3, 6)].concat();
    engine.submit(Request::new(1, b.clone(), 3)).unwrap();
    let done = run(&mut engine).remove(0);
    // The window layers kept A's last 12 positions, not the window before
    // position 8: B is evaluated whole.
    assert_eq!(done.reused, 0);
    let b_kept = kept(&b, &done);
    let b_names = names(&b_kept);
    assert_eq!(b_names[..2], a_names[..2]);
    // Only B's own blocks are new, chained on the shared ones.
    assert_eq!(
        log.take(),
        [stored(&b_names[2..], Some(b_names[1]), &b_kept[8..16])]
    );

    // A's next turn resumes at A's end: its blocks stay reported, the
    // blocks the new turn completes follow them.
    let a2 = [&a_kept[..], &prompt(4, 6)].concat();
    engine.submit(Request::new(2, a2.clone(), 2)).unwrap();
    let done = run(&mut engine).remove(0);
    assert_eq!(done.reused, a_kept.len());
    let a2_kept = kept(&a2, &done);
    let a2_names = names(&a2_kept);
    assert_eq!(a2_names[..3], a_names[..]);
    assert_eq!(
        log.take(),
        [stored(
            &a2_names[3..],
            Some(a2_names[2]),
            &a2_kept[12..a2_names.len() * 4]
        )]
    );
    // One end per conversation (A2's replaced A's), and the junction B
    // kept where it parted from A (its 2 blocks were kept already: no event).
    assert_eq!(engine.cache().kept_ends(), 3);

    // Ageing everything out removes each block once, in one event (one
    // operation's removals are one batch).
    assert!(engine.evict_idle(std::time::Duration::ZERO).unwrap() > 0);
    let events = log.take();
    assert_eq!(events.len(), 1);
    let kvcache_api::KvEvent::BlockRemoved { block_hashes, .. } = &events[0] else {
        panic!("not a removal: {events:?}");
    };
    let mut got = block_hashes.clone();
    got.sort_unstable();
    let mut want: Vec<u64> = a2_names.iter().chain(&b_names[2..]).copied().collect();
    want.sort_unstable();
    assert_eq!(got, want);
    assert_eq!(engine.cache().kept_ends(), 0);
    engine.cache().check();
}

/// Five conversations on three sequence ids, turns interleaved: every
/// conversation's next turn resumes where its last one ended, through both
/// layer groups, whatever sequence ran it (idle sequences would keep only
/// three of them).
#[test]
fn conversations_beyond_the_sequence_ids_keep_their_reuse_by_block() {
    let model = model();
    let cache = model
        .new_cache(&CausalConfig::new(3, 128, 16), 12, &Device::Cpu)
        .unwrap();
    let mut engine = by_block(&model, cache);
    let mut convs: Vec<Vec<u32>> = (0..5).map(|c| prompt(10 + c, 6 + c)).collect();
    let mut minimum = 0;
    for turn in 0..3 {
        for (c, conv) in convs.iter_mut().enumerate() {
            let id = turn * 5 + c;
            engine.submit(Request::new(id, conv.clone(), 3)).unwrap();
            let done = run(&mut engine).remove(0);
            assert_eq!(done.generated, alone(&model, conv, 3), "request {id}");
            let resumable = if turn == 0 { 0 } else { conv.len() - 2 };
            assert_eq!(done.reused, resumable, "request {id}");
            minimum += conv.len() - resumable;
            // The next turn: what the cache holds (the answer's first two
            // tokens fed back) and a new message.
            conv.extend_from_slice(&done.generated[..2]);
            conv.extend(prompt(20 + id, 2));
        }
        assert_eq!(engine.cache().kept_ends(), 5, "one end per conversation");
        engine.cache().check();
    }
    assert_eq!(engine.reuse_stats().evaluated_tokens, minimum);
}

/// Kept prefixes of one namespace are never another's: the same prompt in
/// another namespace is evaluated whole, and both are kept apart.
#[test]
fn a_salted_prompt_never_resumes_another_namespaces_blocks() {
    use kvcache_api::Namespace;
    let model = model();
    let mut engine = by_block(&model, cache(&model, 2, 16, 12));
    let first = prompt(30, 14);
    engine.submit(Request::new(0, first.clone(), 3)).unwrap();
    let done = run(&mut engine).remove(0);
    let next = [&kept(&first, &done)[..], &prompt(31, 3)].concat();
    let mut salted = Request::new(1, next.clone(), 2);
    salted.namespace = Namespace::new("tenant-b").unwrap();
    engine.submit(salted).unwrap();
    let other = run(&mut engine).remove(0);
    assert_eq!(other.reused, 0, "another namespace's blocks");
    assert_eq!(other.generated, alone(&model, &next, 2));
    // The shared namespace still resumes its own.
    engine.submit(Request::new(2, next.clone(), 2)).unwrap();
    let own = run(&mut engine).remove(0);
    assert_eq!(own.reused, first.len() + 2);
    assert_eq!(own.generated, other.generated);
    assert_eq!(engine.cache().kept_ends(), 2, "one end per namespace");
    engine.cache().check();
}

/// Prompts that share a long prefix and part past the window of every kept
/// end: the second keeps a junction where it parts from the first, and the
/// third (and every later one) resumes there.
#[test]
fn a_shared_prefix_is_kept_where_prompts_part() {
    let model = model();
    let mut engine = by_block(&model, cache(&model, 2, 16, 12));
    // A 20-token shared prefix, then 16 tokens of each request's own: a
    // kept end's tail (12 positions) lies far past the prefix's end.
    let shared = prompt(40, 20);
    let ask = |i: usize| [&shared[..], &prompt(41 + i, 16)].concat();
    let reused: Vec<usize> = (0..4)
        .map(|i| {
            engine.submit(Request::new(i, ask(i), 2)).unwrap();
            let done = run(&mut engine).remove(0);
            assert_eq!(done.generated, alone(&model, &ask(i), 2), "request {i}");
            done.reused
        })
        .collect();
    // The first has nothing to resume; the second parts from the first past
    // every kept window and keeps a junction at 20; the others resume there.
    assert_eq!(reused, [0, 0, 20, 20]);
    // The junction and one end per request.
    assert_eq!(engine.cache().kept_ends(), 5);
    engine.cache().check();
}
