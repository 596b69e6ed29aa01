//! `kvcache-demo`: SmolLM2-135M-Instruct served through the kvcache-rs caches.
//!
//! Run through `cargo xtask demo [ARGS]`; `--help` lists the flags.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use candle_core::Device;
use kvcache_api::{CausalConfig, SlidingWindow};
use kvcache_causal::{CausalKvCache, RopeLayout, RopeShift};
use kvcache_engine::bench::{e1_chat_reuse, e2_batched_decode, E2Config};
use kvcache_engine::chat::{ChatServer, Reuse, TurnOutcome};
use kvcache_engine::engine::{Engine, EngineConfig, Event, Request, Stats};
use kvcache_engine::replica::{self, Replica};
use kvcache_engine::store::{self, StoreOptions};
use kvcache_engine::store_bench::{e3_restart, e4_replicas, ReplicaSetup};
use kvcache_engine::tokenizer::{chatml, Message, Role};
use kvcache_engine::trace::Trace;
use kvcache_engine::{paths, ChatTokenizer, EngineError, Llama, LoadProgress, ModelFile, Result, WeightMode};
use kvcache_mlx::trie::Stats as TrieStats;

const HELP: &str = "\
kvcache-demo: SmolLM2-135M-Instruct served through the kvcache-rs caches

