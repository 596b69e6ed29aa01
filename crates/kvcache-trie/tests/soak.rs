//! Soak: 10,000 random requests over the prefix trie (new conversations, next
//! turns, edits, repeats, user snapshots, abandoned requests) under a small byte
//! budget. After every request the paged-out bytes fit the budget (or nothing is
//! evictable), every live snapshot belongs to the trie, and the trie's checker
//! passes; over the run the trie's size and the process's resident memory stay
//! bounded, and once the trie is dropped no snapshot is left.
//!
//! Over fake layer caches (KV, sliding window, recurrent); the same soak over
//! real mlx-rs KV caches is `kvcache-mlx/tests/soak.rs`.
//! `KVCACHE_SOAK_REQUESTS` changes the number of requests (10,000 by default).
//! The test reads the process's memory: it is alone in its test binary.

mod soak_support;
mod trie_support;

use soak_support::{requests, status_kib, Peaks, Workload};
use trie_support::{cache, request_with};

#[test]
fn ten_thousand_requests_over_fake_layers_stay_bounded() {
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
