//! KvCache on real mlx-rs CPU arrays: growth, snapshots, restore, merge, split.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;

use kvcache_api::{BoxedSnapshot, CacheError, LayerCache, SnapshotCache};
use kvcache_mlx::layers::{KvCache, KvSnapshot, RecurrentCache, RotatingKvCache, RotatingSnapshot};
use layers_common::{data_range, error_of, ids_of, overlaps, Foreign, Ids, Shape, SMALL};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;
use proptest::prelude::*;

fn write(cache: &mut KvCache, ids: &[u32]) -> Vec<u32> {
    let (k, v) = SMALL.kv(ids);
    let (k, v) = cache.update(&k, &v).unwrap();
    ids_of(&k, &v)
}

fn live(cache: &KvCache) -> Vec<u32> {
    cache
        .live()
        .unwrap()
        .map_or_else(Vec::new, |(k, v)| ids_of(&k, &v))
}

fn kv_of(s: &BoxedSnapshot) -> &KvSnapshot {
    s.as_any().downcast_ref::<KvSnapshot>().unwrap()
}

fn snap_ids(s: &BoxedSnapshot) -> Vec<u32> {
    let s = kv_of(s);
    ids_of(s.keys(), s.values())
}

#[test]
fn every_type_is_send() {
    fn send<T: Send>() {}
    send::<KvCache>();
    send::<RotatingKvCache>();
    send::<RecurrentCache>();
    send::<KvSnapshot>();
    send::<RotatingSnapshot>();
    send::<kvcache_mlx::layers::RecurrentSnapshot>();
}

#[test]
fn update_returns_every_position_and_grows_in_steps() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let mut all: Vec<u32> = Vec::new();
    for (n, capacity) in [(3, 4), (1, 4), (1, 8), (5, 12), (2, 12), (1, 16)] {
        let new = ids.next(n);
        all.extend(&new);
        assert_eq!(write(&mut cache, &new), all);
        assert_eq!(cache.offset(), all.len());
        assert_eq!(cache.capacity(), capacity, "after {} tokens", all.len());
    }
    let state = cache.state();
    assert_eq!(state.len(), 2);
    assert_eq!(state[0].shape(), &[2, 2, 16, 3]);
    assert_eq!(state[1].shape(), &[2, 2, 16, 2]);
}

#[test]
fn views_are_values_unaffected_by_later_writes() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let first = ids.next(3);
    let (k, v) = SMALL.kv(&first);
    let (k0, v0) = cache.update(&k, &v).unwrap();
    assert!(cache.restore(None, 1).unwrap());
    let other = ids.next(5);
    write(&mut cache, &other);
    assert_eq!(ids_of(&k0, &v0), first);
    assert_eq!(live(&cache), [&first[..1], &other[..]].concat());
}

#[test]
fn snapshot_is_a_compact_copy_of_its_range() {
    let mut ids = Ids::default();
    let mut cache = KvCache::new();
    let all = ids.next(300);
    write(&mut cache, &all);
    assert_eq!(cache.capacity(), 512);
    let snap = cache.snapshot(100).unwrap().unwrap();
    assert_eq!(snap.range(), 100..300);
    let s = kv_of(&snap);
    assert_eq!(s.keys().shape(), &[2, 2, 200, 3]);
    assert_eq!(s.values().shape(), &[2, 2, 200, 2]);
    // What it keeps alive is its range, not the 512-position buffer.
    assert_eq!(snap.size_bytes(), SMALL.bytes(200));
    assert_eq!(s.keys().nbytes() + s.values().nbytes(), SMALL.bytes(200));
    // ... in buffers of its own.
    let state = cache.state();
    for live in &state {
        for copy in [s.keys(), s.values()] {
            assert!(!overlaps(&data_range(live), &data_range(copy)));
        }
    }
    assert_eq!(snap_ids(&snap), all[100..]);
    // Overwriting the live range leaves the snapshot as it was.
    drop(state);
    assert!(cache.restore(None, 150).unwrap());
    write(&mut cache, &ids.next(10));
    assert_eq!(snap_ids(&snap), all[100..]);
}

#[test]
fn nothing_to_snapshot() {
    let mut cache = KvCache::new();
    assert!(cache.snapshot(0).unwrap().is_none());
    write(&mut cache, &Ids::default().next(5));
    assert!(cache.snapshot(5).unwrap().is_none());
    assert!(cache.snapshot(9).unwrap().is_none());
    assert_eq!(cache.snapshot(4).unwrap().unwrap().range(), 4..5);
}

