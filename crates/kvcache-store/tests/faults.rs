//! Faults: a process killed in the middle of disk writes, damaged and truncated
//! files, and a Redis server stopped, frozen and restarted mid-run.

mod common;

use kvcache_api::Submitted;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvcache_api::{DType, HostKv, KvLayout, Namespace, PrefixStore};
use kvcache_store::{
    Block, BlockKey, DiskTier, KeyChain, RedisConfig, RedisTier, Scope, StoreConfig, Tier, TierContext,
    TieredStore,
};

const CRASH_DIR_ENV: &str = "KVCACHE_STORE_CRASH_DIR";

/// Blocks of 256 tokens of 16 KiB each: 4 MiB per file.
fn crash_context() -> TierContext {
    StoreConfig::new(FP, KvLayout::new(8, 4, 64, DType::F32))
        .with_block_tokens(256)
        .context()
}

/// The bytes every crash block starts from (made once: cheap blocks keep the
/// child's time in its writes, where the kill should land).
fn crash_base(ctx: &TierContext) -> Vec<u8> {
    (0..ctx.block_tokens * ctx.layout.token_bytes())
        .map(|j| (j as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
        .collect()
}

/// Write number `i` of the crash stream: the first block of prompt `i`, its
/// bytes the base with `i` in the first four.
fn crash_block(ctx: &TierContext, base: &[u8], i: u32) -> Arc<Block> {
    let ns = Namespace::new("crash").unwrap();
    let tokens = prompt(i, ctx.block_tokens);
    let (range, key) = KeyChain::new(Scope::new(&ctx.fingerprint, &ns), ctx.block_tokens, &tokens)
        .next()
        .unwrap();
    let mut data = base.to_vec();
    data[..4].copy_from_slice(&i.to_le_bytes());
    Arc::new(Block {
        key,
        parent: BlockKey::ROOT,
        namespace: ns,
        kv: HostKv::from_bytes(ctx.layout, range.start, range.len(), data).unwrap(),
    })
}

/// The child side of `a_killed_writer_leaves_a_consistent_directory`: with the
/// env var set, writes blocks to the directory until killed (bounded), saying
/// after each one. Without it (a normal test run), does nothing.
#[test]
fn crash_child_process() {
    let Some(dir) = std::env::var_os(CRASH_DIR_ENV) else {
        return;
    };
    let ctx = crash_context();
    let base = crash_base(&ctx);
    // A budget of 6 files: evictions happen during the stream too.
    let tier = DiskTier::open(ctx, dir, 6 * ((4 << 20) + 8192)).unwrap();
    for i in 0..10_000 {
        tier.put(&crash_block(&ctx, &base, i), Instant::now() + SECOND)
            .unwrap();
        println!("wrote {i}");
    }
}

#[test]
fn a_killed_writer_leaves_a_consistent_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = crash_context();
    let base = crash_base(&ctx);
    let mut written = 0u32;
    // Three kills at different points of the stream, the later ones over what
    // the earlier left behind.
    for (round, kill_after) in [(0u64, 3u32), (1, 7), (2, 10), (3, 14)] {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "crash_child_process",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_DIR_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut seen = 0;
        while let Some(Ok(line)) = lines.next() {
            if let Some(i) = line.strip_prefix("wrote ").and_then(|n| n.parse::<u32>().ok()) {
                seen = i + 1;
                if seen >= kill_after {
                    break;
                }
            }
        }
        assert!(
            seen >= kill_after,
            "round {round}: the child stopped after {seen} writes"
        );
        // Let it get into the next write, then SIGKILL it by pid.
        std::thread::sleep(Duration::from_millis(1 + 2 * round));
        child.kill().unwrap();
        child.wait().unwrap();
        // The child may have finished a few more writes before the kill landed.
        written = written.max(seen + 100);
        let temps = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(".tmp-")
            })
            .count();
        eprintln!("round {round}: killed after {seen} writes, {temps} temporary file(s) left");

        let ns = Namespace::new("crash").unwrap();
        let scope = Scope::new(&ctx.fingerprint, &ns);
        let expected: HashMap<BlockKey, u32> = (0..written)
            .map(|i| {
                (
                    KeyChain::new(scope, ctx.block_tokens, &prompt(i, ctx.block_tokens))
                        .next()
                        .unwrap()
                        .1,
                    i,
                )
            })
            .collect();
        let tier = DiskTier::open(ctx, dir.path(), 1 << 30).unwrap();
        let keys = tier.keys();
        assert!(!keys.is_empty());
        for key in &keys {
            let i = *expected.get(key).expect("an entry the child wrote");
            let want = crash_block(&ctx, &base, i);
            let got = tier.get(&ns, key, Instant::now() + SECOND).unwrap();
            assert_eq!(got.as_deref(), Some(&*want), "round {round}");
        }
        assert_eq!(tier.stats().corrupt, 0, "a renamed file is always whole");
        // No temporary file survives the open, and every file is an entry.
        let files: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(files.iter().all(|f| !f.starts_with(".tmp-")), "{files:?}");
        assert_eq!(files.len(), keys.len());
    }
}

