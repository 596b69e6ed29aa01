//! Each tier on its own and the tiered store over them: round trips, budgets
//! and LRU eviction, promotion, persistence across store instances, the writer
//! queue.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use kvcache_api::{HostKv, Namespace, PrefixStore};
use kvcache_store::{
    redis_prefix, Block, BlockKey, DiskTier, KeyChain, MemoryTier, RedisConfig, RedisTier, Scope, Submitted,
    Tier, TierContext, TierCounters, TieredStore,
};

fn later() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Block `index` (full, of `block_tokens`) of prompt `seed` in `ns`, keyed as
/// the store keys it.
fn block(ctx: &TierContext, ns: &Namespace, seed: u32, blocks: usize) -> Vec<Arc<Block>> {
    let tokens = prompt(seed, blocks * ctx.block_tokens);
    let scope = Scope::new(&ctx.fingerprint, ns);
    let mut parent = BlockKey::ROOT;
    KeyChain::new(scope, ctx.block_tokens, &tokens)
        .map(|(range, key)| {
            let b = Block {
                key,
                parent,
                namespace: ns.clone(),
                kv: kv_of(ctx.layout, &tokens, range),
            };
            parent = key;
            Arc::new(b)
        })
        .collect()
}

fn tail(ctx: &TierContext, ns: &Namespace, parent: &Block, seed: u32, len: usize) -> Arc<Block> {
    let start = parent.kv.end();
    let tokens = prompt(seed, start + len);
    let scope = Scope::new(&ctx.fingerprint, ns);
    Arc::new(Block {
        key: BlockKey::new(&scope, &parent.key, &tokens[start..]),
        parent: parent.key,
        namespace: ns.clone(),
        kv: kv_of(ctx.layout, &tokens, start..start + len),
    })
}

/// Put, get, contains, tails and remove on any tier.
fn round_trip(tier: &dyn Tier) {
    let ctx = *tier.context();
    let ns = Namespace::new("rt").unwrap();
    let blocks = block(&ctx, &ns, 10, 2);
    let t = tail(&ctx, &ns, &blocks[1], 10, 3);
    for b in blocks.iter().chain([&t]) {
        tier.put(b, later()).unwrap();
    }
    for b in blocks.iter().chain([&t]) {
        let got = tier.get(&ns, &b.key, later()).unwrap().expect("stored block");
        assert_eq!(*got, **b, "{}", tier.name());
        assert!(tier.contains(&ns, &b.key, later()).unwrap());
        // Another namespace never sees it.
        assert!(tier.get(&Namespace::shared(), &b.key, later()).unwrap().is_none());
    }
    assert_eq!(tier.tails(&ns, &blocks[1].key, later()).unwrap(), vec![3]);
    assert!(tier.tails(&ns, &blocks[0].key, later()).unwrap().is_empty());
    tier.remove(&ns, &blocks[0].key, later()).unwrap();
    assert!(tier.get(&ns, &blocks[0].key, later()).unwrap().is_none());
    assert!(!tier.contains(&ns, &blocks[0].key, later()).unwrap());
    assert!(tier.get(&ns, &blocks[1].key, later()).unwrap().is_some());
}

#[test]
fn memory_tier_round_trip() {
    round_trip(&MemoryTier::new(config(4).context(), 1 << 20));
}

#[test]
fn disk_tier_round_trip_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = config(4).context();
    round_trip(&DiskTier::open(ctx, dir.path(), 1 << 20).unwrap());
    // A new tier over the directory rebuilds the index (and tails) from headers.
    let again = DiskTier::open(ctx, dir.path(), 1 << 20).unwrap();
    let ns = Namespace::new("rt").unwrap();
    let blocks = block(&ctx, &ns, 10, 2);
    assert_eq!(again.entries(), Some(2));
    assert_eq!(
        *again.get(&ns, &blocks[1].key, later()).unwrap().unwrap(),
        *blocks[1]
    );
    assert_eq!(again.tails(&ns, &blocks[1].key, later()).unwrap(), vec![3]);
    // Another model's tier over the same directory indexes nothing.
    let other = TierContext {
        fingerprint: kvcache_api::Fingerprint([3; 32]),
        ..ctx
    };
    assert_eq!(
        DiskTier::open(other, dir.path(), 1 << 20).unwrap().entries(),
        Some(0)
    );
}

