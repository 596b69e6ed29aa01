//! The Redis tier, through the `redis` crate's synchronous API.
//!
//! Keys, under the scope's prefix `kvc2:{fp16}:{len}:{namespace}:` (see
//! [`redis_prefix`]: no tenant's prefix is a prefix of another's):
//!
//! - `…m:{key}`: the block's manifest, a few text lines (format, key, parent,
//!   start, tokens, chunk count, total length, CRC32, layout, fingerprint,
//!   namespace);
//! - `…c:{key}:{i}`: chunk `i` of the block's canonical bytes, each at most
//!   [`RedisConfig::chunk_bytes`] (Redis takes at most 512 MB per value);
//! - `…t:{parent}`: a SET of the lengths of the tails stored after `parent`.
//!
//! Chunks are written before the manifest, in one pipeline, each with the
//! optional TTL. A missing chunk (evicted by Redis), a manifest that does not
//! parse or does not match, or a checksum mismatch is a miss; the damaged keys are
//! deleted. Redis owns its memory: run it with `maxmemory` and
//! `--maxmemory-policy allkeys-lru`; [`Tier::used_bytes`] reports `used_memory`.
//!
//! Connections come from a small pool; one that fails is dropped, and the next
//! call connects again, so a Redis restarted mid-run is used again without
//! restarting the process. After a failed connection attempt, calls fail at
//! once for [`RedisConfig::retry_after`], so a server that is down costs fetches
//! nothing. Every call's socket timeouts are the time left
//! before its deadline (capped by [`RedisConfig::io_timeout`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvcache_api::{HostKv, Namespace};
use redis::{Client, Connection, RedisError};

use crate::entry_file::{layout_text, FORMAT};
use crate::error::{Result, StoreError};
use crate::keys::BlockKey;
use crate::namespace::{redis_prefix, Scope};
use crate::stats::{bump, TierCounters};
use crate::tier::{Block, Tier, TierContext};

/// How to reach and use a Redis server.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `redis://127.0.0.1:6379/`, `redis+unix:///path/to/redis.sock`, ...
    pub url: String,
    /// The longest a connection attempt may take (also bounded by each call's
    /// deadline).
    pub connect_timeout: Duration,
    /// The longest one call's reads and writes may take (also bounded by each
    /// call's deadline).
    pub io_timeout: Duration,
    /// The largest value written: blocks are split into chunks of this size.
    pub chunk_bytes: usize,
    /// Expiry of every key written, if any (rounded up to whole seconds).
    pub ttl: Option<Duration>,
    /// Idle connections kept for reuse.
    pub pool_size: usize,
    /// After a failed connection attempt, calls fail at once (without trying)
    /// for this long, so a server that is down costs fetches nothing.
    pub retry_after: Duration,
}

impl RedisConfig {
    /// Redis's limit on one value.
    pub const MAX_CHUNK: usize = 512 << 20;

    /// Defaults for `url`: 1 s to connect, 5 s per call, 8 MiB chunks, no TTL,
    /// 4 pooled connections, 250 ms between connection attempts after a failure.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(5),
            chunk_bytes: 8 << 20,
            ttl: None,
            pool_size: 4,
            retry_after: Duration::from_millis(250),
        }
    }

    /// With chunks of at most `bytes`.
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes;
        self
    }

    /// With every key expiring after `ttl`.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }
}

/// Blocks in a Redis server (see the [module docs](self)).
pub struct RedisTier {
    context: TierContext,
    config: RedisConfig,
    client: Client,
    pool: Mutex<Vec<Connection>>,
    /// Until when calls fail without trying, after a failed connection.
    down_until: Mutex<Option<Instant>>,
    counters: TierCounters,
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("context", &self.context)
            .field("config", &self.config)
            .finish()
    }
}

/// What a manifest says.
#[derive(Debug, PartialEq, Eq)]
struct Manifest {
    key: BlockKey,
    parent: BlockKey,
    start: usize,
    tokens: usize,
    chunks: usize,
    len: usize,
    crc32: u32,
    layout: String,
    fingerprint: String,
    namespace: String,
}

