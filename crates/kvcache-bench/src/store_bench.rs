//! Benchmarks E3 and E4: the E1 trace over a prefix store shared across
//! processes.
//!
//! - **E3 restart**: one replica answers the first requests over a disk store
//!   and is stopped; a new replica over the same directory answers the rest.
//!   Compared: prompt tokens evaluated over the whole trace against the trace's
//!   minimum, and each conversation's first time to first token after the
//!   restart against recomputing that request from scratch in the same process.
//! - **E4 replicas**: two replicas answer the trace, the requests alternating
//!   between them, once sharing one Redis and once without a store.

use std::fmt;
use std::path::Path;

use kvcache_engine::store::StoreOptions;
use kvcache_engine::{EngineError, Result};
use kvcache_testkit::redis_server::RedisServer;

pub use crate::replica::ReplicaSetup;
use crate::replica::TurnLine;
use crate::trace::Trace;

/// E3's result.
#[derive(Debug, Clone)]
pub struct E3Report {
    /// Requests answered before the restart.
    pub restart_after: usize,
    /// Every request, both processes, in trace order.
    pub turns: Vec<TurnLine>,
    /// The first request of each conversation after the restart, recomputed
    /// from scratch in the second process right after it was answered.
    pub recomputed: Vec<TurnLine>,
    /// The trace's minimum prefill over the same requests.
    pub min_prefill: usize,
}

impl E3Report {
    /// Prompt tokens evaluated, both processes.
    pub fn evaluated(&self) -> usize {
        self.turns.iter().map(|t| t.evaluated).sum()
    }

    /// Evaluated over the minimum.
    pub fn ratio(&self) -> f64 {
        self.evaluated() as f64 / self.min_prefill.max(1) as f64
    }

    /// Per conversation: (restored time to first token, recomputed), ms.
    pub fn first_after_restart(&self) -> Vec<(f64, f64)> {
        self.recomputed
            .iter()
            .filter_map(|r| {
                let t = self.turns.iter().find(|t| t.idx == r.idx)?;
                Some((t.ttft_ms, r.ttft_ms))
            })
            .collect()
    }

    /// Median of recomputed / restored time to first token.
    pub fn speedup(&self) -> f64 {
        median(
            self.first_after_restart()
                .iter()
                .map(|(restored, recomputed)| recomputed / restored.max(1e-9))
                .collect(),
        )
    }
}

impl fmt::Display for E3Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let second: Vec<&TurnLine> = self
            .turns
            .iter()
            .filter(|t| t.idx >= self.restart_after)
            .collect();
        let restored: usize = second.iter().map(|t| t.restored).sum();
        writeln!(
            f,
            "E3 restart: {} requests, process stopped after {} and started again over the same disk store",
            self.turns.len(),
            self.restart_after
        )?;
        writeln!(
            f,
            "  prompt tokens evaluated {} vs minimum {} = {:.4}x (target <= 1.01x); restored from the store after the restart: {restored} tokens",
            self.evaluated(),
            self.min_prefill,
            self.ratio()
        )?;
        let pairs = self.first_after_restart();
        let ms = |v: Vec<f64>| v.iter().map(|x| x.round()).collect::<Vec<_>>();
        writeln!(
            f,
            "  first request of each conversation after the restart, time to first token (ms): restored {:?}",
            ms(pairs.iter().map(|p| p.0).collect())
        )?;
        writeln!(f, "    recomputed {:?}", ms(pairs.iter().map(|p| p.1).collect()))?;
        write!(f, "  median speed-up {:.1}x (target >= 3x)", self.speedup())
    }
}

/// Runs E3 over `requests` trace requests, stopping the first replica after
/// `restart_after`; the store lives in `dir` (which should start empty).
pub fn e3_restart(
    setup: &ReplicaSetup<'_>,
    trace: &Trace,
    requests: usize,
    restart_after: usize,
    dir: &Path,
    log: &mut dyn FnMut(&str),
) -> Result<E3Report> {
    let store = StoreOptions {
        dir: Some(dir.to_owned()),
        redis: None,
    };
    let requests = requests.min(trace.requests.len());
    let mut turns = Vec::new();
    let mut first = setup.spawn(&store, "replica before the restart")?;
    for i in 0..restart_after.min(requests) {
        let t = first.run(i)?;
        log(&line("before", &t));
        turns.push(t);
    }
    first.stop()?;
    log("-- stopped; a new process opens the same store --");
    let mut second = setup.spawn(&store, "replica after the restart")?;
    let mut seen = std::collections::HashSet::new();
    let mut recomputed = Vec::new();
    for i in restart_after..requests {
        let t = second.run(i)?;
        log(&line("after", &t));
        if seen.insert(t.conv) {
            let r = second.recompute(i)?;
            log(&format!("  recomputed from scratch: ttft {:.0} ms", r.ttft_ms));
            recomputed.push(r);
        }
        turns.push(t);
    }
    second.stop()?;
    Ok(E3Report {
        restart_after,
        min_prefill: trace.requests[..requests].iter().map(|r| r.min_prefill).sum(),
        turns,
        recomputed,
    })
}

