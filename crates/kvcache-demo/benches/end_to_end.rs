//! E1 and E2 of BENCHMARKS.md with the real model (`cargo xtask bench`, or
//! `cargo bench -p kvcache-demo`). Needs the model (`$KVCACHE_MODEL` or the
//! download cache); without it, prints one line and exits.
//!
//! Knobs: `KVCACHE_E1_REQUESTS` (default 80), `KVCACHE_E1_PREDICT` (default 32),
//! `KVCACHE_E1_POLICIES` (default `trie,single,none`), `KVCACHE_E2_RUNS` (default 5),
//! `KVCACHE_E2_TOKENS` (default 32), `KVCACHE_BENCH` (a comma-separated list of `e1`, `e2`,
//! `e3`, `e4`; default all), `KVCACHE_E1_VERBOSE=1` (a line per request and policy).
//! E3 and E4 (the store across processes) start replicas of the demo binary; E4 needs
//! `redis-server` on `PATH` (`cargo xtask prepare` installs it).
//!
//! E1 alternates the policies request by request (one server each, in one process),
//! so their times to first token are taken under the same machine load.

#[path = "../src/replicas.rs"]
mod replicas;

use candle_core::Device;
use kvcache_bench::bench::{
    e1_chat_reuse_interleaved, e2_batched_decode, E1Verdict, E2Config, SAMPLE_QUESTIONS,
};
use kvcache_bench::store_bench::{e3_restart, e4_replicas};
use kvcache_bench::trace::Trace;
use kvcache_engine::chat::Reuse;
use kvcache_models::{paths, ModelFile, WeightMode};
use replicas::Replicas;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: first thing in main, before any thread starts.
    unsafe { kvcache_models::threads::tune_cpu_threads() };
    let Some(path) = paths::model_path() else {
        println!(
            "end_to_end: skipped (no model: set {} or run `cargo xtask prepare`)",
            paths::MODEL_ENV
        );
        return Ok(());
    };
    let which = std::env::var("KVCACHE_BENCH").unwrap_or_default();
    let wanted = |name: &str| which.is_empty() || which.split(',').any(|w| w == name);
    let file = ModelFile::open(&path)?;
    let model = file.load(&Device::Cpu, WeightMode::F32, &mut |_| {})?;
    let tokenizer = file.tokenizer()?;
    println!(
        "model {} (f32 weights, CPU, {} threads)",
        path.display(),
        candle_core::utils::get_num_threads()
    );

    if wanted("e2") {
        let prompts = SAMPLE_QUESTIONS
            .iter()
            .map(|q| tokenizer.encode_user(q))
            .collect::<Result<Vec<_>, _>>()?;
        let cfg = E2Config {
            tokens: knob("KVCACHE_E2_TOKENS", 32),
            runs: knob("KVCACHE_E2_RUNS", 5),
        };
        let report = e2_batched_decode(&model, &prompts, &cfg, &mut |l| println!("  {l}"))?;
        println!("{report}");
    }
    if wanted("e1") {
        let trace = Trace::load(paths::e1_trace_path())?;
        let requests = knob("KVCACHE_E1_REQUESTS", 80);
        let predict = knob("KVCACHE_E1_PREDICT", 32);
        let policies = std::env::var("KVCACHE_E1_POLICIES").unwrap_or_else(|_| "trie,single,none".into());
        let verbose = std::env::var("KVCACHE_E1_VERBOSE").is_ok_and(|v| v == "1");
        let reuses = policies
            .split(',')
            .map(|name| match name {
                "trie" => Ok(Reuse::Trie),
                "single" => Ok(Reuse::SingleEntry),
                "none" => Ok(Reuse::None),
                other => Err(format!("unknown policy {other:?}")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        println!(
            "E1: {requests} requests x {predict} generated tokens, policies {policies} alternating per request"
        );
        let reports = e1_chat_reuse_interleaved(
            &model,
            &trace,
            &reuses,
            requests,
            predict,
            4 << 30,
            &mut |reuse, row| {
                if verbose {
                    println!(
                    "  {:<12} request {:2} (conversation {}, turn {}): {:4} prompt tokens, {:4} evaluated (min {:4}), TTFT {:7.1} ms",
                    reuse.name(),
                    row.idx,
                    row.conv,
                    row.turn,
                    row.outcome.prompt_tokens,
                    row.outcome.evaluated,
                    row.min_prefill,
                    row.outcome.time_to_first_token.as_secs_f64() * 1e3
                );
                }
            },
        )?;
        for r in &reports {
            println!("E1 {r}");
        }
        if let Some(verdict) = E1Verdict::from_reports(&reports) {
            println!("E1 {verdict}");
        }
    }
    if wanted("e3") || wanted("e4") {
        store_benches(&path, &wanted)?;
    }
    Ok(())
}

/// E3 and E4: replicas of the demo binary sharing a store.
fn store_benches(
    model: &std::path::Path,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let trace_path = paths::e1_trace_path();
    let trace = Trace::load(&trace_path)?;
    let requests = knob("KVCACHE_E1_REQUESTS", 80);
    let predict = knob("KVCACHE_E1_PREDICT", 32);
    let replicas = Replicas {
        exe: env!("CARGO_BIN_EXE_kvcache-demo").into(),
        model: model.to_owned(),
        trace: trace_path,
        n_predict: predict,
        device: "cpu",
        weights: WeightMode::F32,
    };
    let setup = replicas.setup();
    let verbose = std::env::var("KVCACHE_E1_VERBOSE").is_ok_and(|v| v == "1");
    let mut log = |line: &str| {
        if verbose {
            println!("  {line}");
        }
    };
    if wanted("e3") {
        let dir = tempfile_dir("e3")?;
        let report = e3_restart(
            &setup,
            &trace,
            requests,
            knob("KVCACHE_E3_RESTART", 40),
            &dir,
            &mut log,
        )?;
        std::fs::remove_dir_all(&dir)?;
        println!("{report}");
    }
    if wanted("e4") {
        let report = e4_replicas(&setup, &trace, requests, 2 << 30, &mut log)?;
        println!("{report}");
    }
    Ok(())
}

fn tempfile_dir(label: &str) -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvcache-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
