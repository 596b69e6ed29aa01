//! Prefixes kept by block (`EngineConfig::block_tokens`) on the tiny random
//! model: retention that depends on cells, not on sequence slots; least
//! recently used blocks evicted first; tenants kept apart; a prefix a running
//! request is evaluating shared rather than evaluated twice; cancelled
//! requests indexing nothing. Every answer equals the request decoded alone.

mod common;

use candle_core::{Device, Tensor};
use common::engine_run::drain;
use kvcache_api::{CausalConfig, KeyShift, Namespace};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{greedy, Engine, EngineConfig, Request};
use kvcache_models::{Llama, LlamaConfig, WeightMode};

const BLOCK: usize = 4;

fn model() -> Llama {
    model_in(WeightMode::F32)
}

fn model_in(mode: WeightMode) -> Llama {
    Llama::random_in(LlamaConfig::tiny(), 5, mode, &Device::Cpu).unwrap()
}

fn engine(model: &Llama, sequences: usize, cells_each: usize, chunk: usize) -> Engine<'_, CausalKvCache> {
    engine_of(
        model,
        sequences,
        cells_each,
        chunk,
        kvcache_api::Fingerprint::default(),
    )
}

/// An engine keeping blocks, over a cache that carries the model `fingerprint`.
fn engine_of(
    model: &Llama,
    sequences: usize,
    cells_each: usize,
    chunk: usize,
    fingerprint: kvcache_api::Fingerprint,
) -> Engine<'_, CausalKvCache> {
    let shift: Box<dyn KeyShift<Tensor>> = Box::new(model.rope().clone());
    let config = CausalConfig::new(sequences, cells_each, 16);
    let mut cache = CausalKvCache::new(config, Device::Cpu, Some(shift)).unwrap();
    cache.set_fingerprint(fingerprint);
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 16,
            prefill_chunk: chunk,
            block_tokens: Some(BLOCK),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    engine.set_prefix_reuse(true).unwrap();
    assert!(engine.keeps_blocks());
    engine
}

fn alone(model: &Llama, r: &Request) -> Vec<u32> {
    let shift: Box<dyn KeyShift<Tensor>> = Box::new(model.rope().clone());
    let mut fresh = CausalKvCache::new(CausalConfig::new(1, 128, 128), Device::Cpu, Some(shift)).unwrap();
    greedy(model, &mut fresh, 0, &r.prompt, r.max_new_tokens, None).unwrap()
}

fn conversation(c: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (c * 17 + i * 5 + 3) % 64).collect()
}

/// In every weight mode: a turn resumed from the blocks its conversation
/// left generates what the whole prompt decoded alone does.
#[test]
fn more_conversations_than_sequence_slots_keep_their_prefixes() {
    for mode in WeightMode::ALL {
        conversations_keep_their_prefixes(&model_in(mode));
    }
}

fn conversations_keep_their_prefixes(model: &Llama) {
    // Two sequence ids, 160 cells: five conversations of ~26 tokens fit.
    let mut engine = engine(model, 2, 80, 8);
    let firsts: Vec<Request> = (0..5)
        .map(|c| Request::new(c, conversation(c as u32, 15), 6))
        .collect();
    for r in &firsts {
        engine.submit(r.clone()).unwrap();
    }
    let done = drain(&mut engine);
    for (f, r) in done.iter().zip(&firsts) {
        assert_eq!(f.generated, alone(model, r), "turn 1 of {}", r.id);
    }
    assert_eq!(engine.active(), 0);
    assert_eq!(engine.idle_sequences(), 0, "nothing is kept as a sequence");
    let (blocks, cells) = engine.indexed_blocks();
    // Each conversation: its prompt and the generated tokens fed back (20),
    // as 5 full blocks of 4.
    assert_eq!((blocks, cells), (25, 100));
    assert_eq!(engine.cache().used_cells(), 100);

    // Every second turn starts from its whole first turn.
    let seconds: Vec<Request> = (0..5)
        .map(|c| {
            let f = &done[c];
            let prompt = [&firsts[c].prompt[..], &f.generated, &[60, 61, 62][..]].concat();
            Request::new(10 + c, prompt, 4)
        })
        .collect();
    for r in &seconds {
        engine.submit(r.clone()).unwrap();
    }
    let done2 = drain(&mut engine);
    for (f, r) in done2.iter().zip(&seconds) {
        assert_eq!(f.reused, 20, "request {}", r.id);
        assert_eq!(f.generated, alone(model, r), "turn 2 of {}", r.id);
    }
    assert_eq!(engine.reuse_stats().blocks_evicted, 0);
}

