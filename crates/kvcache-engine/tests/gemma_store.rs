//! A window model's prefixes in the prefix store (the tiny random Gemma: a
//! window layer of 8 positions, then a global one): the global layers store
//! every block of a prompt, the window layers its tail, each part under a
//! fingerprint of its own. A new engine over the same directory (a restarted
//! server, as far as the store can tell) restores a conversation up to where
//! both parts serve it and answers as an uninterrupted engine does; another
//! namespace restores nothing; parts of another layout are refused.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use kvcache_api::{CausalCache, CausalConfig, Fingerprint, Namespace, PrefixStore, StorePart, StoreParts};
use kvcache_causal::LayerGroupCache;
use kvcache_engine::engine::{greedy, Engine, EngineConfig, Event, Finished, Request};
use kvcache_models::gemma::{Gemma, GemmaConfig};
use kvcache_models::Model;
use kvcache_store::{DiskTier, MemoryTier, StoreConfig, Tier, TieredStore};

const MODEL: Fingerprint = Fingerprint([0x6e; 32]);
/// Window layers keep 16 positions: room for a store block's rounding
/// beyond the window of 8.
const WINDOW_MEMORY: usize = 16;
const STORE_BLOCK: usize = 4;

fn model() -> Gemma {
    Gemma::random(GemmaConfig::tiny(), 9, &Device::Cpu).unwrap()
}

fn cache(model: &Gemma) -> LayerGroupCache {
    let mut cache = model
        .new_cache(&CausalConfig::new(3, 64, 16), WINDOW_MEMORY, &Device::Cpu)
        .unwrap();
    cache.set_fingerprint(MODEL);
    cache
}

fn prompt(id: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((id * 13 + i * 7 + 1) % 64) as u32).collect()
}

/// One store per part of `cache`, memory then `dir`.
fn open(model: &Gemma, cache: &LayerGroupCache, dir: &Path) -> (StoreParts, Vec<Arc<TieredStore>>) {
    let mut stores = Vec::new();
    let mut parts: Vec<(StorePart, Arc<dyn PrefixStore>)> = Vec::new();
    for part in cache.store_parts() {
        let config = StoreConfig::new(part.fingerprint(MODEL), part.layout(model.kv_layout()))
            .with_block_tokens(STORE_BLOCK);
        let context = config.context();
        let tiers: Vec<Box<dyn Tier>> = vec![
            Box::new(MemoryTier::new(context, 1 << 24)),
            Box::new(DiskTier::open(context, dir, 1 << 26).unwrap()),
        ];
        let store = Arc::new(TieredStore::new(config, tiers).unwrap());
        stores.push(store.clone());
        parts.push((part, store));
    }
    (
        StoreParts::new(MODEL, parts, Duration::from_secs(5)).unwrap(),
        stores,
    )
}

/// A new engine (a new process, as far as the store can tell) over the
/// stores in `dir`, keeping finished requests by block.
fn open_engine<'m>(
    model: &'m Gemma,
    dir: &Path,
) -> (Engine<'m, LayerGroupCache, Gemma>, Vec<Arc<TieredStore>>) {
    let cache = cache(model);
    let (parts, stores) = open(model, &cache, dir);
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
    engine.set_store_parts(parts).unwrap();
    (engine, stores)
}

fn run(engine: &mut Engine<'_, LayerGroupCache, Gemma>, request: Request) -> Finished {
    engine.submit(request).unwrap();
    let mut finished = Vec::new();
    engine
        .run(&mut |e| {
            if let Event::Finished(f) = e {
                finished.push(f.clone());
            }
        })
        .unwrap();
    engine.cache().check();
    finished.remove(0)
}

/// What `prompt` generates alone, in a fresh cache.
fn alone(model: &Gemma, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut fresh = model
        .new_cache(&CausalConfig::new(1, 64, 64), WINDOW_MEMORY, &Device::Cpu)
        .unwrap();
    greedy(model, &mut fresh, 0, prompt, n, None).unwrap()
}

#[test]
fn a_new_engine_restores_a_window_models_conversation_from_disk_and_answers_alike() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let first = prompt(1, 22);
    let answer = {
        let (mut engine, stores) = open_engine(&model, dir.path());
        let done = run(&mut engine, Request::new(0, first.clone(), 6));
        assert_eq!(done.restored, 0, "an empty store holds nothing");
        for store in &stores {
            store.flush();
        }
        // Both parts wrote: the global layers every block, the window
        // layers the tail they keep.
        let counters = engine.store_parts().unwrap().counters();
        assert!(counters.writes >= 4, "{counters:?}");
        done.generated
    };
    // The next turn: the history (the answer but its last token, never fed
    // back, which the client sends as it is) and a new message.
    let mut second = first.clone();
    second.extend_from_slice(&answer);
    second.extend_from_slice(&prompt(2, 5));
    let (mut engine, _stores) = open_engine(&model, dir.path());
    let done = run(&mut engine, Request::new(1, second.clone(), 5));
    // Everything evaluated before: the prompt and the answer but its last
    // token.
    let held = first.len() + answer.len() - 1;
    assert_eq!(done.reused, 0, "a fresh cache");
    assert_eq!(done.restored, held);
    assert_eq!(done.generated, alone(&model, &second, 5));
    let counters = engine.store_parts().unwrap().counters();
    assert_eq!((counters.restores, counters.restored_tokens), (1, held as u64));
    assert_eq!(counters.rejected, 0);

    // Another namespace shares nothing.
    let mut other = Request::new(2, second.clone(), 5);
    other.namespace = Namespace::new("tenant-b").unwrap();
    let (mut engine, _stores) = open_engine(&model, dir.path());
    let done = run(&mut engine, other);
    assert_eq!(done.restored, 0);
    assert_eq!(done.generated, alone(&model, &second, 5));
}

#[test]
fn a_prompt_parting_within_the_window_tails_margin_restores_up_to_a_block_before_it() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let first = prompt(3, 30);
    {
        let (mut engine, stores) = open_engine(&model, dir.path());
        run(&mut engine, Request::new(0, first.clone(), 3));
        for store in &stores {
            store.flush();
        }
    }
    // Parts 3 positions before the first prompt's end: the global part
    // serves whole blocks up to 24 (a tail is served whole or not at all),
    // and the window part holds the window before 24 (its tail starts at
    // most 15 positions before the end of what was kept).
    let mut second = first[..27].to_vec();
    second.extend_from_slice(&prompt(4, 6));
    let (mut engine, _stores) = open_engine(&model, dir.path());
    let done = run(&mut engine, Request::new(1, second.clone(), 4));
    assert_eq!(done.restored, 24);
    assert_eq!(done.generated, alone(&model, &second, 4));
}

#[test]
fn store_parts_of_another_cache_are_refused() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(&model);
    let (parts, _) = open(&model, &cache, dir.path());
    // Two parts: the window layers (window 8, memory 16) and the global ones.
    let layout = parts.layout();
    assert_eq!(layout.len(), 2);
    assert_eq!((layout[0].window, layout[0].memory), (Some(8), Some(16)));
    assert_eq!((layout[1].window, layout[1].memory), (None, None));
    // A cache whose window layers keep another memory is another cache.
    let other = model
        .new_cache(&CausalConfig::new(3, 64, 16), 24, &Device::Cpu)
        .unwrap();
    let config = EngineConfig {
        max_batch: 16,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, other, config).unwrap();
    assert!(engine.set_store_parts(parts).is_err());
    assert!(engine.store_parts().is_none());
}
