//! `GET /metrics`: the engine's gauges and the server's counters, written
//! by the `prometheus-client` crate in the OpenMetrics text format
//! ([`CONTENT_TYPE`]), which Prometheus scrapes as it does its own.
//!
//! The counters' samples keep the names they have always had
//! (`kvcache_requests_total`, ...); OpenMetrics names a counter's family
//! without its `_total` suffix, so its `# HELP` and `# TYPE` lines read
//! `kvcache_requests`, and the text ends in `# EOF`. Each scrape registers
//! a snapshot of the values: the engine's come from the engine thread's
//! last pass ([`Gauges`]), the server's from its atomics.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kvcache_engine::engine::ReuseStats;
use kvcache_store::StoreStats;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::worker::Gauges;

/// The content type of the text [`Metrics::render`] writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// A latency histogram: per-bucket counts and the sum in whole microseconds
/// (so that the sum of 30 ms and 300 ms is 0.33 s, not a float's neighbour).
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&bound| secs <= bound) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.micros.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Its values now, as the encoder takes them.
    fn snapshot(&self) -> HistogramSnapshot {
        let count = self.count.load(Ordering::Relaxed);
        let mut buckets: Vec<(f64, u64)> = BUCKETS
            .iter()
            .zip(&self.buckets)
            .map(|(&bound, n)| (bound, n.load(Ordering::Relaxed)))
            .collect();
        // Past the last bound: `+Inf` (the encoder writes `f64::MAX` so).
        let within: u64 = buckets.iter().map(|b| b.1).sum();
        buckets.push((f64::MAX, count.saturating_sub(within)));
        HistogramSnapshot {
            sum: self.micros.load(Ordering::Relaxed) as f64 / 1e6,
            count,
            buckets,
        }
    }
}

/// A histogram's values at one scrape; the encoder makes the buckets
/// cumulative.
#[derive(Debug)]
struct HistogramSnapshot {
    sum: f64,
    count: u64,
    buckets: Vec<(f64, u64)>,
}