#[test]
fn blocks_are_evicted_least_recently_used_first_and_salts_stay_apart() {
    let model = model();
    // 48 cells: three 16-token conversations fill them.
    let mut engine = engine(&model, 2, 24, 8);
    let convs: Vec<Request> = (0..3)
        .map(|c| Request::new(c, conversation(c as u32, 15), 1))
        .collect();
    for r in &convs {
        engine.submit(r.clone()).unwrap();
        drain(&mut engine);
    }
    // Each: 3 full blocks and a tail of 3 (15 tokens; the one generated
    // token is never fed back).
    assert_eq!(engine.indexed_blocks(), (12, 45));
    // Conversation 0 is used again (adopted whole, then kept again).
    let again = Request::new(10, [&convs[0].prompt[..], &[9]].concat(), 1);
    engine.submit(again.clone()).unwrap();
    let done = drain(&mut engine);
    assert_eq!(done[0].reused, 15);
    assert_eq!(done[0].generated, alone(&model, &again));
    assert_eq!(engine.cache().used_cells(), 46);
    // A new 12-token prompt, evaluated 8 then 4 tokens, needs 8 of the two
    // free cells' worth and then 4 more: conversation 1 (the least recently
    // used) gives its tail, then its last full blocks, leaves first.
    let fresh = Request::new(11, conversation(9, 12), 1);
    engine.submit(fresh.clone()).unwrap();
    let done = drain(&mut engine);
    assert_eq!(done[0].generated, alone(&model, &fresh));
    assert_eq!(engine.reuse_stats().blocks_evicted, 3);
    let probe = |engine: &mut Engine<'_, CausalKvCache>, id: usize, c: usize| {
        let r = Request::new(id, [&convs[c].prompt[..], &[1]].concat(), 1);
        engine.submit(r.clone()).unwrap();
        let done = drain(engine);
        assert_eq!(done[0].generated, alone(&model, &r));
        done[0].reused
    };
    assert_eq!(engine.cache().used_cells(), 47);
    assert_eq!(
        probe(&mut engine, 20, 1),
        4,
        "the least recently used kept its first block"
    );
    // That probe evaluated 12 tokens with one cell free: conversation 2, now
    // the least recently used (conversation 0 was used after it), gave 11 of
    // them, leaves first, and its first block goes for the next probe's cell.
    assert_eq!(
        probe(&mut engine, 21, 0),
        15,
        "the most recently used stays whole"
    );
    assert_eq!(probe(&mut engine, 22, 2), 0, "the least recently used is gone");

    // The same tokens under a salt adopt nothing, and keep their own blocks.
    let mut salted = Request::new(30, [&convs[0].prompt[..], &[1]].concat(), 1);
    salted.namespace = Namespace::new("tenant-b").unwrap();
    engine.submit(salted.clone()).unwrap();
    let done = drain(&mut engine);
    assert_eq!(done[0].reused, 0);
    assert_eq!(done[0].generated, alone(&model, &salted));
}

