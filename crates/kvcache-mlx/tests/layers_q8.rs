//! 8-bit snapshots ([`SnapshotEncoding::Q8`]) of the mlx KV and rotating
//! caches: the snapshot contract with restores equal within the quantization
//! bound, the bytes they really hold, the full-precision fallback, and a
//! trie keeping more of them under one byte budget.
#![cfg(any(target_os = "macos", kvcache_mlx))]

use kvcache_api::contract::{self, Subject};
use kvcache_api::paging::Rewind;
use kvcache_api::{BoxedSnapshot, CacheError, LayerCache, SnapshotCache};
use kvcache_mlx::layers::{KvCache, KvSnapshot, RotatingKvCache, SnapshotEncoding};
use kvcache_trie::PrefixCache;
use mlx_rs::{Array, Dtype};

/// Batch, KV heads and head dimension of the test arrays.
const B: usize = 1;
const H: usize = 2;
const D: usize = 64;

/// Key element `d` of token `id`: `id + d / 256`, so a group of 64 spans
/// 0.246 and 8 bits keep it within 0.246 / 510 (about 5e-4); tokens differ by 1.
fn key(id: u32, d: usize) -> f32 {
    id as f32 + d as f32 / 256.0
}

/// Value element `d` of token `id`: `-id - d / 128` (a span of 0.49 per group).
fn value(id: u32, d: usize) -> f32 {
    -(id as f32) - d as f32 / 128.0
}

/// Keys and values `[B, H, L, dim]` of `ids` in `dtype`.
fn kv(ids: &[u32], dim: usize, dtype: Dtype) -> (Array, Array) {
    let mut k = Vec::new();
    let mut v = Vec::new();
    for _ in 0..B * H {
        for &id in ids {
            k.extend((0..dim).map(|d| key(id, d)));
            v.extend((0..dim).map(|d| value(id, d)));
        }
    }
    let shape = [B as i32, H as i32, ids.len() as i32, dim as i32];
    let cast = |a: Array| a.as_dtype(dtype).unwrap();
    (
        cast(Array::from_slice(&k, &shape)),
        cast(Array::from_slice(&v, &shape)),
    )
}