USAGE: kvcache-demo [FLAGS]

  --model PATH          GGUF file (default: $KVCACHE_MODEL, else the `cargo xtask prepare` cache)
  --prompt TEXT         a user message; repeat for several (default: built-in questions)
  --conversations N     conversations to answer in the batching demo (default 6)
  --slots N             sequences decoding at once (default 4)
  --max-new N           tokens to generate per reply (default 32)
  --backend NAME        causal (default): everything on candle; the chat's trie drives candle layer caches
                        mlx: the prefix-trie chat runs the model on mlx-rs through kvcache-mlx's KvCache
                        (needs an mlx build: `cargo xtask demo` on Linux, or macOS); the batching, window
                        and shift parts and the benchmarks stay on candle (the causal cache is candle-only)
  --device NAME         cpu | cuda | metal (default cpu) for candle; mlx uses its default device
  --weights KIND        f32 (dequantized, default) | q (keep GGUF quantization; candle only, mlx is f32)
  --window N            sliding window of the windowed run (default 48)
  --context N           context of the context-shift run (default 64)
  --turns N             turns per conversation in the prefix-trie chat (default 3)
  --skip NAMES          comma-separated parts to skip: chat,store,batching,window,shift
  --bench-e1            run benchmark E1 (the chat trace: trie vs single-entry vs no reuse) and exit
  --trace PATH          E1 trace (default: fixtures/e1_trace.json)
  --e1-requests N       first N requests of the trace (default 80: all)
  --e1-predict N        tokens generated per request (default 32)
  --e1-policies LIST    comma-separated: trie,single,none (default all three)
  --bench-e2            run benchmark E2 (8 sequences together vs one after another) and exit
  --e2-tokens N         tokens each sequence decodes in E2 (default 32)
  --e2-runs N           alternating runs of E2 (default 3)
  --bench-e3            run benchmark E3 (the E1 trace, restarted after --e3-restart requests over
                        a disk store: evaluated tokens and time to first token after the restart)
  --e3-restart N        requests before the restart (default 40)
  --bench-e4            run benchmark E4 (two replicas alternating over one Redis vs no store;
                        needs redis-server on PATH)
  --store-dir DIR       keep the prefix store in DIR (the chat and --replica)
  --redis URL           share the prefix store through Redis (redis://H:P or redis+unix:///PATH)
  --replica             serve trace requests as commands on stdin (what E3/E4 and the store demo
                        start; see kvcache_engine::replica)
  -h, --help            this text
";

const DEFAULT_PROMPTS: &[&str] = kvcache_engine::bench::SAMPLE_QUESTIONS;

struct Args {
    model: Option<PathBuf>,
    prompts: Vec<String>,
    conversations: usize,
    slots: usize,
    max_new: usize,
    backend: String,
    device: String,
    weights: WeightMode,
    window: usize,
    context: usize,
    turns: usize,
    skip: Vec<String>,
    bench_e1: bool,
    trace: Option<PathBuf>,
    e1_requests: usize,
    e1_predict: usize,
    e1_policies: Vec<String>,
    bench_e2: bool,
    e2_tokens: usize,
    e2_runs: usize,
    bench_e3: bool,
    e3_restart: usize,
    bench_e4: bool,
    store_dir: Option<PathBuf>,
    redis: Option<String>,
    replica: bool,
}

fn parse_args() -> Result<Option<Args>> {
    let mut a = Args {
        model: None,
        prompts: Vec::new(),
        conversations: 6,
        slots: 4,
        max_new: 32,
        backend: "causal".into(),
        device: "cpu".into(),
        weights: WeightMode::F32,
        window: 48,
        context: 64,
        turns: 3,
        skip: Vec::new(),
        bench_e1: false,
        trace: None,
        e1_requests: 80,
        e1_predict: 32,
        e1_policies: vec!["trie".into(), "single".into(), "none".into()],
        bench_e2: false,
        e2_tokens: 32,
        e2_runs: 3,
        bench_e3: false,
        e3_restart: 40,
        bench_e4: false,
        store_dir: None,
        redis: None,
        replica: false,
    };
    let mut it = std::env::args().skip(1);
    let bad = |m: String| EngineError::InvalidArgument(m);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| bad(format!("{name} needs a value")));
        let num = |s: String, name: &str| -> Result<usize> {
            s.parse()
                .ok()
                .filter(|&n: &usize| n > 0)
                .ok_or_else(|| bad(format!("{name} takes a positive integer, got {s:?}")))
        };
        match flag.as_str() {
            "-h" | "--help" => {
                print!("{HELP}");
                return Ok(None);
            }
            "--model" => a.model = Some(PathBuf::from(value("--model")?)),
            "--prompt" => a.prompts.push(value("--prompt")?),
            "--conversations" => a.conversations = num(value(&flag)?, &flag)?,
            "--slots" => a.slots = num(value(&flag)?, &flag)?,
            "--max-new" => a.max_new = num(value(&flag)?, &flag)?,
            "--backend" => a.backend = value(&flag)?,
            "--device" => a.device = value(&flag)?,
            "--weights" => {
                a.weights = match value(&flag)?.as_str() {
                    "f32" => WeightMode::F32,
                    "q" | "quantized" => WeightMode::Quantized,
                    other => return Err(bad(format!("--weights: f32 or q, got {other:?}"))),
                }
            }
            "--window" => a.window = num(value(&flag)?, &flag)?,
            "--context" => a.context = num(value(&flag)?, &flag)?,
            "--skip" => a.skip = value(&flag)?.split(',').map(str::to_owned).collect(),
            "--turns" => a.turns = num(value(&flag)?, &flag)?,
            "--bench-e1" => a.bench_e1 = true,
            "--trace" => a.trace = Some(PathBuf::from(value(&flag)?)),
            "--e1-requests" => a.e1_requests = num(value(&flag)?, &flag)?,
            "--e1-predict" => a.e1_predict = num(value(&flag)?, &flag)?,
            "--e1-policies" => a.e1_policies = value(&flag)?.split(',').map(str::to_owned).collect(),
            "--bench-e2" => a.bench_e2 = true,
            "--e2-tokens" => a.e2_tokens = num(value(&flag)?, &flag)?,
            "--e2-runs" => a.e2_runs = num(value(&flag)?, &flag)?,
            "--bench-e3" => a.bench_e3 = true,
            "--e3-restart" => a.e3_restart = num(value(&flag)?, &flag)?,
            "--bench-e4" => a.bench_e4 = true,
            "--store-dir" => a.store_dir = Some(PathBuf::from(value(&flag)?)),
            "--redis" => a.redis = Some(value(&flag)?),
            "--replica" => a.replica = true,
            other => return Err(bad(format!("unknown flag {other:?} (see --help)"))),
        }
    }
    if a.prompts.is_empty() {
        a.prompts = DEFAULT_PROMPTS.iter().map(|s| s.to_string()).collect();
    }
    Ok(Some(a))
}

