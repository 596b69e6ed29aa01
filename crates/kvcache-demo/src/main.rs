//! `kvcache-demo`: SmolLM2-135M-Instruct (or, with `--model gemma3`, Gemma 3
//! 270M in the windowed parts) served through the kvcache-rs caches,
//! a thin program over `kvcache_engine`: parse the flags, run what they ask,
//! print it.
//!
//! Run through `cargo xtask demo [ARGS]`; `--help` lists the flags.

mod benchmarks;
mod cli;
mod gemma_parts;
mod mlx_chat;
mod parts;
mod progress;
mod replicas;
mod report;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use clap::Parser;
use kvcache_bench::replica::{self, ReplicaOptions};
use kvcache_engine::store::StoreOptions;
use kvcache_engine::{EngineError, Result};
use kvcache_models::loader::{self, Architecture, LoadedModel, ModelSource};
use kvcache_models::{gemma, paths, ChatTokenizer, Llama, LlamaConfig, WeightMode};

use crate::cli::{Backend, Cli, DeviceName, Mode, ModelChoice, Part};
use crate::replicas::Replicas;

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread starts.
    unsafe { kvcache_models::threads::tune_cpu_threads() };
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvcache-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> Result<()> {
    let start = Instant::now();
    let mlx = cli.model.backend == Backend::Mlx;
    if mlx && !mlx_chat::AVAILABLE {
        return Err(EngineError::InvalidArgument(
            "--backend mlx: this build has no mlx-rs; run it through `cargo xtask demo -- --backend mlx` \
             (Linux) or build on macOS"
                .into(),
        ));
    }
    let device = device(cli.model.device)?;
    let path = model_path(cli)?;
    let weights = cli
        .model
        .weights
        .unwrap_or_else(|| WeightMode::fastest_on(&device));
    weights.check_device(&device)?;
    let mode = cli.mode();
    let source = loader::open(&path)?;
    if source.architecture() == Architecture::Gemma3 {
        if mode != Mode::Demo || mlx {
            return Err(EngineError::InvalidArgument(
                "Gemma 3 runs the demo's windowed parts on candle; the benchmarks, --replica and \
                 --backend mlx run on SmolLM2"
                    .into(),
            ));
        }
        gemma_parts::run(&path, &device, weights, cli)?;
        println!("\ndone in {:.1} s", start.elapsed().as_secs_f64());
        return Ok(());
    }
    match mode {
        Mode::Replica => return serve_replica(&path, device, weights, cli),
        Mode::StoreBench => return benchmarks::store(&replicas(&path, cli, weights)?.setup(), cli),
        Mode::E1 | Mode::E2 | Mode::Demo => {}
    }
    let (model, tokenizer) = load(source, &device, weights)?;
    if mlx && mode != Mode::Demo {
        println!("note: --backend mlx applies to the chat demo; the benchmarks measure the candle engine");
    }
    match mode {
        Mode::E1 => benchmarks::e1(&model, cli),
        Mode::E2 => benchmarks::e2(&model, &tokenizer, cli),
        _ => {
            demo(&path, &model, &tokenizer, cli, weights)?;
            println!("\ndone in {:.1} s", start.elapsed().as_secs_f64());
            Ok(())
        }
    }
}

/// The demo's parts in order, but those `--skip` names.
fn demo(path: &Path, model: &Llama, tokenizer: &ChatTokenizer, cli: &Cli, weights: WeightMode) -> Result<()> {
    let mlx = cli.model.backend == Backend::Mlx;
    if !cli.skips(Part::Chat) {
        if mlx {
            mlx_chat::run(path, tokenizer, cli)?;
        } else {
            parts::chat(model, tokenizer, cli)?;
        }
    }
    if !cli.skips(Part::Store) {
        parts::store(&replicas(path, cli, weights)?.setup(), cli)?;
    }
    let candle_parts = [Part::Batching, Part::Window, Part::Shift];
    if mlx && candle_parts.iter().any(|&p| !cli.skips(p)) {
        println!(
            "\n(--backend mlx: the parts below run on candle through kvcache-causal, the multi-sequence \
             cache, which has no mlx-rs storage; the mlx backend is the prefix trie above)"
        );
    }
    if !cli.skips(Part::Batching) {
        parts::batching(model, tokenizer, cli)?;
    }
    if !cli.skips(Part::Window) {
        parts::window(model, tokenizer, cli)?;
    }
    if !cli.skips(Part::Shift) {
        parts::shift(model, tokenizer, cli)?;
    }
    Ok(())
}