/// E4's result.
#[derive(Debug, Clone)]
pub struct E4Report {
    /// Every request with the shared store, in trace order.
    pub shared: Vec<TurnLine>,
    /// Every request without a store.
    pub alone: Vec<TurnLine>,
    /// The trace's minimum prefill over the same requests.
    pub min_prefill: usize,
}

impl E4Report {
    fn total(turns: &[TurnLine]) -> usize {
        turns.iter().map(|t| t.evaluated).sum()
    }
}

impl fmt::Display for E4Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ratio = |n: usize| n as f64 / self.min_prefill.max(1) as f64;
        let (shared, alone) = (Self::total(&self.shared), Self::total(&self.alone));
        let from_redis: usize = self
            .shared
            .iter()
            .flat_map(|t| &t.tiers)
            .filter(|(tier, _)| tier == "redis")
            .map(|(_, n)| n)
            .sum();
        writeln!(
            f,
            "E4 replicas: {} requests over two replicas, request i to replica (i + i/10) % 2 (each conversation alternates)",
            self.shared.len()
        )?;
        writeln!(
            f,
            "  shared Redis store: {shared} prompt tokens evaluated = {:.4}x the minimum {} (target <= 1.02x); {from_redis} tokens restored from Redis",
            ratio(shared),
            self.min_prefill
        )?;
        write!(
            f,
            "  without a store:    {alone} prompt tokens evaluated = {:.4}x",
            ratio(alone)
        )
    }
}

/// Which replica answers request `i`: strict round-robin over the trace's order
/// would pin every conversation to one replica (10 conversations, 2 replicas),
/// so the replica alternates with each turn as well: no affinity at all.
pub fn replica_of(i: usize) -> usize {
    (i + i / 10) % 2
}

/// Runs E4 over `requests` trace requests: two replicas sharing a Redis started
/// here (holding at most `redis_bytes`), then two without a store.
pub fn e4_replicas(
    setup: &ReplicaSetup<'_>,
    trace: &Trace,
    requests: usize,
    redis_bytes: usize,
    log: &mut dyn FnMut(&str),
) -> Result<E4Report> {
    let requests = requests.min(trace.requests.len());
    let dir = std::env::temp_dir().join(format!("kvcache-e4-redis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| EngineError::io(&dir, e))?;
    let redis = RedisServer::start(&dir, redis_bytes as u64)
        .map_err(|e| EngineError::io("a redis-server for E4", std::io::Error::other(e)))?;
    let with_redis = StoreOptions {
        dir: None,
        redis: Some(redis.url()),
    };
    let shared = run_pair(setup, &with_redis, requests, "shared", log);
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
    let shared = shared?;
    let alone = run_pair(setup, &StoreOptions::default(), requests, "alone", log)?;
    Ok(E4Report {
        shared,
        alone,
        min_prefill: trace.requests[..requests].iter().map(|r| r.min_prefill).sum(),
    })
}

fn run_pair(
    setup: &ReplicaSetup<'_>,
    store: &StoreOptions,
    requests: usize,
    label: &str,
    log: &mut dyn FnMut(&str),
) -> Result<Vec<TurnLine>> {
    let mut pair = [
        setup.spawn(store, &format!("{label} replica 0"))?,
        setup.spawn(store, &format!("{label} replica 1"))?,
    ];
    let mut turns = Vec::new();
    for i in 0..requests {
        let t = pair[replica_of(i)].run(i)?;
        log(&line(&format!("{label} r{}", replica_of(i)), &t));
        turns.push(t);
    }
    for replica in pair {
        replica.stop()?;
    }
    Ok(turns)
}

fn line(label: &str, t: &TurnLine) -> String {
    format!(
        "{label:>9} #{:<2} conv {} turn {}: {} prompt tokens, {} cached ({} from the store {:?}), {} evaluated, ttft {:.0} ms",
        t.idx, t.conv, t.turn, t.prompt_tokens, t.cached, t.restored, t.tiers, t.evaluated, t.ttft_ms
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_conversation_alternates_between_replicas() {
        // 10 conversations interleaved: request i is conversation i % 10, turn i / 10.
        for conv in 0..10 {
            let replicas: Vec<usize> = (0..8).map(|turn| replica_of(turn * 10 + conv)).collect();
            for pair in replicas.windows(2) {
                assert_ne!(pair[0], pair[1], "conversation {conv}: {replicas:?}");
            }
        }
        let load = (0..80).filter(|&i| replica_of(i) == 0).count();
        assert_eq!(load, 40);
    }
}
