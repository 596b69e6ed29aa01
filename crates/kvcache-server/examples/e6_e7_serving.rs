//! E6 serving and E7 concurrency: the E1 trace replayed over HTTP against
//! `kvcache-server`'s `/v1/completions` (prompts as the trace's token ids,
//! streamed, usage included).
//!
//! - E6: the requests one at a time in trace order. Prompt tokens evaluated
//!   (`usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens`) against
//!   the trace's minimum, and the median time to first token on turns >= 2.
//! - E7: the trace's conversations as concurrent clients, each sending its
//!   turns in order. Generated tokens per second over the run's wall time and
//!   p50/p99 time to first token, against the sequential run.
//!
//! Either `--url` (a server already running; one mode only, since a second
//! run would find the first one's prefixes cached) or `--server-bin` (a fresh
//! server on a free loopback port for each mode, killed afterwards).
//!
//! ```text
//! cargo build --release -p kvcache-server --bin kvcache-server --example e6_e7_serving
//! target/release/examples/e6_e7_serving --server-bin target/release/kvcache-server --mode both
//! ```
//!
//! `--device cuda` starts the servers on the GPU (a server built with `--features cuda`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

#[path = "common/e1.rs"]
mod e1;
#[path = "common/server.rs"]
mod server;
#[path = "common/stream.rs"]
mod stream;

use clap::{Parser, ValueEnum};
use e1::E1Args;
use kvcache_bench::trace::Request;
use server::Server;
use stream::{complete, percentile, Error};

/// Replays the E1 trace against kvcache-server (E6 sequential, E7 concurrent).
#[derive(Debug, Parser)]
struct Args {
    /// A running server's base URL, e.g. http://127.0.0.1:8080.
    #[arg(long, conflicts_with = "server_bin")]
    url: Option<String>,
    /// The server binary to start (on 127.0.0.1, a free port) for each mode.
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Which run(s).
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    #[command(flatten)]
    e1: E1Args,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// E6: one request at a time.
    Sequential,
    /// E7: one client per conversation, all at once.
    Concurrent,
    /// Both, each on a fresh server (needs --server-bin).
    Both,
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
}

impl Outcome {
    fn evaluated(&self) -> usize {
        self.prompt_tokens - self.cached_tokens
    }
}

/// A whole run.
struct RunReport {
    name: &'static str,
    outcomes: Vec<Outcome>,
    wall: Duration,
}

impl RunReport {
    fn print(&self) {
        let evaluated: usize = self.outcomes.iter().map(Outcome::evaluated).sum();
        let minimum: usize = self.outcomes.iter().map(|o| o.min_prefill).sum();
        let prompt: usize = self.outcomes.iter().map(|o| o.prompt_tokens).sum();
        let generated: usize = self.outcomes.iter().map(|o| o.completion_tokens).sum();
        let mut later: Vec<f64> = self
            .outcomes
            .iter()
            .filter(|o| o.turn >= 2)
            .map(|o| o.ttft.as_secs_f64())
            .collect();
        let mut all: Vec<f64> = self.outcomes.iter().map(|o| o.ttft.as_secs_f64()).collect();
        let wall = self.wall.as_secs_f64();
        println!(
            "{}: {} requests, {:.1} s: {} of {} prompt tokens evaluated ({:.4}x the minimum {}); \
             median TTFT turns>=2 {:.1} ms; TTFT all p50 {:.1} ms p99 {:.1} ms; \
             {} generated tokens = {:.2} tok/s; (evaluated + generated) {:.1} tok/s",
            self.name,
            self.outcomes.len(),
            wall,
            evaluated,
            prompt,
            evaluated as f64 / minimum.max(1) as f64,
            minimum,
            percentile(&mut later, 0.5) * 1e3,
            percentile(&mut all, 0.5) * 1e3,
            percentile(&mut all, 0.99) * 1e3,
            generated,
            generated as f64 / wall,
            (evaluated + generated) as f64 / wall,
        );
        let last = self.outcomes.iter().map(|o| o.turn).max().unwrap_or(0);
        let per_turn: Vec<f64> = (1..=last)
            .map(|turn| {
                let mut ttft: Vec<f64> = self
                    .outcomes
                    .iter()
                    .filter(|o| o.turn == turn)
                    .map(|o| o.ttft.as_secs_f64())
                    .collect();
                percentile(&mut ttft, 0.5) * 1e3
            })
            .collect();
        let cells: Vec<String> = per_turn
            .iter()
            .enumerate()
            .map(|(i, ms)| format!("{} {ms:.0}", i + 1))
            .collect();
        println!("{}: median TTFT per turn (ms): {}", self.name, cells.join(", "));
        if last >= 2 && per_turn[1] > 0.0 {
            println!(
                "{}: turn {last} / turn 2 median TTFT: {:.2}x",
                self.name,
                per_turn[last - 1] / per_turn[1]
            );
        }
    }
}