#[test]
fn disk_files_are_plain_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = config(4).context();
    let tier = DiskTier::open(ctx, dir.path(), 1 << 20).unwrap();
    let ns = Namespace::new("st").unwrap();
    let b = &block(&ctx, &ns, 11, 1)[0];
    tier.put(b, later()).unwrap();
    let bytes = std::fs::read(tier.path_of(&b.key)).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.len(), 2 * ctx.layout.layers);
    let values = file.tensor("layers.2.values").unwrap();
    assert_eq!(values.dtype(), safetensors::Dtype::F16);
    assert_eq!(values.shape(), &[2, 4, 2]);
    assert_eq!(values.data(), b.kv.layer(2).values);
    assert_eq!(file.tensor("layers.0.keys").unwrap().data(), b.kv.layer(0).keys);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta["key"], b.key.to_hex());
    assert_eq!(meta["parent"], BlockKey::ROOT.to_hex());
    assert_eq!(meta["namespace"], "st");
    assert_eq!(meta["tokens"], "4");
    assert_eq!(meta["fingerprint"], FP.to_hex());
    assert_eq!(meta["crc32"], format!("{:08x}", crc32fast::hash(b.kv.as_bytes())));
}

/// Writes 12 blocks into `tier`, checking the budget after every write; the
/// newest blocks stay, the oldest go, a recently read one survives.
fn stays_within_budget(tier: &dyn Tier) {
    let ctx = *tier.context();
    let ns = Namespace::shared();
    let blocks = block(&ctx, &ns, 12, 12);
    let budget = tier.budget().unwrap();
    for (i, b) in blocks.iter().enumerate() {
        tier.put(b, later()).unwrap();
        assert!(
            tier.used_bytes().unwrap() <= budget,
            "{} over budget",
            tier.name()
        );
        if i >= 1 {
            // Keep block 0 recently used.
            assert!(tier.get(&ns, &blocks[0].key, later()).unwrap().is_some());
        }
    }
    let held = blocks
        .iter()
        .filter(|b| tier.contains(&ns, &b.key, later()).unwrap())
        .count() as u64;
    assert_eq!(Some(held), tier.entries());
    assert!((2..12).contains(&held), "{held}");
    assert!(tier.contains(&ns, &blocks[0].key, later()).unwrap());
    assert!(tier.contains(&ns, &blocks[11].key, later()).unwrap());
    assert!(!tier.contains(&ns, &blocks[1].key, later()).unwrap());
    assert_eq!(tier.stats().evictions, 12 - held);
}

#[test]
fn memory_tier_evicts_least_recently_used() {
    let ctx = config(4).context();
    let per_block = 4 * ctx.layout.token_bytes() as u64;
    stays_within_budget(&MemoryTier::new(ctx, per_block * 4 + per_block / 2));
}

#[test]
fn disk_tier_evicts_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = config(4).context();
    let tier = DiskTier::open(ctx, dir.path(), 1 << 30).unwrap();
    let probe = &block(&ctx, &Namespace::new("probe").unwrap(), 1, 1)[0];
    tier.put(probe, later()).unwrap();
    let per_file = tier.used_bytes().unwrap();
    drop(tier);
    std::fs::remove_dir_all(dir.path()).unwrap();
    let tier = DiskTier::open(ctx, dir.path(), per_file * 4 + per_file / 2).unwrap();
    stays_within_budget(&tier);
    // The files on disk are exactly the entries indexed.
    let files = std::fs::read_dir(dir.path()).unwrap().count() as u64;
    assert_eq!(Some(files), tier.entries());
}

