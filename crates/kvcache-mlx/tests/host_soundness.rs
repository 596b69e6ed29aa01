//! The host copies of `layers::host` (Linux) through the public API, in the
//! situations where they used to break Rust's rules: restores that write rows
//! in place, restores of a one-token snapshot into a one-row buffer (where
//! mlx's `slice_update` hands back the snapshot itself), and snapshots, merges
//! and splits whose plans are closed on every way out.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;

use kvcache_api::{BoxedSnapshot, LayerCache, SnapshotCache};
use kvcache_mlx::layers::{KvCache, KvSnapshot};
use layers_common::{data_range, ids_of, overlaps, Ids, SMALL};

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

/// Address ranges of the cache's key and value buffers (the clones that
/// `state` returns are dropped before this returns, so they pin nothing).
fn buffers(cache: &KvCache) -> Vec<std::ops::Range<usize>> {
    cache.state().iter().map(data_range).collect()
}

/// Finding 1: a restore into a buffer the cache holds alone writes the
/// snapshot's rows in place (through mlx's data pointer), and neither the
/// snapshot nor rows outside the restored range change.
#[test]
fn restores_write_rows_in_place_and_leave_the_snapshot_intact() {
    let mut ids = Ids::default();
    let mut cache = KvCache::new();
    let first = ids.next(10);
    write(&mut cache, &first);
    let snap = cache.snapshot(3).unwrap().unwrap();
    assert_eq!(snap_ids(&snap), first[3..]);
    // Rewind and overwrite positions 3.. with other tokens.
    assert!(cache.restore(None, 3).unwrap());
    let other = ids.next(5);
    write(&mut cache, &other);
    let before = buffers(&cache);
    for target in [10, 6, 10] {
        assert!(cache.restore(Some(snap.as_ref()), target).unwrap());
        assert_eq!(live(&cache), first[..target], "restored to {target}");
        assert_eq!(buffers(&cache), before, "written in place");
        assert_eq!(snap_ids(&snap), first[3..], "the snapshot is intact");
        let held = data_range(kv_of(&snap).keys());
        assert!(before.iter().all(|b| !overlaps(b, &held)));
        // Move the cache away from the snapshot's end before restoring again.
        assert!(cache.restore(None, 3).unwrap());
        write(&mut cache, &ids.next(2));
    }
}

/// Finding 2: with a step of 1 a one-token cache is a one-row buffer, and
/// restoring a one-token snapshot makes mlx's `slice_update` return the
/// snapshot's own array: the cache then shares the snapshot's buffer, which
/// nothing may write through. Restoring it twice, then writing, growing,
/// rewinding and restoring again, leaves the snapshot's data intact.
#[test]
fn a_one_token_snapshot_restored_twice_with_step_1_stays_intact() {
    let mut cache = KvCache::with_step(1).unwrap();
    assert_eq!(write(&mut cache, &[7]), [7]);
    assert_eq!(cache.capacity(), 1);
    let snap = cache.snapshot(0).unwrap().unwrap();
    let snap_keys = data_range(kv_of(&snap).keys());
    let snap_values = data_range(kv_of(&snap).values());
    for round in 0..2 {
        assert!(cache.restore(Some(snap.as_ref()), 1).unwrap());
        assert_eq!(live(&cache), [7], "round {round}");
        assert_eq!(snap_ids(&snap), [7], "round {round}: the snapshot is intact");
        assert_eq!(
            buffers(&cache),
            [snap_keys.clone(), snap_values.clone()],
            "round {round}: the cache shares the snapshot's buffers (the case is reached)"
        );
    }
    // The next write grows the cache into buffers of its own.
    assert_eq!(write(&mut cache, &[8]), [7, 8]);
    assert_eq!(snap_ids(&snap), [7]);
    // A restore into a two-row buffer is a real `slice_update` again.
    assert!(cache.restore(Some(snap.as_ref()), 1).unwrap());
    assert_eq!(live(&cache), [7]);
    assert!(buffers(&cache)
        .iter()
        .all(|b| !overlaps(b, &snap_keys) && !overlaps(b, &snap_values)));
    assert_eq!(write(&mut cache, &[9]), [7, 9]);
    assert_eq!(snap_ids(&snap), [7]);
    // Back to a fresh one-row cache restored from the same snapshot, then
    // overwritten by an update: the snapshot still holds token 7.
    let mut small = KvCache::with_step(1).unwrap();
    write(&mut small, &[1]);
    assert!(small.restore(Some(snap.as_ref()), 1).unwrap());
    assert!(small.restore(Some(snap.as_ref()), 1).unwrap());
    assert!(small.restore(None, 0).unwrap());
    assert_eq!(write(&mut small, &[2]), [2]);
    assert_eq!(snap_ids(&snap), [7]);
    drop(cache);
    drop(small);
    assert_eq!(snap_ids(&snap), [7], "the snapshot outlives both caches");
}

/// Findings 3 and 4 through the public API: snapshots, splits and merges,
/// whose readers' plans are closed before they return, copy exactly, and the
/// copies stay exact after their sources are gone (no read after close
/// reaches a freed source).
#[test]
fn copies_made_by_readers_outlive_their_sources() {
    let mut ids = Ids::default();
    let mut cache = KvCache::new();
    let tokens = ids.next(12);
    write(&mut cache, &tokens);
    let snap = cache.snapshot(2).unwrap().unwrap();
    let (left, right) = cache.split(snap, 6).unwrap();
    let (left, right) = (left.unwrap(), right.unwrap());
    assert_eq!(snap_ids(&left), tokens[2..6]);
    assert_eq!(snap_ids(&right), tokens[6..]);
    let merged = cache.merge(Some(left), Some(right)).unwrap().unwrap();
    cache.free();
    drop(cache);
    assert_eq!(snap_ids(&merged), tokens[2..]);
    let mut again = KvCache::new();
    write(&mut again, &tokens[..2]);
    assert!(again.restore(Some(merged.as_ref()), 12).unwrap());
    drop(merged);
    assert_eq!(live(&again), tokens);
}
