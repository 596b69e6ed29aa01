//! Host rows of real mlx-rs `KvCache`s: `read_rows` and `append_rows` round-trip
//! every dtype exactly, refuse what they cannot do without changing anything,
//! and a prefix restored from a store into a brand-new trie holds the same
//! array contents as evaluating it. Whole states of `RotatingKvCache` and
//! `RecurrentCache` (`read_state` / `load_state`) round-trip exactly, behave
//! as the live cache afterwards, and refuse what does not fit unchanged; a
//! model mixing all three kinds, restored from the store into a brand-new
//! trie, holds what evaluating its prompt gives in every layer.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;

use std::sync::Arc;
use std::time::Duration;

use kvcache_api::{CacheError, DType, HostKv, KvLayout, LayerCache, SnapshotCache};
use kvcache_mlx::layers::{KvCache, RecurrentCache, RotatingKvCache};
use kvcache_trie::fake::MemStore;
use kvcache_trie::PrefixCache;
use layers_common::{code, f32s, ids_of, Shape};
use mlx_rs::{Array, Dtype};

/// One sequence (batch 1), two heads, keys of 3 and values of 2 elements.
const ONE: Shape = Shape {
    b: 1,
    h: 2,
    dk: 3,
    dv: 2,
};

fn host_layout(layers: usize, dtype: DType) -> KvLayout {
    KvLayout {
        layers,
        kv_heads: ONE.h,
        head_dim: ONE.dk,
        head_dim_v: ONE.dv,
        dtype,
    }
}

/// Keys and values of `ids` in `dtype`.
fn kv(ids: &[u32], dtype: Dtype) -> (Array, Array) {
    let (k, v) = ONE.kv(ids);
    (k.as_dtype(dtype).unwrap(), v.as_dtype(dtype).unwrap())
}

/// A cache that evaluated `ids` (in one update per chunk of `chunk` tokens).
fn computed(ids: &[u32], dtype: Dtype, chunk: usize) -> KvCache {
    let mut cache = KvCache::with_step(4).unwrap();
    for part in ids.chunks(chunk) {
        let (k, v) = kv(part, dtype);
        cache.update(&k, &v).unwrap();
    }
    cache
}

/// The live keys and values as f32 (whatever the dtype).
fn contents(cache: &KvCache) -> (Vec<f32>, Vec<f32>) {
    let (k, v) = cache.live().unwrap().expect("a cache holding tokens");
    (
        f32s(&k.as_dtype(Dtype::Float32).unwrap()),
        f32s(&v.as_dtype(Dtype::Float32).unwrap()),
    )
}

#[test]
fn rows_round_trip_in_every_dtype() {
    let ids: Vec<u32> = (1..=9).collect();
    for (dtype, host) in [
        (Dtype::Float32, DType::F32),
        (Dtype::Float16, DType::F16),
        (Dtype::Bfloat16, DType::BF16),
    ] {
        let source = computed(&ids, dtype, 4);
        // Rows [3, 9) to the host, then onto a cache holding [0, 3).
        let mut rows = HostKv::zeroed(host_layout(1, host), 3, 6);
        assert!(source.read_rows(3..9, rows.layer_mut(0)).unwrap());
        let mut restored = computed(&ids[..3], dtype, 3);
        assert!(restored.append_rows(rows.layer(0), 0..6).unwrap());
        assert_eq!(restored.offset(), 9);
        assert_eq!(contents(&restored), contents(&source), "{dtype:?}");
        // The host form is head-major: head 1's keys of offset 4 (id 5, row 1 of the
        // run) are where `head_keys` says.
        if host == DType::F32 {
            let got: Vec<f32> = rows
                .layer(0)
                .head_keys(1, 1..2)
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let want: Vec<f32> = (0..ONE.dk).map(|d| code(5, 0, 1, d)).collect();
            assert_eq!(got, want);
        }
        // Appending part of a host run, from an empty cache.
        let mut empty = KvCache::with_step(4).unwrap();
        assert!(empty.append_rows(rows.layer(0), 2..5).unwrap());
        let reference = computed(&ids[5..8], dtype, 3);
        assert_eq!(contents(&empty), contents(&reference), "{dtype:?}");
    }
}