#[test]
fn restore_round_trips() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let a = ids.next(10);
    write(&mut cache, &a);
    let snap = cache.snapshot(4).unwrap().unwrap();

    // Diverge from 4, then page the snapshot back in.
    assert!(cache.restore(None, 4).unwrap());
    let b = ids.next(7);
    write(&mut cache, &b);
    assert!(cache.restore(Some(&*snap), 10).unwrap());
    assert_eq!(cache.offset(), 10);
    assert_eq!(live(&cache), a);

    // A target inside the snapshot stops there.
    assert!(cache.restore(None, 4).unwrap());
    write(&mut cache, &ids.next(2));
    assert!(cache.restore(Some(&*snap), 7).unwrap());
    assert_eq!(live(&cache), a[..7]);
    // And writing continues from the target.
    let c = ids.next(3);
    assert_eq!(write(&mut cache, &c), [&a[..7], &c[..]].concat());

    // A target before the snapshot just rewinds the live cache.
    assert!(cache.restore(Some(&*snap), 2).unwrap());
    assert_eq!(live(&cache), a[..2]);
}

#[test]
fn restore_refuses_unreachable_targets() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let a = ids.next(10);
    write(&mut cache, &a);
    let snap = cache.snapshot(6).unwrap().unwrap();

    // Beyond the snapshot's end.
    assert!(!cache.restore(Some(&*snap), 11).unwrap());
    // The live cache lacks [4, 6) that the snapshot builds on.
    assert!(cache.restore(None, 4).unwrap());
    assert!(!cache.restore(Some(&*snap), 8).unwrap());
    assert_eq!(cache.offset(), 4);
    assert_eq!(live(&cache), a[..4]);
    // Live rewind cannot go forward.
    assert!(!cache.restore(None, 5).unwrap());
    assert!(cache.restore(None, 4).unwrap());
    assert!(cache.restore(None, 0).unwrap());
    assert_eq!(cache.offset(), 0);
}

#[test]
fn restore_into_a_freed_cache() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let a = ids.next(9);
    write(&mut cache, &a);
    let whole = cache.snapshot(0).unwrap().unwrap();
    let tail = cache.snapshot(3).unwrap().unwrap();
    cache.free();
    assert_eq!(cache.offset(), 0);
    assert!(cache.state().is_empty());
    assert!(cache.live().unwrap().is_none());

    assert!(!cache.restore(Some(&*tail), 9).unwrap());
    assert!(cache.restore(Some(&*whole), 9).unwrap());
    assert_eq!(live(&cache), a);
    assert!(cache.restore(Some(&*tail), 9).unwrap());
    assert_eq!(live(&cache), a);
    // The restored buffer is the cache's own, not the snapshot's.
    let s = kv_of(&whole);
    for live in cache.state() {
        for copy in [s.keys(), s.values()] {
            assert!(!overlaps(&data_range(&live), &data_range(copy)));
        }
    }
}

#[test]
fn merge_concatenates_consecutive_snapshots() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let a = ids.next(4);
    write(&mut cache, &a);
    let first = cache.snapshot(0).unwrap().unwrap();
    let b = ids.next(5);
    write(&mut cache, &b);
    let second = cache.snapshot(4).unwrap().unwrap();
    let third = cache.snapshot(5).unwrap().unwrap();

    let merged = cache.merge(Some(first), Some(second)).unwrap().unwrap();
    assert_eq!(merged.range(), 0..9);
    assert_eq!(merged.size_bytes(), SMALL.bytes(9));
    assert_eq!(snap_ids(&merged), [&a[..], &b[..]].concat());

    let err = error_of(cache.merge(Some(merged), Some(third)));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");

    let lone = cache.snapshot(0).unwrap();
    assert!(cache.merge(lone, None).unwrap().is_none());
    let lone = cache.snapshot(0).unwrap();
    assert!(cache.merge(None, lone).unwrap().is_none());
}

#[test]
fn split_makes_two_compact_copies() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let a = ids.next(9);
    write(&mut cache, &a);
    let snap = cache.snapshot(2).unwrap().unwrap();

    let (parent, child) = cache.split(snap, 5).unwrap();
    let (parent, child) = (parent.unwrap(), child.unwrap());
    assert_eq!(parent.range(), 2..5);
    assert_eq!(child.range(), 5..9);
    assert_eq!(snap_ids(&parent), a[2..5]);
    assert_eq!(snap_ids(&child), a[5..]);
    assert_eq!(parent.size_bytes(), SMALL.bytes(3));
    assert_eq!(child.size_bytes(), SMALL.bytes(4));
    let (p, c) = (kv_of(&parent), kv_of(&child));
    assert!(!overlaps(&data_range(p.keys()), &data_range(c.keys())));

    // Splitting at or outside the ends hands the snapshot back whole.
    let (none, whole) = cache.split(child, 5).unwrap();
    assert!(none.is_none());
    let whole = whole.unwrap();
    assert_eq!(whole.range(), 5..9);
    let (whole, none) = cache.split(whole, 12).unwrap();
    assert!(none.is_none());
    assert_eq!(whole.unwrap().range(), 5..9);

    // The halves restore like the original.
    cache.free();
    write(&mut cache, &a[..2]);
    assert!(cache.restore(Some(&*parent), 5).unwrap());
    assert_eq!(live(&cache), a[..5]);
}