#[test]
fn a_prefix_in_flight_is_evaluated_once() {
    let model = model();
    let mut engine = engine(&model, 4, 64, 8);
    let shared = conversation(5, 40);
    let a = Request::new(0, [&shared[..], &[1, 2]].concat(), 3);
    let b = Request::new(1, [&shared[..], &[3, 4, 5]].concat(), 3);
    engine.submit(a.clone()).unwrap();
    engine.submit(b.clone()).unwrap();
    let done = drain(&mut engine);
    assert_eq!(done[0].generated, alone(&model, &a));
    assert_eq!(done[1].generated, alone(&model, &b));
    // b waited for a's 40 shared tokens and took a's cells.
    assert_eq!(done[1].reused, 40);
    let stats = engine.reuse_stats();
    assert_eq!(stats.waited_for_prefix, 1);
    assert_eq!(stats.evaluated_tokens, a.prompt.len() + (b.prompt.len() - 40));
}

#[test]
fn a_request_cancelled_mid_prefill_indexes_nothing() {
    let model = model();
    let mut engine = engine(&model, 2, 64, 8);
    let long = Request::new(0, conversation(3, 40), 4);
    engine.submit(long.clone()).unwrap();
    engine.step(&mut |_| {}).unwrap();
    engine.step(&mut |_| {}).unwrap();
    assert_eq!(engine.cached_tokens(0), Some(16), "two chunks evaluated");
    assert!(engine.cancel(0).unwrap());
    assert_eq!(engine.indexed_blocks(), (0, 0));
    assert_eq!(engine.cache().used_cells(), 0);
    engine.cache().check();
    // The same prompt again evaluates it all, and gives the same answer.
    engine.submit(Request::new(1, long.prompt.clone(), 4)).unwrap();
    let done = drain(&mut engine);
    assert_eq!(
        (done[0].reused, done[0].generated.clone()),
        (0, alone(&model, &long))
    );
}

#[test]
fn a_prompt_parting_mid_block_reuses_every_token_before_it() {
    let model = model();
    let mut engine = engine(&model, 2, 64, 8);
    let first = Request::new(0, conversation(4, 22), 3);
    engine.submit(first.clone()).unwrap();
    drain(&mut engine);
    // Kept: 24 tokens (22 + 2 fed back) as blocks 0..4, ..., 20..24.
    assert_eq!(engine.indexed_blocks(), (6, 24));
    // Parts from it at token 10 (inside block 8..12), then at 22.
    let mut parted = first.prompt[..10].to_vec();
    parted.extend([63, 62, 61]);
    let same = Request::new(2, first.prompt.clone(), 2);
    for (id, prompt, reused) in [(1, parted, 10), (2, same.prompt.clone(), 21)] {
        let r = Request::new(id, prompt, 2);
        engine.submit(r.clone()).unwrap();
        let done = drain(&mut engine);
        assert_eq!(done[0].reused, reused, "request {id}");
        assert_eq!(done[0].generated, alone(&model, &r), "request {id}");
    }
    // Idle blocks age out and give their cells back.
    assert!(engine.evict_idle(std::time::Duration::ZERO).unwrap() > 0);
    assert_eq!(
        (engine.indexed_blocks(), engine.cache().used_cells()),
        ((0, 0), 0)
    );
    engine.cache().check();
}