fn device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Device::new_cuda(0).map_err(|e| {
            EngineError::InvalidArgument(format!(
                "--device cuda: {e} (build with `--features cuda` and the CUDA toolkit)"
            ))
        }),
        "metal" => Device::new_metal(0)
            .map_err(|e| EngineError::InvalidArgument(format!("--device metal: {e} (macOS only)"))),
        other => Err(EngineError::InvalidArgument(format!(
            "--device: cpu, cuda or metal, got {other:?}"
        ))),
    }
}

/// Prints weight-loading progress after `label`, every 10%, on one line.
fn load_progress(label: String) -> impl FnMut(LoadProgress) {
    let mut last = 0;
    move |p: LoadProgress| {
        let pct = p.done * 100 / p.total.max(1);
        if pct >= last + 10 || p.done == p.total {
            last = pct;
            print!("\r{label}: {pct:3}% ({}/{} tensors)", p.done, p.total);
            flush();
        }
    }
}

fn flush() {
    let _ = std::io::stdout().flush();
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvcache-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let Some(args) = parse_args()? else { return Ok(()) };
    let start = Instant::now();
    let mlx = match args.backend.as_str() {
        "causal" => false,
        "mlx" => true,
        other => {
            return Err(EngineError::InvalidArgument(format!(
                "--backend: causal or mlx, got {other:?}"
            )))
        }
    };
    if mlx && !mlx_chat::AVAILABLE {
        return Err(EngineError::InvalidArgument(
            "--backend mlx: this build has no mlx-rs; run it through `cargo xtask demo -- --backend mlx` \
             (Linux) or build on macOS"
                .into(),
        ));
    }
    let dev = device(&args.device)?;
    let path = args.model.clone().or_else(paths::model_path).ok_or_else(|| {
        EngineError::InvalidArgument(format!(
            "no model: pass --model, set {}, or run `cargo xtask prepare`",
            paths::MODEL_ENV
        ))
    })?;
    if args.replica {
        return replica_main(&path, &dev, &args);
    }
    if args.bench_e3 || args.bench_e4 {
        return bench_store(&path, &args);
    }
    let (model, tokenizer) = load(&path, &dev, args.weights)?;

    if (args.bench_e1 || args.bench_e2) && mlx {
        println!("note: --backend mlx applies to the chat demo; the benchmarks measure the candle engine");
    }
    if args.bench_e1 {
        return bench_e1(&model, &args);
    }
    if args.bench_e2 {
        return bench_e2(&model, &tokenizer, &args);
    }
    let skip = |part: &str| args.skip.iter().any(|s| s == part);
    if !skip("chat") {
        if mlx {
            mlx_chat::run(&path, &tokenizer, &args)?;
        } else {
            let mut server = ChatServer::new(&model, Reuse::Trie, 1 << 30)?;
            chat_demo(
                "candle layer caches (kvcache-causal's CandleKv)",
                &tokenizer,
                &args,
                &mut |prompt, n, eos| server.generate(prompt, n, eos),
            )?;
            print_trie_stats(&server.trie_stats().expect("a trie server"));
        }
    }
    if !skip("store") {
        store_demo(&path, &args)?;
    }
    if mlx && ["batching", "window", "shift"].iter().any(|p| !skip(p)) {
        println!(
            "\n(--backend mlx: the parts below run on candle through kvcache-causal, the multi-sequence \
             cache, which has no mlx-rs storage; the mlx backend is the prefix trie above)"
        );
    }
    if !skip("batching") {
        batching_demo(&model, &tokenizer, &args)?;
    }
    if !skip("window") {
        window_demo(&model, &tokenizer, &args)?;
    }
    if !skip("shift") {
        shift_demo(&model, &tokenizer, &args)?;
    }
    println!("\ndone in {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}

fn load(path: &std::path::Path, dev: &Device, weights: WeightMode) -> Result<(Llama, ChatTokenizer)> {
    let t0 = Instant::now();
    let file = ModelFile::open(path)?;
    let c = file.config()?;
    println!("model: {} ({} tensors)", path.display(), file.tensor_count());
    println!(
        "config: {} layers, dim {}, {} heads / {} KV heads of {}, FFN {}, vocab {}, rope base {}",
        c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size, c.rope_base
    );
    let mut progress = load_progress(format!("loading weights ({weights:?})"));
    let model = file.load(dev, weights, &mut progress)?;
    let tokenizer = file.tokenizer()?;
    println!(
        "\nloaded model and tokenizer ({} tokens) in {:.2} s",
        tokenizer.vocab_size(),
        t0.elapsed().as_secs_f64()
    );
    Ok((model, tokenizer))
}

/// The causal cache with SmolLM2's RoPE shift (GGUF's normal layout).
fn causal_cache(model: &Llama, config: CausalConfig) -> Result<CausalKvCache> {
    let c = model.config();
    let shift = RopeShift::new(RopeLayout::Normal, c.head_dim, c.rope_base as f32)?;
    Ok(CausalKvCache::new(
        config,
        model.device().clone(),
        Some(Box::new(shift)),
    )?)
}

fn prompt_tokens(tokenizer: &ChatTokenizer, user: &str) -> Result<Vec<u32>> {
    tokenizer.encode(&chatml(&[Message::new(Role::User, user)], true))
}

/// Prints events as they come; replies in full when their request finishes.
fn printer<'a>(tokenizer: &'a ChatTokenizer, prompts: &'a [String]) -> impl FnMut(&Event) + 'a {
    move |ev: &Event| match ev {
        Event::Joined {
            id,
            seq,
            prompt_tokens,
        } => {
            println!("  [join] conversation {id} -> sequence {seq} ({prompt_tokens} prompt tokens)");
        }
        Event::Prefilled { id, done, total } => {
            println!("  [prefill] conversation {id}: {done}/{total} prompt tokens");
        }
        Event::ContextShift { id, seq, removed } => {
            println!(
                "  [context shift] conversation {id} (sequence {seq}): removed positions {}..{}, later keys re-rotated",
                removed.start, removed.end
            );
        }
        Event::Finished(f) => {
            let text = tokenizer
                .decode(&f.generated)
                .unwrap_or_else(|e| format!("<{e}>"));
            let decode_s = (f.total - f.time_to_first_token).as_secs_f64();
            println!(
                "  [done] conversation {} (sequence {}): {} tokens, first token after {:.0} ms, {:.1} tokens/s after it{}",
                f.id,
                f.seq,
                f.generated.len(),
                f.time_to_first_token.as_secs_f64() * 1e3,
                (f.generated.len().saturating_sub(1)) as f64 / decode_s.max(1e-9),
                if f.context_shifts > 0 { format!(", {} context shifts", f.context_shifts) } else { String::new() }
            );
            println!("      user: {}", prompts[f.id % prompts.len()]);
            println!(
                "      assistant: {}",
                text.trim().replace('\n', "\n                 ")
            );
            flush();
        }
        Event::Token { .. } | Event::Pass { .. } => {}
    }
}

fn summary(label: &str, s: &Stats) {
    println!(
        "{label}: {} passes, {} prompt tokens + {} generated in {:.2} s: {:.1} generated tokens/s \
         (decode-only passes: {:.1} tokens/s){}",
        s.passes,
        s.prefill_tokens,
        s.generated_tokens,
        s.elapsed.as_secs_f64(),
        s.tokens_per_second(),
        s.decode_tokens as f64 / s.decode_time.as_secs_f64().max(1e-9),
        if s.context_shifts > 0 {
            format!(", {} context shifts", s.context_shifts)
        } else {
            String::new()
        }
    );
}

fn batching_demo(model: &Llama, tokenizer: &ChatTokenizer, args: &Args) -> Result<()> {
    let slots = args.slots.min(args.conversations);
    println!(
        "\n== continuous batching: {} conversations through {slots} sequences of one causal cache ==",
        args.conversations
    );
    let cfg = CausalConfig::new(slots, 512, 256);
    let cache = causal_cache(model, cfg)?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 256,
            prefill_chunk: 64,
            eos: Some(tokenizer.eos_token_id()),
            ..EngineConfig::default()
        },
    )?;
    for id in 0..args.conversations {
        let user = &args.prompts[id % args.prompts.len()];
        // Different lengths, so sequences leave at different times and queued
        // conversations join mid-flight.
        let max_new = (args.max_new / 2 + (id * 7) % args.max_new.max(1)).max(1);
        engine.submit(Request::new(id, prompt_tokens(tokenizer, user)?, max_new))?;
    }
    let mut print = printer(tokenizer, &args.prompts);
    let (mut decode_passes, mut decode_tokens, mut mixed) = (0, 0, 0);
    let stats = engine.run(&mut |ev| {
        if let Event::Pass { decode, prefill, .. } = *ev {
            if prefill == 0 {
                decode_passes += 1;
                decode_tokens += decode;
            } else if decode > 0 {
                mixed += 1;
            }
        }
        print(ev)
    })?;
    println!(
        "  {decode_passes} decode-only passes of {:.2} sequences on average; {mixed} passes mixed decode steps \
         with a joining prompt",
        decode_tokens as f64 / decode_passes.max(1) as f64
    );
    summary("continuous batching", &stats);
    Ok(())
}

