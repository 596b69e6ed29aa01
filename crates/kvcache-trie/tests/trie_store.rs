//! The prefix trie with a store behind it and requests in namespaces, over fake
//! layer caches and the in-memory [`MemStore`]: write-through at close, restore
//! on miss in a brand-new trie (a restarted process), namespaces kept apart in
//! the trie and through the store, a store that answers nothing, restores that
//! a layer refuses, and the eviction budget under random schedules full of
//! branch points.

mod trie_support;

use kvcache_api::Submitted;
use std::sync::Arc;
use std::time::Duration;

use kvcache_api::{CacheError, DType, KvLayout, Namespace, PrefixStore};
use kvcache_trie::fake::{feed_all, Counters, FakeKv, MemStore};
use kvcache_trie::{PrefixCache, Restored};
use trie_support::{assert_holds, cache, request, request_full, request_in, request_with, Layer, Options};

const NO_LIMIT: usize = usize::MAX;
const DEADLINE: Duration = Duration::from_millis(50);

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..=b).collect()
}

fn ns(name: &str) -> Namespace {
    Namespace::new(name).unwrap()
}

/// A store for `layers` fake KV layers, cutting blocks of `block` tokens.
fn store(layers: usize, block: usize) -> Arc<MemStore> {
    Arc::new(MemStore::new(FakeKv::layout(layers), block))
}

/// A trie of the given layer kinds (see `trie_support::layers`) with `store` behind it.
fn cache_with(kinds: &str, budget: usize, store: &Arc<MemStore>) -> (PrefixCache<Layer>, Counters) {
    let (mut c, n) = cache(kinds, budget);
    c.set_store(store.clone(), DEADLINE).unwrap();
    c.check();
    (c, n)
}

#[test]
fn a_closed_conversation_is_restored_by_a_restarted_process() {
    let store = store(3, 4);
    let prompt = range(1, 10);
    {
        let (mut first, n) = cache_with("kkk", NO_LIMIT, &store);
        let out = request(&mut first, &n, &prompt, &[50, 51, 52]);
        assert_eq!(out.cached, 0);
        let s = first.stats();
        // The prompt is written through at close; generated tokens are not.
        assert_eq!((s.store_writes, s.store_tokens_written), (1, 10));
        assert_eq!(store.known_prefix(&Namespace::shared(), &prompt), 10);
        assert_eq!(
            store.known_prefix(&Namespace::shared(), &[&prompt[..], &[50]].concat()),
            8
        );
    }

    // A new process: a new trie over new layers, the same store.
    let (mut second, n) = cache_with("kkk", NO_LIMIT, &store);
    let next_turn = [&prompt[..], &[60, 61, 62]].concat();
    let out = request(&mut second, &n, &next_turn, &[]);
    assert_eq!(out.cached, 10, "the whole stored prompt is restored");
    assert_eq!(out.remaining, vec![60, 61, 62]);
    assert_eq!(
        out.fed,
        3 * 3,
        "only the new tokens are evaluated, in each of 3 layers"
    );
    assert_eq!(n.appended_tokens(), 3 * 10);
    let s = second.stats();
    assert_eq!((s.hits, s.misses, s.store_hits, s.store_tokens), (1, 0, 1, 10));
    assert_eq!(s.reused_tokens, 10);
    assert_eq!(s.store_tier_tokens.get("memory"), Some(&10));
    // Only the new prompt tokens past the stored whole blocks are written.
    assert_eq!((s.store_writes, s.store_tokens_written), (1, 13 - 8));

    // An exact repeat in a third process evaluates the last token only.
    let (mut third, n) = cache_with("kkk", NO_LIMIT, &store);
    let mut session = third.begin(&next_turn).unwrap();
    session.check();
    assert_eq!(session.cached(), 12);
    assert_eq!(session.remaining(), &[62]);
    assert_holds(session.caches(), &next_turn[..12]);
    assert_eq!(session.pending_snapshot(), None);
    session
        .prefill(|tokens, caches| {
            feed_all(caches, tokens);
            Ok::<(), CacheError>(())
        })
        .unwrap();
    session.close().unwrap();
    third.check();
    assert_holds(third.caches(), &next_turn);
    assert_eq!(n.fed_tokens(), 3);
    // Nothing new for the store: the whole prompt is known.
    assert_eq!(third.stats().store_writes, 0);
    assert_eq!(store.refused(), 0);
}

