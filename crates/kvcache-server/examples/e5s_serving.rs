//! E5s: the E5 trace (Gemma 3, ten interleaved conversations of eight turns
//! growing past three windows) replayed over HTTP against `kvcache-server
//! --model gemma3` as chat messages: the trace's instruction as the system
//! message, the earlier turns as user and assistant messages, then the new
//! user message (streamed, usage included). `--mode sequential` sends one
//! request at a time in trace order; `--mode concurrent` runs the ten
//! conversations as ten concurrent clients, each sending its turns one after
//! another; `--mode both` runs one then the other, each on a fresh server.
//!
//! Reports the prompt tokens evaluated (`usage.prompt_tokens -
//! usage.prompt_tokens_details.cached_tokens`) against the trace's minimum,
//! the time to first token (turn 1 and turns >= 2), and the bytes of keys and
//! values the server's cache holds per conversation at the end
//! (`kvcache_cache_bytes_in_use` of `/metrics`) beside a full-size cache of
//! the same conversations (every layer keeping every position). Every
//! request's `usage.prompt_tokens` must equal the trace's token count: the
//! server's chat template is checked on the way.
//!
//! ```text
//! cargo build --release -p kvcache-server --bin kvcache-server --example e5s_serving
//! target/release/examples/e5s_serving --server-bin target/release/kvcache-server --gemma $KVCACHE_GEMMA \
//!     [--mode sequential|concurrent|both]
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

#[path = "common/server.rs"]
mod server;
#[path = "common/stream.rs"]
mod stream;

use clap::{Parser, ValueEnum};
use serde::Deserialize;
use serde_json::{json, Value};
use server::Server;
use stream::stream;

/// Replays the E5 trace against kvcache-server serving Gemma 3 (E5s).
#[derive(Debug, Parser)]
struct Args {
    /// The server binary, started on 127.0.0.1 (a free port) and killed at the end.
    #[arg(long)]
    server_bin: PathBuf,
    /// The Gemma 3 270M GGUF file [default: $KVCACHE_GEMMA].
    #[arg(long)]
    gemma: Option<PathBuf>,
    /// The trace file [default: the project's fixtures/e5_trace.json].
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The first N conversations of the trace (all turns of each).
    #[arg(long, default_value_t = 10)]
    conversations: usize,
    /// One request at a time, the conversations as concurrent clients, or
    /// one run of each (a fresh server for each).
    #[arg(long, value_enum, default_value_t = Mode::Sequential)]
    mode: Mode,
    /// Print one line per request.
    #[arg(long)]
    verbose: bool,
    /// Extra flags for the server (e.g. `--server-arg=--window-memory=768`).
    #[arg(long = "server-arg", value_name = "FLAG", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

/// How the requests are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// One at a time, in trace order.
    Sequential,
    /// Each conversation a client of its own, all at once.
    Concurrent,
    /// Sequential, then concurrent.
    Both,
}

/// The parts of `fixtures/e5_trace.json` a replay needs.
#[derive(Debug, Deserialize)]
struct Trace {
    meta: Meta,
    instruction: String,
    conversations: Vec<Vec<Turn>>,
    requests: Vec<TraceRequest>,
}

#[derive(Debug, Deserialize)]
struct Meta {
    n_predict: usize,
}

#[derive(Debug, Deserialize)]
struct Turn {
    user: String,
    model: String,
}

#[derive(Debug, Deserialize)]
struct TraceRequest {
    conv: usize,
    turn: usize,
    prompt_tokens: usize,
    min_prefill: usize,
}

/// What one request gave.
#[derive(Debug)]
struct Outcome {
    conv: usize,
    turn: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    ttft: Duration,
}

/// The chat messages of turn `turn` (from 1) of conversation `conv`.
fn messages(trace: &Trace, conv: usize, turn: usize) -> Vec<Value> {
    let mut out = vec![json!({"role": "system", "content": trace.instruction})];
    let turns = &trace.conversations[conv];
    for earlier in &turns[..turn - 1] {
        out.push(json!({"role": "user", "content": earlier.user}));
        out.push(json!({"role": "assistant", "content": earlier.model}));
    }
    out.push(json!({"role": "user", "content": turns[turn - 1].user}));
    out
}