#[test]
fn rows_that_do_not_fit_change_nothing() {
    let ids: Vec<u32> = (1..=5).collect();
    let mut cache = computed(&ids, Dtype::Float32, 5);
    let before = contents(&cache);
    // Rows past the offset are not live.
    let mut rows = HostKv::zeroed(host_layout(1, DType::F32), 3, 3);
    assert!(!cache.read_rows(3..6, rows.layer_mut(0)).unwrap());
    // A layout of other heads or dtype is an error, on both sides.
    let wrong = KvLayout {
        kv_heads: 3,
        ..host_layout(1, DType::F32)
    };
    let mut other = HostKv::zeroed(wrong, 0, 2);
    assert!(matches!(
        cache.read_rows(0..2, other.layer_mut(0)),
        Err(CacheError::LayoutMismatch { what: "kv_heads", .. })
    ));
    assert!(matches!(
        cache.append_rows(other.layer(0), 0..2),
        Err(CacheError::LayoutMismatch { what: "kv_heads", .. })
    ));
    let f16 = HostKv::zeroed(host_layout(1, DType::F16), 0, 2);
    assert!(matches!(
        cache.append_rows(f16.layer(0), 0..2),
        Err(CacheError::LayoutMismatch { what: "dtype", .. })
    ));
    // Rows outside the host run are an error.
    let good = HostKv::zeroed(host_layout(1, DType::F32), 0, 2);
    assert!(matches!(
        cache.append_rows(good.layer(0), 1..3),
        Err(CacheError::InvalidArgument(_))
    ));
    assert_eq!(cache.offset(), 5);
    assert_eq!(contents(&cache), before);

    // A cache of two sequences cannot be cut into one sequence's rows.
    let two = Shape { b: 2, ..ONE };
    let mut batched = KvCache::with_step(4).unwrap();
    let (k, v) = two.kv(&ids);
    batched.update(&k, &v).unwrap();
    let mut rows = HostKv::zeroed(host_layout(1, DType::F32), 0, 2);
    assert!(!batched.read_rows(0..2, rows.layer_mut(0)).unwrap());
    assert!(!batched.append_rows(good.layer(0), 0..2).unwrap());
    assert_eq!(batched.offset(), 5);

    // Rotating and recurrent caches cannot cut their state: the defaults.
    let rotating = RotatingKvCache::new(4).unwrap();
    assert!(!rotating.read_rows(0..0, rows.layer_mut(0)).unwrap());
    let mut recurrent = RecurrentCache::new();
    assert!(!recurrent.append_rows(good.layer(0), 0..2).unwrap());
}

/// The model: every token writes keys/values that encode its id.
fn eval(caches: &mut [KvCache], tokens: &[u32]) -> Result<(), CacheError> {
    let (k, v) = ONE.kv(tokens);
    for cache in caches {
        cache.update(&k, &v)?;
    }
    Ok(())
}

#[test]
fn a_prefix_restored_from_the_store_equals_recomputation() {
    let store = Arc::new(MemStore::new(host_layout(2, DType::F32), 4));
    let deadline = Duration::from_millis(50);
    let prompt: Vec<u32> = (1..=14).collect();
    {
        let layers = vec![KvCache::with_step(4).unwrap(), KvCache::with_step(4).unwrap()];
        let mut first = PrefixCache::new(layers, usize::MAX).unwrap();
        first.set_store(store.clone(), deadline).unwrap();
        let mut s = first.begin(&prompt).unwrap();
        s.prefill(|chunk, caches| eval(caches, chunk)).unwrap();
        s.record(99);
        s.close().unwrap();
        first.check();
        assert_eq!(first.stats().store_tokens_written, 14);
    }

    // A restarted process: new layers, the same store.
    let layers = vec![KvCache::with_step(4).unwrap(), KvCache::with_step(4).unwrap()];
    let mut second = PrefixCache::new(layers, usize::MAX).unwrap();
    second.set_store(store, deadline).unwrap();
    let next: Vec<u32> = prompt.iter().copied().chain([40, 41]).collect();
    let mut s = second.begin(&next).unwrap();
    assert_eq!(s.cached(), 14);
    assert_eq!(s.remaining(), &[40, 41]);
    let reference = computed(&prompt, Dtype::Float32, 5);
    for layer in s.caches() {
        assert_eq!(contents(layer), contents(&reference));
        let (k, v) = layer.live().unwrap().unwrap();
        assert_eq!(ids_of(&k, &v), prompt);
    }
    s.prefill(|chunk, caches| eval(caches, chunk)).unwrap();
    let reference = computed(&next, Dtype::Float32, 3);
    for layer in s.caches() {
        assert_eq!(contents(layer), contents(&reference));
    }
    s.close().unwrap();
    second.check();
    let stats = second.stats();
    assert_eq!((stats.store_hits, stats.store_tokens), (1, 14));
}

