//! RotatingKvCache on real mlx-rs CPU arrays, checked against a plain list of
//! the tokens written: the window after wrap-around with mixed batched and
//! single writes (Ollama #15591), rewind rules, snapshots.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;

use kvcache_api::{BoxedSnapshot, CacheError, LayerCache, Snapshot, SnapshotCache};
use kvcache_mlx::layers::{KvCache, RotatingKvCache, RotatingSnapshot};
use kvcache_trie::PrefixCache;
use layers_common::{error_of, f32s, ids_of, Foreign, Ids, Shape, SMALL};
use proptest::prelude::*;

const ONE: Shape = Shape {
    b: 1,
    h: 2,
    dk: 2,
    dv: 1,
};

/// The window in temporal order, as token ids.
fn window_ids(cache: &RotatingKvCache) -> Vec<u32> {
    cache
        .ordered_window()
        .unwrap()
        .map_or_else(Vec::new, |(k, v)| ids_of(&k, &v))
}

fn rot(s: &BoxedSnapshot) -> &RotatingSnapshot {
    s.as_any().downcast_ref::<RotatingSnapshot>().unwrap()
}

/// Writes `new` and checks what `update` returns against `model`, the ids of
/// every position written so far (before `new`).
fn write_checked(cache: &mut RotatingKvCache, model: &mut Vec<u32>, new: &[u32], shape: Shape) {
    let w = cache.window();
    let o = model.len();
    assert_eq!(cache.offset(), o);
    let mask = f32s(&cache.update_mask(new.len()).unwrap());
    let (k, v) = shape.kv(new);
    let (k, v) = cache.update(&k, &v).unwrap();
    let got = ids_of(&k, &v);
    model.extend_from_slice(new);
    let end = model.len();
    if new.len() == 1 {
        // The ring: the last min(o + 1, W) positions, position p in slot p % W.
        let n = end.min(w);
        assert_eq!(got.len(), n);
        for p in end - n..end {
            assert_eq!(got[p % w], model[p], "slot of position {p} (W = {w})");
        }
    } else {
        // Temporal order: the W - 1 earlier positions (or all), then the new ones.
        let earlier = o.min(w - 1);
        assert_eq!(
            got,
            model[o - earlier..],
            "batch of {} at {o} (W = {w})",
            new.len()
        );
    }
    // The mask says exactly which returned positions each query may see.
    let cols = got.len();
    assert_eq!(mask.len(), new.len() * cols);
    let pos_of_col = |j: usize| {
        if new.len() == 1 && end > w {
            // Ring order: find the position whose id sits in slot j.
            (end - w..end).find(|p| p % w == j).unwrap()
        } else {
            end - cols + j
        }
    };
    for i in 0..new.len() {
        let q = o + i;
        for j in 0..cols {
            let p = pos_of_col(j);
            let visible = p <= q && q - p < w;
            assert_eq!(mask[i * cols + j] == 0.0, visible, "query {q} key {p} (W = {w})");
        }
    }
    assert_eq!(cache.offset(), end);
    assert_eq!(window_ids(cache), model[end.saturating_sub(w)..]);
    assert!(cache.capacity() <= w);
}