#[test]
fn the_store_extends_a_partial_trie_match() {
    let store = store(2, 2);
    let long = range(1, 12);
    {
        let (mut writer, n) = cache_with("kk", NO_LIMIT, &store);
        request(&mut writer, &n, &long, &[]);
    }
    // This process knows only a shorter, diverging conversation.
    let (mut c, n) = cache_with("kk", NO_LIMIT, &store);
    store.set_offline(true);
    assert_eq!(request(&mut c, &n, &[1, 2, 3, 4, 99], &[]).cached, 0);
    store.set_offline(false);
    let out = request(&mut c, &n, &[&long[..], &[70]].concat(), &[]);
    assert_eq!(out.cached, 12, "4 tokens from the trie, 8 from the store");
    assert_eq!((c.stats().store_hits, c.stats().store_tokens), (1, 8));
    // The trie branched at 4: both continuations live there now.
    assert_eq!(c.lookup(&[1, 2, 3, 4, 99]), 5);
    assert_eq!(c.lookup(&long), 12);
    // And the first conversation still comes back from memory.
    let out = request(&mut c, &n, &[1, 2, 3, 4, 99, 5], &[]);
    assert_eq!(out.cached, 5);
}

#[test]
fn namespaces_never_share_prefixes() {
    let store = store(2, 4);
    let (a, b) = (ns("tenant-a"), ns("tenant-b"));
    let prompt = range(1, 9);
    let (mut c, n) = cache_with("kk", NO_LIMIT, &store);
    assert_eq!(request_in(&mut c, &n, &a, &prompt, &[]).cached, 0);
    // The same tokens in another namespace: nothing is reused, in memory or
    // from the store, and the live caches start again from 0.
    let out = request_in(&mut c, &n, &b, &prompt, &[]);
    assert_eq!(out.cached, 0);
    assert_eq!(out.fed, 2 * 9);
    assert_eq!(
        request(&mut c, &n, &prompt, &[]).cached,
        0,
        "the shared namespace"
    );
    assert_eq!(c.lookup_in(&a, &prompt), 9);
    assert_eq!(c.lookup_in(&b, &prompt), 9);
    assert_eq!(c.lookup_in(&ns("tenant-c"), &prompt), 0);
    let dump = c.dump();
    assert!(dump.starts_with("root\n"), "{dump}");
    assert!(
        dump.contains("root \"tenant-a\"\n") && dump.contains("root \"tenant-b\"\n"),
        "{dump}"
    );
    // Back in a: restored from a's own path.
    assert_eq!(
        request_in(&mut c, &n, &a, &[&prompt[..], &[20]].concat(), &[]).cached,
        9
    );
    assert_eq!(c.stats().store_hits, 0);

    // Through the store: a new process sees a's prefix only in a.
    let (mut fresh, n) = cache_with("kk", NO_LIMIT, &store);
    let other = ns("tenant-c");
    assert_eq!(request_in(&mut fresh, &n, &other, &prompt, &[]).cached, 0);
    assert_eq!(fresh.stats().store_hits, 0);
    assert_eq!(request_in(&mut fresh, &n, &a, &prompt, &[]).cached, 8);
    assert_eq!(fresh.stats().store_hits, 1);
}

#[test]
fn namespace_roots_go_when_emptied() {
    let (mut c, n) = cache("k", NO_LIMIT);
    for i in 0..20u32 {
        request_in(&mut c, &n, &ns(&format!("t{i}")), &[i, i + 1, i + 2], &[]);
    }
    assert_eq!(
        c.stats().nodes,
        1 + 2 * 20,
        "the shared root, then a root and a leaf each"
    );
    c.set_budget(0);
    c.check();
    // Only the active namespace keeps its (live) path.
    assert_eq!(c.stats().nodes, 1 + 2, "{}", c.dump());
    request(&mut c, &n, &[7], &[]);
    c.set_budget(0);
    assert_eq!(c.stats().nodes, 2, "{}", c.dump());
    assert_eq!(n.alive(), 0);
}