/// The file `--model` names, else the prepared SmolLM2.
fn model_path(cli: &Cli) -> Result<PathBuf> {
    match &cli.model.model {
        Some(ModelChoice::File(path)) => Ok(path.clone()),
        Some(ModelChoice::Gemma3) => std::env::var_os(gemma::GEMMA_ENV)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .ok_or_else(|| {
                EngineError::InvalidArgument(format!(
                    "--model gemma3: {} is unset; run through `cargo xtask demo --model gemma3`, which \
                     fetches Gemma 3 270M and sets it",
                    gemma::GEMMA_ENV
                ))
            }),
        None => paths::model_path().ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "no model: pass --model, set {}, or run `cargo xtask prepare`",
                paths::MODEL_ENV
            ))
        }),
    }
}

fn device(name: DeviceName) -> Result<Device> {
    match name {
        DeviceName::Cpu => Ok(Device::Cpu),
        DeviceName::Cuda => Device::new_cuda(0).map_err(|e| {
            EngineError::InvalidArgument(format!(
                "--device cuda: {e} (build with `--features cuda` and the CUDA toolkit)"
            ))
        }),
        DeviceName::Metal => Device::new_metal(0)
            .map_err(|e| EngineError::InvalidArgument(format!("--device metal: {e} (macOS only)"))),
    }
}

/// The Llama of `source` (the loader's) and its tokenizer, saying what it
/// loads.
fn load(source: ModelSource, device: &Device, weights: WeightMode) -> Result<(Llama, Arc<ChatTokenizer>)> {
    let t0 = Instant::now();
    let c = LlamaConfig::from_gguf_metadata(source.gguf().metadata())?;
    println!(
        "model: {} ({} tensors)",
        source.path().display(),
        source.gguf().tensor_count()
    );
    println!(
        "config: {} layers, dim {}, {} heads / {} KV heads of {}, FFN {}, vocab {}, rope base {}",
        c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size, c.rope_base
    );
    let (bar, mut on_load) = progress::loading(&format!("loading weights ({weights})"));
    let loaded = source.load(device, weights, &mut on_load);
    bar.finish_and_clear();
    let LoadedModel::Llama { model, tokenizer } = loaded?.model else {
        return Err(EngineError::InvalidArgument(
            "the benchmarks and the chat demo run on a Llama".into(),
        ));
    };
    println!(
        "loaded model ({weights} weights) and tokenizer ({} tokens) in {:.2} s",
        tokenizer.vocab_size(),
        t0.elapsed().as_secs_f64()
    );
    Ok((model, tokenizer))
}

/// `--replica`: one engine process answering commands on stdin; stdout
/// carries only the answers.
fn serve_replica(path: &Path, device: Device, weights: WeightMode, cli: &Cli) -> Result<()> {
    let options = ReplicaOptions {
        model: path.to_owned(),
        device,
        weights,
        trace: cli.trace_path(),
        n_predict: cli.bench.e1_predict,
        store: StoreOptions {
            dir: cli.store.store_dir.clone(),
            redis: cli.store.redis.clone(),
        },
    };
    replica::run_process(&options, std::io::stdin().lock(), std::io::stdout().lock())
}

/// Replicas of this binary with this run's model, trace, tokens, device and weights.
fn replicas(path: &Path, cli: &Cli, weights: WeightMode) -> Result<Replicas> {
    Ok(Replicas {
        exe: parts::current_exe()?,
        model: path.to_owned(),
        trace: cli.trace_path(),
        n_predict: cli.bench.e1_predict,
        device: cli.model.device.as_flag(),
        weights,
    })
}
