//! `kvcache-server`: the OpenAI-compatible server on the kvcache-rs engine.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvcache_engine::store::StoreOptions;
use kvcache_models::attention::AttentionPath;
use kvcache_models::loader::{self, DeviceSpec};
use kvcache_models::WeightMode;
use kvcache_server::config::ApiKey;
use kvcache_server::{router, AppState, ServerConfig};

/// Serve SmolLM2 or Gemma 3 through an OpenAI-compatible HTTP API (chat
/// completions, completions, models), with continuous batching and prefix
/// reuse across requests on the kvcache-rs causal cache.
///
/// Gemma 3's sliding-window layers keep --window-memory positions of each
/// sequence, its global layers every position; its chat template has no
/// system role: a system message's text opens the first user turn.
///
/// Requests with the same `cache_salt` share cached prefixes; different salts
/// never do. `GET /metrics` reports the cache in Prometheus' text format.
#[derive(Debug, Parser)]
#[command(name = "kvcache-server", version, about, long_about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model: `smollm2` ($KVCACHE_MODEL, else the file `cargo xtask
    /// prepare` cached), `gemma3` ($KVCACHE_GEMMA, which `cargo xtask serve
    /// --model gemma3` sets), or a GGUF file (Llama or Gemma 3 architecture).
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// The model name clients send and `/v1/models` lists [default:
    /// SmolLM2-135M-Instruct, or gemma-3-270m for a Gemma 3 file].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Sequences in the cache: running requests plus finished ones kept for reuse.
    #[arg(long, default_value_t = 16)]
    max_sequences: usize,
    /// Positions per sequence (prompt plus generated tokens).
    #[arg(long, default_value_t = 2048)]
    context: usize,
    /// Most tokens in one forward pass.
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// Longest prompt chunk of one request in one forward pass.
    #[arg(long, default_value_t = 128)]
    prefill_chunk: usize,
    /// How attention reads the cache: `paged` (each request's own cells, in their
    /// stored type) or `dense` (the pass's whole cell range under a mask: the
    /// reference, for comparison).
    #[arg(long, value_enum, default_value_t = AttentionArg::Paged)]
    attention: AttentionArg,
    /// Where the model and its cache run: `cpu`, `cuda` (the first GPU) or
    /// `cuda:N` (a build with `--features cuda`; with the f32 or candle
    /// weights, the packed ones run on the CPU only). A device this build or
    /// machine lacks stops the server at start.
    #[arg(long, value_name = "DEVICE", default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
    /// How the weights are held and multiplied: `gguf` (the file's own 4- and
    /// 8-bit blocks, multiplied against activations quantized per row, as
    /// llama.cpp does; the fastest on the CPU), `q8` or `q4` (every matrix in
    /// 8- or 4-bit blocks), `candle` (the file's blocks through candle's
    /// quantized kernels, on any device) or `f32` (dequantized: the
    /// reference). Prefixes stored under one mode are never reused under
    /// another [default: gguf on the CPU, candle on a GPU].
    #[arg(long, value_name = "MODE")]
    weights: Option<WeightMode>,
    /// Positions of each sequence, and of each kept prefix, a sliding-window
    /// layer keeps (Gemma 3; at least the window): a conversation's next turn
    /// reuses the cache when it parts from what the cache holds at most this
    /// minus the window positions before its end [default: the window + 128].
    #[arg(long, value_name = "POSITIONS")]
    window_memory: Option<usize>,
    /// Keep finished requests' prefixes by blocks of this many tokens, whatever
    /// sequence ran them (Gemma 3's window layers keep each prefix's last
    /// --window-memory positions); 0 keeps them as idle sequences, at most
    /// --max-sequences of them.
    #[arg(long, value_name = "TOKENS", default_value_t = 16)]
    block_tokens: usize,
    /// Publish kept blocks as KV events (vLLM's schema, msgpack over a ZMQ PUB
    /// socket bound at ENDPOINT, e.g. tcp://127.0.0.1:5557) for a cache-aware
    /// router such as NVIDIA Dynamo's KV indexer; needs --block-tokens > 0.
    #[arg(long, value_name = "ENDPOINT")]
    kv_events: Option<String>,
    /// Requests waiting beyond --max-sequences before new ones get 503 and Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Seconds a finished sequence stays cached for reuse.
    #[arg(long, default_value_t = 300.0)]
    idle_ttl: f64,
    /// Tokens generated when a request gives no max_tokens.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Keep evaluated prompts in a prefix store on disk in DIR: they outlive the
    /// process, and a restarted server (or a replica on the same disk) imports them
    #[arg(long, value_name = "DIR")]
    store_dir: Option<PathBuf>,
    /// Share the prefix store through Redis (`redis://host:port`, `redis+unix:///path`)
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// Evaluated prompts waiting to be written to the prefix store; beyond it,
    /// writes are dropped (logged, and counted in /metrics as
    /// kvcache_store_writes_dropped_total) rather than slowing requests down.
    #[arg(long, value_name = "N", default_value_t = 64)]
    store_queue: usize,
    /// Tokens per block of the prefix store: one key per block; a restore
    /// reads whole blocks, so smaller ones read less past what a request
    /// lacks, larger ones mean fewer keys and files (a restore of ~110
    /// tokens from Redis: 61 ms with 256, 35 ms with 64, 29 ms with 16;
    /// docs/BENCHMARKS.md, E4r).
    #[arg(long, value_name = "N", default_value_t = 64)]
    store_block_tokens: usize,
    /// How log lines look on stderr: `text` for people, `json` (one object a
    /// line) for collectors. What is logged: `RUST_LOG` (default `info`: one
    /// access line per request, warnings and errors; `RUST_LOG=kvcache_server::access=off`
    /// silences the access log).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Accept this API key (repeatable): every /v1 request then needs
    /// `Authorization: Bearer KEY` (401 without), and each key is a tenant of
    /// its own: its prefixes are never shared with another key's, salt or not.
    /// /health and /metrics stay open.
    #[arg(long, value_name = "KEY")]
    api_key: Vec<String>,
    /// Read API keys from PATH: one a line, `KEY` or `KEY TENANT-NAME`; blank
    /// lines and `#` comments skipped. Adds to --api-key. A file that cannot
    /// be read, or holds no key, stops the server at start (it would
    /// otherwise serve everyone): to shut every client out, stop the server
    /// or start it with a new key no client has.
    #[arg(long, value_name = "PATH")]
    api_keys_file: Option<PathBuf>,
    /// Seconds a request body may take to arrive before the server answers
    /// 408 and closes the connection.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds a request's headers may take, from their first byte, before
    /// the server closes the connection (slow clients).
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a connection may stay idle, between requests or before the
    /// first, before the server closes it; 0: one request per connection.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    keep_alive_timeout: f64,
    /// Connections open at once; past it a new one is answered 503 (with
    /// `Connection: close`) and closed. Keep it below the descriptor limit
    /// (`ulimit -n`).
    #[arg(long, value_name = "N", default_value_t = 512)]
    max_connections: usize,
}