#[test]
fn a_store_that_answers_nothing_leads_to_full_evaluation() {
    let store = store(2, 4);
    let prompt = range(1, 9);
    {
        let (mut writer, n) = cache_with("kk", NO_LIMIT, &store);
        request(&mut writer, &n, &prompt, &[]);
    }
    store.set_offline(true);
    let (mut c, n) = cache_with("kk", NO_LIMIT, &store);
    let before = store.fetches();
    let out = request(&mut c, &n, &[&prompt[..], &[30]].concat(), &[]);
    assert_eq!(store.fetches(), before + 1, "the store was asked");
    assert_eq!(out.cached, 0);
    assert_eq!(out.fed, 2 * 10);
    let s = c.stats();
    assert_eq!(
        (s.misses, s.store_hits, s.store_tokens, s.store_rejected),
        (1, 0, 0, 0)
    );

    // A store that holds nothing for the prompt answers None too.
    store.set_offline(false);
    let out = request(&mut c, &n, &range(40, 45), &[]);
    assert_eq!(out.cached, 0);
    assert_eq!(c.stats().store_hits, 0);
}

#[test]
fn a_refused_restore_rewinds_every_layer() {
    let store = store(2, 2);
    let long = range(1, 10);
    {
        let (mut writer, n) = cache_with("kk", NO_LIMIT, &store);
        request(&mut writer, &n, &long, &[]);
    }

    // A recurrent layer refuses rows after the KV layer took them: both go
    // back to what the trie restored (4 tokens), and the rest is evaluated.
    let (mut c, n) = cache_with("kr", NO_LIMIT, &store);
    store.set_offline(true);
    request(&mut c, &n, &[1, 2, 3, 4], &[]);
    store.set_offline(false);
    let out = request(&mut c, &n, &[&long[..], &[80]].concat(), &[]);
    assert_eq!(out.cached, 4);
    assert_eq!(out.fed, 2 * 7);
    assert_eq!(
        n.appended_tokens(),
        6,
        "the KV layer took the rows, then was rewound"
    );
    let s = c.stats();
    assert_eq!((s.store_hits, s.store_tokens, s.store_rejected), (0, 0, 1));
    // A recurrent layer cannot be cut into rows: its whole state is written at
    // each prompt end (4, then 11), the KV layer's rows the store lacked once.
    assert_eq!((s.store_writes, s.store_states_written), (1, 2));

    // A layer that fails: nothing changes, the trie stays consistent.
    let (mut c, n) = cache_with("kk", NO_LIMIT, &store);
    n.set_fail_append(true);
    let out = request(&mut c, &n, &[&long[..], &[81]].concat(), &[]);
    assert_eq!(out.cached, 0);
    assert_eq!(c.stats().store_rejected, 1);
    n.set_fail_append(false);
    let out = request(&mut c, &n, &[&long[..], &[81, 82]].concat(), &[]);
    assert_eq!(out.cached, 11, "from the trie now");
}

#[test]
fn a_store_of_another_layout_is_refused() {
    let (mut c, n) = cache("kk", NO_LIMIT);
    let three = Arc::new(MemStore::new(FakeKv::layout(3), 4));
    assert!(matches!(
        c.set_store(three, DEADLINE),
        Err(CacheError::LayoutMismatch { what: "layers", .. })
    ));
    assert!(c.store().is_none());
    // Right layer count, wrong heads: the layers refuse to read rows into it
    // with an error, so nothing is written.
    let wide = Arc::new(MemStore::new(KvLayout::new(2, 2, 1, DType::F32), 4));
    c.set_store(wide.clone(), DEADLINE).unwrap();
    request(&mut c, &n, &range(1, 6), &[]);
    assert_eq!(c.stats().store_writes, 0);
    assert_eq!((wide.blocks(), wide.refused()), (0, 0));
    assert!(c.remove_store().is_some());
    assert!(c.store().is_none());
}

