//! `GET /metrics`: the engine's gauges and the server's counters in
//! Prometheus' text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kvcache_engine::engine::ReuseStats;
use kvcache_store::StoreStats;

use crate::worker::Gauges;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// A counter's value as a sample.
fn load(a: &AtomicU64) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

/// A latency histogram in Prometheus' cumulative buckets.
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (bucket, &bound) in self.buckets.iter().zip(&BUCKETS) {
            if secs <= bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.micros.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bucket, bound) in self.buckets.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {}", load(bucket));
        }
        let count = load(&self.count);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", load(&self.micros) / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// The server's own counters (the engine's come from [`Gauges`]).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests accepted for generation.
    pub requests: AtomicU64,
    /// Requests refused with a 4xx, by reason ([`REJECT_REASONS`]).
    rejected: [AtomicU64; REJECT_REASONS.len()],
    /// Requests refused because the queue was full.
    pub overloaded: AtomicU64,
    /// Requests submitted and not yet answered in full.
    pub in_flight: AtomicUsize,
    ttft: Histogram,
    queue_wait: Histogram,
    /// Connections open now.
    pub connections_open: AtomicUsize,
    /// Connections accepted and served.
    pub connections_accepted: AtomicU64,
    /// Connections refused past `--max-connections`.
    pub connections_refused: AtomicU64,
    /// Connections closed because a request's headers did not arrive in time.
    pub header_timeouts: AtomicU64,
    /// Keep-alive connections closed after their idle time.
    pub idle_closed: AtomicU64,
}

/// The reasons of `kvcache_requests_rejected_total{reason}`, one per 4xx
/// status the server answers ([`crate::error::ApiError::reason`]).
pub const REJECT_REASONS: [&str; 7] = [
    "invalid_request",
    "unauthorized",
    "not_found",
    "method_not_allowed",
    "timeout",
    "too_large",
    "other",
];

