//! E4r: the E1 trace over two `kvcache-server` replicas that share one Redis
//! prefix store (`--redis`) and publish KV events (`--kv-events`), routed
//! by an existing cache-aware router's index versus round-robin.
//!
//! NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer` from
//! `ai-dynamo-runtime`, the venv `cargo xtask test` prepares) subscribes to
//! both replicas' events (workers 1 and 2 of one model, blocks of 16 tokens).
//! The requests go one at a time in trace order (as `e6_e7_serving`'s
//! sequential mode), streamed, usage included; before each one the example
//! asks the indexer's `/query` which worker holds the longest prefix of the
//! prompt's token ids. Two modes, each on fresh servers, a fresh Redis and a
//! fresh indexer:
//!
//! - `routed`: the worker with the most matched blocks; on a tie or no match,
//!   round-robin;
//! - `round-robin`: E4's rule, the indexer asked all the same: conversation
//!   `c`'s turn `t` goes to replica `(c + t - 1) mod 2`, so no turn stays on
//!   the replica of the conversation's previous turn (on the whole trace this
//!   is `kvcache_bench::store_bench::replica_of` of the request's index;
//!   strict alternation in trace order would pin each of the trace's 10
//!   conversations to one replica).
//!
//! Per mode: prompt tokens evaluated (`prompt_tokens - cached_tokens`)
//! against the trace's minimum (each request's `min_prefill`, summed as
//! `e6_e7_serving` does), the median time to first token on turns >= 2, and
//! how many turns >= 2 went to the replica that served their conversation's
//! previous turn. Targets (issue 25): routed median TTFT (turns >= 2) at
//! least 1.3x better than round-robin's, routed evaluated at most 1.01x the
//! minimum.
//!
//! ```text
//! cargo build --release -p kvcache-server --bin kvcache-server --example e4r_routing
//! target/release/examples/e4r_routing --server-bin target/release/kvcache-server
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "common/e1.rs"]
mod e1;
#[path = "common/server.rs"]
mod server;
#[path = "common/stream.rs"]
mod stream;

use clap::{Parser, ValueEnum};
use e1::E1Args;
use kvcache_bench::store_bench::replica_of;
use kvcache_bench::trace::Request;
use kvcache_testkit::dynamo_indexer::{DynamoIndexer, IndexerConfig};
use kvcache_testkit::redis_server::{self, RedisServer};
use server::Server;
use stream::{complete, percentile, Error};

/// Blocks of the replicas (`--block-tokens`) and of the indexer's workers.
const BLOCK: usize = 16;
/// The model name the replicas are registered under in the indexer.
const INDEXED_MODEL: &str = "smollm2-replicas";
/// The indexer process ends by itself after this, whatever happens here.
const INDEXER_LIFETIME_S: u64 = 3600;

/// E4r: the E1 trace over two replicas sharing Redis, routed by NVIDIA
/// Dynamo's KV indexer versus round-robin.
#[derive(Debug, Parser)]
struct Args {
    /// The server binary to start (on 127.0.0.1, free ports) for each mode.
    #[arg(long)]
    server_bin: PathBuf,
    /// The Python with `ai-dynamo-runtime` [default: $KVCACHE_DYNAMO_PYTHON,
    /// else ~/.cache/kvcache-rs/python/dynamo-1.6.1/bin/python].
    #[arg(long)]
    dynamo_python: Option<PathBuf>,
    /// Which run(s).
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    /// What the replicas share: a Redis store, or nothing (each its own
    /// memory only), or both, one after the other.
    #[arg(long, value_enum, default_value = "redis")]
    shared: Shared,
    #[command(flatten)]
    e1: E1Args,
    /// The Redis `maxmemory` in MiB.
    #[arg(long, default_value_t = 2048)]
    redis_mib: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// The indexer's best match; ties and no match round-robin.
    Routed,
    /// E4's round-robin, no affinity.
    RoundRobin,
    /// Both, routed first, each on fresh servers and a fresh Redis.
    Both,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Routed => "routed",
            Mode::RoundRobin => "round-robin",
            Mode::Both => "both",
        }
    }
}

/// What the two replicas share besides the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Shared {
    /// One Redis prefix store (`--redis`), each replica with its own memory
    /// tier: a turn on the other replica reads the previous one back.
    Redis,
    /// Nothing: a turn on the other replica evaluates what that replica
    /// does not hold (the setting of the published routing gains).
    Nothing,
    /// Redis, then nothing.
    Both,
}