#[test]
fn tiered_store_round_trips_and_promotes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(8);
    let open = || {
        let tiers: Vec<Box<dyn Tier>> = vec![
            Box::new(MemoryTier::new(cfg.context(), 1 << 20)),
            Box::new(DiskTier::open(cfg.context(), dir.path(), 1 << 24).unwrap()),
        ];
        TieredStore::new(cfg.clone(), tiers).unwrap()
    };
    let ns = Namespace::new("promo").unwrap();
    let tokens = prompt(20, 45);
    let kv = kv_of(layout(), &tokens, 0..45);
    {
        let store = open();
        assert_eq!(store.submit(&ns, &tokens, kv.clone()), Submitted::Queued);
        store.flush();
        let got = store.fetch(&ns, &tokens, 0, SECOND).unwrap();
        assert_eq!((got.kv.clone(), got.tiers), (kv.clone(), vec![("memory", 45)]));
        let stats = store.stats();
        assert_eq!(stats.blocks_written, 6);
        assert_eq!((stats.tiers[0].puts, stats.tiers[1].puts), (6, 6));
    }
    // A new process: memory is empty, the disk serves, and promotes.
    let store = open();
    assert_eq!(store.known_prefix(&ns, &tokens), 0);
    let got = store.fetch(&ns, &tokens, 13, SECOND).unwrap();
    assert_eq!(got.kv, kv.slice(13..45).unwrap());
    assert_eq!(got.tiers, vec![("disk", 32)]);
    let got = store.fetch(&ns, &tokens, 0, SECOND).unwrap();
    assert_eq!(got.kv, kv);
    // Blocks 0 and 1 come from the disk again: block 0 was not asked for
    // before, and block 1 only from offset 13 on (a block is promoted whole).
    assert_eq!(got.tiers, vec![("memory", 29), ("disk", 16)]);
    assert_eq!(store.known_prefix(&ns, &tokens), 45);
    let stats = store.stats();
    assert_eq!(stats.tiers[0].entries, Some(6));
    assert_eq!(stats.tiers[1].hits, 7);
    assert_eq!(stats.tiers[0].hits, 4);
}

#[test]
fn dropping_the_store_finishes_queued_writes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(8);
    let ns = Namespace::shared();
    let prompts: Vec<Vec<u32>> = (0..10).map(|s| prompt(30 + s, 24)).collect();
    {
        let disk = DiskTier::open(cfg.context(), dir.path(), 1 << 24).unwrap();
        let store = TieredStore::new(cfg.clone(), vec![Box::new(disk)]).unwrap();
        for p in &prompts {
            assert_eq!(store.submit(&ns, p, kv_of(layout(), p, 0..24)), Submitted::Queued);
        }
    }
    let disk = DiskTier::open(cfg.context(), dir.path(), 1 << 24).unwrap();
    let store = TieredStore::new(cfg, vec![Box::new(disk)]).unwrap();
    for p in &prompts {
        assert_eq!(
            store.fetch(&ns, p, 0, SECOND).unwrap().kv,
            kv_of(layout(), p, 0..24)
        );
    }
}

/// A tier whose puts wait until the test opens a gate; `entered` counts the
/// puts that reached it.
struct GatedTier {
    inner: MemoryTier,
    gate: Arc<Mutex<()>>,
    entered: Arc<AtomicUsize>,
}

impl Tier for GatedTier {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn context(&self) -> &TierContext {
        self.inner.context()
    }
    fn get(&self, ns: &Namespace, key: &BlockKey, d: Instant) -> kvcache_store::Result<Option<Arc<Block>>> {
        self.inner.get(ns, key, d)
    }
    fn put(&self, block: &Arc<Block>, d: Instant) -> kvcache_store::Result<()> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let _open = self.gate.lock().unwrap();
        self.inner.put(block, d)
    }
    fn contains(&self, ns: &Namespace, key: &BlockKey, d: Instant) -> kvcache_store::Result<bool> {
        self.inner.contains(ns, key, d)
    }
    fn remove(&self, ns: &Namespace, key: &BlockKey, d: Instant) -> kvcache_store::Result<()> {
        self.inner.remove(ns, key, d)
    }
    fn tails(&self, ns: &Namespace, parent: &BlockKey, d: Instant) -> kvcache_store::Result<Vec<usize>> {
        self.inner.tails(ns, parent, d)
    }
    fn used_bytes(&self) -> kvcache_store::Result<u64> {
        self.inner.used_bytes()
    }
    fn budget(&self) -> Option<u64> {
        self.inner.budget()
    }
    fn entries(&self) -> Option<u64> {
        self.inner.entries()
    }
    fn counters(&self) -> &TierCounters {
        self.inner.counters()
    }
}