#[derive(Clone, Debug)]
enum Op {
    Write(usize),
    Rewind(usize),
    Snapshot,
    Restore(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..4).prop_map(Op::Write),
        3 => Just(Op::Write(1)),
        2 => (4usize..14).prop_map(Op::Write),
        1 => (0usize..20).prop_map(Op::Rewind),
        1 => Just(Op::Snapshot),
        1 => (0usize..8, 0usize..3).prop_map(|(i, back)| Op::Restore(i, back)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// After any sequence of batched and single writes, rewinds and restores,
    /// `update` returns every position the new tokens need.
    #[test]
    fn window_matches_a_plain_list(
        window in 1usize..9,
        step in 1usize..6,
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let mut cache = RotatingKvCache::with_step(window, step).unwrap();
        let mut ids = Ids::default();
        let mut model: Vec<u32> = Vec::new();
        let mut snaps: Vec<(BoxedSnapshot, Vec<u32>)> = Vec::new();
        for op in ops {
            match op {
                Op::Write(n) => write_checked(&mut cache, &mut model, &ids.next(n), ONE),
                Op::Rewind(t) => {
                    let o = model.len();
                    let ok = cache.restore(None, t).unwrap();
                    let expected = t == o || t == 0 || (t < o && o <= window);
                    prop_assert_eq!(ok, expected, "rewind {} -> {} (W = {})", o, t, window);
                    if ok {
                        model.truncate(t);
                    }
                    prop_assert_eq!(cache.offset(), model.len());
                }
                Op::Snapshot => {
                    let from = model.len().saturating_sub(3);
                    if let Some(s) = cache.snapshot(from).unwrap() {
                        prop_assert_eq!(s.range(), from..model.len());
                        prop_assert_eq!(s.size_bytes(), ONE.bytes(model.len().min(window)));
                        prop_assert_eq!(rot(&s).write_index(), model.len() % window);
                        snaps.push((s, model.clone()));
                    }
                }
                Op::Restore(i, back) => {
                    if snaps.is_empty() {
                        continue;
                    }
                    let (s, m) = &snaps[i % snaps.len()];
                    let end = m.len();
                    let target = end.saturating_sub(back);
                    let ok = cache.restore(Some(&**s), target).unwrap();
                    prop_assert_eq!(ok, target == end || end <= window);
                    if ok {
                        model = m[..target].to_vec();
                    }
                    prop_assert_eq!(cache.offset(), model.len());
                    prop_assert_eq!(window_ids(&cache), model[model.len().saturating_sub(window)..].to_vec());
                }
            }
        }
        // One more batched and one more single write after whatever came before.
        write_checked(&mut cache, &mut model, &ids.next(3), ONE);
        write_checked(&mut cache, &mut model, &ids.next(1), ONE);
    }
}

/// Ollama #15591: a batched write after a wrap dropped positions still inside
/// the window.
#[test]
fn batched_write_after_wrap_keeps_the_window() {
    let mut cache = RotatingKvCache::with_step(4, 2).unwrap();
    let mut ids = Ids::default();
    let mut model = Vec::new();
    for _ in 0..6 {
        write_checked(&mut cache, &mut model, &ids.next(1), SMALL);
    }
    // Positions 3, 4, 5 are in the window of position 6.
    let (k, v) = SMALL.kv(&ids.next(3));
    let (k, v) = cache.update(&k, &v).unwrap();
    assert_eq!(ids_of(&k, &v), [3, 4, 5, 6, 7, 8]);
    assert_eq!(window_ids(&cache), [5, 6, 7, 8]);
    // A batch longer than the window.
    let (k, v) = SMALL.kv(&ids.next(6));
    let (k, v) = cache.update(&k, &v).unwrap();
    assert_eq!(ids_of(&k, &v), (6..15).collect::<Vec<_>>());
    assert_eq!(window_ids(&cache), [11, 12, 13, 14]);
    assert_eq!(cache.capacity(), 4);
}

#[test]
fn update_mask_marks_the_window() {
    let mut cache = RotatingKvCache::new(3).unwrap();
    let (k, v) = SMALL.kv(&Ids::default().next(5));
    cache.update(&k, &v).unwrap();
    // Offset 5: 2 earlier positions (3, 4), then queries 5, 6, 7.
    let mask = f32s(&cache.update_mask(3).unwrap());
    let x = f32::NEG_INFINITY;
    #[rustfmt::skip]
    let expected = [
        0.0, 0.0, 0.0, x, x,
        x, 0.0, 0.0, 0.0, x,
        x, x, 0.0, 0.0, 0.0,
    ];
    assert_eq!(mask, expected);
    assert_eq!(f32s(&cache.update_mask(1).unwrap()), [0.0, 0.0, 0.0]);
}

#[test]
fn live_rewind_only_before_the_first_wrap() {
    let mut cache = RotatingKvCache::with_step(4, 2).unwrap();
    let mut ids = Ids::default();
    let mut model = Vec::new();
    write_checked(&mut cache, &mut model, &ids.next(3), SMALL);
    assert!(cache.restore(None, 1).unwrap());
    model.truncate(1);
    write_checked(&mut cache, &mut model, &ids.next(3), SMALL);
    assert_eq!(cache.offset(), 4);
    assert!(!cache.has_wrapped());
    assert!(cache.restore(None, 2).unwrap());
    model.truncate(2);
    write_checked(&mut cache, &mut model, &ids.next(3), SMALL);
    assert!(cache.has_wrapped());
    assert!(!cache.restore(None, 4).unwrap());
    assert!(!cache.restore(None, 6).unwrap());
    assert!(cache.restore(None, 5).unwrap());
    assert_eq!(window_ids(&cache), model[1..]);
    // Back to empty is always possible, and the ring is reused from slot 0.
    assert!(cache.restore(None, 0).unwrap());
    let mut model = Vec::new();
    write_checked(&mut cache, &mut model, &ids.next(2), SMALL);
    write_checked(&mut cache, &mut model, &ids.next(1), SMALL);
    write_checked(&mut cache, &mut model, &ids.next(3), SMALL);
}

#[test]
fn snapshots_hold_the_window_and_write_index() {
    let mut cache = RotatingKvCache::with_step(4, 2).unwrap();
    let mut ids = Ids::default();
    let mut model = Vec::new();
    write_checked(&mut cache, &mut model, &ids.next(6), SMALL);
    let snap = cache.snapshot(2).unwrap().unwrap();
    assert_eq!(snap.range(), 2..6);
    let s = rot(&snap);
    assert_eq!(s.window(), 4);
    assert_eq!(s.write_index(), 2);
    assert_eq!(s.slots().keys().shape(), &[2, 2, 4, 3]);
    // Ring order: position p in slot p % 4.
    assert_eq!(ids_of(s.slots().keys(), s.slots().values()), [4, 5, 2, 3]);
    assert_eq!(snap.size_bytes(), SMALL.bytes(4));

    // Restores into any cache with the same window, whatever it holds.
    let mut other = RotatingKvCache::new(4).unwrap();
    assert!(
        !other.restore(Some(&*snap), 5).unwrap(),
        "inside a wrapped window"
    );
    assert!(!other.restore(Some(&*snap), 7).unwrap());
    assert!(other.restore(Some(&*snap), 6).unwrap());
    assert_eq!(window_ids(&other), model[2..]);
    let mut resumed = model.clone();
    write_checked(&mut other, &mut resumed, &ids.next(1), SMALL);
    write_checked(&mut other, &mut resumed, &ids.next(2), SMALL);
    // The snapshot did not change.
    assert_eq!(ids_of(s.slots().keys(), s.slots().values()), [4, 5, 2, 3]);

    // Before a wrap the window holds everything, so any earlier target works.
    let mut short = RotatingKvCache::new(8).unwrap();
    let mut m = Vec::new();
    write_checked(&mut short, &mut m, &ids.next(5), SMALL);
    let snap = short.snapshot(3).unwrap().unwrap();
    write_checked(&mut short, &mut m, &ids.next(2), SMALL);
    assert!(short.restore(Some(&*snap), 2).unwrap());
    m.truncate(2);
    assert_eq!(window_ids(&short), m);
    write_checked(&mut short, &mut m, &ids.next(9), SMALL);
}

#[test]
fn foreign_and_mismatched_snapshots_are_invalid_arguments() {
    let mut ids = Ids::default();
    let mut cache = RotatingKvCache::new(4).unwrap();
    let (k, v) = SMALL.kv(&ids.next(3));
    cache.update(&k, &v).unwrap();

    let mut wider = RotatingKvCache::new(5).unwrap();
    wider.update(&k, &v).unwrap();
    let wide = wider.snapshot(0).unwrap().unwrap();
    let mut plain = KvCache::new();
    plain.update(&k, &v).unwrap();
    let kv = plain.snapshot(0).unwrap().unwrap();

    let foreign = Foreign(0..3);
    let others: [&dyn Snapshot; 3] = [&*wide, &*kv, &foreign];
    for s in others {
        let err = cache.restore(Some(s), 3).unwrap_err();
        assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    }
    let err = error_of(cache.split(kv, 1));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let mine = cache.snapshot(0).unwrap();
    let err = error_of(cache.merge(mine, Some(Box::new(Foreign(3..4)))));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    assert_eq!(cache.offset(), 3);
    assert!(RotatingKvCache::new(0).is_err());
}

#[test]
fn free_forgets_everything() {
    let mut cache = RotatingKvCache::new(4).unwrap();
    let (k, v) = SMALL.kv(&Ids::default().next(6));
    cache.update(&k, &v).unwrap();
    cache.free();
    assert_eq!(cache.offset(), 0);
    assert_eq!(cache.capacity(), 0);
    assert!(cache.state().is_empty());
    assert!(cache.snapshot(0).unwrap().is_none());
    // A different layout is fine after free.
    let (k, v) = ONE.kv(&Ids::default().next(2));
    cache.update(&k, &v).unwrap();
    assert_eq!(cache.offset(), 2);
}

/// The model's forward pass on rotating layers: every token writes keys and
/// values that encode its id.
fn eval_rotating(caches: &mut [RotatingKvCache], tokens: &[u32]) -> Result<(), CacheError> {
    let (k, v) = SMALL.kv(tokens);
    for cache in caches {
        cache.update(&k, &v)?;
    }
    Ok(())
}

/// A prefix trie over rotating layers (window 4). A request continues a
/// conversation with generated tokens that leave an existing edge part-way,
/// so closing it splits that edge at a node with no snapshot (a window cannot
/// be split) and branches off a new leaf. Evicting the other branch merges
/// that node into the new leaf: merging the leaf's snapshot with no parent
/// snapshot used to give none, and the conversation's next turn recomputed
/// from the last snapshot before it (offset 5). It now keeps the leaf's
/// window, and the next turn restores all 8 tokens.
#[test]
fn a_trie_merge_keeps_the_rotating_snapshot_for_the_next_turn() {
    let layers = vec![
        RotatingKvCache::with_step(4, 2).unwrap(),
        RotatingKvCache::with_step(4, 2).unwrap(),
    ];
    let mut trie = PrefixCache::new(layers, usize::MAX).unwrap();
    let run = |trie: &mut PrefixCache<RotatingKvCache>, prompt: &[u32], generated: &[u32]| {
        let mut session = trie.begin(prompt).unwrap();
        let cached = session.cached();
        session
            .prefill(|chunk, caches| eval_rotating(caches, chunk))
            .unwrap();
        for (i, &t) in generated.iter().enumerate() {
            session.record(t);
            if i + 1 < generated.len() {
                eval_rotating(session.caches_mut(), &[t]).unwrap();
            }
        }
        session.close().unwrap();
        trie.check();
        cached
    };
    // [0, 8), then an unrelated conversation pages it out.
    let first: Vec<u32> = (1..=8).collect();
    run(&mut trie, &first, &[]);
    run(&mut trie, &[30, 31, 32], &[]);
    // Six of the first eight tokens, then 7 and 60 generated (61 recorded,
    // not evaluated): the edge [5, 8) splits at 7 with no window snapshot,
    // and [60] branches off it.
    run(&mut trie, &first[..6], &[7, 60, 61]);
    run(&mut trie, &[40, 41, 42], &[]);
    // Room for two nodes' windows: the oldest, [30, 31, 32] and the first
    // conversation's [7, 8), are evicted, and the snapshot-less node at [5, 7)
    // merges into [7, 8) = [60], which keeps its window.
    let window_bytes = 2 * SMALL.bytes(4);
    let (evictions, merges) = (trie.stats().evictions, trie.stats().auto_merges);
    trie.set_budget(2 * window_bytes);
    assert_eq!(trie.stats().evictions, evictions + 2);
    assert_eq!(trie.stats().auto_merges, merges + 1);
    trie.set_budget(usize::MAX);
    trie.check();

    // The next turn restores the merged leaf's window: 8 tokens cached.
    let next = [&first[..7], &[60, 61]].concat();
    let mut session = trie.begin(&next).unwrap();
    assert_eq!(session.cached(), 8, "{}", session.cached());
    for layer in session.caches() {
        assert_eq!(window_ids(layer), next[4..8]);
    }
    session
        .prefill(|chunk, caches| eval_rotating(caches, chunk))
        .unwrap();
    for layer in session.caches() {
        assert_eq!(window_ids(layer), next[5..]);
    }
    session.close().unwrap();
    trie.check();
}

#[test]
fn rotating_cache_keeps_the_state_cache_contract() {
    for window in [4, 16] {
        let subject = layers_common::MlxRotating(window);
        kvcache_api::contract::state_cache(&subject, kvcache_api::paging::Rewind::Window(window));
    }
}
