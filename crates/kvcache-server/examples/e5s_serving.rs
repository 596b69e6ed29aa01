//! E5s: the E5 trace (Gemma 3, ten interleaved conversations of eight turns
//! growing past three windows) replayed over HTTP against `kvcache-server
//! --model gemma3` as chat messages: the trace's instruction as the system
//! message, the earlier turns as user and assistant messages, then the new
//! user message (streamed, usage included). `--mode sequential` sends one
//! request at a time in trace order; `--mode concurrent` runs the ten
//! conversations as ten concurrent clients, each sending its turns one after
//! another; `--mode both` runs one then the other, each on a fresh server.
//!
//! `--mode restart` (E3g) measures what a restarted server gets back from its
//! prefix store. First a reference run: a fresh server without a store, the
//! trace sent one request at a time in trace order (as `sequential`), every
//! answer's text kept (requests are greedy: temperature 0). Then the restart
//! run: servers with `--store-dir` on a fresh temporary directory (removed at
//! the end), the trace again in trace order, the server stopped gracefully
//! (SIGTERM, up to 60 s to finish its queued store writes and exit, else
//! SIGKILL) and a fresh one started on the same directory between turns. The
//! trace sends turn k of every conversation before turn k+1 of any, so a
//! restart comes before each request whose turn is greater than the largest
//! turn sent since the last (re)start: before turn 2, 3, ... (in a trace
//! whose conversations' turns interleaved, the same rule would restart before
//! the first request of a new, higher turn). For every request that is the
//! first of its conversation on its server and of turn >= 2 it reports the
//! prompt tokens and the cached ones (on a fresh server all of them came
//! from the store) and their fraction, with the fractions' minimum and median
//! and how many reach 95%; the prompt tokens evaluated over the whole run
//! against the trace's minimum; how many answers equal the reference run's
//! (those that differ by conversation and turn, with the first differing
//! character); and `kvcache_store_restores_total` and
//! `kvcache_store_restored_tokens_total` of `/metrics`, summed over the
//! restart run's servers (each scraped before it is stopped).
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
//!     [--mode sequential|concurrent|both|restart] [--conversations N] [--device cuda]
//! ```

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "common/server.rs"]
mod server;
#[path = "common/stream.rs"]
mod stream;

use clap::{Parser, ValueEnum};
use serde::Deserialize;
use serde_json::{json, Value};
use server::{Server, Stopped};
use stream::stream_each;

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
    /// One request at a time, the conversations as concurrent clients, one
    /// run of each (a fresh server for each), or a reference run then one
    /// restarting a server with a prefix store between turns.
    #[arg(long, value_enum, default_value_t = Mode::Sequential)]
    mode: Mode,
    /// Print one line per request.
    #[arg(long)]
    verbose: bool,
    /// Where the servers run the model: `cpu`, `cuda` or `cuda:N` (their
    /// `--device`; CUDA needs a server built with `--features cuda`).
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    device: String,
    /// Extra flags for the server (e.g. `--server-arg=--window-memory=768`).
    #[arg(long = "server-arg", value_name = "FLAG", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// With `--mode restart`: restart without a store, every turn evaluated
    /// whole on a fresh server (the control for the answers: what a prefix
    /// laid out in other cells does to them without any store).
    #[arg(long)]
    no_store: bool,
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
    /// Sequential without a store (the reference), then sequential with a
    /// store on disk and a fresh server before each new turn (E3g).
    Restart,
}

/// How long a stopped server may take to exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(60);

/// The parts of `fixtures/e5_trace.json` a replay needs.
#[derive(Debug, Deserialize)]
struct Trace {
    meta: Meta,
    instruction: String,
    conversations: Vec<Vec<Turn>>,
    requests: Vec<TraceRequest>,
}