impl EncodeMetric for HistogramSnapshot {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A counter with one label, a sample per value, in the order given.
#[derive(Debug)]
struct LabelledCounter {
    label: &'static str,
    samples: Vec<(String, u64)>,
}

impl EncodeMetric for LabelledCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        for (value, count) in &self.samples {
            let labels = [(self.label, value.as_str())];
            encoder
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, u64, u64>(count, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// One scrape's registry: metrics registered under the names their samples
/// carry, with their help texts as written here (the encoder ends each with
/// the full stop it adds itself).
struct Scrape(Registry);

/// `help` without its full stop: the encoder adds one.
fn help(help: &str) -> &str {
    help.strip_suffix('.').unwrap_or(help)
}

impl Scrape {
    /// The family name of counter `name`: its samples' name, less the
    /// `_total` the encoder adds back.
    fn family(name: &'static str) -> &'static str {
        name.strip_suffix("_total")
            .unwrap_or_else(|| panic!("counter {name} must end in _total"))
    }

    fn counter(&mut self, name: &'static str, text: &str, value: u64) {
        self.0
            .register(Self::family(name), help(text), ConstCounter::new(value));
    }

    fn seconds_counter(&mut self, name: &'static str, text: &str, value: f64) {
        self.0
            .register(Self::family(name), help(text), ConstCounter::new(value));
    }

    fn labelled(&mut self, name: &'static str, text: &str, label: &'static str, samples: Vec<(String, u64)>) {
        self.0
            .register(Self::family(name), help(text), LabelledCounter { label, samples });
    }

    fn gauge(&mut self, name: &'static str, text: &str, value: usize) {
        self.0.register(name, help(text), ConstGauge::new(value as u64));
    }

    fn histogram(&mut self, name: &'static str, text: &str, histogram: &Histogram) {
        self.0.register(name, help(text), histogram.snapshot());
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

    /// The text of these counters, the engine's `gauges` and, with a prefix
    /// store, its counters per tier.
    pub fn render(&self, g: &Gauges, store: Option<&StoreStats>) -> String {
        let mut m = Scrape(Registry::default());
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let count = |n: usize| n as u64;
        m.counter(
            "kvcache_prefix_hits_total",
            "Requests that started from cached cells.",
            count(g.reuse.hits),
        );
        m.counter(
            "kvcache_prefix_misses_total",
            "Requests that found no cached prefix.",
            count(g.reuse.misses),
        );
        m.counter(
            "kvcache_prompt_tokens_cached_total",
            "Prompt tokens reused from cached cells instead of evaluated.",
            count(g.reuse.reused_tokens),
        );
        m.counter(
            "kvcache_prompt_tokens_evaluated_total",
            "Prompt tokens evaluated by the model.",
            count(g.reuse.evaluated_tokens),
        );
        m.counter(
            "kvcache_evictions_total",
            "Idle cached sequences dropped.",
            count(g.reuse.evictions),
        );
        m.counter(
            "kvcache_blocks_evicted_total",
            "Cached prefix blocks evicted, least recently used first, to make room or for age.",
            count(g.reuse.blocks_evicted),
        );
        m.counter(
            "kvcache_prefix_waits_total",
            "Requests that waited for a running request to evaluate a prefix they share.",
            count(g.reuse.waited_for_prefix),
        );
        m.counter(
            "kvcache_requests_cancelled_total",
            "Requests cancelled because their client went away.",
            count(g.reuse.cancelled),
        );
        m.counter(
            "kvcache_generated_tokens_total",
            "Tokens generated.",
            count(g.generated_tokens),
        );
        m.counter(
            "kvcache_forward_passes_total",
            "Forward passes run.",
            count(g.passes),
        );
        m.gauge(
            "kvcache_cells_in_use",
            "KV cells held by at least one sequence.",
            g.cells_in_use,
        );
        m.gauge(
            "kvcache_cache_bytes_in_use",
            "Bytes of keys and values the cells in use hold (every layer group).",
            g.bytes_in_use,
        );
        m.gauge("kvcache_cells_total", "KV cells in the cache.", g.cells_total);
        m.gauge(
            "kvcache_sequences_active",
            "Requests holding a sequence.",
            g.active,
        );
        m.gauge(
            "kvcache_sequences_idle",
            "Finished sequences kept for prefix reuse.",
            g.idle,
        );
        m.gauge(
            "kvcache_blocks_cached",
            "Prefix blocks of finished requests kept for reuse.",
            g.blocks.0,
        );
        m.gauge(
            "kvcache_block_cells",
            "Cells those blocks keep (counted once per block).",
            g.blocks.1,
        );
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        m.gauge(
            "kvcache_queue_depth",
            "Requests accepted and not yet holding a sequence.",
            in_flight.saturating_sub(g.active),
        );
        m.gauge(
            "kvcache_requests_in_flight",
            "Requests accepted and not yet answered in full.",
            in_flight,
        );
        m.counter(
            "kvcache_requests_total",
            "Generation requests accepted.",
            load(&self.requests),
        );
        m.counter(
            "kvcache_requests_overloaded_total",
            "Requests refused with 503 because the queue was full.",
            load(&self.overloaded),
        );
        m.gauge(
            "kvcache_connections_open",
            "HTTP connections open.",
            self.connections_open.load(Ordering::Relaxed),
        );
        m.counter(
            "kvcache_connections_accepted_total",
            "HTTP connections accepted and served.",
            load(&self.connections_accepted),
        );
        m.counter(
            "kvcache_connections_refused_total",
            "HTTP connections refused (503, closed) because --max-connections were open.",
            load(&self.connections_refused),
        );
        m.labelled(
            "kvcache_requests_rejected_total",
            "Requests refused with a 4xx, by reason.",
            "reason",
            REJECT_REASONS
                .iter()
                .zip(&self.rejected)
                .map(|(reason, n)| (reason.to_string(), load(n)))
                .collect(),
        );
        m.labelled(
            "kvcache_connections_timed_out_total",
            "HTTP connections closed by a timeout: headers not complete within \
             --header-timeout, or idle past --keep-alive-timeout.",
            "phase",
            vec![
                ("headers".into(), load(&self.header_timeouts)),
                ("idle".into(), load(&self.idle_closed)),
            ],
        );
        m.histogram(
            "kvcache_time_to_first_token_seconds",
            "From receiving a request to its first generated token.",
            &self.ttft,
        );
        m.histogram(
            "kvcache_queue_wait_seconds",
            "How long a request waited in the engine's queue for a sequence.",
            &self.queue_wait,
        );
        if let Some(store) = store {
            register_store(&mut m, store, &g.reuse);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &m.0).expect("writing to a String cannot fail");
        out
    }
}

/// The prefix store's counters, one sample per tier (`tier="memory"`, ...),
/// and the engine's restores from it.
fn register_store(m: &mut Scrape, store: &StoreStats, reuse: &ReuseStats) {
    type Field = fn(&kvcache_store::TierStats) -> u64;
    let per_tier: [(&'static str, &str, Field); 5] = [
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
        let samples = store
            .tiers
            .iter()
            .map(|tier| (tier.name.to_string(), field(tier)))
            .collect();
        m.labelled(name, help, "tier", samples);
    }
    m.counter(
        "kvcache_store_writes_submitted_total",
        "Store writes (prompts' keys and values, or layer states) queued for the writer.",
        store.submitted + store.states_submitted,
    );
    m.counter(
        "kvcache_store_writes_done_total",
        "Store writes of prompts' keys and values the writer has finished (every tier tried).",
        store.runs_written,
    );
    m.counter(
        "kvcache_store_writes_dropped_total",
        "Store writes dropped, not stored, because the writer's queue was full (--store-queue).",
        store.dropped,
    );
    m.counter(
        "kvcache_store_writes_rejected_total",
        "Store writes refused as invalid.",
        store.rejected,
    );
    m.counter(
        "kvcache_store_restores_total",
        "Requests that imported part of their prompt from the prefix store.",
        reuse.store_restores as u64,
    );
    m.counter(
        "kvcache_store_restored_tokens_total",
        "Prompt tokens imported from the prefix store instead of evaluated.",
        reuse.store_restored_tokens as u64,
    );
    m.seconds_counter(
        "kvcache_store_restore_seconds_total",
        "Time spent asking the prefix store, reading its answer and importing it (part of TTFT).",
        reuse.store_restore_time.as_secs_f64(),
    );
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
        assert!(text.contains("kvcache_queue_wait_seconds_bucket{le=\"5.0\"} 1\n"));
        assert!(text.contains("kvcache_queue_wait_seconds_bucket{le=\"+Inf\"} 1\n"));
        // The encoder ends each help text with its own full stop.
        assert!(text.contains("# HELP kvcache_requests Generation requests accepted.\n"));
        assert!(!text.contains(".."));
        assert!(text.ends_with("# EOF\n"));
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
            text.matches("# TYPE kvcache_requests_rejected counter").count(),
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
        assert!(text.contains("kvcache_store_restore_seconds_total 0.0\n"));
        assert_eq!(text.matches("# TYPE kvcache_store_hits counter").count(), 1);
    }
}