/// Sends one streamed completion of `r`'s token ids and reads it to `[DONE]`.
async fn complete_request(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    r: &Request,
    max_tokens: usize,
) -> Result<Outcome, Error> {
    let s = complete(http, url, model, &r.token_ids, max_tokens)
        .await
        .map_err(|e| format!("request {}: {e}", r.idx))?;
    Ok(Outcome {
        conv: r.conv,
        turn: r.turn,
        min_prefill: r.min_prefill,
        prompt_tokens: s.prompt_tokens,
        cached_tokens: s.cached_tokens,
        completion_tokens: s.completion_tokens,
        ttft: s.ttft,
    })
}

fn log(verbose: bool, o: &Outcome) {
    if verbose {
        println!(
            "  conv {} turn {}: prompt {} cached {} evaluated {} (min {}) ttft {:.1} ms, {} generated",
            o.conv,
            o.turn,
            o.prompt_tokens,
            o.cached_tokens,
            o.evaluated(),
            o.min_prefill,
            o.ttft.as_secs_f64() * 1e3,
            o.completion_tokens
        );
    }
}

async fn sequential(
    url: &str,
    args: &Args,
    requests: &[Request],
    max_tokens: usize,
) -> Result<RunReport, Error> {
    let http = reqwest::Client::new();
    let start = Instant::now();
    let mut outcomes = Vec::new();
    for r in requests {
        let o = complete_request(&http, url, &args.e1.model, r, max_tokens).await?;
        log(args.e1.verbose, &o);
        outcomes.push(o);
    }
    Ok(RunReport {
        name: "E6 sequential",
        outcomes,
        wall: start.elapsed(),
    })
}

async fn concurrent(
    url: &str,
    args: &Args,
    requests: &[Request],
    max_tokens: usize,
) -> Result<RunReport, Error> {
    let http = reqwest::Client::new();
    let mut convs: Vec<usize> = requests.iter().map(|r| r.conv).collect();
    convs.sort_unstable();
    convs.dedup();
    let start = Instant::now();
    let mut clients = Vec::new();
    for conv in convs {
        let turns: Vec<Request> = requests.iter().filter(|r| r.conv == conv).cloned().collect();
        let (http, url, model, verbose) = (
            http.clone(),
            url.to_string(),
            args.e1.model.clone(),
            args.e1.verbose,
        );
        clients.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for r in &turns {
                let o = complete_request(&http, &url, &model, r, max_tokens).await?;
                log(verbose, &o);
                outcomes.push(o);
            }
            Ok::<_, Error>(outcomes)
        }));
    }
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(client.await??);
    }
    Ok(RunReport {
        name: "E7 concurrent",
        outcomes,
        wall: start.elapsed(),
    })
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let run = args.e1.load()?;
    let (requests, max_tokens) = (&run.requests, run.max_tokens);
    let modes: &[Mode] = match args.mode {
        Mode::Both => &[Mode::Sequential, Mode::Concurrent],
        Mode::Sequential => &[Mode::Sequential],
        Mode::Concurrent => &[Mode::Concurrent],
    };
    if modes.len() > 1 && args.server_bin.is_none() {
        return Err("--mode both needs --server-bin (a fresh server per run)".into());
    }
    println!(
        "{}; server --device {}",
        run.describe(args.e1.conversations),
        args.e1.device
    );
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut reports = Vec::new();
    for &mode in modes {
        let server = match &args.server_bin {
            Some(bin) => Some(Server::start(bin, args.e1.server_flags(), &[]).map_err(|e| e.to_string())?),
            None => None,
        };
        let url = match (&server, &args.url) {
            (Some(s), _) => s.url.clone(),
            (None, Some(url)) => url.trim_end_matches('/').to_string(),
            (None, None) => return Err("pass --url or --server-bin".into()),
        };
        let report = runtime.block_on(async {
            match mode {
                Mode::Sequential => sequential(&url, &args, requests, max_tokens).await,
                _ => concurrent(&url, &args, requests, max_tokens).await,
            }
        })?;
        report.print();
        reports.push(report);
        drop(server);
    }
    if let [seq, conc] = &reports[..] {
        let tps = |r: &RunReport| {
            r.outcomes.iter().map(|o| o.completion_tokens).sum::<usize>() as f64 / r.wall.as_secs_f64()
        };
        println!(
            "E7 vs E6: generated tok/s {:.2}x, wall {:.2}x faster",
            tps(conc) / tps(seq),
            seq.wall.as_secs_f64() / conc.wall.as_secs_f64()
        );
    }
    Ok(())
}