#[test]
fn an_evicted_branch_point_keeps_its_node_and_heals() {
    let (mut c, n) = cache("k", NO_LIMIT);
    let base = range(1, 6);
    let user = Options {
        user_snapshot: true,
        ..Options::default()
    };
    // Two restore points below a branch point at 6.
    request_with(&mut c, &n, &[&base[..], &[10, 11]].concat(), &[], user);
    request_with(&mut c, &n, &[&base[..], &[20, 21]].concat(), &[], user);
    // Elsewhere, so that the branch point leaves the active path.
    request(&mut c, &n, &[90, 91], &[]);
    assert!(
        c.dump().contains("[1, 2, 3, 4, 5, 6] [0,6) snaps 1/1 24B\n"),
        "{}",
        c.dump()
    );
    // The restore points (8 bytes each) go last; the branch point, an
    // ordinary node with two children, is the first candidate: its snapshots
    // go, its node stays.
    c.set_budget(16);
    c.check();
    let s = c.stats();
    assert_eq!((s.evictions, s.branch_evictions), (1, 1), "{}", c.dump());
    assert_eq!((s.paged_out_bytes, s.over_budget), (16, false));
    assert!(c.dump().contains("[1, 2, 3, 4, 5, 6] [0,6)\n"), "{}", c.dump());
    assert_eq!(c.lookup(&[&base[..], &[20, 21]].concat()), 8);

    c.set_budget(NO_LIMIT);
    // A request through it cannot page in past 0 (the restore point below
    // needs [0, 6) live): it evaluates the branch point's edge, stops at its
    // end to heal it, and holds the right tokens (checked by the helper).
    let out = request(&mut c, &n, &[&base[..], &[20, 21, 22]].concat(), &[]);
    assert_eq!(out.cached, 0);
    assert_eq!(out.stops, vec![6]);
    assert!(
        c.dump()
            .contains("[1, 2, 3, 4, 5, 6] [0,6) snaps 1/1 24B active\n"),
        "{}",
        c.dump()
    );
    // Healed: the other restore point pages in whole.
    let out = request(&mut c, &n, &[&base[..], &[10, 11, 12]].concat(), &[]);
    assert_eq!(out.cached, 8);
}

/// A tiny deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Bytes of snapshots off the active path, from the dump (lines without `active`).
fn off_path_bytes(c: &PrefixCache<Layer>) -> usize {
    c.dump()
        .lines()
        .filter(|l| !l.ends_with(" active") && !l.contains(" user active"))
        .filter_map(|l| l.split(" snaps ").nth(1))
        .filter_map(|rest| rest.split(' ').nth(1))
        .map(|b| b.trim_end_matches('B').parse::<usize>().unwrap())
        .sum()
}