impl Metrics {
    /// Counts one request refused with a 4xx for `reason` (one of
    /// [`REJECT_REASONS`]; anything else counts as `other`).
    pub fn reject(&self, reason: &str) {
        let i = REJECT_REASONS
            .iter()
            .position(|&r| r == reason)
            .unwrap_or(REJECT_REASONS.len() - 1);
        self.rejected[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests refused with a 4xx for `reason` so far.
    pub fn rejected(&self, reason: &str) -> u64 {
        REJECT_REASONS
            .iter()
            .position(|&r| r == reason)
            .map_or(0, |i| self.rejected[i].load(Ordering::Relaxed))
    }

    /// Records one time to first token.
    pub fn observe_ttft(&self, ttft: Duration) {
        self.ttft.observe(ttft);
    }

    /// Records how long one request waited in the engine's queue for a
    /// sequence.
    pub fn observe_queue_wait(&self, waited: Duration) {
        self.queue_wait.observe(waited);
    }

    /// The Prometheus text of these counters, the engine's `gauges` and, with a
    /// prefix store, its counters per tier.
    pub fn render(&self, g: &Gauges, store: Option<&StoreStats>) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        metric(
            "kvcache_prefix_hits_total",
            "counter",
            "Requests that started from cached cells.",
            g.reuse.hits as f64,
        );
        metric(
            "kvcache_prefix_misses_total",
            "counter",
            "Requests that found no cached prefix.",
            g.reuse.misses as f64,
        );
        metric(
            "kvcache_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from cached cells instead of evaluated.",
            g.reuse.reused_tokens as f64,
        );
        metric(
            "kvcache_prompt_tokens_evaluated_total",
            "counter",
            "Prompt tokens evaluated by the model.",
            g.reuse.evaluated_tokens as f64,
        );
        metric(
            "kvcache_evictions_total",
            "counter",
            "Idle cached sequences dropped.",
            g.reuse.evictions as f64,
        );
        metric(
            "kvcache_blocks_evicted_total",
            "counter",
            "Cached prefix blocks evicted, least recently used first, to make room or for age.",
            g.reuse.blocks_evicted as f64,
        );
        metric(
            "kvcache_prefix_waits_total",
            "counter",
            "Requests that waited for a running request to evaluate a prefix they share.",
            g.reuse.waited_for_prefix as f64,
        );
        metric(
            "kvcache_requests_cancelled_total",
            "counter",
            "Requests cancelled because their client went away.",
            g.reuse.cancelled as f64,
        );
        metric(
            "kvcache_generated_tokens_total",
            "counter",
            "Tokens generated.",
            g.generated_tokens as f64,
        );
        metric(
            "kvcache_forward_passes_total",
            "counter",
            "Forward passes run.",
            g.passes as f64,
        );
        metric(
            "kvcache_cells_in_use",
            "gauge",
            "KV cells held by at least one sequence.",
            g.cells_in_use as f64,
        );
        metric(
            "kvcache_cache_bytes_in_use",
            "gauge",
            "Bytes of keys and values the cells in use hold (every layer group).",
            g.bytes_in_use as f64,
        );
        metric(
            "kvcache_cells_total",
            "gauge",
            "KV cells in the cache.",
            g.cells_total as f64,
        );
        metric(
            "kvcache_sequences_active",
            "gauge",
            "Requests holding a sequence.",
            g.active as f64,
        );
        metric(
            "kvcache_sequences_idle",
            "gauge",
            "Finished sequences kept for prefix reuse.",
            g.idle as f64,
        );
        metric(
            "kvcache_blocks_cached",
            "gauge",
            "Prefix blocks of finished requests kept for reuse.",
            g.blocks.0 as f64,
        );
        metric(
            "kvcache_block_cells",
            "gauge",
            "Cells those blocks keep (counted once per block).",
            g.blocks.1 as f64,
        );
        metric(
            "kvcache_queue_depth",
            "gauge",
            "Requests accepted and not yet holding a sequence.",
            self.in_flight.load(Ordering::Relaxed).saturating_sub(g.active) as f64,
        );
        metric(
            "kvcache_requests_in_flight",
            "gauge",
            "Requests accepted and not yet answered in full.",
            self.in_flight.load(Ordering::Relaxed) as f64,
        );
        metric(
            "kvcache_requests_total",
            "counter",
            "Generation requests accepted.",
            load(&self.requests),
        );
        metric(
            "kvcache_requests_overloaded_total",
            "counter",
            "Requests refused with 503 because the queue was full.",
            load(&self.overloaded),
        );
        metric(
            "kvcache_connections_open",
            "gauge",
            "HTTP connections open.",
            self.connections_open.load(Ordering::Relaxed) as f64,
        );
        metric(
            "kvcache_connections_accepted_total",
            "counter",
            "HTTP connections accepted and served.",
            load(&self.connections_accepted),
        );
        metric(
            "kvcache_connections_refused_total",
            "counter",
            "HTTP connections refused (503, closed) because --max-connections were open.",
            load(&self.connections_refused),
        );
        let name = "kvcache_requests_rejected_total";
        let _ = writeln!(
            out,
            "# HELP {name} Requests refused with a 4xx, by reason.\n# TYPE {name} counter"
        );
        for (reason, count) in REJECT_REASONS.iter().zip(&self.rejected) {
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {}", load(count));
        }
        let name = "kvcache_connections_timed_out_total";
        let _ = writeln!(
            out,
            "# HELP {name} HTTP connections closed by a timeout: headers not complete within \
             --header-timeout, or idle past --keep-alive-timeout.\n# TYPE {name} counter"
        );
        let _ = writeln!(out, "{name}{{phase=\"headers\"}} {}", load(&self.header_timeouts));
        let _ = writeln!(out, "{name}{{phase=\"idle\"}} {}", load(&self.idle_closed));
        self.ttft.render(
            &mut out,
            "kvcache_time_to_first_token_seconds",
            "From receiving a request to its first generated token.",
        );
        self.queue_wait.render(
            &mut out,
            "kvcache_queue_wait_seconds",
            "How long a request waited in the engine's queue for a sequence.",
        );
        if let Some(store) = store {
            render_store(&mut out, store, &g.reuse);
        }
        out
    }
}

/// The prefix store's counters, one sample per tier (`tier="memory"`, ...),
/// and the engine's restores from it.
fn render_store(out: &mut String, store: &StoreStats, reuse: &ReuseStats) {
    type Field = fn(&kvcache_store::TierStats) -> u64;
    let per_tier: [(&str, &str, Field); 5] = [
        ("kvcache_store_hits_total", "Blocks found in the tier.", |t| {
            t.hits
        }),
        (
            "kvcache_store_misses_total",
            "Blocks looked for in the tier and not found.",
            |t| t.misses,
        ),
        ("kvcache_store_puts_total", "Blocks written to the tier.", |t| {
            t.puts
        }),
        (
            "kvcache_store_evictions_total",
            "Entries the tier evicted to stay within its budget.",
            |t| t.evictions,
        ),
        (
            "kvcache_store_errors_total",
            "Failed operations of the tier.",
            |t| t.errors,
        ),
    ];
    for (name, help, field) in per_tier {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for tier in &store.tiers {
            let _ = writeln!(out, "{name}{{tier=\"{}\"}} {}", tier.name, field(tier));
        }
    }
    let writes = [
        (
            "kvcache_store_writes_submitted_total",
            "Store writes (prompts' keys and values, or layer states) queued for the writer.",
            store.submitted + store.states_submitted,
        ),
        (
            "kvcache_store_writes_done_total",
            "Store writes of prompts' keys and values the writer has finished (every tier tried).",
            store.runs_written,
        ),
        (
            "kvcache_store_writes_dropped_total",
            "Store writes dropped, not stored, because the writer's queue was full (--store-queue).",
            store.dropped,
        ),
        (
            "kvcache_store_writes_rejected_total",
            "Store writes refused as invalid.",
            store.rejected,
        ),
    ];
    for (name, help, value) in writes {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}");
    }
    let restores = [
        (
            "kvcache_store_restores_total",
            "Requests that imported part of their prompt from the prefix store.",
            reuse.store_restores as f64,
        ),
        (
            "kvcache_store_restored_tokens_total",
            "Prompt tokens imported from the prefix store instead of evaluated.",
            reuse.store_restored_tokens as f64,
        ),
        (
            "kvcache_store_restore_seconds_total",
            "Time spent asking the prefix store, reading its answer and importing it (part of TTFT).",
            reuse.store_restore_time.as_secs_f64(),
        ),
    ];
    for (name, help, value) in restores {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let m = Metrics::default();
        m.observe_ttft(Duration::from_millis(30));
        m.observe_ttft(Duration::from_millis(300));
        let text = m.render(&Gauges::default(), None);
        assert!(text.contains("kvcache_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n"));
        assert!(text.contains("kvcache_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(text.contains("kvcache_time_to_first_token_seconds_bucket{le=\"0.5\"} 2\n"));
        assert!(text.contains("kvcache_time_to_first_token_seconds_count 2\n"));
        assert!(text.contains("kvcache_time_to_first_token_seconds_sum 0.33\n"));
        // Queue waits are their own histogram.
        assert!(text.contains("kvcache_queue_wait_seconds_count 0\n"));
        m.observe_queue_wait(Duration::from_secs(3));
        let text = m.render(&Gauges::default(), None);
        assert!(text.contains("kvcache_queue_wait_seconds_bucket{le=\"2.5\"} 0\n"));
        assert!(text.contains("kvcache_queue_wait_seconds_bucket{le=\"5\"} 1\n"));
        assert!(text.contains("kvcache_time_to_first_token_seconds_count 2\n"));
    }
    #[test]
    fn rejections_are_counted_by_reason() {
        let m = Metrics::default();
        m.reject("unauthorized");
        m.reject("unauthorized");
        m.reject("too_large");
        m.reject("no such reason");
        let text = m.render(&Gauges::default(), None);
        assert!(text.contains("kvcache_requests_rejected_total{reason=\"unauthorized\"} 2\n"));
        assert!(text.contains("kvcache_requests_rejected_total{reason=\"too_large\"} 1\n"));
        assert!(text.contains("kvcache_requests_rejected_total{reason=\"other\"} 1\n"));
        assert!(text.contains("kvcache_requests_rejected_total{reason=\"timeout\"} 0\n"));
        assert_eq!(m.rejected("unauthorized"), 2);
        assert_eq!(
            text.matches("# TYPE kvcache_requests_rejected_total counter")
                .count(),
            1
        );
        assert!(text.contains("kvcache_connections_timed_out_total{phase=\"headers\"} 0\n"));
    }

    #[test]
    fn store_counters_come_per_tier() {
        let tier = |name, hits, puts| kvcache_store::TierStats {
            name,
            hits,
            puts,
            ..kvcache_store::TierStats::default()
        };
        let store = StoreStats {
            tiers: vec![tier("memory", 3, 5), tier("disk", 2, 4)],
            dropped: 1,
            submitted: 7,
            states_submitted: 2,
            rejected: 3,
            ..StoreStats::default()
        };
        let m = Metrics::default();
        assert!(!m.render(&Gauges::default(), None).contains("kvcache_store_"));
        let text = m.render(&Gauges::default(), Some(&store));
        assert!(text.contains("kvcache_store_hits_total{tier=\"memory\"} 3\n"));
        assert!(text.contains("kvcache_store_hits_total{tier=\"disk\"} 2\n"));
        assert!(text.contains("kvcache_store_puts_total{tier=\"disk\"} 4\n"));
        assert!(text.contains("kvcache_store_writes_dropped_total 1\n"));
        assert!(text.contains("kvcache_store_writes_submitted_total 9\n"));
        assert!(text.contains("kvcache_store_writes_rejected_total 3\n"));
        // The engine's restores come with the store only.
        assert!(text.contains("kvcache_store_restores_total 0\n"));
        assert!(text.contains("kvcache_store_restore_seconds_total 0\n"));
        assert_eq!(text.matches("# TYPE kvcache_store_hits_total counter").count(), 1);
    }
}