/// `--attention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AttentionArg {
    Paged,
    Dense,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Installs the `tracing` subscriber: `RUST_LOG` (else `info`), on stderr, as
/// text or JSON lines.
fn init_logging(format: LogFormat) -> Result<(), Box<dyn std::error::Error>> {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => {
            EnvFilter::try_new(directives).map_err(|e| format!("RUST_LOG is not a valid filter: {e}"))?
        }
        _ => EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
    installed.map_err(|e| format!("could not install the logger: {e}").into())
}

/// Whether the command line asks for JSON logs (read before the arguments
/// are parsed, so that even a bad argument is reported as JSON).
fn json_asked(args: &[std::ffi::OsString]) -> bool {
    let args: Vec<&str> = args.iter().filter_map(|a| a.to_str()).collect();
    args.iter()
        .enumerate()
        .any(|(i, a)| *a == "--log-format=json" || (*a == "--log-format" && args.get(i + 1) == Some(&"json")))
}

/// One error line on stderr before the logger exists: a JSON object when
/// `json`, else text.
fn early_error(json: bool, message: &str) {
    if json {
        let line = serde_json::json!({
            "level": "ERROR",
            "target": "kvcache_server",
            "message": message.trim_end(),
        });
        eprintln!("{line}");
    } else {
        eprintln!("kvcache-server: error: {}", message.trim_end());
    }
}

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread starts.
    unsafe { kvcache_models::threads::tune_cpu_threads() };
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let json = json_asked(&argv);
    let args = match Args::try_parse_from(&argv) {
        Ok(args) => args,
        // --help and --version go to stdout as they are.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) if json => {
            early_error(true, &e.render().to_string());
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    if let Err(e) = init_logging(args.log_format) {
        early_error(json, &e.to_string());
        return ExitCode::FAILURE;
    }
    if args.log_format == LogFormat::Json {
        // A panic is one JSON line too.
        std::panic::set_hook(Box::new(|info| {
            tracing::error!(panic = %info, "the server panicked");
        }));
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "kvcache-server could not start or stopped on an error");
            ExitCode::FAILURE
        }
    }
}

/// The keys of `--api-keys-file`: refused if the file cannot be read or
/// holds no key (only comments or blank lines), which would start a server
/// open to everyone.
fn read_keys_file(path: &std::path::Path) -> Result<Vec<ApiKey>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--api-keys-file {}: {e}", path.display()))?;
    let keys = ApiKey::parse_file(&text).map_err(|e| format!("--api-keys-file {}: {e}", path.display()))?;
    if keys.is_empty() {
        return Err(format!(
            "--api-keys-file {} holds no key (only comments or blank lines); refusing to start \
             without keys. To shut every client out, stop the server or give it a new key no \
             client has",
            path.display()
        ));
    }
    Ok(keys)
}

