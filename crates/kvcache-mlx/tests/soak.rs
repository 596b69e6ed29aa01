//! Soak: 10,000 random requests over the prefix trie on two real mlx-rs
//! `KvCache` layers under a small byte budget, with the workload of
//! `kvcache-trie/tests/soak.rs` (new conversations, next turns, edits, repeats,
//! user snapshots, abandoned requests). After every request the paged-out bytes
//! fit the budget (or nothing is evictable); over the run the trie's size, the
//! process's resident memory and MLX's own allocator counter stay bounded, and
//! once the trie is dropped MLX holds nothing more.
//!
//! Built with mlx (through `cargo xtask test`). `KVCACHE_SOAK_REQUESTS` changes
//! the number of requests (10,000 by default). The test reads the process's
//! memory: it is alone in its test binary.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;
#[path = "../../kvcache-trie/tests/soak_support/mod.rs"]
mod soak_support;
#[path = "../../kvcache-trie/tests/trie_support/mod.rs"]
mod trie_support;

use soak_support::{requests, status_kib, Peaks, Workload};

#[test]
fn ten_thousand_requests_over_mlx_kv_caches_stay_bounded() {
    use kvcache_api::{CacheError, LayerCache};
    use kvcache_mlx::layers::KvCache;
    use kvcache_trie::PrefixCache;
    use layers_common::{ids_of, SMALL};
    use mlx_rs::memory::active_memory;

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