fn one_block_on_disk(dir: &std::path::Path) -> (DiskTier, Arc<Block>, std::path::PathBuf) {
    let ctx = config(4).context();
    let tier = DiskTier::open(ctx, dir, 1 << 20).unwrap();
    let ns = Namespace::shared();
    let tokens = prompt(80, 4);
    let key = BlockKey::new(&Scope::new(&FP, &ns), &BlockKey::ROOT, &tokens);
    let block = Arc::new(Block {
        key,
        parent: BlockKey::ROOT,
        namespace: ns,
        kv: kv_of(ctx.layout, &tokens, 0..4),
    });
    tier.put(&block, Instant::now() + SECOND).unwrap();
    let path = tier.path_of(&key);
    (tier, block, path)
}

fn assert_discarded(tier: &DiskTier, block: &Block, path: &std::path::Path) {
    let got = tier
        .get(&block.namespace, &block.key, Instant::now() + SECOND)
        .unwrap();
    assert!(got.is_none());
    assert_eq!(tier.stats().corrupt, 1);
    assert!(!path.exists());
    assert_eq!(tier.entries(), Some(0));
}

#[test]
fn a_flipped_byte_is_a_counted_miss_and_the_file_goes() {
    let dir = tempfile::tempdir().unwrap();
    let (tier, block, path) = one_block_on_disk(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 7;
    bytes[last] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    assert_discarded(&tier, &block, &path);
}

#[test]
fn a_damaged_header_is_a_counted_miss_and_the_file_goes() {
    let dir = tempfile::tempdir().unwrap();
    let (tier, block, path) = one_block_on_disk(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12] = b'\x00';
    std::fs::write(&path, &bytes).unwrap();
    assert_discarded(&tier, &block, &path);
}

#[test]
fn a_truncated_file_is_a_counted_miss_and_the_file_goes() {
    let dir = tempfile::tempdir().unwrap();
    let (tier, block, path) = one_block_on_disk(dir.path());
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    assert_discarded(&tier, &block, &path);
}

#[test]
fn damaged_files_are_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let (tier, block, path) = one_block_on_disk(dir.path());
    drop(tier);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let garbage = dir.path().join(format!("{}.safetensors", "ab".repeat(32)));
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let temp = dir.path().join(".tmp-leftover");
    std::fs::write(&temp, b"half a block").unwrap();
    let unrelated = dir.path().join("notes.txt");
    std::fs::write(&unrelated, b"left alone").unwrap();

    let tier = DiskTier::open(config(4).context(), dir.path(), 1 << 20).unwrap();
    assert_eq!(tier.entries(), Some(0));
    assert_eq!(tier.stats().corrupt, 2);
    assert!(!path.exists() && !garbage.exists() && !temp.exists());
    assert!(unrelated.exists());
    assert!(tier
        .get(&block.namespace, &block.key, Instant::now() + SECOND)
        .unwrap()
        .is_none());
}

#[test]
fn a_damaged_block_through_the_store_shortens_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(4);
    let disk = DiskTier::open(cfg.context(), dir.path(), 1 << 20).unwrap();
    let store = TieredStore::new(cfg, vec![Box::new(disk)]).unwrap();
    let ns = Namespace::shared();
    let tokens = prompt(81, 12);
    let kv = kv_of(layout(), &tokens, 0..12);
    assert_eq!(store.submit(&ns, &tokens, kv.clone()), Submitted::Queued);
    store.flush();
    // Damage the second block.
    let keys: Vec<BlockKey> = KeyChain::new(Scope::new(&FP, &ns), 4, &tokens)
        .map(|(_, k)| k)
        .collect();
    let disk = &store.tiers()[0];
    let path = dir.path().join(format!("{}.safetensors", keys[1].to_hex()));
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 1;
    bytes[at] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let got = store.fetch(&ns, &tokens, 0, SECOND).unwrap();
    assert_eq!(got.kv, kv.slice(0..4).unwrap());
    let stats = store.stats();
    assert_eq!((stats.tiers[0].corrupt, stats.tiers[0].hits), (1, 1));
    assert_eq!(disk.entries(), Some(2));
    assert_eq!(store.known_prefix(&ns, &tokens), 4);
    // Now the first block's file loses its end: nothing left to serve.
    let path = dir.path().join(format!("{}.safetensors", keys[0].to_hex()));
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    assert!(store.fetch(&ns, &tokens, 0, SECOND).is_none());
    assert_eq!(store.stats().tiers[0].corrupt, 2);
    assert!(!path.exists());
    // The third block is whole: a caller that holds [0, 9) still gets the rest.
    let got = store.fetch(&ns, &tokens, 9, SECOND).unwrap();
    assert_eq!(got.kv, kv.slice(9..12).unwrap());
}