impl Manifest {
    fn encode(&self) -> String {
        format!(
            "format {FORMAT}\nkey {}\nparent {}\nstart {}\ntokens {}\nchunks {}\nlen {}\ncrc32 {:08x}\n\
             layout {}\nfingerprint {}\nnamespace {}\n",
            self.key,
            self.parent,
            self.start,
            self.tokens,
            self.chunks,
            self.len,
            self.crc32,
            self.layout,
            self.fingerprint,
            self.namespace
        )
    }

    fn decode(bytes: &[u8]) -> Option<Manifest> {
        let text = std::str::from_utf8(bytes).ok()?;
        let fields: HashMap<&str, &str> = text.lines().filter_map(|line| line.split_once(' ')).collect();
        if *fields.get("format")? != FORMAT {
            return None;
        }
        Some(Manifest {
            key: BlockKey::from_hex(fields.get("key")?)?,
            parent: BlockKey::from_hex(fields.get("parent")?)?,
            start: fields.get("start")?.parse().ok()?,
            tokens: fields.get("tokens")?.parse().ok()?,
            chunks: fields.get("chunks")?.parse().ok()?,
            len: fields.get("len")?.parse().ok()?,
            crc32: u32::from_str_radix(fields.get("crc32")?, 16).ok()?,
            layout: fields.get("layout")?.to_string(),
            fingerprint: fields.get("fingerprint")?.to_string(),
            namespace: fields.get("namespace")?.to_string(),
        })
    }
}

/// The Redis key names of one block.
struct Names {
    prefix: String,
    key: String,
}

impl Names {
    fn new(context: &TierContext, namespace: &Namespace, key: &BlockKey) -> Self {
        Names {
            prefix: redis_prefix(&Scope::new(&context.fingerprint, namespace)),
            key: key.to_hex(),
        }
    }
    fn manifest(&self) -> String {
        format!("{}m:{}", self.prefix, self.key)
    }
    fn chunk(&self, i: usize) -> String {
        format!("{}c:{}:{i}", self.prefix, self.key)
    }
    fn tails(&self, parent: &BlockKey) -> String {
        format!("{}t:{}", self.prefix, parent.to_hex())
    }
}

impl RedisTier {
    /// A tier on the server at `config.url` (no connection is made yet).
    pub fn new(context: TierContext, config: RedisConfig) -> Result<Self> {
        if config.chunk_bytes == 0 || config.chunk_bytes > RedisConfig::MAX_CHUNK {
            return Err(StoreError::Config(format!(
                "Redis chunks of {} bytes: choose 1 to {}",
                config.chunk_bytes,
                RedisConfig::MAX_CHUNK
            )));
        }
        let client = Client::open(config.url.as_str())?;
        Ok(RedisTier {
            context,
            config,
            client,
            pool: Mutex::new(Vec::new()),
            down_until: Mutex::new(None),
            counters: TierCounters::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The server's `maxmemory` (0: unlimited).
    pub fn maxmemory(&self) -> Result<u64> {
        let deadline = Instant::now() + self.config.io_timeout;
        let reply: HashMap<String, String> = self.with_connection(deadline, |c| {
            redis::cmd("CONFIG").arg("GET").arg("maxmemory").query(c)
        })?;
        Ok(reply.get("maxmemory").and_then(|v| v.parse().ok()).unwrap_or(0))
    }

    /// Runs `op` on a pooled or new connection whose socket timeouts end at
    /// `deadline`. A pooled connection that fails with a connection error is
    /// replaced by a new one once (the server may have restarted since).
    fn with_connection<T>(
        &self,
        deadline: Instant,
        mut op: impl FnMut(&mut Connection) -> redis::RedisResult<T>,
    ) -> Result<T> {
        let mut retried = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StoreError::Timeout);
            }
            let pooled = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let from_pool = pooled.is_some();
            let mut connection = match pooled {
                Some(connection) => connection,
                None => self.connect(left)?,
            };
            let left = deadline
                .saturating_duration_since(Instant::now())
                .min(self.config.io_timeout)
                .max(Duration::from_millis(1));
            connection.set_read_timeout(Some(left)).map_err(classify)?;
            connection.set_write_timeout(Some(left)).map_err(classify)?;
            match op(&mut connection) {
                Ok(value) => {
                    let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
                    if pool.len() < self.config.pool_size {
                        pool.push(connection);
                    }
                    return Ok(value);
                }
                Err(err) => {
                    let stale = err.is_connection_dropped() || err.is_io_error();
                    if from_pool && stale && !err.is_timeout() && !retried {
                        retried = true;
                        continue;
                    }
                    return Err(classify(err));
                }
            }
        }
    }

