//! Metadata does not grow with the number of forward passes.

mod common;

use kvcache_api::{Batch, CausalCache, CausalConfig, DType, ForwardMode, SlidingWindow};
use kvcache_causal::CausalKvCache;

#[test]
fn ten_thousand_sliding_window_decode_steps_keep_metadata_bounded() {
    let device = common::device();
    let config = CausalConfig::new(4, 1 << 20, 8).with_window(SlidingWindow::new(16));
    let mut cache = CausalKvCache::new(config, device.clone(), None).unwrap();
    let kv = common::filled(&[1.0; 4], 1, 2, DType::F32, &device);
    let mut after_warmup = 0;
    for step in 0..10_000 {
        let batch = Batch::from_tokens((0..4).map(|s| (s, step))).unwrap();
        cache.start_forward(&batch, ForwardMode::Compute).unwrap();
        cache.set_layer(0);
        cache.put(&kv, &kv).unwrap();
        if step == 1_000 {
            after_warmup = cache.metadata_bytes();
            cache.check();
        }
    }
    cache.check();
    assert_eq!(
        cache.metadata_bytes(),
        after_warmup,
        "metadata grew between pass 1000 and 10000"
    );
    // Memory 17 per sequence: 4 * 16 + 8 cells, each sequence holding at most 17.
    assert_eq!(cache.num_cells(), 72);
    assert!(cache.used_cells() <= 4 * 17);
}

/// Mixed traffic: four sequences decoding and prefilling in uneven batches through
/// a sliding window, with tail removals, prefix copies, restarts, contiguous
/// placement and hole-driven compaction. After a warm-up the bookkeeping's heap
/// never exceeds what the warm-up needed, and neither does the process's
/// resident memory by more than a little.
#[test]
fn mixed_traffic_keeps_metadata_at_its_warm_up_peak() {
    use kvcache_api::{Placement, PosRange};

    let device = common::device();
    let config = CausalConfig::new(4, 1 << 20, 8)
        .with_window(SlidingWindow::with_memory(16, 24))
        .with_placement(Placement::Contiguous)
        .with_compact_threshold(Some(0.3));
    let mut cache = CausalKvCache::new(config, device.clone(), None).unwrap();
    let mut next = [0i32; 4];
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut roll = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let (warmup, steps) = (2_000, 12_000);
    let (mut warm_peak, mut later_peak) = (0, 0);
    let rss = || {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_owned))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
    };
    let mut rss_after_warmup = None;
    for step in 0..steps {
        match roll(20) {
            0 => {
                let s = roll(4) as usize;
                let k = roll(4) as i32;
                cache.remove(s, PosRange::from((next[s] - k).max(0)..)).unwrap();
                next[s] = (next[s] - k).max(0);
            }
            1 => {
                let (src, dst) = (roll(4) as usize, roll(4) as usize);
                // Copying keeps only what the source still holds inside its memory.
                cache.copy_prefix(src, dst, next[src]).unwrap();
                next[dst] = cache.positions(dst).last().map_or(0, |p| p.0 + 1);
            }
            2 => {
                let s = roll(4) as usize;
                cache.remove(s, PosRange::from(..)).unwrap();
                next[s] = 0;
            }
            _ => {
                let mut tokens = Vec::new();
                for (s, next) in next.iter_mut().enumerate() {
                    let n = if roll(3) == 0 { roll(3) as i32 } else { 1 };
                    for _ in 0..n.min(8 - tokens.len() as i32) {
                        tokens.push((s, *next));
                        *next += 1;
                    }
                }
                if tokens.is_empty() {
                    continue;
                }
                let batch = Batch::from_tokens(tokens.iter().copied()).unwrap();
                cache.start_forward(&batch, ForwardMode::Compute).unwrap();
                cache.set_layer(0);
                let kv = common::filled(&vec![1.0; tokens.len()], 1, 2, DType::F32, &device);
                cache.put(&kv, &kv).unwrap();
            }
        }
        if step < warmup {
            warm_peak = warm_peak.max(cache.metadata_bytes());
        } else {
            later_peak = later_peak.max(cache.metadata_bytes());
        }
        if step == warmup {
            cache.check();
            rss_after_warmup = rss();
        }
    }
    cache.check();
    assert!(
        later_peak <= warm_peak,
        "metadata grew after warm-up: {later_peak} B after pass {warmup}, {warm_peak} B before"
    );
    if let (Some(before), Some(after)) = (rss_after_warmup, rss()) {
        assert!(
            after <= before + 4 * 1024,
            "resident memory grew from {before} KiB to {after} KiB after warm-up"
        );
    }
}
