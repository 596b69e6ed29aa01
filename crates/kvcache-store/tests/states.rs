//! Whole layer states in the store (`submit_states` / `fetch_states`): exact
//! round trips through every tier (entries of several parts included, and a
//! disk store reopened), served for exactly the prefix they stand at, kept
//! apart by namespace and model, held within the tiers' budgets, and a damaged
//! or truncated file is a counted miss.

mod common;

use std::sync::Arc;

use common::{
    config, layout, memory_store, opaque_memory_store, prompt, redis_available, RedisServer, FP, SECOND,
};
use kvcache_api::{DType, Fingerprint, HostArray, HostState, Namespace, PrefixStore, Submitted};
use kvcache_store::{DiskTier, MemoryTier, RedisConfig, RedisTier, StoreConfig, Tier, TieredStore};

/// Tokens per block in these tests: a part carries 4 * 72 = 288 bytes.
const BLOCK: usize = 4;

/// A state of layer `layer` at `offset`: arrays whose bytes depend on every
/// argument, one of them `big` f32 elements long (several parts when large).
fn state(layer: usize, offset: usize, seed: u8, big: usize) -> (usize, HostState) {
    let array = |shape: Vec<usize>, dtype: DType, salt: u8| {
        let n = shape.iter().product::<usize>() * dtype.size_in_bytes();
        let data = (0..n)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ salt ^ (layer as u8) ^ (offset as u8))
            .collect();
        HostArray::new(shape, dtype, data).unwrap()
    };
    let arrays = vec![
        array(vec![1, 2, big], DType::F32, 1),
        array(vec![1, 3], DType::BF16, 2),
        array(vec![], DType::F16, 3),
    ];
    (layer, HostState { offset, arrays })
}

/// States of layers 0 and 2 standing at the end of `tokens`.
fn states_for(tokens: &[u32], seed: u8, big: usize) -> Vec<(usize, HostState)> {
    vec![state(0, tokens.len(), seed, big), state(2, tokens.len(), seed, 1)]
}

fn ns(name: &str) -> Namespace {
    Namespace::new(name).unwrap()
}

/// Submits, flushes, and checks the answer for exactly the prefix, and no
/// answer one token shorter or longer.
fn round_trip(store: &TieredStore, big: usize) {
    let tenant = ns("tenant-a");
    for len in [3, 4, 9] {
        let tokens = prompt(len as u32, len);
        let states = states_for(&tokens, len as u8, big);
        assert_eq!(
            store.submit_states(&tenant, &tokens, states.clone()),
            Submitted::Queued
        );
        store.flush();
        assert_eq!(
            store.fetch_states(&tenant, &tokens, SECOND),
            Some(states),
            "{len} tokens"
        );
        assert_eq!(store.fetch_states(&tenant, &tokens[..len - 1], SECOND), None);
        let longer = [&tokens[..], &[7]].concat();
        assert_eq!(store.fetch_states(&tenant, &longer, SECOND), None);
        // States are no rows: a row fetch of the same prompt finds nothing.
        assert!(store.fetch(&tenant, &tokens, 0, SECOND).is_none());
    }
    let s = store.stats();
    assert_eq!((s.states_submitted, s.states_written), (3, 3));
    assert_eq!((s.state_hits, s.state_corrupt), (3, 0));
}

#[test]
fn memory_tier_round_trip_of_one_and_of_several_parts() {
    // 270 bytes: one part; 1,838 bytes (400 f32): seven parts of 288 bytes.
    round_trip(&memory_store(BLOCK, 1 << 20), 4);
    round_trip(&memory_store(BLOCK, 1 << 20), 200);
    // Without planned reads (as over Redis) the answer is the same.
    round_trip(&opaque_memory_store(BLOCK, 1 << 20), 200);
}

fn disk_store(dir: &std::path::Path, fingerprint: Fingerprint, budget: u64) -> TieredStore {
    let config = StoreConfig::new(fingerprint, layout()).with_block_tokens(BLOCK);
    let tiers: Vec<Box<dyn Tier>> = vec![Box::new(DiskTier::open(config.context(), dir, budget).unwrap())];
    TieredStore::new(config, tiers).unwrap()
}