fn window_demo(model: &Llama, tokenizer: &ChatTokenizer, args: &Args) -> Result<()> {
    let n = 2.min(args.prompts.len()).max(1);
    println!(
        "\n== sliding window: {n} sequences attending to their last {} positions ==",
        args.window
    );
    let cfg = CausalConfig::new(n, 4096, 128).with_window(SlidingWindow::new(args.window));
    println!(
        "  cache of {} cells for {n} sequences (each keeps its last {} positions)",
        cfg.num_cells(),
        cfg.effective_memory().unwrap_or(cfg.capacity)
    );
    let cache = causal_cache(model, cfg)?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 128,
            prefill_chunk: 64,
            ..EngineConfig::default()
        },
    )?;
    for id in 0..n {
        engine.submit(Request::new(
            id,
            prompt_tokens(tokenizer, &args.prompts[id])?,
            args.max_new,
        ))?;
    }
    let mut print = printer(tokenizer, &args.prompts);
    let stats = engine.run(&mut print)?;
    println!(
        "  (SmolLM2 was trained with full attention, so a short window changes what it writes; \
         the cache holds {} cells whatever the length of the replies)",
        engine.cache().num_cells()
    );
    summary("sliding window", &stats);
    Ok(())
}

fn shift_demo(model: &Llama, tokenizer: &ChatTokenizer, args: &Args) -> Result<()> {
    let ctx = args.context;
    let prompt = prompt_tokens(tokenizer, &args.prompts[0])?;
    if prompt.len() + 2 > ctx {
        println!(
            "\n== context shift: skipped (prompt of {} tokens does not fit --context {ctx}) ==",
            prompt.len()
        );
        return Ok(());
    }
    let new = ctx + ctx / 2;
    println!("\n== context shift: one sequence with a context of {ctx} positions generating {new} tokens ==");
    let cache = causal_cache(model, CausalConfig::new(1, ctx + 1, 64))?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 64,
            prefill_chunk: 64,
            context: Some(ctx),
            keep: prompt.len().min(ctx / 2),
            eos: None,
        },
    )?;
    engine.submit(Request::new(0, prompt, new))?;
    let mut print = printer(tokenizer, &args.prompts);
    let stats = engine.run(&mut print)?;
    summary("context shift", &stats);
    Ok(())
}