#[test]
fn a_full_queue_drops_writes_instead_of_blocking() {
    let cfg = config(8).with_queue_capacity(2);
    let gate = Arc::new(Mutex::new(()));
    let tier = GatedTier {
        inner: MemoryTier::new(cfg.context(), 1 << 20),
        gate: Arc::clone(&gate),
        entered: Arc::default(),
    };
    let store = TieredStore::new(cfg, vec![Box::new(tier)]).unwrap();
    let ns = Namespace::shared();
    let closed = gate.lock().unwrap();
    for s in 0..10 {
        let p = prompt(40 + s, 8);
        assert_ne!(
            store.submit(&ns, &p, kv_of(layout(), &p, 0..8)),
            Submitted::Rejected
        ); // returns at once
    }
    let stats = store.stats();
    // One run is with the writer (blocked on the gate), two wait in the queue.
    assert!(stats.dropped >= 7, "{stats:?}");
    assert_eq!(stats.submitted + stats.dropped, 10);
    drop(closed);
    store.flush();
    let stats = store.stats();
    assert_eq!(stats.blocks_written, stats.submitted);
}

/// 300 submits of distinct prompts, no flush in between: each says whether it
/// was queued or dropped, the store counts exactly those, and after a flush
/// exactly the queued ones can be fetched.
fn check_submits_against_what_is_stored(store: &TieredStore, results: &[(Vec<u32>, Submitted)]) {
    let queued = results.iter().filter(|(_, r)| r.is_queued()).count() as u64;
    let dropped = results
        .iter()
        .filter(|(_, r)| matches!(r, Submitted::Dropped { .. }))
        .count() as u64;
    assert_eq!(queued + dropped, results.len() as u64);
    let stats = store.stats();
    assert_eq!(
        (stats.submitted, stats.dropped, stats.rejected),
        (queued, dropped, 0)
    );
    store.flush();
    let ns = Namespace::shared();
    let mut restorable = 0;
    for (p, result) in results {
        let fetched = store.fetch(&ns, p, 0, SECOND);
        assert_eq!(fetched.is_some(), result.is_queued(), "{result:?}");
        if let Some(f) = fetched {
            assert_eq!(f.kv, kv_of(layout(), p, 0..p.len()));
            restorable += 1;
        }
    }
    assert_eq!(restorable, queued);
}