impl Trace {
    /// The requests of the first `n` conversations, in trace order.
    fn first_conversations(&self, n: usize) -> Vec<&TraceRequest> {
        self.requests.iter().filter(|r| r.conv < n).collect()
    }
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
    /// The answer: the generated content.
    text: String,
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
    let content = |chunk: &Value| {
        chunk["choices"][0]["delta"]["content"]
            .as_str()
            .map(str::to_owned)
    };
    let mut text = String::new();
    let streamed = stream_each(
        http,
        &format!("{url}/v1/chat/completions"),
        &body,
        |chunk| content(chunk).is_some_and(|t| !t.is_empty()),
        |chunk| text.extend(content(chunk)),
    )
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
        text,
    })
}

/// The value of the gauge `name` in a Prometheus text page.
fn gauge(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

/// The `/metrics` page of the server at `url` once no sequence is active:
/// the engine publishes its gauges and counters after the pass that ends a
/// request, which may come after the answer.
fn settled_metrics(
    runtime: &tokio::runtime::Runtime,
    http: &reqwest::Client,
    url: &str,
) -> Result<String, Box<dyn std::error::Error>> {
    let metrics = || {
        runtime.block_on(async {
            http.get(format!("{url}/metrics"))
                .send()
                .await?
                .error_for_status()?
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
    Ok(page)
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
        Mode::Restart => {
            let (_, reference) = replay(&args, &trace, &gemma, "reference", false)?;
            return restart_run(&args, &trace, &gemma, &reference);
        }
    };
    let mut rates = Vec::new();
    for &concurrent in modes {
        let mode = if concurrent { "concurrent" } else { "sequential" };
        rates.push(replay(&args, &trace, &gemma, mode, concurrent)?.0);
    }
    if let [sequential, concurrent] = rates[..] {
        println!(
            "E5s: generated tokens/s concurrent / sequential = {concurrent:.2} / {sequential:.2} = {:.2}x",
            concurrent / sequential
        );
    }
    Ok(())
}

/// One replay on a fresh server (reports labelled `mode`); prints its
/// report and returns its generated tokens per second and what each request
/// gave.
fn replay(
    args: &Args,
    trace: &Trace,
    gemma: &Path,
    mode: &str,
    concurrent: bool,
) -> Result<(f64, Vec<Outcome>), Box<dyn std::error::Error>> {
    let config = kvcache_models::gemma::GemmaFile::open(gemma)?.config()?;
    // Keys and values of one position in every layer, f32: a full-size cache.
    let full_per_position = config.n_layers * config.n_kv_heads * config.head_dim * 2 * 4;

    let started = Instant::now();
    let mut server_args = vec![OsString::from("--model"), gemma.as_os_str().to_owned()];
    server_args.push(format!("--device={}", args.device).into());
    server_args.extend(args.server_args.iter().map(Into::into));
    let server = Server::start(&args.server_bin, &server_args, &[("RUST_LOG", "warn")])?;
    println!(
        "E5s {mode}: server (--device {}) up in {:.1} s at {}",
        args.device,
        started.elapsed().as_secs_f64(),
        server.url
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let http = reqwest::Client::new();
    let requests = trace.first_conversations(args.conversations);
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
    let page = settled_metrics(&runtime, &http, &server.url)?;
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
    Ok((rate, outcomes))
}

/// The first character position where `a` and `b` differ; `None` if equal.
fn first_difference(a: &str, b: &str) -> Option<usize> {
    (a != b).then(|| a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count())
}

/// The restart run of `--mode restart`: servers on one prefix store, a fresh
/// one before each new turn; compares its answers with `reference`'s and
/// prints the report (see the top of the file).
fn restart_run(
    args: &Args,
    trace: &Trace,
    gemma: &Path,
    reference: &[Outcome],
) -> Result<(), Box<dyn std::error::Error>> {
    const COUNTERS: [&str; 3] = [
        "kvcache_store_restores_total",
        "kvcache_store_restored_tokens_total",
        "kvcache_store_writes_dropped_total",
    ];
    // Dropped last: after every server has stopped.
    let store = tempfile::Builder::new().prefix("kvcache-e5s-store-").tempdir()?;
    let mut server_args = vec![OsString::from("--model"), gemma.as_os_str().to_owned()];
    if !args.no_store {
        server_args.push(OsString::from("--store-dir"));
        server_args.push(store.path().as_os_str().to_owned());
    }
    server_args.push(format!("--device={}", args.device).into());
    server_args.extend(args.server_args.iter().map(Into::into));
    let mut restart_time = Duration::ZERO;
    let mut start = |n: usize| -> Result<Server, Box<dyn std::error::Error>> {
        let t = Instant::now();
        let server = Server::start(&args.server_bin, &server_args, &[("RUST_LOG", "warn")]).map_err(|e| {
            format!(
                "E5s restart: server {n} (--store-dir {}): {e}",
                store.path().display()
            )
        })?;
        restart_time += t.elapsed();
        Ok(server)
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let http = reqwest::Client::new();
    // Scrapes the server's store counters into `sums` (None: not in
    // /metrics), then stops it gracefully.
    let mut stop_time = Duration::ZERO;
    let mut finish = |server: Server,
                      n: usize,
                      sums: &mut [Option<f64>; 3]|
     -> Result<(), Box<dyn std::error::Error>> {
        let page = settled_metrics(&runtime, &http, &server.url)?;
        for (sum, name) in sums.iter_mut().zip(COUNTERS) {
            if let Some(v) = gauge(&page, name) {
                *sum = Some(sum.unwrap_or(0.0) + v);
            }
        }
        let t = Instant::now();
        match server.stop(STOP_GRACE)? {
            Stopped::Exited(status) if status.success() => {}
            Stopped::Exited(status) => eprintln!("E5s restart: server {n} exited with {status}"),
            Stopped::Killed => eprintln!(
                "E5s restart: server {n} had not exited {} s after SIGTERM: killed (its queued store writes may be lost)",
                STOP_GRACE.as_secs()
            ),
        }
        stop_time += t.elapsed();
        Ok(())
    };

    let requests = trace.first_conversations(args.conversations);
    let n_predict = trace.meta.n_predict;
    let mut sums = [None; 3];
    let mut servers = 1;
    let mut server = start(servers)?;
    println!(
        "E5s restart: store in {}, server 1 up at {}",
        store.path().display(),
        server.url
    );
    // The largest turn sent to the current server, and the conversations it
    // has seen.
    let (mut top_turn, mut seen) = (0, vec![false; args.conversations]);
    // What each request gave, and whether it was its conversation's first
    // on a restarted server.
    let mut outcomes: Vec<(Outcome, bool)> = Vec::new();
    let mut sending = Duration::ZERO;
    for r in &requests {
        if top_turn > 0 && r.turn > top_turn {
            finish(server, servers, &mut sums)?;
            servers += 1;
            server = start(servers)?;
            (top_turn, seen) = (0, vec![false; args.conversations]);
        }
        top_turn = top_turn.max(r.turn);
        let first = !std::mem::replace(&mut seen[r.conv], true);
        let t = Instant::now();
        let o = runtime.block_on(chat(
            &http,
            &server.url,
            messages(trace, r.conv, r.turn),
            n_predict,
            r,
        ))?;
        sending += t.elapsed();
        if args.verbose {
            println!(
                "  conv {} turn {} (server {servers}): prompt {} cached {} evaluated {} (min {}) ttft {:.0} ms",
                o.conv,
                o.turn,
                o.prompt_tokens,
                o.cached_tokens,
                o.prompt_tokens - o.cached_tokens,
                r.min_prefill,
                o.ttft.as_secs_f64() * 1e3
            );
        }
        outcomes.push((o, first && servers > 1));
    }
    finish(server, servers, &mut sums)?;

    let evaluated: usize = outcomes
        .iter()
        .map(|(o, _)| o.prompt_tokens - o.cached_tokens)
        .sum();
    let minimum: usize = requests.iter().map(|r| r.min_prefill).sum();
    let prompt: usize = outcomes.iter().map(|(o, _)| o.prompt_tokens).sum();
    let generated: usize = outcomes.iter().map(|(o, _)| o.completion_tokens).sum();
    println!(
        "E5s restart: {} requests on {servers} servers ({} restarts) in {:.1} s of requests \
         (+ {:.1} s starting and {:.1} s stopping servers); prompt tokens {prompt}, \
         evaluated {evaluated} / minimum {minimum} = {:.4}x; {generated} generated",
        outcomes.len(),
        servers - 1,
        sending.as_secs_f64(),
        restart_time.as_secs_f64(),
        stop_time.as_secs_f64(),
        evaluated as f64 / minimum as f64
    );

    let reference_of = |o: &Outcome| reference.iter().find(|x| x.conv == o.conv && x.turn == o.turn);
    let restored: Vec<&Outcome> = outcomes
        .iter()
        .filter(|(o, first)| *first && o.turn >= 2)
        .map(|(o, _)| o)
        .collect();
    println!(
        "E5s restart: the first request of each conversation on a restarted server (turn >= 2): \
         prompt tokens, cached (from the store)"
    );
    let mut fractions = Vec::new();
    for o in &restored {
        let fraction = o.cached_tokens as f64 / o.prompt_tokens as f64;
        fractions.push(fraction);
        println!(
            "  conv {} turn {}: prompt {} cached {} = {:.1}%; ttft {:.0} ms (reference {:.0} ms)",
            o.conv,
            o.turn,
            o.prompt_tokens,
            o.cached_tokens,
            fraction * 1e2,
            o.ttft.as_secs_f64() * 1e3,
            reference_of(o).map_or(f64::NAN, |x| x.ttft.as_secs_f64() * 1e3)
        );
    }
    let min = fractions.iter().copied().fold(f64::INFINITY, f64::min);
    let at_95 = fractions.iter().filter(|&&f| f >= 0.95).count();
    let ttfts = |of: &dyn Fn(&Outcome) -> Option<Duration>| {
        median(
            restored
                .iter()
                .filter_map(|o| of(o))
                .map(|t| t.as_secs_f64() * 1e3)
                .collect(),
        )
    };
    println!(
        "E5s restart: cached / prompt over those {} requests: min {:.1}%, median {:.1}%; {at_95} of {} >= 95%; \
         TTFT median {:.0} ms (the same requests in the reference run {:.0} ms)",
        restored.len(),
        if fractions.is_empty() { 0.0 } else { min * 1e2 },
        median(fractions.clone()) * 1e2,
        restored.len(),
        ttfts(&|o| Some(o.ttft)),
        ttfts(&|o| reference_of(o).map(|x| x.ttft)),
    );

    let mut equal = 0;
    let mut differ = Vec::new();
    for (o, _) in &outcomes {
        let Some(x) = reference_of(o) else {
            differ.push(format!(
                "  conv {} turn {}: not in the reference run",
                o.conv, o.turn
            ));
            continue;
        };
        match first_difference(&o.text, &x.text) {
            None => equal += 1,
            Some(at) => differ.push(format!(
                "  conv {} turn {}: differs from character {at}: {:?} (reference {:?})",
                o.conv, o.turn, o.text, x.text
            )),
        }
    }
    println!(
        "E5s restart: answers equal to the reference run's: {equal} of {}",
        outcomes.len()
    );
    for line in &differ {
        println!("{line}");
    }
    let sum = |i: usize| sums[i].map_or_else(|| "not in /metrics".to_string(), |v: f64| format!("{v}"));
    println!(
        "E5s restart: /metrics over the {servers} servers: {} {}, {} {} ({} {})",
        COUNTERS[0],
        sum(0),
        COUNTERS[1],
        sum(1),
        COUNTERS[2],
        sum(2)
    );
    store.close()?;
    Ok(())
}