#[test]
fn the_budget_holds_off_the_active_path_under_random_schedules() {
    let (mut branch_evictions, mut store_hits) = (0, 0);
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let kinds = ["k", "kk", "kr", "kw", "rk"][seed as usize % 5];
        let store = store(kinds.len(), 1 + seed as usize % 4);
        let (mut c, n) = cache_with(kinds, [0, 16, 40, 100, 400][rng.below(5)], &store);
        let spaces = [Namespace::shared(), ns("a"), ns("b")];
        // Few distinct tokens and shared stems: many branch points.
        let mut conversations: Vec<(usize, Vec<u32>)> = vec![];
        for _ in 0..60 {
            let space = rng.below(3);
            let prompt: Vec<u32> = match (rng.below(4), conversations.len()) {
                (0, _) | (_, 0) => (0..1 + rng.below(6)).map(|_| rng.below(3) as u32).collect(),
                (1, k) => {
                    let (_, t) = &conversations[rng.below(k)];
                    let cut = rng.below(t.len() + 1);
                    [&t[..cut], &[rng.below(3) as u32, rng.below(3) as u32]].concat()
                }
                (_, k) => {
                    let (_, t) = &conversations[rng.below(k)];
                    [&t[..], &[rng.below(3) as u32]].concat()
                }
            };
            let generated: Vec<u32> = (0..rng.below(3)).map(|_| rng.below(3) as u32).collect();
            let options = Options {
                user_snapshot: rng.below(6) == 0,
                ..Options::default()
            };
            request_full(&mut c, &n, &spaces[space], &prompt, &generated, options);
            let s = c.stats();
            let off = off_path_bytes(&c);
            assert!(
                off <= s.budget,
                "seed {seed}: {off} bytes off the active path\n{}",
                c.dump()
            );
            assert!(s.paged_out_bytes <= s.budget || off == 0, "seed {seed}: {s:?}");
            assert_eq!(n.alive(), s.snapshots, "seed {seed}");
            if rng.below(10) == 0 {
                c.set_budget([0, 16, 40, 100, 400][rng.below(5)]);
                c.check();
            }
            conversations.push((space, prompt));
        }
        branch_evictions += c.stats().branch_evictions;
        store_hits += c.stats().store_hits;
        drop(c);
        assert_eq!(n.alive(), 0, "seed {seed}: snapshots leaked");
    }
    assert!(branch_evictions > 0, "no schedule evicted a branch point");
    assert!(store_hits > 0, "no schedule restored from the store");
}

#[test]
fn layers_without_rows_write_their_whole_state_at_the_prompt_end() {
    let store = store(2, 4);
    let prompt = range(1, 8);
    let (mut c, n) = cache_with("kw", NO_LIMIT, &store);
    request(&mut c, &n, &prompt, &[]);
    let s = c.stats();
    assert_eq!((s.store_writes, s.store_states_written), (1, 1));
    assert_eq!((store.blocks(), store.state_prefixes()), (2, 1));
    let states = store
        .fetch_states(&Namespace::shared(), &prompt, DEADLINE)
        .unwrap();
    assert_eq!(states.len(), 1);
    assert_eq!((states[0].0, states[0].1.offset), (1, 8));
    assert_eq!(request(&mut c, &n, &[&prompt[..], &[9]].concat(), &[]).cached, 8);
}

#[test]
fn the_prompt_reaches_the_store_when_decoding_starts() {
    let store = store(2, 4);
    let (mut trie, _) = cache_with("kk", NO_LIMIT, &store);
    let prompt = range(1, 9);
    let mut session = trie.begin(&prompt).unwrap();
    session
        .prefill(|tokens, caches| {
            feed_all(caches, tokens);
            Ok::<(), CacheError>(())
        })
        .unwrap();
    assert_eq!(
        store.known_prefix(&Namespace::shared(), &prompt),
        0,
        "nothing before decoding"
    );
    // The first sampled token: the prompt is written while the engine decodes,
    // so another engine on the store can reuse it before this session ends.
    session.record(77);
    assert_eq!(store.known_prefix(&Namespace::shared(), &prompt), 9);
    feed_all(session.caches_mut(), &[77]);
    session.record(78);
    session.close().unwrap();
    let s = trie.stats();
    assert_eq!((s.store_writes, s.store_tokens_written), (1, 9), "written once");
    trie.check();
}

// ---- models with layers that cannot be cut into rows ----

/// A model of a KV layer, a recurrent layer and a window of 4 (`"krw"`) whose
/// first conversation (prompt 1..=10, reply 50, 51, 52) was closed in a trie
/// now gone: the store holds the KV rows of `[0, 10)` and whole states at 10.
fn closed_mixed_conversation() -> Arc<MemStore> {
    let store = store(3, 4);
    let (mut first, n) = cache_with("krw", NO_LIMIT, &store);
    request(&mut first, &n, &range(1, 10), &[50, 51, 52]);
    let s = first.stats();
    assert_eq!((s.store_writes, s.store_tokens_written), (1, 10));
    assert_eq!(s.store_states_written, 2, "the recurrent and the window layer");
    assert_eq!(store.state_prefixes(), 1);
    store
}