#[test]
fn disk_tier_round_trip_survives_a_reopen_and_keeps_models_apart() {
    let dir = tempfile::tempdir().unwrap();
    round_trip(&disk_store(dir.path(), FP, 1 << 20), 200);
    let tenant = ns("tenant-a");
    let tokens = prompt(9, 9);
    // A new process over the same directory.
    let reopened = disk_store(dir.path(), FP, 1 << 20);
    assert_eq!(
        reopened.fetch_states(&tenant, &tokens, SECOND),
        Some(states_for(&tokens, 9, 200))
    );
    // Another model over the same directory finds nothing.
    let other = disk_store(dir.path(), Fingerprint([0x22; 32]), 1 << 20);
    assert_eq!(other.fetch_states(&tenant, &tokens, SECOND), None);
}

#[test]
fn redis_tier_round_trip() {
    if !redis_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = RedisServer::start(dir.path(), 64 << 20);
    let config = config(BLOCK);
    let redis = RedisTier::new(
        config.context(),
        RedisConfig::new(server.url()).with_chunk_bytes(100),
    )
    .unwrap();
    let store = TieredStore::new(config.clone(), vec![Box::new(redis)]).unwrap();
    round_trip(&store, 200);
    // A second store (another replica) over the same Redis, with memory in
    // front: served by Redis, then promoted into memory.
    let redis = RedisTier::new(config.context(), RedisConfig::new(server.url())).unwrap();
    let memory = MemoryTier::new(config.context(), 1 << 20);
    let replica = TieredStore::new(config, vec![Box::new(memory), Box::new(redis)]).unwrap();
    let tokens = prompt(9, 9);
    let tenant = ns("tenant-a");
    let want = Some(states_for(&tokens, 9, 200));
    assert_eq!(replica.fetch_states(&tenant, &tokens, SECOND), want);
    let redis_hits = |s: &TieredStore| s.stats().tiers[1].hits;
    let before = redis_hits(&replica);
    assert_eq!(replica.fetch_states(&tenant, &tokens, SECOND), want);
    assert_eq!(
        redis_hits(&replica),
        before,
        "the second read is served by memory"
    );
    assert!(replica.stats().tiers[0].hits >= 3);
}

#[test]
fn namespaces_never_share_states() {
    let store = memory_store(BLOCK, 1 << 20);
    let tokens = prompt(1, 6);
    let a = states_for(&tokens, 1, 8);
    let b = states_for(&tokens, 2, 8);
    assert_eq!(
        store.submit_states(&ns("a"), &tokens, a.clone()),
        Submitted::Queued
    );
    assert_eq!(
        store.submit_states(&Namespace::shared(), &tokens, b.clone()),
        Submitted::Queued
    );
    store.flush();
    assert_eq!(store.fetch_states(&ns("a"), &tokens, SECOND), Some(a));
    assert_eq!(store.fetch_states(&Namespace::shared(), &tokens, SECOND), Some(b));
    assert_eq!(store.fetch_states(&ns("c"), &tokens, SECOND), None);
}

#[test]
fn invalid_submissions_are_refused_and_counted() {
    let store = memory_store(BLOCK, 1 << 20);
    let tokens = prompt(1, 6);
    let tenant = ns("a");
    // A state not standing at the end of the tokens.
    assert_eq!(
        store.submit_states(&tenant, &tokens, vec![state(0, 5, 1, 4)]),
        Submitted::Rejected
    );
    // A layer beyond the layout's 3.
    assert_eq!(
        store.submit_states(&tenant, &tokens, vec![state(3, 6, 1, 4)]),
        Submitted::Rejected
    );
    // A layer twice.
    assert_eq!(
        store.submit_states(&tenant, &tokens, vec![state(1, 6, 1, 4), state(1, 6, 2, 4)]),
        Submitted::Rejected
    );
    // Bytes that do not fit the shape.
    let mut bad = state(0, 6, 1, 4);
    bad.1.arrays[0].data.pop();
    assert_eq!(
        store.submit_states(&tenant, &tokens, vec![bad]),
        Submitted::Rejected
    );
    // Nothing at all.
    assert_eq!(store.submit_states(&tenant, &tokens, vec![]), Submitted::Rejected);
    store.flush();
    let s = store.stats();
    assert_eq!((s.rejected, s.states_submitted, s.states_written), (5, 0, 0));
    assert_eq!(store.fetch_states(&tenant, &tokens, SECOND), None);
    // Layers may come in any order; they are served sorted.
    let (first, second) = (state(2, 6, 3, 4), state(0, 6, 3, 4));
    assert_eq!(
        store.submit_states(&tenant, &tokens, vec![first.clone(), second.clone()]),
        Submitted::Queued
    );
    store.flush();
    assert_eq!(
        store.fetch_states(&tenant, &tokens, SECOND),
        Some(vec![second, first])
    );
}

