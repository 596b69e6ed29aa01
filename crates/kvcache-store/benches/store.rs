//! S1: put and get of a 1,024-token SmolLM2 prefix (30 layers, 3 KV heads,
//! head_dim 64; f32 ≈ 47 MB, f16 ≈ 24 MB) through a [`TieredStore`] with one
//! tier at a time, as a fraction of a bound measured in the same run:
//!
//! - memory: a memcpy of the same bytes into a fresh buffer (`to_vec`);
//! - disk: one plain sequential file write of the same bytes with `sync_all`,
//!   and a plain read of it back (`fs::read`);
//! - redis: raw SET / GET of the same bytes, cut into the same chunks, pipelined
//!   per block, against the same `redis-server` (started here on a Unix socket;
//!   skipped when `redis-server` is not on PATH).
//!
//! Page faults on fresh memory dominate copies of this size (about 1.3 GB/s on a
//! small VM), and glibc's adaptive mmap threshold decides which allocations get
//! fresh pages, differently from run to run. So the table is printed twice, by
//! two child processes with fixed glibc tunables: *cold* (every allocation of
//! 1 MiB or more is a fresh mmap: both sides pay page faults for what they
//! allocate) and *warm* (allocations come from a heap that is never trimmed:
//! both sides reuse memory, as a long-running server mostly does).
//!
//! The store's put is `submit` + `flush` (cut into 4 blocks of 256 tokens,
//! keyed, checksummed, written); its get is `fetch` from 0 (every block read,
//! checked, joined). Runs alternate store and bound; the table shows medians.
//! `KVCACHE_BENCH_QUICK=1` does 3 runs instead of 9.
//!
//! ```sh
//! CARGO_TARGET_DIR=/tmp/tgt-store cargo bench -p kvcache-store --bench store
//! ```

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvcache_api::{DType, Fingerprint, HostKv, KvLayout, Namespace, PrefixStore, Submitted};
use kvcache_store::{DiskTier, MemoryTier, RedisConfig, RedisTier, StoreConfig, Tier, TieredStore};
use kvcache_testkit::redis_server::RedisServer;

const TOKENS: usize = 1024;
const CHUNK: usize = 8 << 20;

/// glibc tunables of the two modes.
const MODES: [(&str, &str); 2] = [
    (
        "cold",
        "glibc.malloc.mmap_threshold=1048576:glibc.malloc.trim_threshold=1048576",
    ),
    (
        "warm",
        "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295",
    ),
];

