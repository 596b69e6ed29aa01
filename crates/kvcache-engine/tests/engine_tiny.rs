//! The continuous-batching engine on the tiny random model: same tokens as
//! decoding each request alone, and context shifts equal to recomputation.

mod common;

use candle_core::{Device, IndexOp, Tensor};
use common::engine_run::drain;
use kvcache_api::{CausalConfig, KeyShift};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{greedy, Engine, EngineConfig, Event, Request};
use kvcache_models::argmax;
use kvcache_models::{Llama, LlamaConfig};

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
        .map(|id| Request::new(id, prompt(id), 2 + (id * 3) % 7))
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
            stop_tokens: Vec::new(),
            block_tokens: None,
        },
    )
    .unwrap();
    engine.submit(Request::new(0, p.clone(), new)).unwrap();
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

/// Runs `requests` through a new engine (a new cache: another process, as far
/// as the store can tell) sharing `store`; returns the finished requests by id
/// and the run's totals.
fn run_with_store(
    model: &Llama,
    store: &std::sync::Arc<kvcache_store::TieredStore>,
    cache_model: kvcache_api::Fingerprint,
    requests: &[Request],
) -> (
    Vec<kvcache_engine::engine::Finished>,
    kvcache_engine::engine::Stats,
) {
    let mut cache = cache(model, CausalConfig::new(3, 64, 16));
    cache.set_fingerprint(cache_model);
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 5,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    engine.set_store(store.clone(), std::time::Duration::from_secs(5));
    for r in requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut finished = Vec::new();
    let stats = engine
        .run(&mut |e| {
            if let Event::Finished(f) = e {
                finished.push(f.clone());
            }
        })
        .unwrap();
    finished.sort_by_key(|f| f.id);
    store.flush();
    assert_eq!(engine.cache().used_cells(), 0);
    // The engine's running counters agree with the run's and the requests'.
    let reuse = engine.reuse_stats();
    assert_eq!(reuse.store_restored_tokens, stats.restored_tokens);
    assert_eq!(
        reuse.store_restores,
        finished.iter().filter(|f| f.restored > 0).count()
    );
    // Every admitted request asks the store, restored or not.
    assert!(!reuse.store_restore_time.is_zero());
    (finished, stats)
}

const MODEL: kvcache_api::Fingerprint = kvcache_api::Fingerprint([7; 32]);

#[test]
fn engines_reuse_prefixes_through_a_store_by_export_and_import() {
    use kvcache_api::{DType, KvLayout, Namespace};
    use kvcache_store::{MemoryTier, StoreConfig, TieredStore};

    let model = model();
    let c = model.config();
    let layout = KvLayout::new(c.n_layers, c.n_kv_heads, c.head_dim, DType::F32);
    let config = StoreConfig::new(MODEL, layout).with_block_tokens(4);
    let memory = MemoryTier::new(config.context(), 1 << 24);
    let store = std::sync::Arc::new(TieredStore::new(config, vec![Box::new(memory)]).unwrap());

    // A shared "system prompt" of 10 tokens, then each request's own tokens.
    let system: Vec<u32> = (0..10).map(|i| (i * 5 + 1) % 64).collect();
    let with = |tail: &[u32]| [&system[..], tail].concat();
    let first = Request::new(0, with(&[40, 41, 42]), 4);
    let (done, stats) = run_with_store(&model, &store, MODEL, std::slice::from_ref(&first));
    assert_eq!((done[0].restored, stats.restored_tokens), (0, 0));
    assert_eq!(stats.stored_tokens, first.prompt.len());

    // A second engine: the next turn of that conversation restores all of the
    // first prompt (its 1-token partial last block too); another conversation
    // restores the system prompt's whole blocks; each decodes the same tokens as
    // a cache that evaluated everything.
    let next_turn = Request::new(1, with(&[40, 41, 42, 50, 51]), 5);
    let other = Request::new(2, with(&[60, 61]), 5);
    let mut tenant = other.clone();
    tenant.id = 3;
    tenant.namespace = Namespace::new("tenant-b").unwrap();
    let requests = [next_turn, other, tenant];
    let (done, stats) = run_with_store(&model, &store, MODEL, &requests);
    assert_eq!(
        done.iter().map(|f| f.restored).collect::<Vec<_>>(),
        [13, 8, 0],
        "whole stored prompt; the system prompt's two full blocks; nothing across namespaces"
    );
    assert_eq!(stats.restored_tokens, 21);
    assert_eq!(stats.prefill_tokens, 15 - 13 + 12 - 8 + 12);
    for (f, r) in done.iter().zip(&requests) {
        let mut alone = cache(&model, CausalConfig::new(1, 64, 64));
        let expect = greedy(&model, &mut alone, 0, &r.prompt, r.max_new_tokens, None).unwrap();
        assert_eq!(f.generated, expect, "request {}", f.id);
    }

    // A cache of another model refuses the store's keys and values: the request
    // evaluates everything and still answers right.
    let (done, stats) = run_with_store(&model, &store, kvcache_api::Fingerprint([8; 32]), &requests[..1]);
    assert_eq!((done[0].restored, stats.store_errors), (0, 1));
    let mut alone = cache(&model, CausalConfig::new(1, 64, 64));
    let expect = greedy(&model, &mut alone, 0, &requests[0].prompt, 5, None).unwrap();
    assert_eq!(done[0].generated, expect);
}

