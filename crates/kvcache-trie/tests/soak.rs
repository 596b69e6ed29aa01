//! Soak: 10,000 random requests over the prefix trie (new conversations, next
//! turns, edits, repeats, user snapshots, abandoned requests) under a small byte
//! budget. After every request the paged-out bytes fit the budget (or nothing is
//! evictable), every live snapshot belongs to the trie, and the trie's checker
//! passes; over the run the trie's size and the process's resident memory stay
//! bounded, and once the trie is dropped no snapshot is left.
//!
//! Over fake layer caches (KV, sliding window, recurrent) always; over real
//! mlx-rs KV caches too when built with mlx (through `cargo xtask test`), where
//! MLX's own allocator counter must stay bounded as well.
//! `KVCACHE_SOAK_REQUESTS` changes the number of requests (10,000 by default).
//! The tests in this file take turns (a lock) so that each reads the process's
//! memory alone.

mod trie_support;

use std::sync::Mutex;

use trie_support::{cache, request_with, Options};

static ALONE: Mutex<()> = Mutex::new(());

/// A field of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`); `None` off Linux.
fn status_kib(field: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn requests() -> usize {
    std::env::var("KVCACHE_SOAK_REQUESTS")
        .map(|v| v.parse().expect("KVCACHE_SOAK_REQUESTS must be a number"))
        .unwrap_or(10_000)
}

/// A deterministic xorshift generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// `lo..=hi` random tokens.
    fn tokens(&mut self, lo: usize, hi: usize) -> Vec<u32> {
        let n = lo + self.below(hi - lo + 1);
        (0..n).map(|_| self.below(40) as u32).collect()
    }
}

/// What the next request looks like.
struct Request {
    prompt: Vec<u32>,
    generated: Vec<u32>,
    options: Options,
}

/// A workload of chat conversations: a pool of 48 transcripts that grow turn by
/// turn, get edited, repeated and replaced; a transcript longer than 160 tokens
/// starts over, so shapes stay small.
struct Workload {
    rng: Rng,
    conversations: Vec<Vec<u32>>,
}

impl Workload {
    fn new(seed: u64) -> Self {
        Workload {
            rng: Rng(seed),
            conversations: Vec::new(),
        }
    }

    fn next(&mut self) -> Request {
        let rng = &mut self.rng;
        let n = self.conversations.len();
        let pick = rng.below(n.max(1));
        let mut options = Options::default();
        let prompt = match rng.below(20) {
            _ if n == 0 => rng.tokens(1, 12),
            0..=2 => rng.tokens(1, 12),
            3..=11 => {
                let extra = rng.tokens(1, 8);
                [&self.conversations[pick][..], &extra].concat()
            }
            12..=14 => {
                let base = &self.conversations[pick];
                let cut = rng.below(base.len() + 1);
                let extra = rng.tokens(1, 6);
                [&base[..cut], &extra].concat()
            }
            15..=16 => self.conversations[pick].clone(),
            17 => {
                options.user_snapshot = true;
                let extra = rng.tokens(1, 4);
                [&self.conversations[pick][..], &extra].concat()
            }
            _ => {
                options.abandon_after = Some(rng.below(6));
                let extra = rng.tokens(1, 6);
                [&self.conversations[pick][..], &extra].concat()
            }
        };
        let prompt = if prompt.is_empty() { vec![0] } else { prompt };
        let generated = if options.abandon_after.is_some() {
            vec![]
        } else {
            rng.tokens(0, 4)
        };
        if options.abandon_after.is_none() {
            let mut transcript = [&prompt[..], &generated[..]].concat();
            if transcript.len() > 160 {
                transcript = rng.tokens(4, 4);
            }
            if n < 48 {
                self.conversations.push(transcript);
            } else {
                self.conversations[pick] = transcript;
            }
        }
        Request {
            prompt,
            generated,
            options,
        }
    }
}