impl Shared {
    fn name(self) -> &'static str {
        match self {
            Shared::Redis => "shared Redis",
            Shared::Nothing => "nothing shared",
            Shared::Both => "both",
        }
    }
}

/// How a request's replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// The indexer's best match.
    Match,
    /// Round-robin: the mode's rule, or a tie or no match.
    RoundRobin,
}

/// What one request did, as the client saw it.
#[derive(Debug, Clone)]
struct Outcome {
    conv: usize,
    turn: usize,
    min_prefill: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    ttft: Duration,
    replica: usize,
    choice: Choice,
    /// Blocks the indexer matched on each replica before the request.
    matched: [usize; 2],
    /// Whether the replica served the conversation's previous turn.
    same_as_previous: bool,
}

impl Outcome {
    fn evaluated(&self) -> usize {
        self.prompt_tokens - self.cached_tokens
    }
}

/// A whole run.
struct RunReport {
    mode: Mode,
    shared: Shared,
    outcomes: Vec<Outcome>,
    wall: Duration,
}

impl RunReport {
    fn evaluated(&self) -> usize {
        self.outcomes.iter().map(Outcome::evaluated).sum()
    }

    fn minimum(&self) -> usize {
        self.outcomes.iter().map(|o| o.min_prefill).sum()
    }

    fn median_ttft_later(&self) -> f64 {
        let mut later: Vec<f64> = self
            .outcomes
            .iter()
            .filter(|o| o.turn >= 2)
            .map(|o| o.ttft.as_secs_f64())
            .collect();
        percentile(&mut later, 0.5)
    }

    fn print(&self) {
        let name = format!("{}, {}", self.mode.name(), self.shared.name());
        let evaluated = self.evaluated();
        let minimum = self.minimum();
        let prompt: usize = self.outcomes.iter().map(|o| o.prompt_tokens).sum();
        let later: Vec<&Outcome> = self.outcomes.iter().filter(|o| o.turn >= 2).collect();
        let same = later.iter().filter(|o| o.same_as_previous).count();
        let by_match = self.outcomes.iter().filter(|o| o.choice == Choice::Match).count();
        let per_replica: Vec<usize> = (0..2)
            .map(|r| self.outcomes.iter().filter(|o| o.replica == r).count())
            .collect();
        let mut all: Vec<f64> = self.outcomes.iter().map(|o| o.ttft.as_secs_f64()).collect();
        println!(
            "{name}: {} requests, {:.1} s: {evaluated} of {prompt} prompt tokens evaluated \
             ({:.4}x the minimum {minimum}); median TTFT turns>=2 {:.1} ms (all turns p50 {:.1} ms, \
             p99 {:.1} ms)",
            self.outcomes.len(),
            self.wall.as_secs_f64(),
            evaluated as f64 / minimum.max(1) as f64,
            self.median_ttft_later() * 1e3,
            percentile(&mut all, 0.5) * 1e3,
            percentile(&mut all, 0.99) * 1e3,
        );
        println!(
            "{name}: {same} of {} turns>=2 went to the replica that served their previous turn; \
             {by_match} requests placed by the indexer's best match, {} round-robin; requests per \
             replica {:?}",
            later.len(),
            self.outcomes.len() - by_match,
            per_replica,
        );
        let last = self.outcomes.iter().map(|o| o.turn).max().unwrap_or(0);
        let cells: Vec<String> = (1..=last)
            .map(|turn| {
                let mut ttft: Vec<f64> = self
                    .outcomes
                    .iter()
                    .filter(|o| o.turn == turn)
                    .map(|o| o.ttft.as_secs_f64())
                    .collect();
                let mut evaluated: Vec<f64> = self
                    .outcomes
                    .iter()
                    .filter(|o| o.turn == turn)
                    .map(|o| o.evaluated() as f64)
                    .collect();
                format!(
                    "{turn}: {:.0} ms / {:.0} evaluated",
                    percentile(&mut ttft, 0.5) * 1e3,
                    percentile(&mut evaluated, 0.5)
                )
            })
            .collect();
        println!(
            "{name}: median TTFT / evaluated tokens per turn: {}",
            cells.join(", ")
        );
    }
}