#[test]
fn kept_blocks_are_reported_as_kv_events() {
    use kvcache_api::block_key::{BlockKey, KeyChain, Scope};
    use kvcache_api::events::{block_hash, EventLog, KvEvent, Medium};
    use kvcache_api::Fingerprint;
    use std::sync::Arc;

    let model = model();
    let mut engine = engine(&model, 2, 64, 8);
    let log = Arc::new(EventLog::new());
    engine.set_event_sink(log.clone());
    let first = Request::new(0, conversation(6, 13), 3);
    engine.submit(first.clone()).unwrap();
    let done = drain(&mut engine);
    // Kept: 15 tokens, three full blocks and a tail of 3, which is not reported.
    let kept = [&first.prompt[..], &done[0].generated[..2]].concat();
    let (fp, ns) = (Fingerprint::default(), Namespace::shared());
    let keys: Vec<BlockKey> = KeyChain::new(Scope::new(&fp, &ns), BLOCK, &kept)
        .map(|(_, k)| k)
        .collect();
    let hashes: Vec<u64> = keys.iter().map(|k| block_hash(&k.0)).collect();
    assert_eq!(
        log.take(),
        [KvEvent::BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids: kept[..12].to_vec(),
            block_size: BLOCK,
            medium: Medium::Device,
            namespace: ns.clone(),
        }]
    );
    // The next turn adds blocks after the third; the tail is replaced by a
    // full block.
    let next = Request::new(1, [&kept[..], &[7, 8, 9]].concat(), 1);
    engine.submit(next.clone()).unwrap();
    drain(&mut engine);
    let events = log.take();
    let KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        ..
    } = &events[0]
    else {
        panic!("{events:?}");
    };
    assert_eq!((block_hashes.len(), *parent_block_hash), (1, Some(hashes[2])));
    assert_eq!(token_ids, &next.prompt[12..16]);
    // Aging everything out reports every full block removed, leaves first.
    engine.evict_idle(std::time::Duration::ZERO).unwrap();
    let removed: Vec<u64> = log
        .take()
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(removed, [block_hashes[0], hashes[2], hashes[1], hashes[0]]);
}

#[test]
fn an_evicted_block_costs_a_fetch_from_the_store_not_a_recompute() {
    use kvcache_api::{DType, Fingerprint, KvLayout};
    use kvcache_store::{MemoryTier, StoreConfig, TieredStore};

    const MODEL: Fingerprint = Fingerprint([7; 32]);
    let model = model();
    let c = model.config();
    let layout = KvLayout::new(c.n_layers, c.n_kv_heads, c.head_dim, DType::F32);
    let config = StoreConfig::new(MODEL, layout).with_block_tokens(BLOCK);
    let memory = MemoryTier::new(config.context(), 1 << 24);
    let store = std::sync::Arc::new(TieredStore::new(config, vec![Box::new(memory)]).unwrap());
    let mut engine = engine_of(&model, 2, 64, 8, MODEL);
    engine.set_store(store.clone(), std::time::Duration::from_secs(5));

    let first = Request::new(0, conversation(8, 14), 5);
    engine.submit(first.clone()).unwrap();
    let done = drain(&mut engine);
    store.flush();
    // The cache keeps 18 tokens (14 + 4 fed back); the store got them all, the
    // prompt at its first token and the rest when the request ended.
    assert_eq!(engine.indexed_blocks(), (5, 18));
    let kept = [&first.prompt[..], &done[0].generated[..4]].concat();
    // Every block ages out of the cache; the next turn fetches the whole
    // first turn from the store instead of evaluating it.
    engine.evict_idle(std::time::Duration::ZERO).unwrap();
    assert_eq!(engine.cache().used_cells(), 0);
    let next = Request::new(1, [&kept[..], &[5, 6]].concat(), 3);
    engine.submit(next.clone()).unwrap();
    let done = drain(&mut engine);
    assert_eq!((done[0].reused, done[0].restored), (0, 18));
    assert_eq!(done[0].generated, alone(&model, &next));

    // Memory and the store together: a prompt whose first blocks the cache
    // still keeps takes them from the cache and the rest from the store.
    engine.evict_idle(std::time::Duration::ZERO).unwrap();
    let short = Request::new(2, kept[..9].to_vec(), 1);
    engine.submit(short.clone()).unwrap();
    drain(&mut engine);
    store.flush();
    let again = Request::new(3, [&kept[..], &[5, 6], &[9]].concat(), 2);
    engine.submit(again.clone()).unwrap();
    let done = drain(&mut engine);
    assert_eq!(done[0].reused, 9, "the cache's part: two blocks and a tail");
    assert!(done[0].reused + done[0].restored >= 18, "{:?}", done[0]);
    assert_eq!(done[0].generated, alone(&model, &again));
}