#[test]
fn a_prompt_is_written_back_once_its_first_token_is_chosen() {
    use kvcache_api::{DType, KvLayout, Namespace, PrefixStore};
    use kvcache_store::{MemoryTier, StoreConfig, TieredStore};

    let model = model();
    let c = model.config();
    let layout = KvLayout::new(c.n_layers, c.n_kv_heads, c.head_dim, DType::F32);
    let config = StoreConfig::new(MODEL, layout).with_block_tokens(4);
    let memory = MemoryTier::new(config.context(), 1 << 24);
    let store = std::sync::Arc::new(TieredStore::new(config, vec![Box::new(memory)]).unwrap());

    // A request that ends at its first token (its cells freed then): the
    // prompt is written after the token is chosen, before the cells go.
    let prompt: Vec<u32> = (0..11).map(|i| (i * 3 + 2) % 64).collect();
    let mut cache = cache(&model, CausalConfig::new(2, 64, 16));
    cache.set_fingerprint(MODEL);
    let config = EngineConfig {
        max_batch: 16,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, cache, config).unwrap();
    engine.set_store(store.clone(), std::time::Duration::from_secs(5));
    assert_eq!(engine.store_client().unwrap().fingerprint(), MODEL);
    engine.submit(Request::new(0, prompt.clone(), 1)).unwrap();
    let mut submitted_at_token = None;
    let stats = engine
        .run(&mut |e| {
            if let Event::Token { .. } = e {
                submitted_at_token.get_or_insert(store.stats().submitted);
            }
        })
        .unwrap();
    store.flush();
    assert_eq!(
        submitted_at_token,
        Some(0),
        "nothing written before the first token"
    );
    assert_eq!(
        (stats.stored_tokens, stats.store_refused, stats.store_errors),
        (11, 0, 0)
    );
    assert_eq!(store.stats().submitted, 1);
    assert_eq!(store.known_prefix(&Namespace::shared(), &prompt), 11);

    // A cache of another model: its keys and values are not written under the
    // store's model; the refusal is counted.
    let other: Vec<u32> = (0..9).map(|i| (i * 5 + 1) % 64).collect();
    let (done, stats) = run_with_store(
        &model,
        &store,
        kvcache_api::Fingerprint([8; 32]),
        &[Request::new(0, other.clone(), 2)],
    );
    assert_eq!(done.len(), 1);
    assert_eq!((stats.stored_tokens, stats.store_errors), (0, 1));
    assert_eq!(store.stats().submitted, 1);
    assert_eq!(store.known_prefix(&Namespace::shared(), &other), 0);
}

fn alone(model: &Llama, r: &Request) -> Vec<u32> {
    let mut fresh = cache(model, CausalConfig::new(1, 64, 64));
    greedy(model, &mut fresh, 0, &r.prompt, r.max_new_tokens, None).unwrap()
}