// ---- whole states of the layers that cannot be cut into rows ----

/// A rotating cache of a window of 4 (growing by 2) that evaluated `ids` in
/// chunks of `chunk` tokens, in `dtype`.
fn rotating_after(ids: &[u32], dtype: Dtype, chunk: usize) -> RotatingKvCache {
    let mut cache = RotatingKvCache::with_step(4, 2).unwrap();
    for part in ids.chunks(chunk) {
        let (k, v) = kv(part, dtype);
        cache.update(&k, &v).unwrap();
    }
    cache
}

/// The retained window in temporal order, as f32 keys and values.
fn window_contents(cache: &RotatingKvCache) -> (Vec<f32>, Vec<f32>) {
    let (k, v) = cache.ordered_window().unwrap().expect("a cache holding tokens");
    (
        f32s(&k.as_dtype(Dtype::Float32).unwrap()),
        f32s(&v.as_dtype(Dtype::Float32).unwrap()),
    )
}

#[test]
fn rotating_state_round_trips_before_and_after_the_wrap() {
    for (dtype, host) in [
        (Dtype::Float32, DType::F32),
        (Dtype::Float16, DType::F16),
        (Dtype::Bfloat16, DType::BF16),
    ] {
        for (tokens, chunk) in [(3, 2), (4, 4), (9, 2), (11, 5)] {
            let ids: Vec<u32> = (1..=tokens).collect();
            let live = rotating_after(&ids, dtype, chunk);
            let state = live.read_state().unwrap().expect("a state");
            let n = (tokens as usize).min(4);
            assert_eq!(state.offset, tokens as usize);
            let shapes: Vec<_> = state.arrays.iter().map(|a| (a.shape.clone(), a.dtype)).collect();
            assert_eq!(shapes, vec![(vec![1, 2, n, 3], host), (vec![1, 2, n, 2], host)]);

            let mut loaded = RotatingKvCache::with_step(4, 2).unwrap();
            assert!(loaded.load_state(&state).unwrap());
            assert_eq!(loaded.offset(), live.offset());
            assert_eq!(loaded.has_wrapped(), live.has_wrapped());
            // The same window, in temporal order: the last n tokens (exact
            // codes in f32; f16 and bf16 round them).
            assert_eq!(window_contents(&loaded), window_contents(&live));
            if dtype == Dtype::Float32 {
                let (k, v) = loaded.ordered_window().unwrap().unwrap();
                assert_eq!(ids_of(&k, &v), ids[ids.len() - n..].to_vec());
            }
            // Byte for byte the same state, and the same after two more steps.
            assert_eq!(loaded.read_state().unwrap(), Some(state));
            let mut live = live;
            for next in [[100, 101, 102], [103, 104, 105]] {
                let (k, v) = kv(&next, dtype);
                let (a, b) = (live.update(&k, &v).unwrap(), loaded.update(&k, &v).unwrap());
                assert_eq!(
                    f32s(&a.0.as_dtype(Dtype::Float32).unwrap()),
                    f32s(&b.0.as_dtype(Dtype::Float32).unwrap())
                );
                assert_eq!(
                    f32s(&a.1.as_dtype(Dtype::Float32).unwrap()),
                    f32s(&b.1.as_dtype(Dtype::Float32).unwrap())
                );
                assert_eq!(window_contents(&loaded), window_contents(&live));
            }
        }
    }
}