#[test]
fn foreign_snapshots_are_invalid_arguments() {
    let mut ids = Ids::default();
    let mut cache = KvCache::new();
    write(&mut cache, &ids.next(4));
    let mine = cache.snapshot(0).unwrap();

    let mut rotating = RotatingKvCache::new(8).unwrap();
    let (k, v) = SMALL.kv(&ids.next(4));
    rotating.update(&k, &v).unwrap();
    let theirs = rotating.snapshot(0).unwrap().unwrap();

    let invalid = |r: Result<bool, CacheError>| matches!(r, Err(CacheError::InvalidArgument(_)));
    assert!(invalid(cache.restore(Some(&Foreign(0..4)), 4)));
    assert!(invalid(cache.restore(Some(&*theirs), 4)));
    assert_eq!(cache.offset(), 4);

    let err = error_of(cache.merge(mine, Some(Box::new(Foreign(4..6)))));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let err = error_of(cache.split(Box::new(Foreign(0..4)), 2));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let err = error_of(cache.split(theirs, 2));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
}

#[test]
fn bad_updates_leave_the_cache_unchanged() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let a = ids.next(3);
    write(&mut cache, &a);

    let heads = Shape { h: 3, ..SMALL };
    let (k, v) = heads.kv(&ids.next(1));
    let err = cache.update(&k, &v).unwrap_err();
    assert!(
        matches!(err, CacheError::ShapeMismatch { what: "keys", .. }),
        "{err}"
    );

    let dv = Shape { dv: 3, ..SMALL };
    let (k, v) = dv.kv(&ids.next(1));
    let err = cache.update(&k, &v).unwrap_err();
    assert!(
        matches!(err, CacheError::ShapeMismatch { what: "values", .. }),
        "{err}"
    );

    let (k, v) = SMALL.kv(&ids.next(2));
    let short = Shape {
        b: 2,
        h: 2,
        dk: 3,
        dv: 2,
    }
    .kv(&ids.next(1))
    .1;
    let err = cache.update(&k, &short).unwrap_err();
    assert!(
        matches!(err, CacheError::ShapeMismatch { what: "values", .. }),
        "{err}"
    );
    let err = cache.update(&k.reshape(&[2, 2, 6]).unwrap(), &v).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");

    let (k, v) = SMALL.kv(&ids.next(1));
    let half = k.as_dtype(mlx_rs::Dtype::Float16).unwrap();
    let err = cache.update(&half, &v).unwrap_err();
    assert!(
        matches!(err, CacheError::DTypeMismatch { what: "keys", .. }),
        "{err}"
    );

    let empty = Array::zeros::<f32>(&[2, 2, 0, 3]).unwrap();
    let empty_v = Array::zeros::<f32>(&[2, 2, 0, 2]).unwrap();
    let err = cache.update(&empty, &empty_v).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");

    assert_eq!(cache.offset(), 3);
    assert_eq!(live(&cache), a);
}

#[test]
fn half_precision_snapshots_count_two_bytes_per_element() {
    let mut cache = KvCache::new();
    let (k, v) = SMALL.kv(&Ids::default().next(10));
    let (k, v) = (
        k.as_dtype(mlx_rs::Dtype::Float16).unwrap(),
        v.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap(),
    );
    cache.update(&k, &v).unwrap();
    let snap = cache.snapshot(3).unwrap().unwrap();
    assert_eq!(snap.size_bytes(), SMALL.bytes(7) / 2);
    let s = kv_of(&snap);
    assert_eq!(s.keys().dtype(), mlx_rs::Dtype::Float16);
    assert_eq!(s.values().dtype(), mlx_rs::Dtype::Bfloat16);
}

/// The bits of a `[B, H, L, D]` f16 array.
fn f16_bits(a: &Array) -> Vec<u16> {
    let bits = a.contiguous().unwrap().view::<u16>().unwrap();
    bits.eval().unwrap();
    bits.as_slice::<u16>().to_vec()
}

