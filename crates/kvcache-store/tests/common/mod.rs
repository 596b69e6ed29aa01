//! Shared test helpers: a small layout, deterministic keys and values, stores,
//! and a `redis-server` of the test's own.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use std::sync::Arc;
use std::time::Instant;

use kvcache_api::{DType, Fingerprint, HostKv, KvLayout, Namespace};
use kvcache_store::{
    Block, BlockKey, MemoryTier, Result, StoreConfig, Tier, TierContext, TierCounters, TieredStore,
};
use kvcache_testkit::redis_server;

/// Keys and values differ in head size, and elements are two bytes.
pub fn layout() -> KvLayout {
    KvLayout {
        layers: 3,
        kv_heads: 2,
        head_dim: 4,
        head_dim_v: 2,
        dtype: DType::F16,
    }
}

pub const FP: Fingerprint = Fingerprint([0x11; 32]);

pub fn config(block_tokens: usize) -> StoreConfig {
    StoreConfig::new(FP, layout()).with_block_tokens(block_tokens)
}

/// Keys and values of `tokens[range]` as a model would compute them: each row
/// depends on the token, its position and everything before it (a running hash),
/// so equal prefixes give equal rows and any divergence changes all later rows.
pub fn kv_of(layout: KvLayout, tokens: &[u32], range: std::ops::Range<usize>) -> HostKv {
    let mut state = Vec::with_capacity(tokens.len());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
        state.push(h);
    }
    let elem = layout.dtype.size_in_bytes();
    let mut out = Vec::with_capacity(range.len() * layout.token_bytes());
    for layer in 0..layout.layers {
        for (kind, dim) in [(0u64, layout.head_dim), (1, layout.head_dim_v)] {
            for head in 0..layout.kv_heads {
                for p in range.clone() {
                    for b in 0..dim * elem {
                        let mut x = state[p]
                            ^ ((layer as u64) << 40)
                            ^ (kind << 39)
                            ^ ((head as u64) << 32)
                            ^ b as u64;
                        x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                        out.push((x >> 56) as u8);
                    }
                }
            }
        }
    }
    HostKv::from_bytes(layout, range.start, range.len(), out).unwrap()
}

/// Tokens `seed * 1000 .. seed * 1000 + len`.
pub fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

/// A store with one memory tier of `budget` bytes.
pub fn memory_store(block_tokens: usize, budget: u64) -> TieredStore {
    let config = config(block_tokens);
    let tiers: Vec<Box<dyn Tier>> = vec![Box::new(MemoryTier::new(config.context(), budget))];
    TieredStore::new(config, tiers).unwrap()
}

/// A store with one memory tier that hides what it holds (no `holds`, no row
/// readers), as Redis does: fetches go block by block instead of by plan.
pub fn opaque_memory_store(block_tokens: usize, budget: u64) -> TieredStore {
    let config = config(block_tokens);
    let tiers: Vec<Box<dyn Tier>> = vec![Box::new(Opaque(MemoryTier::new(config.context(), budget)))];
    TieredStore::new(config, tiers).unwrap()
}

/// A tier that passes everything on but what lets a store plan its fetches.
pub struct Opaque<T>(pub T);

impl<T: Tier> Tier for Opaque<T> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn context(&self) -> &TierContext {
        self.0.context()
    }
    fn get(&self, ns: &Namespace, key: &BlockKey, d: Instant) -> Result<Option<Arc<Block>>> {
        self.0.get(ns, key, d)
    }
    fn put(&self, block: &Arc<Block>, d: Instant) -> Result<()> {
        self.0.put(block, d)
    }
    fn contains(&self, ns: &Namespace, key: &BlockKey, d: Instant) -> Result<bool> {
        self.0.contains(ns, key, d)
    }
    fn remove(&self, ns: &Namespace, key: &BlockKey, d: Instant) -> Result<()> {
        self.0.remove(ns, key, d)
    }
    fn tails(&self, ns: &Namespace, parent: &BlockKey, d: Instant) -> Result<Vec<usize>> {
        self.0.tails(ns, parent, d)
    }
    fn used_bytes(&self) -> Result<u64> {
        self.0.used_bytes()
    }
    fn budget(&self) -> Option<u64> {
        self.0.budget()
    }
    fn entries(&self) -> Option<u64> {
        self.0.entries()
    }
    fn counters(&self) -> &TierCounters {
        self.0.counters()
    }
}

pub const SECOND: Duration = Duration::from_secs(1);

/// Whether the test can use Redis: see [`redis_server::available_or_skip`].
pub fn redis_available() -> bool {
    redis_server::available_or_skip()
}

/// A `redis-server` of the test's own on `dir/redis.sock` (killed on drop).
pub struct RedisServer(redis_server::RedisServer);

impl RedisServer {
    /// Starts a server with `maxmemory` bytes under allkeys-lru.
    pub fn start(dir: &Path, maxmemory: u64) -> RedisServer {
        RedisServer(redis_server::RedisServer::start(dir, maxmemory).expect("start redis-server"))
    }

    pub fn url(&self) -> String {
        self.0.url()
    }

    pub fn pid(&self) -> Option<u32> {
        self.0.pid()
    }

    pub fn maxmemory(&self) -> u64 {
        self.0.maxmemory()
    }

    /// A connection for checks from the test.
    pub fn connection(&self) -> redis::Connection {
        self.0.connection().expect("redis connection")
    }

    /// Kills the server (SIGKILL, by its process id) and reaps it.
    pub fn kill(&mut self) {
        self.0.kill();
    }

    /// A new, empty server on the same socket.
    pub fn restart(&mut self) {
        self.0.restart().expect("restart redis-server");
    }
}
