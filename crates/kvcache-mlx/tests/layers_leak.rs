//! Seed 000's leak must not come back: a snapshot of a slice of the live cache
//! must not keep the live buffer alive. Measured with mlx's own allocator
//! counter, so this file holds a single test (tests in one binary run in
//! parallel and would disturb the process-wide counter).
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;

use kvcache_api::{LayerCache, SnapshotCache};
use kvcache_mlx::layers::{KvCache, KvSnapshot, RotatingKvCache, RotatingSnapshot};
use layers_common::{data_range, overlaps, Ids, Shape};
use mlx_rs::memory::active_memory;

#[test]
fn snapshots_keep_only_their_range_alive() {
    // 1 batch, 2 heads, head dims 64, f32: 1 KiB of K+V per position.
    let big = Shape {
        b: 1,
        h: 2,
        dk: 64,
        dv: 64,
    };
    let mut ids = Ids::default();

    let before = active_memory().unwrap();
    let mut cache = KvCache::new();
    let (k, v) = big.kv(&ids.next(1000));
    cache.update(&k, &v).unwrap();
    drop((k, v));
    for a in cache.state() {
        a.eval().unwrap();
    }
    assert_eq!(cache.capacity(), 1024);
    let buffer_bytes = big.bytes(1024);
    let snap = cache.snapshot(900).unwrap().unwrap();
    assert_eq!(snap.size_bytes(), big.bytes(100));
    let with_cache = active_memory().unwrap() - before;
    assert!(
        with_cache >= buffer_bytes,
        "the live buffers use {with_cache} bytes"
    );

    drop(cache);
    let held = active_memory().unwrap() - before;
    assert!(
        held <= snap.size_bytes() + 16 * 1024,
        "after dropping the cache its snapshot of 100 positions ({} bytes) keeps {held} bytes \
         alive; the cache's buffers were {buffer_bytes} bytes",
        snap.size_bytes()
    );
    drop(snap);

    // A slice that mlx's `contiguous` would share (row-contiguous, at most
    // 16 KiB smaller than its buffer) is copied all the same.
    let one_head = Shape {
        b: 1,
        h: 1,
        dk: 4,
        dv: 4,
    };
    let mut cache = KvCache::new();
    let (k, v) = one_head.kv(&ids.next(250));
    cache.update(&k, &v).unwrap();
    let snap = cache.snapshot(10).unwrap().unwrap();
    let s = snap.as_any().downcast_ref::<KvSnapshot>().unwrap();
    for live in cache.state() {
        for copy in [s.keys(), s.values()] {
            assert!(!overlaps(&data_range(&live), &data_range(copy)));
        }
    }
    assert_eq!(snap.size_bytes(), one_head.bytes(240));

    // The rotating cache's snapshots are compact copies of the window too.
    let mut rotating = RotatingKvCache::new(300).unwrap();
    let (k, v) = one_head.kv(&ids.next(100));
    rotating.update(&k, &v).unwrap();
    assert_eq!(rotating.capacity(), 256);
    let snap = rotating.snapshot(50).unwrap().unwrap();
    assert_eq!(snap.size_bytes(), one_head.bytes(100));
    let s = snap.as_any().downcast_ref::<RotatingSnapshot>().unwrap();
    for live in rotating.state() {
        for copy in [s.slots().keys(), s.slots().values()] {
            assert!(!overlaps(&data_range(&live), &data_range(copy)));
        }
    }
}