#[test]
fn finished_sequences_are_reused_within_their_namespace_only() {
    use kvcache_api::Namespace;
    let model = model();
    let mut engine = Engine::new(
        &model,
        cache(&model, CausalConfig::new(3, 64, 16)),
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 4,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    engine.set_prefix_reuse(true).unwrap();
    let system: Vec<u32> = (0..9).map(|i| (i * 5 + 1) % 64).collect();
    let first = Request::new(0, [&system[..], &[40, 41]].concat(), 4);
    let done = drain(&mut engine);
    assert!(done.is_empty());
    engine.submit(first.clone()).unwrap();
    let done = drain(&mut engine);
    assert_eq!(
        (done[0].reused, done[0].generated.clone()),
        (0, alone(&model, &first))
    );
    // Its cells stay: the prompt and all generated tokens but the last.
    let kept = first.prompt.len() + first.max_new_tokens - 1;
    assert_eq!(engine.cache().used_cells(), kept);
    assert_eq!(engine.idle_sequences(), 1);

    // The next turn starts from everything the first one holds; the same
    // system prompt in another namespace starts from nothing.
    let next = Request::new(1, [&first.prompt[..], &done[0].generated, &[50, 51]].concat(), 5);
    let mut tenant = Request::new(2, first.prompt.clone(), 3);
    tenant.namespace = Namespace::new("tenant-b").unwrap();
    engine.submit(next.clone()).unwrap();
    engine.submit(tenant.clone()).unwrap();
    let mut done = drain(&mut engine);
    done.sort_by_key(|f| f.id);
    assert_eq!(done[0].reused, kept);
    assert_eq!(done[1].reused, 0);
    assert_eq!(done[0].generated, alone(&model, &next));
    assert_eq!(done[1].generated, alone(&model, &tenant));
    let stats = engine.reuse_stats();
    assert_eq!((stats.hits, stats.misses, stats.reused_tokens), (1, 2, kept));
    assert_eq!(
        stats.evaluated_tokens,
        first.prompt.len() + (next.prompt.len() - kept) + tenant.prompt.len()
    );

    // A running sibling shares its prompt's cells (copy_prefix): two requests
    // with the system prompt, the second joining while the first decodes.
    let a = Request::new(3, [&system[..], &[7]].concat(), 6);
    let b = Request::new(4, [&system[..], &[8, 9]].concat(), 2);
    engine.submit(a.clone()).unwrap();
    let mut finished = Vec::new();
    let mut collect = |e: &Event| {
        if let Event::Finished(f) = e {
            finished.push(f.clone());
        }
    };
    for _ in 0..5 {
        engine.step(&mut collect).unwrap();
    }
    engine.submit(b.clone()).unwrap();
    while engine.step(&mut collect).unwrap() {}
    finished.sort_by_key(|f| f.id);
    assert!(finished[1].reused >= system.len(), "{}", finished[1].reused);
    assert_eq!(finished[0].generated, alone(&model, &a));
    assert_eq!(finished[1].generated, alone(&model, &b));
    // Idle sequences age out and give their cells back.
    engine.evict_idle(std::time::Duration::ZERO).unwrap();
    assert_eq!((engine.idle_sequences(), engine.cache().used_cells()), (0, 0));
    engine.cache().check();
}

#[test]
fn idle_sequences_make_room_and_cancelled_requests_free_their_cells() {
    let model = model();
    // Two slots of 24 cells: three different conversations evict the oldest.
    let mut engine = Engine::new(
        &model,
        cache(&model, CausalConfig::new(2, 24, 16)),
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 8,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    engine.set_prefix_reuse(true).unwrap();
    for id in 0..3 {
        let r = Request::new(id, prompt(id + 10), 3);
        engine.submit(r.clone()).unwrap();
        let done = drain(&mut engine);
        assert_eq!(done[0].generated, alone(&model, &r));
    }
    assert_eq!(engine.reuse_stats().evictions, 1);
    assert_eq!(engine.idle_sequences(), 2);

    // Cancelling: a queued request disappears, a running one frees its cells.
    let before = engine.cache().used_cells();
    let long = Request::new(7, prompt(3), 20);
    engine.submit(long.clone()).unwrap();
    engine.submit(Request::new(8, prompt(4), 20)).unwrap();
    engine.step(&mut |_| {}).unwrap();
    assert!(engine.cancel(7).unwrap());
    assert!(engine.cancel(8).unwrap());
    assert!(!engine.cancel(8).unwrap());
    assert_eq!((engine.active(), engine.queued()), (0, 0));
    assert!(engine.cache().used_cells() <= before, "cells freed");
    assert_eq!(engine.reuse_stats().cancelled, 2);
    assert!(!engine.step(&mut |_| {}).unwrap());
    engine.cache().check();
}

#[test]
fn seeded_sampling_repeats_and_greedy_sampler_equals_argmax() {
    use kvcache_engine::sampling::{Sampler, SamplingParams};
    let model = model();
    let run = |params: SamplingParams| {
        let mut engine = Engine::new(
            &model,
            cache(&model, CausalConfig::new(2, 64, 16)),
            EngineConfig {
                max_batch: 16,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        // A greedy neighbour in the same passes must not change the draws.
        engine.submit(Request::new(1, prompt(2), 12)).unwrap();
        engine
            .submit_sampled(
                Request::new(0, prompt(1), 12),
                Some(Sampler::new(params).unwrap()),
            )
            .unwrap();
        let mut done = drain(&mut engine);
        done.sort_by_key(|f| f.id);
        done[0].generated.clone()
    };
    let hot = SamplingParams {
        temperature: 1.5,
        top_p: 1.0,
        seed: Some(42),
    };
    assert_eq!(run(hot), run(hot));
    assert_ne!(
        run(hot),
        run(SamplingParams {
            seed: Some(43),
            ..hot
        })
    );
    assert_eq!(
        run(SamplingParams::greedy()),
        alone(&model, &Request::new(0, prompt(1), 12))
    );
}

/// One edit of [`paged_and_dense_schedule`] between passes.
enum Edit {
    /// A pass: `(sequence, tokens)` per entry, interleaved round-robin.
    Pass(Vec<(usize, usize)>),
    /// `copy_prefix(src, dst, len)`.
    Copy(usize, usize, usize),
    /// `remove(seq, keep..)`.
    Truncate(usize, usize),
}

/// Several sequences side by side: long prefills (more than 16 rows a block,
/// more than 64 cells a tile), mixed prefill and decode passes, a prefix
/// copy, a truncation, then decoding.
fn paged_and_dense_schedule() -> Vec<Edit> {
    let mut edits = vec![
        Edit::Pass(vec![(0, 20), (1, 5)]),
        Edit::Pass(vec![(0, 1), (1, 1), (2, 4)]),
        Edit::Pass(vec![(0, 50), (1, 3)]),
        Edit::Copy(0, 2, 60),
        Edit::Pass(vec![(2, 3), (0, 1), (1, 6)]),
        Edit::Truncate(1, 8),
    ];
    edits.extend((0..6).map(|_| Edit::Pass(vec![(0, 1), (1, 1), (2, 1)])));
    edits
}

/// Runs [`paged_and_dense_schedule`] through `forward` on `paged` and `dense`
/// (a model set to each path over a cache of its own), comparing their logits
/// with each other and every row with `full` (recomputing the row's sequence
/// from scratch); returns (rows compared, largest paged-dense difference,
/// largest difference from recompute).
fn run_paged_and_dense<C>(
    mut paged: C,
    mut dense: C,
    forward: &dyn Fn(bool, &[kvcache_models::BatchToken], &mut C) -> Tensor,
    full: &dyn Fn(&[u32]) -> Tensor,
) -> (usize, f32, f32)
where
    C: kvcache_api::CausalCache<Tensor = Tensor>,
{
    use kvcache_models::BatchToken;
    let mut seqs: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let (mut rows, mut between, mut recompute) = (0, 0f32, 0f32);
    let mut next_token = 0u32;
    for edit in paged_and_dense_schedule() {
        match edit {
            Edit::Pass(entries) => {
                let mut lists: Vec<Vec<BatchToken>> = entries
                    .iter()
                    .map(|&(seq, len)| {
                        let tokens: Vec<u32> = (0..len)
                            .map(|_| {
                                next_token = (next_token * 37 + 11) % 64;
                                next_token
                            })
                            .collect();
                        BatchToken::run(seq, seqs[seq].len() as i32, &tokens)
                    })
                    .collect();
                let longest = lists.iter().map(Vec::len).max().unwrap();
                let batch: Vec<BatchToken> = (0..longest)
                    .flat_map(|i| lists.iter().filter_map(move |l| l.get(i).copied()))
                    .collect();
                for list in &mut lists {
                    seqs[list[0].seq].extend(list.iter().map(|t| t.token));
                }
                let p = forward(true, &batch, &mut paged);
                let d = forward(false, &batch, &mut dense);
                between = between.max(common_max_diff(&p, &d));
                for (i, t) in batch.iter().enumerate() {
                    let want = full(&seqs[t.seq][..=t.pos as usize]);
                    let want = want.i(t.pos as usize).unwrap();
                    recompute = recompute.max(common_max_diff(&p.i(i).unwrap(), &want));
                    recompute = recompute.max(common_max_diff(&d.i(i).unwrap(), &want));
                    rows += 1;
                }
            }
            Edit::Copy(src, dst, len) => {
                paged.copy_prefix(src, dst, len as i32).unwrap();
                dense.copy_prefix(src, dst, len as i32).unwrap();
                seqs[dst] = seqs[src][..len].to_vec();
            }
            Edit::Truncate(seq, keep) => {
                paged.remove(seq, (keep as i32..).into()).unwrap();
                dense.remove(seq, (keep as i32..).into()).unwrap();
                seqs[seq].truncate(keep);
            }
        }
    }
    (rows, between, recompute)
}

fn common_max_diff(a: &Tensor, b: &Tensor) -> f32 {
    common::max_abs_diff(a, b)
}

#[test]
fn paged_and_dense_attention_give_the_same_llama_logits() {
    use kvcache_models::attention::AttentionPath;
    let paged = model();
    assert_eq!(paged.attention_path(), AttentionPath::Paged, "the default");
    let mut dense = paged.clone();
    dense.set_attention(AttentionPath::Dense);
    assert_eq!(dense.attention_path(), AttentionPath::Dense);
    for config in [
        CausalConfig::new(3, 96, 64),
        CausalConfig::new(3, 96, 64)
            .with_v_layout(kvcache_api::VLayout::Permuted)
            .with_padding(4, 8),
    ] {
        let (rows, between, recompute) = run_paged_and_dense(
            cache(&paged, config.clone()),
            cache(&paged, config),
            &|use_paged, batch, c| {
                let m = if use_paged { &paged } else { &dense };
                m.forward(batch, c).unwrap()
            },
            &|tokens| paged.forward_full(tokens, None).unwrap(),
        );
        assert!(rows > 100, "{rows}");
        assert!(between <= 1e-4, "paged vs dense: {between}");
        assert!(recompute <= 1e-4, "cached vs recompute: {recompute}");
    }
}

#[test]
fn paged_and_dense_attention_give_the_same_gemma_logits() {
    use kvcache_models::attention::AttentionPath;
    use kvcache_models::gemma::{Gemma, GemmaConfig};
    let paged = Gemma::random(GemmaConfig::tiny(), 11, &Device::Cpu).unwrap();
    assert_eq!(paged.attention_path(), AttentionPath::Paged, "the default");
    let mut dense = paged.clone();
    dense.set_attention(AttentionPath::Dense);
    // Window layers keep a memory of 80 positions: every sequence stays
    // resumable, so each row equals recomputing its sequence.
    let base = CausalConfig::new(3, 96, 64);
    let new_cache = || paged.new_cache(&base, 80, &Device::Cpu).unwrap();
    let (rows, between, recompute) = run_paged_and_dense(
        new_cache(),
        new_cache(),
        &|use_paged, batch, c| {
            let m = if use_paged { &paged } else { &dense };
            m.forward(batch, c).unwrap()
        },
        &|tokens| paged.forward_full(tokens).unwrap(),
    );
    assert!(rows > 100, "{rows}");
    assert!(between <= 1e-4, "paged vs dense: {between}");
    assert!(recompute <= 1e-4, "cached vs recompute: {recompute}");
}