/// Sends one streamed chat completion and reads it to `[DONE]`.
async fn chat(
    http: &reqwest::Client,
    url: &str,
    messages: Vec<Value>,
    max_tokens: usize,
    r: &TraceRequest,
) -> Result<Outcome, Box<dyn std::error::Error>> {
    let body = json!({
        "model": "gemma-3-270m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    // The first chunk opens the assistant's message; the first token's text
    // comes in a chunk with content.
    let streamed = stream(http, &format!("{url}/v1/chat/completions"), &body, |chunk| {
        chunk["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    })
    .await
    .map_err(|e| e as Box<dyn std::error::Error>)?;
    if streamed.prompt_tokens != r.prompt_tokens {
        return Err(format!(
            "conversation {} turn {}: the server's prompt has {} tokens, the trace's {}: the chat template differs",
            r.conv, r.turn, streamed.prompt_tokens, r.prompt_tokens
        )
        .into());
    }
    Ok(Outcome {
        conv: r.conv,
        turn: r.turn,
        prompt_tokens: streamed.prompt_tokens,
        cached_tokens: streamed.cached_tokens,
        completion_tokens: streamed.completion_tokens,
        ttft: streamed.ttft,
    })
}

/// The value of the gauge `name` in a Prometheus text page.
fn gauge(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let gemma = args
        .gemma
        .clone()
        .or_else(|| std::env::var_os("KVCACHE_GEMMA").map(PathBuf::from))
        .ok_or("no Gemma file: pass --gemma or set KVCACHE_GEMMA")?;
    let trace_path = args
        .trace
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/e5_trace.json"));
    let trace: Trace = serde_json::from_str(&std::fs::read_to_string(&trace_path)?)?;
    let modes: &[bool] = match args.mode {
        Mode::Sequential => &[false],
        Mode::Concurrent => &[true],
        Mode::Both => &[false, true],
    };
    let mut rates = Vec::new();
    for &concurrent in modes {
        rates.push(replay(&args, &trace, &gemma, concurrent)?);
    }
    if let [sequential, concurrent] = rates[..] {
        println!(
            "E5s: generated tokens/s concurrent / sequential = {concurrent:.2} / {sequential:.2} = {:.2}x",
            concurrent / sequential
        );
    }
    Ok(())
}

/// One replay on a fresh server; prints its report and returns its
/// generated tokens per second.
fn replay(
    args: &Args,
    trace: &Trace,
    gemma: &std::path::Path,
    concurrent: bool,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mode = if concurrent { "concurrent" } else { "sequential" };
    let config = kvcache_models::gemma::GemmaFile::open(gemma)?.config()?;
    // Keys and values of one position in every layer, f32: a full-size cache.
    let full_per_position = config.n_layers * config.n_kv_heads * config.head_dim * 2 * 4;

    let started = Instant::now();
    let mut server_args = vec![std::ffi::OsString::from("--model"), gemma.as_os_str().to_owned()];
    server_args.extend(args.server_args.iter().map(Into::into));
    let server = Server::start(&args.server_bin, &server_args, &[("RUST_LOG", "warn")])?;
    println!(
        "E5s {mode}: server up in {:.1} s at {}",
        started.elapsed().as_secs_f64(),
        server.url
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let http = reqwest::Client::new();
    let requests: Vec<&TraceRequest> = trace
        .requests
        .iter()
        .filter(|r| r.conv < args.conversations)
        .collect();
    let n_predict = trace.meta.n_predict;
    let t0 = Instant::now();
    let outcomes: Vec<Outcome> = if concurrent {
        // A client per conversation, each sending its turns in order.
        let clients = (0..args.conversations).map(|conv| {
            let turns: Vec<&TraceRequest> = requests.iter().copied().filter(|r| r.conv == conv).collect();
            let (http, url) = (&http, &server.url);
            async move {
                let mut out = Vec::new();
                for r in turns {
                    out.push(chat(http, url, messages(trace, r.conv, r.turn), n_predict, r).await?);
                }
                Ok::<_, Box<dyn std::error::Error>>(out)
            }
        });
        let results = runtime.block_on(futures_util::future::join_all(clients));
        let mut all = Vec::new();
        for r in results {
            all.extend(r?);
        }
        all
    } else {
        let mut all = Vec::new();
        for r in &requests {
            all.push(runtime.block_on(chat(
                &http,
                &server.url,
                messages(trace, r.conv, r.turn),
                n_predict,
                r,
            ))?);
        }
        all
    };
    let wall = t0.elapsed();
    let minimum_of = |o: &Outcome| {
        requests
            .iter()
            .find(|r| r.conv == o.conv && r.turn == o.turn)
            .map_or(0, |r| r.min_prefill)
    };
    let mut last_len = vec![0usize; args.conversations];
    for o in &outcomes {
        if args.verbose {
            println!(
                "  conv {} turn {}: prompt {} cached {} evaluated {} (min {}) ttft {:.0} ms",
                o.conv,
                o.turn,
                o.prompt_tokens,
                o.cached_tokens,
                o.prompt_tokens - o.cached_tokens,
                minimum_of(o),
                o.ttft.as_secs_f64() * 1e3
            );
        }
        last_len[o.conv] = last_len[o.conv].max(o.prompt_tokens + o.completion_tokens);
    }
    // The engine publishes its gauges after the pass that ends a request,
    // which may come after the answer: wait for the last one to leave.
    let metrics = || {
        runtime.block_on(async {
            http.get(format!("{}/metrics", server.url))
                .send()
                .await?
                .text()
                .await
        })
    };
    let mut page = metrics()?;
    for _ in 0..50 {
        if gauge(&page, "kvcache_sequences_active") == Some(0.0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        page = metrics()?;
    }
    let held =
        gauge(&page, "kvcache_cache_bytes_in_use").ok_or("no kvcache_cache_bytes_in_use in /metrics")?;
    let evictions = gauge(&page, "kvcache_evictions_total").unwrap_or(0.0);

    let evaluated: usize = outcomes.iter().map(|o| o.prompt_tokens - o.cached_tokens).sum();
    let minimum: usize = requests.iter().map(|r| r.min_prefill).sum();
    let prompt: usize = outcomes.iter().map(|o| o.prompt_tokens).sum();
    let generated: usize = outcomes.iter().map(|o| o.completion_tokens).sum();
    let ms = |turns: &dyn Fn(usize) -> bool| {
        let v: Vec<f64> = outcomes
            .iter()
            .filter(|o| turns(o.turn))
            .map(|o| o.ttft.as_secs_f64() * 1e3)
            .collect();
        let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
        (mean, median(v))
    };
    let (first_mean, first_median) = ms(&|t| t == 1);
    let (later_mean, later_median) = ms(&|t| t >= 2);
    let conversations = args.conversations as f64;
    let full: f64 = last_len
        .iter()
        .map(|&n| (n * full_per_position) as f64)
        .sum::<f64>()
        / conversations;
    let mib = |b: f64| b / (1 << 20) as f64;
    let rate = generated as f64 / wall.as_secs_f64();
    println!(
        "E5s {mode}: {} requests in {:.1} s; prompt tokens {prompt}, evaluated {evaluated} / minimum {minimum} = {:.4}x; \
         {generated} generated, {rate:.2} tokens/s",
        outcomes.len(),
        wall.as_secs_f64(),
        evaluated as f64 / minimum as f64
    );
    println!(
        "E5s {mode}: TTFT turn 1 mean / median {first_mean:.0} / {first_median:.0} ms; turns >= 2 {later_mean:.0} / {later_median:.0} ms"
    );
    let per_conversation = held / conversations;
    println!(
        "E5s {mode}: cache holds {:.1} MiB for {conversations} conversations ({evictions} evicted on the way): \
         {:.2} MiB per conversation, a full-size cache {:.2} MiB ({:.2}x)",
        mib(held),
        mib(per_conversation),
        mib(full),
        per_conversation / full
    );
    Ok(rate)
}