fn bench_e2(model: &Llama, tokenizer: &ChatTokenizer, args: &Args) -> Result<()> {
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| prompt_tokens(tokenizer, &args.prompts[i % args.prompts.len()]))
        .collect::<Result<_>>()?;
    let cfg = E2Config {
        tokens: args.e2_tokens,
        runs: args.e2_runs,
    };
    println!(
        "\n== E2: 8 sequences decoding {} tokens each, together vs one after another ({} alternating runs) ==",
        cfg.tokens, cfg.runs
    );
    let report = e2_batched_decode(model, &prompts, &cfg, &mut |line| {
        println!("  {line}");
        flush();
    })?;
    println!("{report}");
    Ok(())
}

const SYSTEM_PROMPT: &str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face. \
You answer questions clearly and briefly, in plain English. If you are not sure about something, \
you say so instead of guessing.";

const FOLLOW_UPS: &[&str] = &[
    "Tell me a little more.",
    "Sum that up in one short sentence.",
    "Thank you!",
];

/// A chat server's `generate(prompt, n_predict, eos)`.
type Generate<'a> = dyn FnMut(&[u32], usize, Option<u32>) -> Result<TurnOutcome> + 'a;

fn chat_demo(
    caches: &str,
    tokenizer: &ChatTokenizer,
    args: &Args,
    generate: &mut Generate<'_>,
) -> Result<()> {
    let convs = args.conversations.min(args.prompts.len()).max(1);
    println!(
        "\n== prefix trie: {convs} conversations x {} turns, interleaved, one live sequence of {caches} ==",
        args.turns
    );
    let mut history: Vec<Vec<Message>> = vec![vec![Message::new(Role::System, SYSTEM_PROMPT)]; convs];
    let eos = tokenizer.eos_token_id();
    for turn in 0..args.turns {
        for (c, messages) in history.iter_mut().enumerate() {
            let user = if turn == 0 {
                args.prompts[c].clone()
            } else {
                FOLLOW_UPS[(turn - 1) % FOLLOW_UPS.len()].to_string()
            };
            messages.push(Message::new(Role::User, user.clone()));
            let prompt = tokenizer.encode(&chatml(messages, true))?;
            let out = generate(&prompt, args.max_new, Some(eos))?;
            let reply_tokens: Vec<u32> = out.generated.iter().copied().filter(|&t| t != eos).collect();
            let reply = tokenizer.decode(&reply_tokens)?.trim().to_string();
            println!(
                "  conversation {c} turn {}: {} prompt tokens, {} reused from the trie, {} evaluated; \
                 first token after {:.0} ms; {} tokens in {:.0} ms",
                turn + 1,
                out.prompt_tokens,
                out.matched,
                out.evaluated,
                out.time_to_first_token.as_secs_f64() * 1e3,
                out.generated.len(),
                out.total.as_secs_f64() * 1e3
            );
            println!("      user: {user}");
            println!("      assistant: {}", reply.replace('\n', "\n                 "));
            flush();
            messages.push(Message::new(Role::Assistant, reply));
        }
    }
    Ok(())
}