/// Peak figures of a soak.
#[derive(Debug, Default)]
struct Peaks {
    paged_out: usize,
    nodes: usize,
    snapshots: usize,
    rss_kib_after_warmup: usize,
    rss_kib_peak: usize,
}

#[test]
fn ten_thousand_requests_over_fake_layers_stay_bounded() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let n = requests();
    let budget = 4096;
    let (mut c, counters) = cache("kwr", budget);
    let mut work = Workload::new(0x50A4);
    let mut peaks = Peaks::default();
    let warmup = n / 10;
    for i in 0..n {
        let r = work.next();
        request_with(&mut c, &counters, &r.prompt, &r.generated, r.options);
        let s = c.stats();
        assert!(
            s.paged_out_bytes <= budget || s.over_budget,
            "request {i}: {} paged-out bytes over the {budget}-byte budget",
            s.paged_out_bytes
        );
        assert_eq!(
            counters.alive(),
            s.snapshots,
            "request {i}: snapshots outside the trie"
        );
        peaks.paged_out = peaks.paged_out.max(s.paged_out_bytes);
        peaks.nodes = peaks.nodes.max(s.nodes);
        peaks.snapshots = peaks.snapshots.max(s.snapshots);
        if i == warmup {
            peaks.rss_kib_after_warmup = status_kib("VmRSS:").unwrap_or(0);
        }
        if i > warmup {
            peaks.rss_kib_peak = peaks.rss_kib_peak.max(status_kib("VmRSS:").unwrap_or(0));
        }
    }
    let s = c.stats();
    eprintln!(
        "soak (fake kv+window+recurrent layers): {n} requests, budget {budget} B; peak paged-out {} B, \
         peak nodes {}, peak snapshots {}; RSS after {warmup} requests {} KiB, peak after {} KiB, \
         VmHWM {:?} KiB; {} snapshots created, {} evictions",
        peaks.paged_out,
        peaks.nodes,
        peaks.snapshots,
        peaks.rss_kib_after_warmup,
        peaks.rss_kib_peak,
        status_kib("VmHWM:"),
        counters.created(),
        s.evictions
    );
    assert!(s.evictions > 0, "the budget never bit: the soak tested nothing");
    // Protected nodes (the active path, branch points) may hold bytes beyond the
    // budget; the pool of 48 conversations of at most 160 tokens bounds them.
    assert!(peaks.paged_out <= budget + 48 * 170 * 4 * 3, "{peaks:?}");
    assert!(peaks.nodes < 2_000, "the trie kept growing: {peaks:?}");
    if peaks.rss_kib_after_warmup > 0 {
        assert!(
            peaks.rss_kib_peak <= peaks.rss_kib_after_warmup + 8 * 1024,
            "resident memory grew by more than 8 MiB after warm-up: {peaks:?}"
        );
    }
    drop(c);
    assert_eq!(counters.alive(), 0, "snapshots leaked");
}

#[cfg(any(target_os = "macos", kvcache_mlx))]
mod layers_common;