#[test]
fn a_mixed_model_conversation_is_restored_by_a_restarted_process() {
    let store = closed_mixed_conversation();
    let prompt = range(1, 10);
    let next_turn = [&prompt[..], &[60, 61, 62]].concat();

    // A new process: every layer holds exactly what evaluating the 10 stored
    // tokens gives (checked by `request` after `begin`: the KV layer's
    // tokens, the recurrent hash, the window's last 4 tokens).
    let (mut second, n) = cache_with("krw", NO_LIMIT, &store);
    let out = request(&mut second, &n, &next_turn, &[]);
    assert_eq!(out.cached, 10);
    assert_eq!(out.remaining, vec![60, 61, 62]);
    assert_eq!(out.fed, 3 * 3, "only the new tokens, in each of 3 layers");
    assert_eq!(n.appended_tokens(), 10, "rows went to the KV layer only");
    let s = second.stats();
    assert_eq!(
        (s.hits, s.store_hits, s.store_tokens, s.store_rejected),
        (1, 1, 10, 0)
    );
    assert_eq!(s.store_states_loaded, 2);
    // The new prompt end is written: rows past the whole blocks, new states.
    assert_eq!(
        (s.store_writes, s.store_tokens_written, s.store_states_written),
        (1, 5, 2)
    );
    second.check();

    // Over an in-process prefix (5 tokens from the trie), the stored states
    // replace the live ones and the KV layer takes the rows past it.
    let (mut third, n) = cache_with("krw", NO_LIMIT, &store);
    store.set_offline(true);
    request(&mut third, &n, &range(1, 5), &[]);
    store.set_offline(false);
    let out = request(&mut third, &n, &[&prompt[..], &[70]].concat(), &[]);
    assert_eq!(out.cached, 10);
    assert_eq!(out.fed, 3);
    assert_eq!(third.stats().store_states_loaded, 2);
}

#[test]
fn a_prompt_ending_where_no_state_is_stored_restores_nothing_from_the_store() {
    let store = closed_mixed_conversation();
    let prompt = range(1, 10);
    let (mut c, n) = cache_with("krw", NO_LIMIT, &store);

    // An exact repeat: the rows end at 9 (the last token is evaluated), where
    // no state was stored. The KV layer's rows are taken back, all 10 tokens
    // evaluated.
    let out = request(&mut c, &n, &prompt, &[]);
    assert_eq!(out.cached, 0);
    assert_eq!(out.fed, 3 * 10);
    let s = c.stats();
    assert_eq!((s.store_hits, s.store_rejected, s.store_states_loaded), (0, 1, 0));

    // A prompt that parts from the stored one at 8 (a block boundary): rows
    // of [0, 8) exist, states at 8 do not.
    let (mut c, n) = cache_with("krw", NO_LIMIT, &store);
    let out = request(&mut c, &n, &[&prompt[..8], &[99, 100]].concat(), &[]);
    assert_eq!(out.cached, 0);
    assert_eq!(c.stats().store_rejected, 1);

    // A model of KV layers only would have reused those 8 tokens: the rows
    // are there (the KV layer's, read as a one-layer model's would be).
    assert_eq!(store.known_prefix(&Namespace::shared(), &prompt[..8]), 8);
}