#[test]
fn half_precision_pages_bit_exactly() {
    // Arbitrary bit patterns, NaN payloads and signed zeros included, through
    // the wide-integer copies of snapshot, split, merge and restore.
    let pattern =
        |n: usize, mul: u32| -> Vec<u16> { (0..n as u32).map(|i| (i * mul % 65536) as u16).collect() };
    let f16s = |bits: Vec<u16>, d: i32| {
        Array::from_slice(&bits, &[2, 3, 20, d])
            .view::<half::f16>()
            .unwrap()
    };
    let keys = f16s(pattern(2 * 3 * 20 * 64, 40503), 64);
    let values = f16s(pattern(2 * 3 * 20 * 12, 2657), 12);
    let mut cache = KvCache::with_step(8).unwrap();
    cache.update(&keys, &values).unwrap();
    let (k0, v0) = cache.live().unwrap().unwrap();
    let (k0, v0) = (f16_bits(&k0), f16_bits(&v0));

    let snap = cache.snapshot(4).unwrap().unwrap();
    let (head, tail) = cache.split(snap, 13).unwrap();
    let snap = cache.merge(head, tail).unwrap().unwrap();
    assert_eq!(snap.range(), 4..20);
    assert!(cache.restore(None, 4).unwrap());
    let other = Array::zeros::<half::f16>(&[2, 3, 3, 64]).unwrap();
    let other_v = Array::zeros::<half::f16>(&[2, 3, 3, 12]).unwrap();
    cache.update(&other, &other_v).unwrap();
    assert!(cache.restore(Some(&*snap), 20).unwrap());
    let (k, v) = cache.live().unwrap().unwrap();
    assert_eq!(f16_bits(&k), k0);
    assert_eq!(f16_bits(&v), v0);

    // Into an empty cache (a new buffer built from the snapshot).
    let mut fresh = KvCache::with_step(8).unwrap();
    fresh
        .update(
            &keys.try_index((.., .., 0..4, ..)).unwrap(),
            &values.try_index((.., .., 0..4, ..)).unwrap(),
        )
        .unwrap();
    assert!(fresh.restore(Some(&*snap), 20).unwrap());
    let (k, v) = fresh.live().unwrap().unwrap();
    assert_eq!(f16_bits(&k), k0);
    assert_eq!(f16_bits(&v), v0);
}

#[test]
fn restore_over_a_rewound_cache_writes_in_place() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(64).unwrap();
    let a = ids.next(40);
    write(&mut cache, &a);
    let snap = cache.snapshot(10).unwrap().unwrap();
    let before: Vec<usize> = cache.state().iter().map(|s| data_range(s).start).collect();
    assert!(cache.restore(None, 10).unwrap());
    assert!(cache.restore(Some(&*snap), 40).unwrap());
    let after: Vec<usize> = cache.state().iter().map(|s| data_range(s).start).collect();
    // mlx reused the buffers (the cache held the only reference to them)
    // instead of copying them whole before writing the snapshot in.
    assert_eq!(before, after);
    assert_eq!(live(&cache), a);
}

#[test]
fn views_held_across_a_restore_keep_their_values() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(64).unwrap();
    let a = ids.next(40);
    write(&mut cache, &a);
    let snap = cache.snapshot(10).unwrap().unwrap();
    assert!(cache.restore(None, 10).unwrap());
    let b = ids.next(30);
    let (k, v) = SMALL.kv(&b);
    // Views of the live buffer, still held while the snapshot is restored: the
    // restore must not write into the buffer they see.
    let (kb, vb) = cache.update(&k, &v).unwrap();
    let seen = [&a[..10], &b[..]].concat();
    assert_eq!(ids_of(&kb, &vb), seen);
    assert!(cache.restore(None, 10).unwrap());
    assert!(cache.restore(Some(&*snap), 40).unwrap());
    assert_eq!(live(&cache), a);
    assert_eq!(
        ids_of(&kb, &vb),
        seen,
        "the held views still show what they showed"
    );
    assert_eq!(snap_ids(&snap), a[10..]);
}

#[test]
fn restore_into_an_empty_cache_of_exactly_the_snapshot_copies_it() {
    let mut ids = Ids::default();
    let mut cache = KvCache::with_step(4).unwrap();
    let a = ids.next(8);
    write(&mut cache, &a);
    let whole = cache.snapshot(0).unwrap().unwrap();
    cache.free();
    assert!(cache.restore(Some(&*whole), 8).unwrap());
    assert_eq!(cache.capacity(), 8);
    assert_eq!(live(&cache), a);
    let s = kv_of(&whole);
    for live in cache.state() {
        for copy in [s.keys(), s.values()] {
            assert!(!overlaps(&data_range(&live), &data_range(copy)));
        }
    }
    // Writing to the live cache leaves the snapshot as it was, and growth works.
    assert!(cache.restore(None, 4).unwrap());
    let b = ids.next(6);
    write(&mut cache, &b);
    assert_eq!(live(&cache), [&a[..4], &b[..]].concat());
    assert_eq!(cache.capacity(), 12);
    assert_eq!(snap_ids(&whole), a);
}