#[test]
fn states_stay_within_the_memory_budget_least_recent_first() {
    // Each entry: 878 bytes in 4 parts, 936 bytes of rows; 2 KiB hold 2.
    let budget = 2048;
    let store = memory_store(BLOCK, budget);
    let tenant = ns("a");
    let mut kept = Vec::new();
    for i in 0..12u32 {
        let tokens = prompt(i, 5);
        assert_eq!(
            store.submit_states(&tenant, &tokens, states_for(&tokens, i as u8, 80)),
            Submitted::Queued
        );
        store.flush();
        let used = store.stats().tiers[0].used_bytes.unwrap();
        assert!(used <= budget, "{used} bytes after entry {i}");
        kept.push(tokens);
    }
    let found: Vec<bool> = kept
        .iter()
        .map(|t| store.fetch_states(&tenant, t, SECOND).is_some())
        .collect();
    assert!(found[11] && found[10], "the newest entries are kept: {found:?}");
    assert!(!found[0] && !found[1], "the oldest are evicted: {found:?}");
    assert!(store.stats().tiers[0].evictions > 0);
}

#[test]
fn a_damaged_or_truncated_file_is_a_counted_miss() {
    for damage in ["flip", "truncate"] {
        let dir = tempfile::tempdir().unwrap();
        let store = disk_store(dir.path(), FP, 1 << 20);
        let tenant = ns("a");
        let tokens = prompt(3, 7);
        assert_eq!(
            store.submit_states(&tenant, &tokens, states_for(&tokens, 3, 200)),
            Submitted::Queued
        );
        store.flush();
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        // 1,838 bytes in parts of 288: seven files.
        assert_eq!(files.len(), 7, "one file per part");
        // Damage the last part: the first ones read fine, the entry is a miss.
        let mut victim = None;
        for path in &files {
            let bytes = std::fs::read(path).unwrap();
            if victim
                .as_ref()
                .is_none_or(|(_, b): &(_, Vec<u8>)| bytes.len() < b.len())
            {
                victim = Some((path.clone(), bytes));
            }
        }
        let (path, mut bytes) = victim.unwrap();
        match damage {
            "flip" => {
                let at = bytes.len() - 3;
                bytes[at] ^= 0x55;
            }
            _ => bytes.truncate(bytes.len() - 5),
        }
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(store.fetch_states(&tenant, &tokens, SECOND), None, "{damage}");
        let s = store.stats();
        assert_eq!(s.tiers[0].corrupt, 1, "{damage}: counted");
        assert_eq!(s.state_hits, 0);
        assert!(!path.exists(), "{damage}: the damaged file is removed");
        // Written again, it is served again.
        assert_eq!(
            store.submit_states(&tenant, &tokens, states_for(&tokens, 3, 200)),
            Submitted::Queued
        );
        store.flush();
        assert_eq!(
            store.fetch_states(&tenant, &tokens, SECOND),
            Some(states_for(&tokens, 3, 200))
        );
    }
}

#[test]
fn usable_as_a_trait_object_with_the_default_elsewhere() {
    let store: Arc<dyn PrefixStore> = Arc::new(memory_store(BLOCK, 1 << 20));
    let tokens = prompt(5, 4);
    assert_eq!(
        store.submit_states(&Namespace::shared(), &tokens, states_for(&tokens, 5, 4)),
        Submitted::Queued
    );
    // The writer runs behind the caller: poll briefly.
    let deadline = std::time::Instant::now() + SECOND * 5;
    let mut found = None;
    while found.is_none() && std::time::Instant::now() < deadline {
        found = store.fetch_states(&Namespace::shared(), &tokens, SECOND);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(found, Some(states_for(&tokens, 5, 4)));
}