#[test]
fn a_rotating_state_that_does_not_fit_changes_nothing() {
    let ids: Vec<u32> = (1..=6).collect();
    let good = rotating_after(&ids, Dtype::Float32, 3)
        .read_state()
        .unwrap()
        .unwrap();
    let mut cache = rotating_after(&[40, 41], Dtype::Float32, 2);
    let before = (cache.offset(), window_contents(&cache));
    let unchanged = |cache: &RotatingKvCache| {
        assert_eq!((cache.offset(), window_contents(cache)), before);
    };

    // Slots that do not match the offset (5 tokens need all 4 slots).
    let mut short = good.clone();
    short.offset = 3;
    assert!(matches!(
        cache.load_state(&short),
        Err(CacheError::ShapeMismatch { .. })
    ));
    unchanged(&cache);
    // Another dtype than the cache holds.
    let other = rotating_after(&ids, Dtype::Float16, 3)
        .read_state()
        .unwrap()
        .unwrap();
    assert!(matches!(
        cache.load_state(&other),
        Err(CacheError::DTypeMismatch { .. })
    ));
    unchanged(&cache);
    // Another head size.
    let mut wide = good.clone();
    wide.arrays[0].shape[3] = 6;
    let len = wide.arrays[0].data.len();
    wide.arrays[0].data.extend(vec![0u8; len]);
    assert!(matches!(
        cache.load_state(&wide),
        Err(CacheError::ShapeMismatch { .. })
    ));
    unchanged(&cache);
    // One array only; bytes that do not fit their shape.
    let mut one = good.clone();
    one.arrays.pop();
    assert!(cache.load_state(&one).is_err());
    let mut torn = good.clone();
    torn.arrays[1].data.pop();
    assert!(matches!(
        cache.load_state(&torn),
        Err(CacheError::InvalidArgument(_))
    ));
    unchanged(&cache);
    // The good one is taken.
    assert!(cache.load_state(&good).unwrap());
    assert_eq!(cache.offset(), 6);
}

/// A recurrent state of two arrays after `steps` steps: a `[1, 4]` f32 running
/// sum and a `[1, 2, 3]` bf16 array, both depending on every step.
fn recurrent_after(steps: u32) -> RecurrentCache {
    let mut cache = RecurrentCache::new();
    for step in 1..=steps {
        let a: Vec<f32> = (0..4).map(|i| (step * 10 + i) as f32 * 0.5).collect();
        let b: Vec<f32> = (0..6).map(|i| step as f32 - i as f32 * 0.25).collect();
        let state = vec![
            Array::from_slice(&a, &[1, 4]),
            Array::from_slice(&b, &[1, 2, 3])
                .as_dtype(Dtype::Bfloat16)
                .unwrap(),
        ];
        cache.advance(2, state).unwrap();
    }
    cache
}

fn recurrent_contents(cache: &RecurrentCache) -> Vec<Vec<f32>> {
    cache
        .state()
        .iter()
        .map(|a| f32s(&a.as_dtype(Dtype::Float32).unwrap()))
        .collect()
}

