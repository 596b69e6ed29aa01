//! `cargo xtask`: set-up and task runner for kvcache-rs. `cargo xtask help` says what it does.

mod cargo;
mod cuda;
mod dynamo_venv;
mod error;
mod files;
mod layout;
mod mlx_sys_patch;
mod mlx_wheel;
mod model;
mod openai_venv;
mod prepare;
mod python;
mod shell;
mod system_packages;
mod tasks;

use std::process::ExitCode;

use error::{bail, Result};
use layout::Layout;
use prepare::Model;

const HELP: &str = "\
cargo xtask <command> [args]

Commands:
  test [CARGO ARGS]    prepare, then every workspace test (all targets, then doc
                       tests), kvcache-mlx included, then xtask's own; with arguments
                       only what they pick, e.g. `-p kvcache-mlx --test mlx_link`
  lint                 cargo fmt --check, clippy -D warnings (MLX code included),
                       cargo doc with warnings denied; fmt and clippy of xtask itself
  prepare [--model]    set up what the build needs, idempotent: on Linux the Debian
                       packages (cmake libclang-dev libopenblas-dev, and redis-server
                       for kvcache-store's tests), the mlx-cpu wheel and the patched
                       mlx-sys; with --model the test model too
  bench [CARGO ARGS]   prepare, then cargo bench --workspace
  demo [DEMO ARGS]     prepare, then run crates/kvcache-demo in release mode
  serve [SERVER ARGS]  prepare, then run the OpenAI-compatible server
                       (crates/kvcache-server) in release mode on the model,
                       on 127.0.0.1:8080 unless told `--host H --port P`
  test-metal [ARGS]    kvcache-causal's tests on the Metal device (macOS)
  test-cuda [ARGS]     kvcache-causal's tests and the models' CUDA kernel on a GPU (needs nvcc)
  test-neon [ARGS]     the quantized kernels' tests on AArch64 (NEON): native on Arm, else
                       cross-built and run under qemu-user (installed when root)
  cuda-bundle          without a GPU: nvcc 13.0 from PyPI (cached), then the CUDA tests
                       and benches built and packed into target/cuda-bundle/ with the
                       run.sh that runs them on a GPU machine without Rust
                       (`bash target/cuda-bundle/run.sh`); `--target-dir DIR` to build
                       elsewhere, `--clippy` to lint the CUDA build too
  help                 this text

Downloads are cached in $KVCACHE_CACHE_DIR, else $XDG_CACHE_HOME/kvcache-rs, else
~/.cache/kvcache-rs. Tests get the model's path in $KVCACHE_MODEL (set it yourself to
use another file), and Gemma 3 270M's in $KVCACHE_GEMMA when it could be fetched
(tests that need it skip otherwise). Run from the repository root.
";

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprint!("{HELP}");
        return ExitCode::from(2);
    }
    let command = args.remove(0);
    // `cargo xtask test -- ARGS` and `cargo xtask test ARGS` mean the same.
    if args.first().is_some_and(|arg| arg == "--") {
        args.remove(0);
    }
    match run(&command, &args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask {command}: error: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: &str, args: &[String]) -> Result<()> {
    let task = match command {
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            return Ok(());
        }
        "prepare" => return prepare_command(args),
        "test" => tasks::test,
        "lint" => tasks::lint,
        "bench" => tasks::bench,
        "demo" => tasks::demo,
        "serve" => tasks::serve,
        "test-metal" => tasks::test_metal,
        "test-cuda" => tasks::test_cuda,
        "test-neon" => tasks::test_neon,
        "cuda-bundle" => cuda::bundle,
        other => bail!("unknown command `{other}`; run `cargo xtask help`"),
    };
    let layout = Layout::detect()?;
    let result = task(&layout, args);
    cargo::restore_lockfile(&layout.root);
    result
}

fn prepare_command(args: &[String]) -> Result<()> {
    let model = match args {
        [] => Model::NotNeeded,
        [flag] if flag == "--model" => Model::Needed,
        _ => bail!("prepare takes only `--model`"),
    };
    let layout = Layout::detect()?;
    prepare::prepare(&layout, model)?;
    println!("prepare: ready");
    Ok(())
}