fn free_port() -> Result<u16, Error> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Dynamo's standalone KV indexer with `endpoints[i]` as worker `i + 1`.
fn start_indexer(python: &Path, endpoints: &[String], log: &Path) -> Result<DynamoIndexer, Error> {
    let config = IndexerConfig {
        python: python.into(),
        workers: (1..).zip(endpoints.iter().cloned()).collect(),
        block_size: BLOCK,
        model: INDEXED_MODEL.into(),
        log: log.into(),
        lifetime: Duration::from_secs(INDEXER_LIFETIME_S),
    };
    Ok(DynamoIndexer::start(&config)?)
}

/// Matched blocks per replica for a prompt's token ids.
fn matched_blocks(indexer: &DynamoIndexer, tokens: &[u32]) -> Result<[usize; 2], Error> {
    let mut blocks = [0; 2];
    for (worker, matched) in indexer.matches(tokens, None)? {
        if let Some(slot) = (worker as usize).checked_sub(1).and_then(|i| blocks.get_mut(i)) {
            *slot = matched;
        }
    }
    Ok(blocks)
}

/// Sends probes (token ids no trace prompt starts with, one token generated)
/// to replica `replica` until the indexer shows one's blocks there: from then
/// on its subscriber receives what the replica publishes.
async fn wait_subscribed(
    indexer: &DynamoIndexer,
    http: &reqwest::Client,
    server: &Server,
    replica: usize,
    model: &str,
) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut attempt = 0u32;
    loop {
        // 2 blocks of ids from the middle of the vocabulary, distinct per
        // replica and attempt from the first token on.
        let first = 20_000 + 100 * attempt + 50 * replica as u32;
        let probe: Vec<u32> = (first..first + 2 * BLOCK as u32 + 1).collect();
        complete(http, &server.url, model, &probe, 1).await?;
        let seen_by = Instant::now() + Duration::from_secs(3);
        while Instant::now() < seen_by {
            if matched_blocks(indexer, &probe)?[replica] == 2 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if Instant::now() > deadline {
            return Err(format!("the indexer never showed replica {replica}'s blocks").into());
        }
        attempt += 1;
    }
}

/// E4's round-robin replica of `r`: alternating with each conversation and
/// each turn, so no turn follows its conversation's previous one.
fn round_robin(r: &Request) -> usize {
    (r.conv + r.turn - 1) % 2
}