    /// A new connection, unless a recent attempt failed (then
    /// [`StoreError::Unavailable`] at once).
    fn connect(&self, left: Duration) -> Result<Connection> {
        let down_until = || self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        if down_until().is_some_and(|until| Instant::now() < until) {
            return Err(StoreError::Unavailable("redis"));
        }
        let timeout = left.min(self.config.connect_timeout);
        match self.client.get_connection_with_timeout(timeout) {
            Ok(connection) => {
                *down_until() = None;
                Ok(connection)
            }
            Err(err) => {
                *down_until() = Some(Instant::now() + self.config.retry_after);
                Err(classify(err))
            }
        }
    }

    fn ttl_seconds(&self) -> Option<u64> {
        self.config
            .ttl
            .map(|ttl| ttl.as_secs_f64().ceil().max(1.0) as u64)
    }

    /// Deletes a block's manifest and chunks (best effort).
    fn delete(&self, names: &Names, chunks: usize, deadline: Instant) -> Result<()> {
        let mut keys = vec![names.manifest()];
        keys.extend((0..chunks).map(|i| names.chunk(i)));
        self.with_connection(deadline, |c| redis::cmd("DEL").arg(&keys).exec(c))
    }
}

/// A timeout as [`StoreError::Timeout`], anything else as [`StoreError::Redis`].
fn classify(err: RedisError) -> StoreError {
    if err.is_timeout() {
        StoreError::Timeout
    } else {
        StoreError::Redis(err)
    }
}

impl Tier for RedisTier {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn context(&self) -> &TierContext {
        &self.context
    }