fn f32s(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap().reshape(&[-1]).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

/// Largest difference between `got` `[B, H, L, D]` and the keys/values of `ids`.
fn max_error(got: (&Array, &Array), ids: &[u32]) -> f32 {
    let (k, v) = kv(ids, D, Dtype::Float32);
    let diff = |a: &Array, b: &Array| {
        f32s(a)
            .iter()
            .zip(f32s(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    if got.0.shape() != k.shape() || got.1.shape() != v.shape() {
        return f32::INFINITY;
    }
    diff(got.0, &k).max(diff(got.1, &v))
}

/// The quantization bound of the test rows: half a step of the widest
/// group span (values, 0.49), with room for the f32 scale and bias.
const Q8_BOUND: f32 = 0.4921875 / 510.0 * 1.01 + 1e-5;

/// An mlx [`KvCache`] with 8-bit snapshots: a restored cache holds the
/// tokens within [`Q8_BOUND`] (ids are 1 apart, so no other tokens pass).
struct Q8Kv;

impl Subject for Q8Kv {
    type Cache = KvCache;

    fn cache(&self) -> KvCache {
        KvCache::with_step(4)
            .unwrap()
            .with_snapshot_encoding(SnapshotEncoding::Q8_64)
            .unwrap()
    }
    fn feed(&self, cache: &mut KvCache, tokens: &[u32]) {
        let (k, v) = kv(tokens, D, Dtype::Float32);
        cache.update(&k, &v).unwrap();
    }
    fn holds(&self, cache: &KvCache, tokens: &[u32]) -> bool {
        if cache.offset() != tokens.len() {
            return false;
        }
        match cache.live().unwrap() {
            None => tokens.is_empty(),
            Some((k, v)) => max_error((&k, &v), tokens) <= Q8_BOUND,
        }
    }
    fn bytes_per_token(&self) -> usize {
        // f32: per head row, 64 one-byte elements plus an f32 scale and bias.
        B * H * 2 * (D + 2 * 4)
    }
}

/// An mlx [`RotatingKvCache`] with a window of `.0` and 8-bit snapshots.
struct Q8Rotating(usize);

impl Subject for Q8Rotating {
    type Cache = RotatingKvCache;

    fn cache(&self) -> RotatingKvCache {
        RotatingKvCache::with_step(self.0, 2)
            .unwrap()
            .with_snapshot_encoding(SnapshotEncoding::Q8_64)
            .unwrap()
    }
    fn feed(&self, cache: &mut RotatingKvCache, tokens: &[u32]) {
        let (k, v) = kv(tokens, D, Dtype::Float32);
        cache.update(&k, &v).unwrap();
    }
    fn holds(&self, cache: &RotatingKvCache, tokens: &[u32]) -> bool {
        if cache.offset() != tokens.len() {
            return false;
        }
        let kept = &tokens[tokens.len().saturating_sub(self.0)..];
        match cache.ordered_window().unwrap() {
            None => kept.is_empty(),
            Some((k, v)) => max_error((&k, &v), kept) <= Q8_BOUND,
        }
    }
}

#[test]
fn q8_kv_cache_keeps_the_row_cache_contract() {
    contract::common(&Q8Kv);
    contract::row_cache(&Q8Kv);
}

#[test]
fn q8_rotating_cache_keeps_the_state_cache_contract() {
    for window in [3, 5] {
        contract::common(&Q8Rotating(window));
        contract::state_cache(&Q8Rotating(window), Rewind::Window(window));
    }
}

fn kv_of(s: &BoxedSnapshot) -> &KvSnapshot {
    s.as_any().downcast_ref::<KvSnapshot>().unwrap()
}

/// Size of a 10-token snapshot of a cache of `dim`-wide heads in `dtype`.
fn snapshot_bytes(encoding: SnapshotEncoding, dim: usize, dtype: Dtype) -> (usize, bool) {
    let mut cache = KvCache::new().with_snapshot_encoding(encoding).unwrap();
    let ids: Vec<u32> = (1..=10).collect();
    let (k, v) = kv(&ids, dim, dtype);
    cache.update(&k, &v).unwrap();
    let snap = cache.snapshot(0).unwrap().unwrap();
    (snap.size_bytes(), kv_of(&snap).is_quantized())
}

#[test]
fn q8_snapshot_size_counts_what_it_holds() {
    let rows = 10 * B * H * 2; // head rows of keys and values
    for (dtype, elem) in [(Dtype::Float16, 2), (Dtype::Bfloat16, 2), (Dtype::Float32, 4)] {
        let (full, q) = snapshot_bytes(SnapshotEncoding::Full, D, dtype);
        assert!(!q);
        assert_eq!(full, rows * D * elem);
        for group in [32, 64, 128] {
            let (q8, q) = snapshot_bytes(SnapshotEncoding::Q8 { group_size: group }, 128, dtype);
            assert!(q, "{dtype:?} group {group}");
            assert_eq!(
                q8,
                rows * (128 + 2 * (128 / group) * elem),
                "{dtype:?} group {group}"
            );
        }
        let (q8, _) = snapshot_bytes(SnapshotEncoding::Q8_64, D, dtype);
        assert_eq!(q8, rows * (D + 2 * elem));
        // 64 + 4 bytes against 128 for f16, 64 + 8 against 256 for f32.
        let ratio = q8 as f64 / full as f64;
        let want = if elem == 2 { 68.0 / 128.0 } else { 72.0 / 256.0 };
        assert!((ratio - want).abs() < 1e-12, "{dtype:?}: {ratio}");
    }
}

#[test]
fn heads_not_a_multiple_of_the_group_stay_full_precision() {
    let (full, _) = snapshot_bytes(SnapshotEncoding::Full, 48, Dtype::Float16);
    let (q8, quantized) = snapshot_bytes(SnapshotEncoding::Q8_64, 48, Dtype::Float16);
    assert!(!quantized);
    assert_eq!(q8, full);
    // And they restore exactly.
    let mut cache = KvCache::new()
        .with_snapshot_encoding(SnapshotEncoding::Q8_64)
        .unwrap();
    let ids = [5, 6, 7];
    let (k, v) = kv(&ids, 48, Dtype::Float32);
    cache.update(&k, &v).unwrap();
    let snap = cache.snapshot(1).unwrap().unwrap();
    assert!(cache.restore(None, 1).unwrap());
    assert!(cache.restore(Some(&*snap), 3).unwrap());
    let (lk, lv) = cache.live().unwrap().unwrap();
    assert_eq!(f32s(&lk), f32s(&k));
    assert_eq!(f32s(&lv), f32s(&v));
}

#[test]
fn group_sizes_mlx_does_not_take_are_refused() {
    for group_size in [0, 16, 96, 256] {
        let encoding = SnapshotEncoding::Q8 { group_size };
        assert!(matches!(
            KvCache::new().with_snapshot_encoding(encoding),
            Err(CacheError::InvalidArgument(_))
        ));
        assert!(matches!(
            RotatingKvCache::new(4).unwrap().with_snapshot_encoding(encoding),
            Err(CacheError::InvalidArgument(_))
        ));
    }
    assert_eq!(KvCache::new().snapshot_encoding(), SnapshotEncoding::Full);
}

#[test]
fn q8_restore_dequantizes_to_the_cache_dtype_within_the_bound() {
    for dtype in [Dtype::Float16, Dtype::Float32] {
        let mut cache = KvCache::new()
            .with_snapshot_encoding(SnapshotEncoding::Q8_64)
            .unwrap();
        let ids: Vec<u32> = (1..=20).collect();
        let (k, v) = kv(&ids, D, dtype);
        cache.update(&k, &v).unwrap();
        let snap = cache.snapshot(4).unwrap().unwrap();
        assert!(cache.restore(None, 4).unwrap());
        assert!(cache.restore(Some(&*snap), 17).unwrap());
        let (lk, lv) = cache.live().unwrap().unwrap();
        assert_eq!(lk.dtype(), dtype);
        // f16 itself rounds 20.25 to a step of 1/64.
        let bound = if dtype == Dtype::Float16 {
            Q8_BOUND + 2.0 / 64.0
        } else {
            Q8_BOUND
        };
        let err = max_error((&lk, &lv), &ids[..17]);
        assert!(err <= bound, "{dtype:?}: {err}");
        assert!(err > 0.0, "8-bit rows are not exact for these values");
    }
}

/// Runs conversations of 24 fresh tokens over a trie of two layers under
/// `budget` bytes, and returns how many snapshots it pages out and keeps.
fn trie_run(encoding: SnapshotEncoding, budget: usize) -> (u64, usize) {
    let layers = (0..2)
        .map(|_| {
            KvCache::with_step(8)
                .unwrap()
                .with_snapshot_encoding(encoding)
                .unwrap()
        })
        .collect();
    let mut trie = PrefixCache::new(layers, budget).unwrap();
    for c in 0..6u32 {
        let tokens: Vec<u32> = (c * 100 + 1..=c * 100 + 24).collect();
        let mut session = trie.begin(&tokens).unwrap();
        session
            .prefill(|chunk, caches| {
                let (k, v) = kv(chunk, D, Dtype::Float16);
                for cache in caches {
                    cache.update(&k, &v)?;
                }
                Ok::<(), CacheError>(())
            })
            .unwrap();
        session.close().unwrap();
        trie.check();
    }
    // Revisit every conversation: the ones kept are hits.
    let mut hits = 0;
    for c in 0..6u32 {
        let tokens: Vec<u32> = (c * 100 + 1..=c * 100 + 25).collect();
        let session = trie.begin(&tokens).unwrap();
        if session.cached() > 0 {
            hits += 1;
        }
        session.close().unwrap();
    }
    (hits, trie.stats().paged_out_bytes)
}

#[test]
fn a_trie_of_q8_layers_keeps_more_under_one_budget() {
    // One f16 conversation: 24 tokens x 2 layers x (keys + values) x 2 heads x 128 bytes.
    let f16_conversation = 24 * 2 * 2 * H * D * 2;
    let budget = 2 * f16_conversation;
    let (full_hits, full_bytes) = trie_run(SnapshotEncoding::Full, budget);
    let (q8_hits, q8_bytes) = trie_run(SnapshotEncoding::Q8_64, budget);
    assert!(full_bytes <= budget && q8_bytes <= budget);
    assert!(full_hits <= 2, "full precision keeps {full_hits} of 6");
    assert!(q8_hits > full_hits, "8-bit keeps {q8_hits}, full {full_hits}");
    assert!(q8_hits >= 3, "8-bit keeps {q8_hits} of 6");
}