/// One mode on fresh servers, a fresh Redis (when shared) and a fresh indexer.
async fn run_mode(
    mode: Mode,
    shared: Shared,
    args: &Args,
    python: &Path,
    requests: &[Request],
    max_tokens: usize,
) -> Result<RunReport, Error> {
    let scratch = tempfile::Builder::new().prefix("kvcache-e4r-").tempdir()?;
    let redis = match shared {
        Shared::Redis => Some(RedisServer::start(scratch.path(), args.redis_mib << 20)?),
        _ => None,
    };
    let endpoints: Vec<String> = (0..2)
        .map(|_| free_port().map(|p| format!("tcp://127.0.0.1:{p}")))
        .collect::<Result<_, _>>()?;
    let log = std::env::temp_dir().join(format!(
        "kvcache-e4r-indexer-{}-{:?}-{}.log",
        mode.name(),
        shared,
        std::process::id()
    ));
    let indexer = start_indexer(python, &endpoints, &log)?;
    let mut servers = Vec::new();
    for endpoint in &endpoints {
        let mut flags: Vec<String> = redis
            .iter()
            .flat_map(|redis| ["--redis".to_string(), redis.url()])
            .collect();
        flags.extend([
            "--kv-events".into(),
            endpoint.clone(),
            "--block-tokens".into(),
            BLOCK.to_string(),
        ]);
        flags.extend(args.e1.server_flags());
        // Warnings only, unless the caller's RUST_LOG says otherwise (the
        // access log would interleave with the report).
        let env: &[(&str, &str)] = if std::env::var_os("RUST_LOG").is_some() {
            &[]
        } else {
            &[("RUST_LOG", "warn")]
        };
        servers.push(Server::start(&args.server_bin, &flags, env).map_err(|e| e.to_string())?);
    }
    let http = reqwest::Client::new();
    for (replica, server) in servers.iter().enumerate() {
        wait_subscribed(&indexer, &http, server, replica, &args.e1.model).await?;
    }
    // Each conversation's replica for its last turn.
    let mut last_replica: std::collections::HashMap<usize, usize> = Default::default();
    let mut outcomes = Vec::new();
    let start = Instant::now();
    for r in requests {
        let matched = matched_blocks(&indexer, &r.token_ids)?;
        let most = matched[0].max(matched[1]);
        let (replica, choice) = match mode {
            Mode::Routed if most > 0 && matched[0] != matched[1] => {
                (usize::from(matched[1] == most), Choice::Match)
            }
            _ => (round_robin(r), Choice::RoundRobin),
        };
        let streamed = complete(
            &http,
            &servers[replica].url,
            &args.e1.model,
            &r.token_ids,
            max_tokens,
        )
        .await
        .map_err(|e| format!("request {}: {e}", r.idx))?;
        let same_as_previous = last_replica.insert(r.conv, replica) == Some(replica);
        let o = Outcome {
            conv: r.conv,
            turn: r.turn,
            min_prefill: r.min_prefill,
            prompt_tokens: streamed.prompt_tokens,
            cached_tokens: streamed.cached_tokens,
            completion_tokens: streamed.completion_tokens,
            ttft: streamed.ttft,
            replica,
            choice,
            matched,
            same_as_previous,
        };
        if args.e1.verbose {
            println!(
                "  {} conv {} turn {}: replica {} ({:?}; indexer {:?} blocks) prompt {} cached {} \
                 evaluated {} (min {}) ttft {:.1} ms, {} generated",
                mode.name(),
                o.conv,
                o.turn,
                o.replica,
                o.choice,
                o.matched,
                o.prompt_tokens,
                o.cached_tokens,
                o.evaluated(),
                o.min_prefill,
                o.ttft.as_secs_f64() * 1e3,
                o.completion_tokens
            );
        }
        outcomes.push(o);
    }
    let wall = start.elapsed();
    // What each replica's prefix store did (local tiers and Redis).
    for (replica, server) in servers.iter().enumerate() {
        let text = http
            .get(format!("{}/metrics", server.url))
            .send()
            .await?
            .text()
            .await?;
        let store: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("kvcache_store_") || l.starts_with("kvcache_prompt_tokens_"))
            .collect();
        println!("{} replica {replica} /metrics: {}", mode.name(), store.join("; "));
    }
    drop(servers);
    drop(indexer);
    drop(redis);
    Ok(RunReport {
        mode,
        shared,
        outcomes,
        wall,
    })
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let python = args
        .dynamo_python
        .clone()
        .or_else(|| std::env::var_os("KVCACHE_DYNAMO_PYTHON").map(PathBuf::from))
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/kvcache-rs/python/dynamo-1.6.1/bin/python"))
        })
        .filter(|p| p.is_file())
        .ok_or("no Python with ai-dynamo-runtime: pass --dynamo-python or run `cargo xtask test` once")?;
    if !redis_server::on_path() {
        return Err("redis-server is not on PATH (`cargo xtask prepare` installs it)".into());
    }
    let run = args.e1.load()?;
    let (requests, max_tokens) = (&run.requests, run.max_tokens);
    // On the whole trace, the round-robin here is E4's.
    if requests.len() == run.trace.requests.len()
        && requests.iter().any(|r| round_robin(r) != replica_of(r.idx))
    {
        return Err("this trace's order is not E4's: round-robin by conversation and turn differs".into());
    }
    let modes: &[Mode] = match args.mode {
        Mode::Both => &[Mode::Routed, Mode::RoundRobin],
        Mode::Routed => &[Mode::Routed],
        Mode::RoundRobin => &[Mode::RoundRobin],
    };
    let shares: &[Shared] = match args.shared {
        Shared::Both => &[Shared::Redis, Shared::Nothing],
        Shared::Redis => &[Shared::Redis],
        Shared::Nothing => &[Shared::Nothing],
    };
    println!(
        "{}; two replicas, KV events to NVIDIA Dynamo's indexer ({})",
        run.describe(args.e1.conversations),
        python.display(),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    for &shared in shares {
        let mut reports = Vec::new();
        for &mode in modes {
            let report = runtime.block_on(run_mode(mode, shared, &args, &python, requests, max_tokens))?;
            report.print();
            reports.push(report);
        }
        if let [routed, rr] = &reports[..] {
            println!(
                "E4r, {}: routed vs round-robin median TTFT turns>=2: {:.2}x better (target >= 1.3x); \
                 routed evaluated {:.4}x the minimum (target <= 1.01x), round-robin {:.4}x",
                shared.name(),
                rr.median_ttft_later() / routed.median_ttft_later(),
                routed.evaluated() as f64 / routed.minimum().max(1) as f64,
                rr.evaluated() as f64 / rr.minimum().max(1) as f64,
            );
        }
    }
    Ok(())
}