#[cfg(any(target_os = "macos", kvcache_mlx))]
#[test]
fn ten_thousand_requests_over_mlx_kv_caches_stay_bounded() {
    use kvcache_api::{CacheError, LayerCache};
    use kvcache_mlx::layers::KvCache;
    use kvcache_mlx::trie::PrefixCache;
    use layers_common::{ids_of, SMALL};
    use mlx_rs::memory::active_memory;

    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let n = requests();
    let budget = SMALL.bytes(256);
    let eval = |caches: &mut [KvCache], tokens: &[u32]| -> Result<(), CacheError> {
        let (k, v) = SMALL.kv(tokens);
        for cache in caches {
            cache.update(&k, &v)?;
        }
        Ok(())
    };
    let before = active_memory().unwrap();
    let layers = vec![KvCache::with_step(16).unwrap(), KvCache::with_step(16).unwrap()];
    let mut c = PrefixCache::new(layers, budget).unwrap();
    let mut work = Workload::new(0x3A7);
    let mut peaks = Peaks::default();
    let mut peak_active = 0usize;
    let mut active_after_warmup = 0usize;
    let warmup = n / 10;
    for i in 0..n {
        let r = work.next();
        let mut s = c.begin(&r.prompt).unwrap();
        let cached = s.cached();
        match r.options.abandon_after {
            Some(keep) => {
                // Abandoned after `keep` tokens (possibly none: mlx caches refuse
                // an empty update).
                let end = cached + keep.min(r.prompt.len() - cached);
                if end > cached {
                    eval(s.caches_mut(), &r.prompt[cached..end]).unwrap();
                }
            }
            None => {
                s.prefill(|tokens, caches| eval(caches, tokens)).unwrap();
                if r.options.user_snapshot {
                    s.snapshot(true).unwrap();
                }
                for (k, &t) in r.generated.iter().enumerate() {
                    s.record(t);
                    if k + 1 < r.generated.len() {
                        eval(s.caches_mut(), &[t]).unwrap();
                    }
                }
            }
        }
        drop(s);
        let st = c.stats();
        assert!(
            st.paged_out_bytes <= budget || st.over_budget,
            "request {i}: {} paged-out bytes over the {budget}-byte budget",
            st.paged_out_bytes
        );
        if i % 500 == 0 {
            c.check();
            let held = c.caches()[0].live().unwrap().map(|(k, v)| ids_of(&k, &v));
            assert_eq!(held.map_or(0, |h| h.len()), c.offset());
        }
        peaks.paged_out = peaks.paged_out.max(st.paged_out_bytes);
        peaks.nodes = peaks.nodes.max(st.nodes);
        peaks.snapshots = peaks.snapshots.max(st.snapshots);
        let active = active_memory().unwrap().saturating_sub(before);
        peak_active = peak_active.max(active);
        if i == warmup {
            peaks.rss_kib_after_warmup = status_kib("VmRSS:").unwrap_or(0);
            active_after_warmup = active;
        }
        if i > warmup {
            peaks.rss_kib_peak = peaks.rss_kib_peak.max(status_kib("VmRSS:").unwrap_or(0));
        }
    }
    c.check();
    let st = c.stats();
    eprintln!(
        "soak (2 mlx KvCache layers, [2, 2, L, 3+2] f32): {n} requests, budget {budget} B; peak paged-out {} B, \
         peak nodes {}, peak snapshots {}; MLX active memory after {warmup} requests {active_after_warmup} B, \
         peak {peak_active} B; RSS after warm-up {} KiB, peak after {} KiB, VmHWM {:?} KiB; {} evictions",
        peaks.paged_out,
        peaks.nodes,
        peaks.snapshots,
        peaks.rss_kib_after_warmup,
        peaks.rss_kib_peak,
        status_kib("VmHWM:"),
        st.evictions
    );
    assert!(st.evictions > 0, "the budget never bit: the soak tested nothing");
    // Snapshots (paged out, possibly over budget on protected nodes) plus two
    // live caches of at most ~170 positions in 16-position steps.
    let live = 2 * SMALL.bytes(176);
    assert!(
        peak_active <= peaks.paged_out + live + 64 * 1024,
        "MLX holds {peak_active} B for {} B of snapshots and {live} B of live caches",
        peaks.paged_out
    );
    if peaks.rss_kib_after_warmup > 0 {
        assert!(
            peaks.rss_kib_peak <= peaks.rss_kib_after_warmup + 32 * 1024,
            "resident memory grew by more than 32 MiB after warm-up: {peaks:?}"
        );
    }
    drop(c);
    let left = active_memory().unwrap().saturating_sub(before);
    assert!(
        left <= 16 * 1024,
        "{left} B of MLX memory still held after the trie was dropped"
    );
}