fn print_trie_stats(s: &TrieStats) {
    println!(
        "prefix trie: {} hits, {} misses, {} prompt tokens reused, {} evaluated; {} page-outs, {} page-ins; \
         {} nodes, {} snapshots, {:.1} MB paged out",
        s.hits,
        s.misses,
        s.reused_tokens,
        s.evaluated_tokens,
        s.page_outs,
        s.page_ins,
        s.nodes,
        s.snapshots,
        s.paged_out_bytes as f64 / 1e6
    );
}

/// `--backend mlx`: the prefix-trie chat on [`kvcache_engine::mlx`].
#[cfg(any(target_os = "macos", kvcache_mlx))]
mod mlx_chat {
    use std::path::Path;
    use std::time::Instant;

    use kvcache_engine::mlx::{MlxChatServer, MlxLlama};
    use kvcache_engine::{ChatTokenizer, ModelFile, Result};

    use super::{chat_demo, print_trie_stats, Args};

    /// Whether this build has the mlx backend.
    pub const AVAILABLE: bool = true;

    /// Loads the model on mlx (f32) and runs the chat demo through the trie.
    pub fn run(path: &Path, tokenizer: &ChatTokenizer, args: &Args) -> Result<()> {
        let t0 = Instant::now();
        let file = ModelFile::open(path)?;
        let mut progress = super::load_progress("loading weights into mlx-rs (F32)".into());
        let model = MlxLlama::load(&file, &mut progress)?;
        let device = mlx_rs::Device::try_default()
            .map(|d| format!("{d:?}"))
            .unwrap_or_else(|e| format!("<{e}>"));
        println!(
            "\nloaded the mlx model in {:.2} s (mlx default device: {device})",
            t0.elapsed().as_secs_f64()
        );
        let mut server = MlxChatServer::new(&model, 1 << 30)?;
        chat_demo(
            "mlx-rs KvCaches (kvcache-mlx)",
            tokenizer,
            args,
            &mut |prompt, n, eos| server.generate(prompt, n, eos),
        )?;
        print_trie_stats(&server.trie_stats());
        Ok(())
    }
}