#[test]
fn a_refused_state_gives_every_layer_back_what_it_held() {
    let store = closed_mixed_conversation();
    let prompt = range(1, 10);
    // The window's stored state is damaged: 3 tokens where a window of 4
    // holds 4. The recurrent layer (before it) has loaded its state by then.
    let mut states = store
        .fetch_states(&Namespace::shared(), &prompt, DEADLINE)
        .unwrap();
    assert_eq!(states.iter().map(|(l, _)| *l).collect::<Vec<_>>(), vec![1, 2]);
    let window = &mut states[1].1.arrays[0];
    window.shape = vec![3];
    window.data.truncate(12);
    assert_eq!(
        store.submit_states(&Namespace::shared(), &prompt, states),
        Submitted::Queued
    );

    let (mut c, n) = cache_with("krw", NO_LIMIT, &store);
    store.set_offline(true);
    request(&mut c, &n, &range(1, 5), &[]);
    store.set_offline(false);
    // `request` checks that every layer holds exactly tokens 1..=5 after
    // `begin`: the recurrent layer got its own state back.
    let out = request(&mut c, &n, &[&prompt[..], &[70]].concat(), &[]);
    assert_eq!(out.cached, 5);
    let s = c.stats();
    assert_eq!((s.store_hits, s.store_rejected, s.store_states_loaded), (0, 1, 0));
    c.check();
}

#[test]
fn namespaces_keep_states_apart() {
    let store = store(2, 4);
    let prompt = range(1, 9);
    let next_turn = [&prompt[..], &[40, 41]].concat();
    {
        let (mut writer, n) = cache_with("kr", NO_LIMIT, &store);
        request_in(&mut writer, &n, &ns("a"), &prompt, &[]);
    }
    let (mut c, n) = cache_with("kr", NO_LIMIT, &store);
    assert_eq!(request_in(&mut c, &n, &ns("b"), &next_turn, &[]).cached, 0);
    assert_eq!(request(&mut c, &n, &next_turn, &[]).cached, 0);
    let out = request_in(&mut c, &n, &ns("a"), &next_turn, &[]);
    assert_eq!(out.cached, 9);
    assert_eq!(c.stats().store_states_loaded, 1);
}

#[test]
fn only_models_with_layers_that_refuse_rows_ask_for_states() {
    let kv_store = store(2, 4);
    let prompt = range(1, 9);
    let next_turn = [&prompt[..], &[30]].concat();
    {
        let (mut writer, n) = cache_with("kk", NO_LIMIT, &kv_store);
        request(&mut writer, &n, &prompt, &[]);
    }
    let (mut c, n) = cache_with("kk", NO_LIMIT, &kv_store);
    assert_eq!(request(&mut c, &n, &next_turn, &[]).cached, 9);
    assert_eq!((kv_store.state_fetches(), kv_store.state_prefixes()), (0, 0));

    let mixed_store = closed_mixed_conversation();
    let (mut c, n) = cache_with("krw", NO_LIMIT, &mixed_store);
    assert_eq!(
        request(&mut c, &n, &[&range(1, 10)[..], &[30]].concat(), &[]).cached,
        10
    );
    assert_eq!(mixed_store.state_fetches(), 1, "asked once, for both layers");
}

// ---- what a session reports of its restore ----

/// A [`MemStore`] whose answers come from two tiers: the rows of the first
/// block an answer touches from "memory", the rest from "disk". It keeps the
/// tiers of every answer it gave.
struct TwoTiers {
    inner: Arc<MemStore>,
    served: std::sync::Mutex<Vec<Vec<(&'static str, usize)>>>,
}

impl PrefixStore for TwoTiers {
    fn fingerprint(&self) -> kvcache_api::Fingerprint {
        self.inner.fingerprint()
    }
    fn layout(&self) -> &KvLayout {
        self.inner.layout()
    }
    fn block_tokens(&self) -> usize {
        self.inner.block_tokens()
    }
    fn known_prefix(&self, namespace: &Namespace, tokens: &[u32]) -> usize {
        self.inner.known_prefix(namespace, tokens)
    }
    fn fetch(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        from: usize,
        deadline: Duration,
    ) -> Option<kvcache_api::Fetched> {
        let mut found = self.inner.fetch(namespace, tokens, from, deadline)?;
        let block = self.block_tokens();
        let memory = found.kv.tokens().min(block - from % block);
        found.tiers = [("memory", memory), ("disk", found.kv.tokens() - memory)]
            .into_iter()
            .filter(|&(_, n)| n > 0)
            .collect();
        self.served.lock().unwrap().push(found.tiers.clone());
        Some(found)
    }
    fn submit(&self, namespace: &Namespace, tokens: &[u32], kv: kvcache_api::HostKv) -> Submitted {
        self.inner.submit(namespace, tokens, kv)
    }
    fn submit_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        states: Vec<(usize, kvcache_api::HostState)>,
    ) -> Submitted {
        self.inner.submit_states(namespace, tokens, states)
    }
    fn fetch_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        deadline: Duration,
    ) -> Option<Vec<(usize, kvcache_api::HostState)>> {
        self.inner.fetch_states(namespace, tokens, deadline)
    }
}