    fn get(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<Option<Arc<Block>>> {
        let names = Names::new(&self.context, namespace, key);
        let raw: Option<Vec<u8>> =
            self.with_connection(deadline, |c| redis::cmd("GET").arg(names.manifest()).query(c))?;
        let Some(raw) = raw else { return Ok(None) };
        let manifest = match Manifest::decode(&raw) {
            Some(m)
                if m.key == *key
                    && m.namespace == namespace.as_str()
                    && m.fingerprint == self.context.fingerprint.to_hex()
                    && m.layout == layout_text(&self.context.layout)
                    && (1..=self.context.block_tokens).contains(&m.tokens)
                    && m.len == m.tokens * self.context.layout.token_bytes()
                    && (1..=m.len).contains(&m.chunks) =>
            {
                m
            }
            _ => {
                bump(&self.counters.corrupt);
                self.delete(&names, 0, deadline)?;
                return Ok(None);
            }
        };
        let mut pipe = redis::pipe();
        for i in 0..manifest.chunks {
            pipe.cmd("GET").arg(names.chunk(i));
        }
        let chunks: Vec<Option<Vec<u8>>> = self.with_connection(deadline, |c| pipe.query(c))?;
        if chunks.iter().any(Option::is_none) {
            // Evicted by Redis: the rest is of no use.
            self.delete(&names, manifest.chunks, deadline)?;
            return Ok(None);
        }
        let mut chunks = chunks.into_iter().flatten();
        let mut data = if manifest.chunks == 1 {
            chunks.next().unwrap_or_default()
        } else {
            let mut data = Vec::with_capacity(manifest.len);
            chunks.for_each(|chunk| data.extend_from_slice(&chunk));
            data
        };
        if data.len() != manifest.len || crc32fast::hash(&data) != manifest.crc32 {
            bump(&self.counters.corrupt);
            self.delete(&names, manifest.chunks, deadline)?;
            return Ok(None);
        }
        data.truncate(manifest.len);
        let kv = HostKv::from_bytes(self.context.layout, manifest.start, manifest.tokens, data)?;
        Ok(Some(Arc::new(Block {
            key: *key,
            parent: manifest.parent,
            namespace: namespace.clone(),
            kv,
        })))
    }

    fn put(&self, block: &Arc<Block>, deadline: Instant) -> Result<()> {
        let names = Names::new(&self.context, &block.namespace, &block.key);
        let data = block.kv.as_bytes();
        let chunks: Vec<&[u8]> = data.chunks(self.config.chunk_bytes).collect();
        let manifest = Manifest {
            key: block.key,
            parent: block.parent,
            start: block.kv.start(),
            tokens: block.kv.tokens(),
            chunks: chunks.len(),
            len: data.len(),
            crc32: crc32fast::hash(data),
            layout: layout_text(&self.context.layout),
            fingerprint: self.context.fingerprint.to_hex(),
            namespace: block.namespace.as_str().to_owned(),
        };
        let ttl = self.ttl_seconds();
        let mut pipe = redis::pipe();
        let mut set = |name: String, value: &[u8]| {
            let cmd = pipe.cmd("SET").arg(name).arg(value);
            if let Some(ttl) = ttl {
                cmd.arg("EX").arg(ttl);
            }
            cmd.ignore();
        };
        for (i, chunk) in chunks.iter().enumerate() {
            set(names.chunk(i), chunk);
        }
        set(names.manifest(), manifest.encode().as_bytes());
        if block.is_tail(&self.context) {
            let tails = names.tails(&block.parent);
            pipe.cmd("SADD").arg(&tails).arg(block.kv.tokens()).ignore();
            if let Some(ttl) = ttl {
                pipe.cmd("EXPIRE").arg(&tails).arg(ttl).ignore();
            }
        }
        self.with_connection(deadline, |c| pipe.exec(c))
    }

    fn contains(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<bool> {
        let names = Names::new(&self.context, namespace, key);
        self.with_connection(deadline, |c| redis::cmd("EXISTS").arg(names.manifest()).query(c))
    }

    fn remove(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<()> {
        let names = Names::new(&self.context, namespace, key);
        let raw: Option<Vec<u8>> =
            self.with_connection(deadline, |c| redis::cmd("GET").arg(names.manifest()).query(c))?;
        let chunks = raw.as_deref().and_then(Manifest::decode).map_or(0, |m| m.chunks);
        self.delete(&names, chunks, deadline)
    }

    fn tails(&self, namespace: &Namespace, parent: &BlockKey, deadline: Instant) -> Result<Vec<usize>> {
        let names = Names::new(&self.context, namespace, parent);
        let members: Vec<String> = self.with_connection(deadline, |c| {
            redis::cmd("SMEMBERS").arg(names.tails(parent)).query(c)
        })?;
        let mut lengths: Vec<usize> = members
            .iter()
            .filter_map(|m| m.parse().ok())
            .filter(|&len| len > 0 && len < self.context.block_tokens)
            .collect();
        lengths.sort_unstable();
        Ok(lengths)
    }

    fn used_bytes(&self) -> Result<u64> {
        let deadline = Instant::now() + self.config.io_timeout;
        let info: String = self.with_connection(deadline, |c| redis::cmd("INFO").arg("memory").query(c))?;
        info.lines()
            .find_map(|line| line.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| StoreError::Corrupt("INFO memory has no used_memory".into()))
    }

    fn budget(&self) -> Option<u64> {
        None
    }

    fn entries(&self) -> Option<u64> {
        None
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}