/// `value` seconds as a duration, if finite and within `range`.
fn seconds(flag: &str, value: f64, zero_ok: bool) -> Result<Duration, String> {
    let ok = value.is_finite() && (value > 0.0 || (zero_ok && value == 0.0)) && value <= 86_400.0;
    if !ok {
        let least = if zero_ok { "0" } else { "above 0" };
        return Err(format!("{flag} must be a number of seconds, {least} to 86400"));
    }
    Ok(Duration::from_secs_f64(value))
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    // The device and the weights it can hold are checked first: a GPU that
    // is not there stops the server before anything is read.
    let device = args.device.open()?;
    let weights = args.weights.unwrap_or_else(|| WeightMode::fastest_on(&device));
    weights.check_device(&device)?;
    let model = match args.model.as_str() {
        "smollm2" => kvcache_models::paths::model_path()
            .ok_or("no model: pass --model FILE, set KVCACHE_MODEL, or run `cargo xtask prepare --model`")?,
        "gemma3" | "gemma" => std::env::var_os(kvcache_models::gemma::GEMMA_ENV)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .ok_or("--model gemma3: KVCACHE_GEMMA is unset; run `cargo xtask serve -- --model gemma3`")?,
        path => PathBuf::from(path),
    };
    if !(args.idle_ttl.is_finite() && args.idle_ttl >= 0.0) {
        return Err("--idle-ttl must be a non-negative number of seconds".into());
    }
    let body_timeout = seconds("--body-timeout", args.body_timeout, false)?;
    let header_timeout = seconds("--header-timeout", args.header_timeout, false)?;
    let keep_alive_timeout = seconds("--keep-alive-timeout", args.keep_alive_timeout, true)?;
    if !(1..=1_000_000).contains(&args.max_connections) {
        return Err("--max-connections must lie in 1..=1000000".into());
    }
    let mut api_keys: Vec<ApiKey> = args
        .api_key
        .iter()
        .map(|key| ApiKey {
            key: key.clone(),
            tenant: None,
        })
        .collect();
    if let Some(path) = &args.api_keys_file {
        api_keys.extend(read_keys_file(path)?);
    }
    if api_keys
        .iter()
        .any(|k| k.key.is_empty() || k.key.chars().any(char::is_whitespace))
    {
        return Err("an API key must be non-empty and hold no whitespace".into());
    }
    let source = loader::open(&model)?;
    let default_name = source.architecture().default_name();
    let config = ServerConfig {
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| default_name.to_string()),
        max_sequences: args.max_sequences,
        context: args.context,
        max_batch: args.max_batch,
        prefill_chunk: args.prefill_chunk,
        window_memory: args.window_memory,
        block_tokens: (args.block_tokens > 0).then_some(args.block_tokens),
        kv_events: args.kv_events.clone(),
        device: args.device,
        weights,
        attention: match args.attention {
            AttentionArg::Paged => AttentionPath::Paged,
            AttentionArg::Dense => AttentionPath::Dense,
        },
        max_queue: args.max_queue,
        idle_ttl: Duration::from_secs_f64(args.idle_ttl),
        default_max_tokens: args.default_max_tokens,
        store: StoreOptions {
            dir: args.store_dir,
            redis: args.redis,
        },
        store_queue: args.store_queue,
        store_block_tokens: args.store_block_tokens,
        api_keys,
        body_timeout,
        header_timeout,
        keep_alive_timeout,
        max_connections: args.max_connections,
        ..ServerConfig::default()
    };
    if !config.api_keys.is_empty() {
        tracing::info!(keys = config.api_keys.len(), "API keys required on /v1");
    }
    if config.store_queue == 0 {
        return Err("--store-queue must be at least 1".into());
    }
    if config.store_block_tokens == 0 {
        return Err("--store-block-tokens must be at least 1".into());
    }
    if let Some(limit) = kvcache_server::connections::descriptor_limit() {
        // The model, the listener, the store and stdio take a few more.
        if limit < config.max_connections as u64 + 64 {
            tracing::warn!(
                max_connections = config.max_connections,
                descriptor_limit = limit,
                "--max-connections is not below the descriptor limit (ulimit -n) by 64: \
                 raise the limit or lower --max-connections, or accept may fail before the bound"
            );
        }
    }
    tracing::info!(model = %model.display(), "loading the model");
    let limits = kvcache_server::connections::Limits {
        header_timeout: config.header_timeout,
        keep_alive_timeout: config.keep_alive_timeout,
        max_connections: config.max_connections,
    };
    let state = AppState::load(source, config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let addr: SocketAddr = tokio::net::lookup_host((args.host.as_str(), args.port))
            .await?
            .next()
            .ok_or("the host resolves to no address")?;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        println!("kvcache-server: listening on http://{}", listener.local_addr()?);
        tracing::info!(address = %listener.local_addr()?, "listening");
        let metrics = state.metrics.clone();
        let worker = state.worker.clone();
        kvcache_server::connections::serve(listener, router(state), limits, metrics, shutdown_signal())
            .await?;
        // The requests are done; their write-backs may still be queued.
        tokio::task::block_in_place(|| worker.flush_store());
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

/// SIGINT or SIGTERM: stop accepting, let the requests in flight (streams
/// included) finish, write what they queued for the prefix store, then exit.
async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: finishing the requests in flight");
}