#[derive(Clone, Debug)]
enum Op {
    Write(usize),
    Rewind(usize),
    Snapshot(usize),
    Restore(usize, usize),
    SplitMerge(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..12).prop_map(Op::Write),
        1 => (0usize..40).prop_map(Op::Rewind),
        2 => (0usize..40).prop_map(Op::Snapshot),
        2 => (0usize..8, 0usize..6).prop_map(|(i, back)| Op::Restore(i, back)),
        1 => (0usize..8, 0usize..20).prop_map(|(i, at)| Op::SplitMerge(i, at)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Any sequence of writes, rewinds, snapshots, restores, splits and merges
    /// leaves the live cache holding what a plain list of token ids says.
    #[test]
    fn matches_a_plain_list(
        step in 1usize..9,
        wide in any::<bool>(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        // Rows of 16 and 8 bytes (u64 copies) or of 12 and 8 bytes.
        let shape = if wide { Shape { b: 1, h: 3, dk: 4, dv: 2 } } else { SMALL };
        let mut cache = KvCache::with_step(step).unwrap();
        let mut ids = Ids::default();
        let mut model: Vec<u32> = Vec::new();
        // Snapshots with the ids of their range.
        let mut snaps: Vec<(BoxedSnapshot, Vec<u32>)> = Vec::new();
        for op in ops {
            match op {
                Op::Write(n) => {
                    let new = ids.next(n);
                    let (k, v) = shape.kv(&new);
                    let (k, v) = cache.update(&k, &v).unwrap();
                    model.extend(&new);
                    prop_assert_eq!(ids_of(&k, &v), model.clone());
                }
                Op::Rewind(t) => {
                    let ok = cache.restore(None, t).unwrap();
                    prop_assert_eq!(ok, t <= model.len());
                    model.truncate(t);
                }
                Op::Snapshot(from) => match cache.snapshot(from).unwrap() {
                    Some(s) => {
                        prop_assert_eq!(s.range(), from..model.len());
                        prop_assert_eq!(s.size_bytes(), shape.bytes(model.len() - from));
                        prop_assert_eq!(snap_ids(&s), model[from..].to_vec());
                        snaps.push((s, model[from..].to_vec()));
                    }
                    None => prop_assert!(from >= model.len()),
                },
                Op::Restore(i, back) => {
                    if snaps.is_empty() {
                        continue;
                    }
                    let (s, snap_model) = &snaps[i % snaps.len()];
                    let range = s.range();
                    let target = range.end.saturating_sub(back);
                    let ok = cache.restore(Some(&**s), target).unwrap();
                    prop_assert_eq!(ok, model.len() >= range.start);
                    if ok {
                        model.truncate(range.start.min(target));
                        if target > range.start {
                            model.extend(&snap_model[..target - range.start]);
                        }
                    }
                }
                Op::SplitMerge(i, at) => {
                    if snaps.is_empty() {
                        continue;
                    }
                    let (s, snap_model) = snaps.swap_remove(i % snaps.len());
                    let range = s.range();
                    let at = range.start + at;
                    let (p, c) = cache.split(s, at).unwrap();
                    if at > range.start && at < range.end {
                        let (p, c) = (p.unwrap(), c.unwrap());
                        let k = at - range.start;
                        prop_assert_eq!(snap_ids(&p), snap_model[..k].to_vec());
                        prop_assert_eq!(snap_ids(&c), snap_model[k..].to_vec());
                        let merged = cache.merge(Some(p), Some(c)).unwrap().unwrap();
                        prop_assert_eq!(merged.range(), range);
                        prop_assert_eq!(snap_ids(&merged), snap_model.clone());
                        snaps.push((merged, snap_model));
                    } else {
                        let whole = p.or(c).unwrap();
                        prop_assert_eq!(whole.range(), range);
                        snaps.push((whole, snap_model));
                    }
                }
            }
            prop_assert_eq!(cache.offset(), model.len());
            prop_assert_eq!(live(&cache), model.clone());
            prop_assert!(cache.capacity().is_multiple_of(step) && cache.capacity() >= model.len());
        }
    }
}

#[test]
fn kv_cache_keeps_the_row_cache_contract() {
    kvcache_api::contract::row_cache(&layers_common::MlxKv);
}