/// Begins `prompt`, returns what the session says it restored, evaluates the
/// rest and closes.
fn restored_by(c: &mut PrefixCache<Layer>, prompt: &[u32]) -> Restored {
    let mut session = c.begin(prompt).unwrap();
    let restored = session.restored().clone();
    assert_eq!(restored.total(), session.cached());
    session
        .prefill(|tokens, caches| {
            feed_all(caches, tokens);
            Ok::<(), CacheError>(())
        })
        .unwrap();
    session.record(99);
    session.close().unwrap();
    c.check();
    restored
}

#[test]
fn a_session_reports_what_the_trie_and_each_store_tier_restored() {
    let inner = store(2, 4);
    let tiers = Arc::new(TwoTiers {
        inner: inner.clone(),
        served: Default::default(),
    });
    let long = range(1, 14);
    {
        let (mut writer, n) = cache_with("kk", NO_LIMIT, &inner);
        request(&mut writer, &n, &long, &[]);
    }
    let (mut c, _) = cache("kk", NO_LIMIT);
    c.set_store(tiers.clone(), DEADLINE).unwrap();

    // Nothing anywhere: nothing restored.
    inner.set_offline(true);
    assert_eq!(restored_by(&mut c, &[1, 2, 3, 4, 5, 6, 77]), Restored::default());
    inner.set_offline(false);

    // 6 tokens from the trie, then [6, 14) from the store: [6, 8) from the
    // memory tier (the rest of the block holding 6), [8, 14) from disk.
    let got = restored_by(&mut c, &[&long[..], &[70]].concat());
    let served = tiers.served.lock().unwrap().clone();
    assert_eq!(served, vec![vec![("memory", 2), ("disk", 6)]]);
    assert_eq!(
        got,
        Restored {
            trie: 6,
            store: 8,
            tiers: served[0].clone(),
            states: 0,
        }
    );
    let s = c.stats();
    assert_eq!((s.store_tokens, s.reused_tokens), (8, 6 + 8));
    assert_eq!(
        s.store_tier_tokens.into_iter().collect::<Vec<_>>(),
        vec![("disk", 6), ("memory", 2)]
    );

    // From the trie only: the store is not asked for what the trie holds.
    let got = restored_by(&mut c, &[&long[..], &[70, 71]].concat());
    assert_eq!((got.trie, got.store, got.tiers), (15, 0, vec![]));
    assert_eq!(tiers.served.lock().unwrap().len(), 1);

    // A refused restore (a recurrent layer finds no state where the rows end)
    // reports nothing from the store, though the store answered rows.
    let (mut mixed, _) = cache("kr", NO_LIMIT);
    mixed.set_store(tiers.clone(), DEADLINE).unwrap();
    assert_eq!(
        restored_by(&mut mixed, &[&long[..12], &[80]].concat()),
        Restored::default()
    );
    assert_eq!(tiers.served.lock().unwrap().len(), 2);
    assert_eq!(mixed.stats().store_rejected, 1);
}

#[test]
fn a_session_reports_the_states_it_loaded() {
    let store = closed_mixed_conversation();
    let (mut c, _) = cache_with("krw", NO_LIMIT, &store);
    let got = restored_by(&mut c, &[&range(1, 10)[..], &[60]].concat());
    assert_eq!(
        got,
        Restored {
            trie: 0,
            store: 10,
            tiers: vec![("memory", 10)],
            states: 2,
        }
    );
    assert_eq!(c.stats().store_states_loaded, 2);
}