fn redis_store(server: &RedisServer, cfg: &StoreConfig) -> TieredStore {
    let mut redis = RedisConfig::new(server.url());
    redis.connect_timeout = Duration::from_millis(500);
    // Far above any deadline below: a fetch that took this long would not
    // have honoured its own.
    redis.io_timeout = Duration::from_secs(10);
    let tier = RedisTier::new(cfg.context(), redis).unwrap();
    TieredStore::new(cfg.clone(), vec![Box::new(tier)]).unwrap()
}

#[test]
fn redis_stopped_mid_run_then_restarted() {
    if !redis_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut server = RedisServer::start(dir.path(), 64 << 20);
    let cfg = config(8).with_queue_capacity(4);
    let store = redis_store(&server, &cfg);
    let ns = Namespace::new("r").unwrap();
    let a = prompt(90, 20);
    assert_eq!(
        store.submit(&ns, &a, kv_of(layout(), &a, 0..20)),
        Submitted::Queued
    );
    store.flush();
    assert!(store.fetch(&ns, &a, 0, SECOND).is_some());

    server.kill();
    let deadline = Duration::from_millis(300);
    let started = Instant::now();
    assert!(store.fetch(&ns, &a, 0, deadline).is_none());
    // A dead server answers at once; the bound only catches a hang (no timing
    // is measured: 2 s of slack on a busy machine, against a 10 s socket timeout).
    assert!(
        started.elapsed() < deadline + 2 * SECOND,
        "{:?}",
        started.elapsed()
    );
    for s in 0..20 {
        let p = prompt(100 + s, 20);
        assert_ne!(
            store.submit(&ns, &p, kv_of(layout(), &p, 0..20)),
            Submitted::Rejected
        );
    }
    store.flush();
    let stats = store.stats();
    assert_eq!(stats.submitted + stats.dropped, 21);
    assert!(stats.tiers[0].errors >= 2, "{stats:?}");
    assert_eq!(stats.blocks_written, 3, "only the first run reached Redis");

    // The same socket again: the store reconnects without being rebuilt (once
    // its short back-off after the failed attempts has passed).
    let server = RedisServer::start(dir.path(), 64 << 20);
    let b = prompt(120, 20);
    let mut got = None;
    for _ in 0..50 {
        assert_eq!(
            store.submit(&ns, &b, kv_of(layout(), &b, 0..20)),
            Submitted::Queued
        );
        store.flush();
        got = store.fetch(&ns, &b, 0, SECOND);
        if got.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(got.expect("Redis used again").kv, kv_of(layout(), &b, 0..20));
    assert!(store.fetch(&ns, &a, 0, SECOND).is_none(), "nothing persisted");
    drop(server);
}

#[test]
fn a_frozen_redis_costs_a_fetch_its_deadline_not_more() {
    if !redis_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = RedisServer::start(dir.path(), 64 << 20);
    let cfg = config(8);
    let store = redis_store(&server, &cfg);
    let ns = Namespace::shared();
    let a = prompt(130, 16);
    assert_eq!(
        store.submit(&ns, &a, kv_of(layout(), &a, 0..16)),
        Submitted::Queued
    );
    store.flush();
    assert!(store.fetch(&ns, &a, 0, SECOND).is_some());

    let pid = server.pid().unwrap().to_string();
    let signal = |sig: &str| assert!(Command::new("kill").args([sig, &pid]).status().unwrap().success());
    signal("-STOP");
    let deadline = Duration::from_millis(300);
    let started = Instant::now();
    let got = store.fetch(&ns, &a, 0, deadline);
    let took = started.elapsed();
    signal("-CONT");
    assert!(got.is_none());
    // The socket timeout is the time left, not the tier's 10 s (2 s of slack
    // for a busy machine).
    assert!(took < deadline + 2 * SECOND, "{took:?}");
    let stats = store.stats();
    assert_eq!(stats.fetch_timeouts, 1);
    assert!(stats.tiers[0].errors >= 1);
    // Thawed, it serves again.
    assert!(store.fetch(&ns, &a, 0, SECOND).is_some());
}