/// Builds without mlx-rs (plain cargo on Linux) have no mlx backend.
#[cfg(not(any(target_os = "macos", kvcache_mlx)))]
mod mlx_chat {
    use std::path::Path;

    use kvcache_engine::{ChatTokenizer, Result};

    use super::Args;

    /// Whether this build has the mlx backend.
    pub const AVAILABLE: bool = false;

    /// Never called: `run` checks [`AVAILABLE`] first.
    pub fn run(_path: &Path, _tokenizer: &ChatTokenizer, _args: &Args) -> Result<()> {
        unreachable!("no mlx backend in this build")
    }
}

/// `--replica`: one engine process over the store the flags name, answering
/// commands on stdin (`kvcache_engine::replica`). Stdout carries only the answers.
fn replica_main(path: &Path, dev: &Device, args: &Args) -> Result<()> {
    let model = ModelFile::open(path)?.load(dev, args.weights, &mut |_| {})?;
    let trace = Trace::load(args.trace.clone().unwrap_or_else(paths::e1_trace_path))?;
    let options = StoreOptions {
        dir: args.store_dir.clone(),
        redis: args.redis.clone(),
    };
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    if options.dir.is_none() && options.redis.is_none() {
        let mut server = ChatServer::new(&model, Reuse::Trie, TRIE_BUDGET)?;
        return replica::serve(
            &model,
            &trace,
            &mut server,
            &|| {},
            args.e1_predict,
            stdin.lock(),
            stdout.lock(),
        );
    }
    let fingerprint = store::model_fingerprint(path, args.weights)?;
    let store = store::open(fingerprint, store::kv_layout(&model), &options)?;
    let mut server = ChatServer::with_store(&model, TRIE_BUDGET, store.clone(), STORE_DEADLINE)?;
    let flush = || store.flush();
    replica::serve(
        &model,
        &trace,
        &mut server,
        &flush,
        args.e1_predict,
        stdin.lock(),
        stdout.lock(),
    )
}

/// Paged-out snapshots a trie keeps in memory (the benchmarks' budget).
const TRIE_BUDGET: usize = 4 << 30;

/// How long a trie waits for the store before it evaluates instead.
const STORE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// The E1 trace's flags for replicas of this binary.
fn replica_setup<'a>(exe: &'a Path, path: &Path, args: &Args) -> ReplicaSetup<'a> {
    let trace = args.trace.clone().unwrap_or_else(paths::e1_trace_path);
    ReplicaSetup {
        exe,
        args: vec![
            "--model".into(),
            path.display().to_string(),
            "--trace".into(),
            trace.display().to_string(),
            "--e1-predict".into(),
            args.e1_predict.to_string(),
            "--device".into(),
            args.device.clone(),
        ],
    }
}

/// `--bench-e3` / `--bench-e4`: replicas of this binary over a shared store.
fn bench_store(path: &Path, args: &Args) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| EngineError::io(Path::new("current executable"), e))?;
    let setup = replica_setup(&exe, path, args);
    let trace = Trace::load(args.trace.clone().unwrap_or_else(paths::e1_trace_path))?;
    let mut log = |line: &str| {
        println!("  {line}");
        flush();
    };
    if args.bench_e3 {
        let dir = scratch_dir("e3")?;
        let report = e3_restart(&setup, &trace, args.e1_requests, args.e3_restart, &dir, &mut log);
        let _ = std::fs::remove_dir_all(&dir);
        println!("{}", report?);
    }
    if args.bench_e4 {
        println!(
            "{}",
            e4_replicas(&setup, &trace, args.e1_requests, 2 << 30, &mut log)?
        );
    }
    Ok(())
}