#[test]
fn a_dropped_submit_says_so_and_the_store_counts_exactly_those() {
    const N: usize = 16;
    let cfg = config(8).with_queue_capacity(N);
    let gate = Arc::new(Mutex::new(()));
    let entered = Arc::new(AtomicUsize::new(0));
    let tier = GatedTier {
        inner: MemoryTier::new(cfg.context(), 1 << 24),
        gate: Arc::clone(&gate),
        entered: Arc::clone(&entered),
    };
    let store = TieredStore::new(cfg, vec![Box::new(tier)]).unwrap();
    let ns = Namespace::shared();
    let closed = gate.lock().unwrap();
    let submit = |s: u32| {
        let p = prompt(500 + s, 12);
        let result = store.try_submit(&ns, &p, kv_of(layout(), &p, 0..12));
        (p, result)
    };
    let mut results = vec![submit(0)];
    assert_eq!(results[0].1, Submitted::Queued);
    // The writer holds the first run, blocked in the tier: the queue is empty.
    let waited = Instant::now();
    while entered.load(Ordering::SeqCst) == 0 {
        assert!(
            waited.elapsed() < 10 * SECOND,
            "the writer never reached the tier"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    results.extend((1..300).map(submit));
    // Exactly N more fit in the queue; every later one is dropped, and says
    // how full the queue was.
    let queued = results.iter().filter(|(_, r)| r.is_queued()).count();
    assert_eq!(queued, 1 + N);
    assert!(results[1..=N].iter().all(|(_, r)| r.is_queued()));
    assert!(results[N + 1..]
        .iter()
        .all(|(_, r)| *r == Submitted::Dropped { queue_len: N }));
    // Invalid input is no drop: rejected, and counted apart.
    let p = prompt(499, 12);
    let unaligned = store.try_submit(&ns, &p, kv_of(layout(), &p, 3..12));
    assert_eq!(unaligned, Submitted::Rejected);
    assert_eq!(store.stats().rejected, 1);
    drop(closed);
    let stats = store.stats();
    assert_eq!((stats.submitted, stats.dropped), (1 + N as u64, 299 - N as u64));
    store.flush();
    let mut restorable = 0;
    for (p, result) in &results {
        let fetched = store.fetch(&ns, p, 0, SECOND);
        assert_eq!(fetched.is_some(), result.is_queued(), "{result:?}");
        restorable += usize::from(fetched.is_some());
    }
    assert_eq!(restorable, 1 + N);
}

#[test]
fn submits_at_full_speed_report_every_drop() {
    // No gate: the writer races the submits; whatever it keeps up with, the
    // answers, the counters and what is stored agree.
    let cfg = config(8).with_queue_capacity(4);
    let store = TieredStore::new(
        cfg.clone(),
        vec![Box::new(MemoryTier::new(cfg.context(), 1 << 26))],
    )
    .unwrap();
    let ns = Namespace::shared();
    let runs: Vec<(Vec<u32>, HostKv)> = (0..300)
        .map(|s| {
            let p = prompt(2000 + s, 40);
            let kv = kv_of(layout(), &p, 0..40);
            (p, kv)
        })
        .collect();
    let results: Vec<(Vec<u32>, Submitted)> = runs
        .into_iter()
        .map(|(p, kv)| {
            let r = store.try_submit(&ns, &p, kv);
            (p, r)
        })
        .collect();
    check_submits_against_what_is_stored(&store, &results);
}

#[test]
fn usable_from_many_threads_as_a_trait_object() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(8);
    let tiers: Vec<Box<dyn Tier>> = vec![
        Box::new(MemoryTier::new(cfg.context(), 4096)),
        Box::new(DiskTier::open(cfg.context(), dir.path(), 1 << 24).unwrap()),
    ];
    let store: Arc<dyn PrefixStore> = Arc::new(TieredStore::new(cfg, tiers).unwrap());
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let ns = Namespace::new(&format!("thread-{t}")).unwrap();
                for s in 0..5 {
                    let p = prompt(50 + s, 20);
                    let kv: HostKv = kv_of(layout(), &p, 0..20);
                    assert_eq!(store.submit(&ns, &p, kv.clone()), Submitted::Queued);
                    // Whatever comes back is a prefix of what was submitted.
                    for _ in 0..3 {
                        if let Some(got) = store.fetch(&ns, &p, 0, SECOND) {
                            assert_eq!(got.kv, kv.slice(0..got.kv.tokens()).unwrap());
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn redis_tier_round_trip_in_chunks_with_ttl() {
    if !redis_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = RedisServer::start(dir.path(), 64 << 20);
    let ctx = config(4).context();
    let block_bytes = 4 * ctx.layout.token_bytes();
    let config = RedisConfig::new(server.url())
        .with_chunk_bytes(block_bytes / 3 + 1)
        .with_ttl(Duration::from_secs(600));
    let tier = RedisTier::new(ctx, config).unwrap();
    round_trip(&tier);
    // Three chunks and a manifest, each with the TTL; tails in a SET.
    let ns = Namespace::new("rt").unwrap();
    let blocks = block(&ctx, &ns, 10, 2);
    let mut conn = server.connection();
    let prefix = redis_prefix(&Scope::new(&FP, &ns));
    let hex = blocks[1].key.to_hex();
    for key in [format!("{prefix}m:{hex}"), format!("{prefix}c:{hex}:2")] {
        let ttl: i64 = redis::cmd("TTL").arg(&key).query(&mut conn).unwrap();
        assert!(ttl > 500 && ttl <= 600, "{key}: {ttl}");
    }
    let exists: bool = redis::cmd("EXISTS")
        .arg(format!("{prefix}c:{hex}:3"))
        .query(&mut conn)
        .unwrap();
    assert!(!exists);
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(format!("{prefix}t:{hex}"))
        .query(&mut conn)
        .unwrap();
    assert_eq!(members, vec!["3"]);
    assert!(tier.used_bytes().unwrap() > 0);
    assert_eq!(tier.maxmemory().unwrap(), 64 << 20);
}

#[test]
fn redis_tier_stays_within_maxmemory() {
    if !redis_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = RedisServer::start(dir.path(), 4 << 20);
    // Blocks of 256 tokens * 72 bytes = 18 KiB; 600 of them = 11 MiB written.
    let cfg = config(256);
    let ctx = cfg.context();
    let tier = RedisTier::new(ctx, RedisConfig::new(server.url()).with_chunk_bytes(8 << 10)).unwrap();
    let ns = Namespace::shared();
    let blocks = block(&ctx, &ns, 60, 600);
    // Redis evicts before running each command, so the INFO that measures sees
    // memory within maxmemory plus that command's own buffers (tens of bytes
    // seen; 16 KiB allowed), never the 18 KiB block just written on top.
    let slack = 16 << 10;
    let mut most = 0;
    for b in &blocks {
        tier.put(b, later()).unwrap();
        let used = tier.used_bytes().unwrap();
        most = most.max(used);
        assert!(
            used <= server.maxmemory() + slack,
            "used_memory {used} over maxmemory"
        );
    }
    assert!(
        most > server.maxmemory() / 2,
        "the test wrote too little to reach the limit"
    );
    // The oldest are gone (whole or in part: a miss either way), the newest held.
    assert!(tier.get(&ns, &blocks[0].key, later()).unwrap().is_none());
    assert_eq!(
        *tier.get(&ns, &blocks[599].key, later()).unwrap().unwrap(),
        *blocks[599]
    );
}

#[test]
fn tiered_store_over_redis_promotes_into_memory() {
    if !redis_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = RedisServer::start(dir.path(), 64 << 20);
    let cfg = config(8);
    let open = || {
        let tiers: Vec<Box<dyn Tier>> = vec![
            Box::new(MemoryTier::new(cfg.context(), 1 << 20)),
            Box::new(RedisTier::new(cfg.context(), RedisConfig::new(server.url())).unwrap()),
        ];
        TieredStore::new(cfg.clone(), tiers).unwrap()
    };
    let ns = Namespace::new("r").unwrap();
    let tokens = prompt(70, 29);
    let kv = kv_of(layout(), &tokens, 0..29);
    assert_eq!(open().submit(&ns, &tokens, kv.clone()), Submitted::Queued); // dropped at once: the write still happens
    let store = open();
    let got = store.fetch(&ns, &tokens, 5, SECOND).unwrap();
    assert_eq!(
        (got.kv, got.tiers),
        (kv.slice(5..29).unwrap(), vec![("redis", 24)])
    );
    let got = store.fetch(&ns, &tokens, 0, SECOND).unwrap();
    assert_eq!((got.kv, got.tiers), (kv, vec![("memory", 29)]));
    assert!(store.fetch(&Namespace::shared(), &tokens, 0, SECOND).is_none());
}

#[test]
fn redis_missing_or_damaged_chunks_are_misses() {
    if !redis_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = RedisServer::start(dir.path(), 64 << 20);
    let ctx = config(4).context();
    let config = RedisConfig::new(server.url()).with_chunk_bytes(100);
    let tier = RedisTier::new(ctx, config).unwrap();
    let ns = Namespace::shared();
    let blocks = block(&ctx, &ns, 15, 2);
    for b in &blocks {
        tier.put(b, later()).unwrap();
    }
    let prefix = redis_prefix(&Scope::new(&FP, &ns));
    let mut conn = server.connection();
    // Block 0 loses a chunk (as Redis's LRU would do): a miss, nothing counted.
    let hex = blocks[0].key.to_hex();
    let _: () = redis::cmd("DEL")
        .arg(format!("{prefix}c:{hex}:1"))
        .query(&mut conn)
        .unwrap();
    assert!(tier.get(&ns, &blocks[0].key, later()).unwrap().is_none());
    assert_eq!(tier.stats().corrupt, 0);
    // Block 1 gets a flipped byte: a miss, counted, and its keys deleted.
    let hex = blocks[1].key.to_hex();
    let chunk = format!("{prefix}c:{hex}:0");
    let mut bytes: Vec<u8> = redis::cmd("GET").arg(&chunk).query(&mut conn).unwrap();
    bytes[5] ^= 0x40;
    let _: () = redis::cmd("SET").arg(&chunk).arg(bytes).query(&mut conn).unwrap();
    assert!(tier.get(&ns, &blocks[1].key, later()).unwrap().is_none());
    assert_eq!(tier.stats().corrupt, 1);
    let left: u32 = redis::cmd("EXISTS")
        .arg(format!("{prefix}m:{hex}"))
        .arg(&chunk)
        .query(&mut conn)
        .unwrap();
    assert_eq!(left, 0);
    // A manifest that does not parse: a miss, counted.
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}m:{hex}"))
        .arg("garbage")
        .query(&mut conn)
        .unwrap();
    assert!(tier.get(&ns, &blocks[1].key, later()).unwrap().is_none());
    assert_eq!(tier.stats().corrupt, 2);
}