#[test]
fn recurrent_state_round_trips_and_refuses_what_does_not_fit() {
    let live = recurrent_after(3);
    let state = live.read_state().unwrap().expect("a state");
    assert_eq!(state.offset, 6);
    let shapes: Vec<_> = state.arrays.iter().map(|a| (a.shape.clone(), a.dtype)).collect();
    assert_eq!(
        shapes,
        vec![(vec![1, 4], DType::F32), (vec![1, 2, 3], DType::BF16)]
    );
    assert_eq!(RecurrentCache::new().read_state().unwrap(), None);

    let mut loaded = RecurrentCache::new();
    assert!(loaded.load_state(&state).unwrap());
    assert_eq!(loaded.offset(), 6);
    assert_eq!(recurrent_contents(&loaded), recurrent_contents(&live));
    assert_eq!(recurrent_contents(&loaded)[0], vec![15.0, 15.5, 16.0, 16.5]);
    assert_eq!(loaded.read_state().unwrap(), Some(state.clone()));

    // Into a cache holding another state: replaced, offset and all.
    let mut other = recurrent_after(1);
    assert!(other.load_state(&state).unwrap());
    assert_eq!(
        (other.offset(), recurrent_contents(&other)),
        (6, recurrent_contents(&live))
    );

    // Shapes, dtypes or counts other than the cache's: errors, nothing changed.
    let mut cache = recurrent_after(1);
    let before = (cache.offset(), recurrent_contents(&cache));
    let mut bad_shape = state.clone();
    bad_shape.arrays[0].shape = vec![2, 2];
    let mut bad_dtype = state.clone();
    bad_dtype.arrays[0] = kvcache_api::HostArray::new(vec![1, 4], DType::F16, vec![0; 8]).unwrap();
    let mut bad_count = state.clone();
    bad_count.arrays.pop();
    let mut at_zero = state.clone();
    at_zero.offset = 0;
    assert!(matches!(
        cache.load_state(&bad_shape),
        Err(CacheError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        cache.load_state(&bad_dtype),
        Err(CacheError::DTypeMismatch { .. })
    ));
    assert!(matches!(
        cache.load_state(&bad_count),
        Err(CacheError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        cache.load_state(&at_zero),
        Err(CacheError::InvalidArgument(_))
    ));
    assert_eq!((cache.offset(), recurrent_contents(&cache)), before);
}

/// One layer of a model mixing the three real cache kinds.
enum Mixed {
    Kv(KvCache),
    Window(RotatingKvCache),
    Recurrent(RecurrentCache),
}

impl Mixed {
    fn inner(&self) -> &dyn SnapshotCache {
        match self {
            Mixed::Kv(c) => c,
            Mixed::Window(c) => c,
            Mixed::Recurrent(c) => c,
        }
    }
    fn inner_mut(&mut self) -> &mut dyn SnapshotCache {
        match self {
            Mixed::Kv(c) => c,
            Mixed::Window(c) => c,
            Mixed::Recurrent(c) => c,
        }
    }

    /// What the layer holds, as f32 values: the KV cache's live keys and
    /// values, the window's retained ones in temporal order, the recurrent state.
    fn contents(&self) -> Vec<Vec<f32>> {
        match self {
            Mixed::Kv(c) => {
                let (k, v) = contents(c);
                vec![k, v]
            }
            Mixed::Window(c) => {
                let (k, v) = window_contents(c);
                vec![k, v]
            }
            Mixed::Recurrent(c) => recurrent_contents(c),
        }
    }
}

impl SnapshotCache for Mixed {
    fn offset(&self) -> usize {
        self.inner().offset()
    }
    fn snapshot(&mut self, from: usize) -> kvcache_api::Result<Option<kvcache_api::BoxedSnapshot>> {
        self.inner_mut().snapshot(from)
    }
    fn restore(
        &mut self,
        snapshot: Option<&dyn kvcache_api::Snapshot>,
        target: usize,
    ) -> kvcache_api::Result<bool> {
        self.inner_mut().restore(snapshot, target)
    }
    fn merge(
        &mut self,
        parent: Option<kvcache_api::BoxedSnapshot>,
        child: Option<kvcache_api::BoxedSnapshot>,
    ) -> kvcache_api::Result<Option<kvcache_api::BoxedSnapshot>> {
        self.inner_mut().merge(parent, child)
    }
    fn split(
        &mut self,
        snapshot: kvcache_api::BoxedSnapshot,
        at: usize,
    ) -> kvcache_api::Result<(
        Option<kvcache_api::BoxedSnapshot>,
        Option<kvcache_api::BoxedSnapshot>,
    )> {
        self.inner_mut().split(snapshot, at)
    }
    fn free(&mut self) {
        self.inner_mut().free()
    }
    fn holds_whole_state(&self) -> bool {
        self.inner().holds_whole_state()
    }
    fn read_rows(
        &self,
        rows: std::ops::Range<usize>,
        out: kvcache_api::LayerRowsMut<'_>,
    ) -> kvcache_api::Result<bool> {
        self.inner().read_rows(rows, out)
    }
    fn append_rows(
        &mut self,
        src: kvcache_api::LayerRows<'_>,
        rows: std::ops::Range<usize>,
    ) -> kvcache_api::Result<bool> {
        self.inner_mut().append_rows(src, rows)
    }
    fn read_state(&self) -> kvcache_api::Result<Option<kvcache_api::HostState>> {
        self.inner().read_state()
    }
    fn load_state(&mut self, state: &kvcache_api::HostState) -> kvcache_api::Result<bool> {
        self.inner_mut().load_state(state)
    }
}

fn mixed_layers() -> Vec<Mixed> {
    vec![
        Mixed::Kv(KvCache::with_step(4).unwrap()),
        Mixed::Window(RotatingKvCache::with_step(4, 2).unwrap()),
        Mixed::Recurrent(RecurrentCache::new()),
    ]
}

/// The mixed model: every token writes keys/values that encode its id into
/// the KV and window layers, and folds into the recurrent `[1, 3]` state
/// (`s[i] = s[i] / 2 + id + i`, exact in f32 for these sizes).
fn eval_mixed(caches: &mut [Mixed], tokens: &[u32]) -> Result<(), CacheError> {
    let (k, v) = ONE.kv(tokens);
    for cache in caches {
        match cache {
            Mixed::Kv(c) => drop(c.update(&k, &v)?),
            Mixed::Window(c) => drop(c.update(&k, &v)?),
            Mixed::Recurrent(c) => {
                let mut s = c.state().first().map_or(vec![0.0; 3], f32s);
                for &id in tokens {
                    for (i, x) in s.iter_mut().enumerate() {
                        *x = *x / 2.0 + id as f32 + i as f32;
                    }
                }
                c.advance(tokens.len(), vec![Array::from_slice(&s, &[1, 3])])?;
            }
        }
    }
    Ok(())
}

#[test]
fn a_mixed_model_restored_from_the_store_equals_recomputation() {
    let store = Arc::new(MemStore::new(host_layout(3, DType::F32), 4));
    let deadline = Duration::from_millis(50);
    let prompt: Vec<u32> = (1..=10).collect();
    {
        let mut first = PrefixCache::new(mixed_layers(), usize::MAX).unwrap();
        first.set_store(store.clone(), deadline).unwrap();
        let mut s = first.begin(&prompt).unwrap();
        s.prefill(|chunk, caches| eval_mixed(caches, chunk)).unwrap();
        s.record(99);
        s.close().unwrap();
        first.check();
        let stats = first.stats();
        assert_eq!((stats.store_tokens_written, stats.store_states_written), (10, 2));
    }

    // A restarted process: every layer holds what evaluating the prompt gives.
    let mut second = PrefixCache::new(mixed_layers(), usize::MAX).unwrap();
    second.set_store(store.clone(), deadline).unwrap();
    let next: Vec<u32> = prompt.iter().copied().chain([40, 41, 42]).collect();
    let mut reference = mixed_layers();
    eval_mixed(&mut reference, &prompt).unwrap();
    let mut s = second.begin(&next).unwrap();
    assert_eq!(s.cached(), 10);
    assert_eq!(s.remaining(), &[40, 41, 42]);
    for (layer, want) in s.caches().iter().zip(&reference) {
        assert_eq!(layer.offset(), 10);
        assert_eq!(layer.contents(), want.contents());
    }
    s.prefill(|chunk, caches| eval_mixed(caches, chunk)).unwrap();
    eval_mixed(&mut reference, &[40, 41, 42]).unwrap();
    for (layer, want) in s.caches().iter().zip(&reference) {
        assert_eq!(layer.contents(), want.contents());
    }
    s.close().unwrap();
    second.check();
    let stats = second.stats();
    assert_eq!(
        (stats.store_hits, stats.store_tokens, stats.store_states_loaded),
        (1, 10, 2)
    );

    // An exact repeat of the stored prompt stops one token short, where no
    // state was stored: nothing from the store, all evaluated.
    let mut third = PrefixCache::new(mixed_layers(), usize::MAX).unwrap();
    third.set_store(store, deadline).unwrap();
    let s = third.begin(&prompt).unwrap();
    assert_eq!(s.cached(), 0);
    drop(s);
    third.check();
    assert_eq!(third.stats().store_rejected, 1);
}