/// The store demo: a conversation of the E1 trace answered by one process,
/// which stops, and continued by a second process from the disk store.
fn store_demo(path: &Path, args: &Args) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| EngineError::io(Path::new("current executable"), e))?;
    let dir = args
        .store_dir
        .clone()
        .map_or_else(|| scratch_dir("store-demo"), Ok)?;
    println!(
        "\n== prefix store: a conversation continued by another process from the disk store in {} ==",
        dir.display()
    );
    let mut setup = replica_setup(&exe, path, args);
    setup
        .args
        .extend(["--store-dir".into(), dir.display().to_string()]);
    let trace = Trace::load(args.trace.clone().unwrap_or_else(paths::e1_trace_path))?;
    // Conversation 0's first three turns (requests 0, 10, 20 of the interleaved trace).
    let turns: Vec<usize> = trace
        .requests
        .iter()
        .filter(|r| r.conv == 0)
        .map(|r| r.idx)
        .take(3)
        .collect();
    let show = |who: &str, t: &kvcache_engine::replica::TurnLine| {
        let tiers: Vec<String> = t
            .tiers
            .iter()
            .map(|(tier, n)| format!("{n} from {tier}"))
            .collect();
        println!(
            "  {who}: turn {} of conversation {}: {} prompt tokens, {} restored from the store{}, {} evaluated; first token after {:.0} ms",
            t.turn,
            t.conv,
            t.prompt_tokens,
            t.restored,
            if tiers.is_empty() { String::new() } else { format!(" ({})", tiers.join(", ")) },
            t.evaluated,
            t.ttft_ms
        );
        flush();
    };
    let mut first = Replica::spawn(&exe, &setup.args, "first process")?;
    for &i in &turns[..turns.len() - 1] {
        show("process 1", &first.run(i)?);
    }
    first.stop()?;
    println!("  process 1 stopped; process 2 starts with an empty trie over the same directory");
    let mut second = Replica::spawn(&exe, &setup.args, "second process")?;
    show("process 2", &second.run(turns[turns.len() - 1])?);
    second.stop()?;
    if args.store_dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

fn scratch_dir(label: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvcache-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| EngineError::io(&dir, e))?;
    Ok(dir)
}

fn bench_e1(model: &Llama, args: &Args) -> Result<()> {
    let path = args.trace.clone().unwrap_or_else(paths::e1_trace_path);
    let trace = Trace::load(&path)?;
    let requests = args.e1_requests.min(trace.requests.len());
    println!(
        "\n== E1: {} of {} requests of {} ({} conversations x {} turns, round-robin), {} greedy tokens each ==",
        requests,
        trace.requests.len(),
        path.display(),
        trace.conversations.len(),
        trace.conversations.first().map_or(0, Vec::len),
        args.e1_predict
    );
    let mut reports = Vec::new();
    for name in &args.e1_policies {
        let reuse = match name.as_str() {
            "trie" => Reuse::Trie,
            "single" => Reuse::SingleEntry,
            "none" => Reuse::None,
            other => {
                return Err(EngineError::InvalidArgument(format!(
                    "--e1-policies: trie, single or none, got {other:?}"
                )))
            }
        };
        println!("-- {} --", reuse.name());
        let report = e1_chat_reuse(
            model,
            &trace,
            reuse,
            requests,
            args.e1_predict,
            4 << 30,
            &mut |row| {
                println!(
                "  request {:2} (conversation {}, turn {}): {:4} prompt tokens, {:4} reused, {:4} evaluated (min {:4}), TTFT {:7.1} ms",
                row.idx,
                row.conv,
                row.turn,
                row.outcome.prompt_tokens,
                row.outcome.matched,
                row.outcome.evaluated,
                row.min_prefill,
                row.outcome.time_to_first_token.as_secs_f64() * 1e3
            );
                flush();
            },
        )?;
        println!("{report}");
        reports.push(report);
    }
    println!(
        "\nE1 summary ({requests} requests, {} tokens generated each):",
        args.e1_predict
    );
    for r in &reports {
        println!("  {r}");
    }
    if let (Some(t), Some(n)) = (
        reports.iter().find(|r| r.reuse == Reuse::Trie),
        reports.iter().find(|r| r.reuse == Reuse::None),
    ) {
        println!(
            "  trie vs no reuse: median TTFT on turns >= 2 {:.1}x faster (target >= 5x); evaluated {:.3}x the minimum (target <= 1.01x)",
            n.median_ttft_later_turns().as_secs_f64() / t.median_ttft_later_turns().as_secs_f64().max(1e-9),
            t.evaluated() as f64 / t.min_prefill().max(1) as f64
        );
    }
    Ok(())
}