fn main() {
    let Ok(mode) = std::env::var("KVCACHE_BENCH_MODE") else {
        // Run each mode in a child of its own: tunables are read at start.
        for (mode, tunables) in MODES {
            let status = Command::new(std::env::current_exe().expect("own path"))
                .args(std::env::args_os().skip(1))
                .env("KVCACHE_BENCH_MODE", mode)
                .env("GLIBC_TUNABLES", tunables)
                .status()
                .expect("run the bench");
            assert!(status.success(), "the {mode} run failed");
        }
        return;
    };
    let quick = std::env::var("KVCACHE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let runs = if quick { 3 } else { 9 };
    let scratch = tempfile::tempdir().expect("temp dir");
    let redis = RedisServer::start(scratch.path(), 2 << 30).ok();
    if redis.is_none() {
        eprintln!("redis: skipped (redis-server not on PATH or did not start)");
    }
    println!();
    println!("S1 ({mode} allocations): put/get of a {TOKENS}-token SmolLM2 prefix, median of {runs} alternating runs");
    println!(
        "{:<7} {:<5} {:<4} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "tier", "dtype", "op", "store ms", "bound ms", "store GB/s", "bound GB/s", "fraction"
    );
    for dtype in [DType::F32, DType::F16] {
        let layout = KvLayout::new(30, 3, 64, dtype);
        let bytes = TOKENS * layout.token_bytes();
        for tier in ["memory", "disk", "redis"] {
            if tier == "redis" && redis.is_none() {
                continue;
            }
            let dir = scratch.path().join(format!("{tier}-{dtype}"));
            let [put, get] = measure(tier, layout, runs, &dir, redis.as_ref());
            for (op, (ours, bound)) in [("put", put), ("get", get)] {
                let gbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
                println!(
                    "{:<7} {:<5} {:<4} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>8.0}%",
                    tier,
                    dtype.to_string(),
                    op,
                    ours.as_secs_f64() * 1e3,
                    bound.as_secs_f64() * 1e3,
                    gbs(ours),
                    gbs(bound),
                    100.0 * bound.as_secs_f64() / ours.as_secs_f64()
                );
            }
        }
    }
}

/// Medians of `[(store put, bound put), (store get, bound get)]`.
fn measure(
    tier: &str,
    layout: KvLayout,
    runs: usize,
    dir: &Path,
    redis: Option<&RedisServer>,
) -> [(Duration, Duration); 2] {
    std::fs::create_dir_all(dir).expect("bench dir");
    let config = StoreConfig::new(Fingerprint([5; 32]), layout);
    let bytes = TOKENS * layout.token_bytes();
    let tiers: Vec<Box<dyn Tier>> = match tier {
        "memory" => vec![Box::new(MemoryTier::new(config.context(), 2 * bytes as u64))],
        "disk" => vec![Box::new(
            DiskTier::open(config.context(), dir.join("store"), 3 * bytes as u64 + (1 << 20))
                .expect("disk tier"),
        )],
        _ => {
            let url = redis.expect("redis server").url();
            vec![Box::new(
                RedisTier::new(config.context(), RedisConfig::new(url)).expect("redis tier"),
            )]
        }
    };
    let store = TieredStore::new(config, tiers).expect("store");
    let ns = Namespace::shared();
    let mut bound_conn = redis.map(|r| r.connection().expect("redis connection"));
    let mut samples = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    // The first runs fill the tier and the allocator's arenas; only later ones
    // are kept (a steady state: the tier evicts as much as it stores).
    let warmup = 3;
    for run in 0..warmup + runs {
        let tokens: Vec<u32> = (0..TOKENS as u32).map(|t| t + 10_000 * run as u32).collect();
        let kv = filled(layout, run as u8);
        let store_first = run % 2 == 0;
        for turn in 0..2 {
            if (turn == 0) == store_first {
                // The store: submit + flush, then fetch everything.
                // The caller's copy is made before the clock starts: submit
                // takes ownership of what the caller hands it.
                let handed = kv.clone();
                let started = Instant::now();
                assert_eq!(store.submit(&ns, &tokens, handed), Submitted::Queued);
                store.flush();
                samples[0][0].push(started.elapsed());
                let started = Instant::now();
                let got = store
                    .fetch(&ns, &tokens, 0, Duration::from_secs(60))
                    .expect("fetch");
                samples[1][0].push(started.elapsed());
                assert_eq!(got.kv.as_bytes().len(), bytes);
                assert!(got.kv.as_bytes() == kv.as_bytes(), "fetched bytes differ");
            } else {
                let (put, get) = match tier {
                    "memory" => bound_memory(&kv),
                    "disk" => bound_disk(&kv, &dir.join(format!("plain-{run}"))),
                    _ => bound_redis(&kv, bound_conn.as_mut().expect("redis"), run),
                };
                samples[0][1].push(put);
                samples[1][1].push(get);
            }
        }
        if let Some(conn) = bound_conn.as_mut() {
            let _: () = redis::cmd("FLUSHALL").query(conn).expect("FLUSHALL");
        }
        if run < warmup {
            samples.iter_mut().flatten().for_each(Vec::clear);
        }
    }
    samples.map(|[ours, bound]| (median(ours), median(bound)))
}

/// A deterministic prefix.
fn filled(layout: KvLayout, seed: u8) -> HostKv {
    let data: Vec<u8> = (0..TOKENS * layout.token_bytes())
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect();
    HostKv::from_bytes(layout, 0, TOKENS, data).expect("prefix")
}

fn bound_memory(kv: &HostKv) -> (Duration, Duration) {
    let started = Instant::now();
    let copy = kv.as_bytes().to_vec();
    let put = started.elapsed();
    let started = Instant::now();
    let back = copy.to_vec();
    let get = started.elapsed();
    std::hint::black_box((copy, back));
    (put, get)
}

fn bound_disk(kv: &HostKv, path: &Path) -> (Duration, Duration) {
    let started = Instant::now();
    let mut file = std::fs::File::create(path).expect("create");
    file.write_all(kv.as_bytes()).expect("write");
    file.sync_all().expect("sync");
    drop(file);
    let put = started.elapsed();
    let started = Instant::now();
    let back = std::fs::read(path).expect("read");
    let get = started.elapsed();
    assert_eq!(back.len(), kv.as_bytes().len());
    let _ = std::fs::remove_file(path);
    (put, get)
}

/// SET and GET of the same bytes in the store's shape: 4 block-sized values,
/// each cut into chunks of at most 8 MiB, one pipeline per block.
fn bound_redis(kv: &HostKv, conn: &mut redis::Connection, run: usize) -> (Duration, Duration) {
    let block = kv.as_bytes().len() / 4;
    let started = Instant::now();
    for (b, value) in kv.as_bytes().chunks(block).enumerate() {
        let mut pipe = redis::pipe();
        for (i, chunk) in value.chunks(CHUNK).enumerate() {
            pipe.cmd("SET")
                .arg(format!("raw:{run}:{b}:{i}"))
                .arg(chunk)
                .ignore();
        }
        pipe.exec(conn).expect("SET");
    }
    let put = started.elapsed();
    let started = Instant::now();
    let mut total = 0;
    for (b, value) in kv.as_bytes().chunks(block).enumerate() {
        let mut pipe = redis::pipe();
        for i in 0..value.len().div_ceil(CHUNK) {
            pipe.cmd("GET").arg(format!("raw:{run}:{b}:{i}"));
        }
        let chunks: Vec<Vec<u8>> = pipe.query(conn).expect("GET");
        total += chunks.iter().map(Vec::len).sum::<usize>();
    }
    let get = started.elapsed();
    assert_eq!(total, kv.as_bytes().len());
    (put, get)
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}
