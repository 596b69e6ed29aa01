//! The commands that run cargo on the main workspace. Each is one function:
//! prepare what it needs, then run cargo with the prepared flags.

use std::process::Command;

use crate::cargo::Cargo;
use crate::error::{bail, Result};
use crate::layout::Layout;
use crate::prepare::{prepare, prepare_model_only, Model};
use crate::shell;

/// Every test of the workspace (all targets, then doc tests), kvcache-mlx included,
/// then xtask's own unless arguments narrow the run.
/// `--no-fail-fast`: report every failing test binary, not only the first.
pub fn test(layout: &Layout, args: &[String]) -> Result<()> {
    let mut cargo = prepare(layout, Model::Needed)?;
    // kvcache-store's Redis tests fail rather than skip where prepare installed redis-server.
    cargo.set_env(
        "KVCACHE_REQUIRE_REDIS",
        if cfg!(target_os = "linux") { "1" } else { "0" },
    );
    // The models' CUDA kernel runs on the CPU through a C++ shim; MLX's build
    // needs the same compiler, so a missing one is a failure, not a skip.
    cargo.set_env("KVCACHE_REQUIRE_CXX", "1");
    // kvcache-server's smoke test runs the official Python `openai` client.
    let python = crate::openai_venv::ensure(&layout.cache)?;
    cargo.set_env(crate::openai_venv::PYTHON_ENV, python);
    cargo.set_env(crate::openai_venv::REQUIRE_ENV, "1");
    // kvcache-events' test subscribes NVIDIA Dynamo's KV indexer (Linux wheels only).
    if crate::dynamo_venv::supported() {
        let python = crate::dynamo_venv::ensure(&layout.cache)?;
        cargo.set_env(crate::dynamo_venv::PYTHON_ENV, python);
        cargo.set_env(crate::dynamo_venv::REQUIRE_ENV, "1");
    }
    let chosen = Chosen::scan(args);
    if chosen.targets {
        return cargo.run(&chosen.command(&["test", "--no-fail-fast"], args));
    }
    // Every target but the benchmarks, which `cargo test` would run in full
    // (they have their own harness); clippy still compiles them. Doc tests
    // need a run of their own.
    let targets = ["--lib", "--bins", "--tests", "--examples"];
    cargo.run(&chosen.command(&[&["test", "--no-fail-fast"][..], &targets[..]].concat(), args))?;
    cargo.run(&chosen.command(&["test", "--no-fail-fast", "--doc"], args))?;
    // xtask is a workspace of its own (its tests run the CUDA bundle's script, for one).
    if args.is_empty() {
        cargo.run_plain(&["test", "--manifest-path", XTASK_MANIFEST])?;
    }
    Ok(())
}

/// xtask's own manifest: a workspace apart from the main one.
const XTASK_MANIFEST: &str = "xtask/Cargo.toml";

/// Formatting, clippy (with the MLX code on) and rustdoc, all warnings denied;
/// formatting and clippy of xtask itself.
pub fn lint(layout: &Layout, args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("lint takes no arguments");
    }
    let cargo = prepare(layout, Model::NotNeeded)?;
    cargo.run_plain(&["fmt", "--all", "--check"])?;
    cargo.run_plain(&["fmt", "--manifest-path", XTASK_MANIFEST, "--check"])?;
    cargo.run(&strings(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    cargo.run_with_rustdocflags(
        &strings(&["doc", "--workspace", "--no-deps"]),
        &["-D", "warnings"],
    )?;
    cargo.run_plain(&[
        "clippy",
        "--manifest-path",
        XTASK_MANIFEST,
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    Ok(())
}

/// `cargo bench` over the workspace; extra arguments go to cargo.
pub fn bench(layout: &Layout, args: &[String]) -> Result<()> {
    let cargo = prepare(layout, Model::Needed)?;
    cargo.run(&Chosen::scan(args).command(&["bench"], args))
}

/// The demo program (crates/kvcache-demo); extra arguments go to the demo.
pub fn demo(layout: &Layout, args: &[String]) -> Result<()> {
    const DEMO: &str = "kvcache-demo";
    let dir = layout.root.join("crates").join(DEMO);
    let has_binary = dir.join("src/main.rs").is_file()
        || dir.join("src/bin").is_dir()
        || std::fs::read_to_string(dir.join("Cargo.toml")).is_ok_and(|toml| toml.contains("[[bin]]"));
    if !has_binary {
        bail!("the demo is not built yet: crates/{DEMO} has no binary");
    }
    let cargo = prepare(layout, Model::Needed)?;
    if asks_for_gemma(args) && cargo.env(crate::model::GEMMA_ENV).is_none() {
        bail!("demo --model gemma3: Gemma 3 270M could not be prepared (the reason is above)");
    }
    let mut run = strings(&["run", "--release", "-p", DEMO, "--"]);
    run.extend_from_slice(args);
    cargo.run(&run)
}

/// Whether the demo's or the server's arguments name Gemma 3 (`--model
/// gemma3`), which they then need rather than merely get when it can be fetched.
fn asks_for_gemma(args: &[String]) -> bool {
    let gemma = |name: &str| matches!(name, "gemma3" | "gemma");
    args.iter()
        .enumerate()
        .any(|(i, arg)| match arg.strip_prefix("--model=") {
            Some(name) => gemma(name),
            None => arg == "--model" && args.get(i + 1).is_some_and(|name| gemma(name)),
        })
}

/// The OpenAI-compatible server (crates/kvcache-server) in release mode on the
/// prepared model; extra arguments go to the server.
pub fn serve(layout: &Layout, args: &[String]) -> Result<()> {
    let cargo = prepare(layout, Model::Needed)?;
    if asks_for_gemma(args) && cargo.env(crate::model::GEMMA_ENV).is_none() {
        bail!("serve --model gemma3: Gemma 3 270M could not be prepared (the reason is above)");
    }
    let mut run = strings(&["run", "--release", "-p", "kvcache-server", "--"]);
    run.extend_from_slice(args);
    cargo.run(&run)
}

/// The candle-backed tests on Apple's Metal device (macOS only).
pub fn test_metal(layout: &Layout, args: &[String]) -> Result<()> {
    if !cfg!(target_os = "macos") {
        bail!(
            "test-metal needs macOS (Metal); this machine runs {}",
            std::env::consts::OS
        );
    }
    device_tests(layout, "metal", &[], args)
}

/// The candle-backed tests on an NVIDIA GPU (needs the CUDA toolkit).
pub fn test_cuda(layout: &Layout, args: &[String]) -> Result<()> {
    if !shell::on_path("nvcc") {
        bail!("test-cuda needs the CUDA toolkit: nvcc is not on PATH");
    }
    device_tests(layout, "cuda", &["--features", "cuda"], args)?;
    // The models' CUDA paged-attention kernel against the dense reference.
    let mut cargo = prepare_model_only(layout)?;
    cargo.set_env("KVCACHE_DEVICE", "cuda");
    let mut run = strings(&[
        "test",
        "-p",
        "kvcache-models",
        "--features",
        "cuda",
        "--test",
        "paged_attention",
    ]);
    run.extend_from_slice(args);
    cargo.run(&run)
}

/// The quantized kernels' tests on AArch64, where the NEON kernels run: native
/// on an Arm machine; elsewhere cross-built and run under qemu's user-mode
/// emulator (Debian's `qemu-user` and `gcc-aarch64-linux-gnu`, installed when
/// run as root), which checks that they give the scalar kernel's bits but
/// says nothing of their speed.
pub fn test_neon(layout: &Layout, args: &[String]) -> Result<()> {
    const TARGET: &str = "aarch64-unknown-linux-gnu";
    let tests = [
        "--test",
        "quant_product",
        "--test",
        "quant_invariance",
        "--test",
        "quant_conversions",
    ];
    let mut cargo = Cargo::plain(&layout.root);
    let mut run = strings(&["test", "--release", "-p", "kvcache-models"]);
    run.extend(strings(&tests));
    if std::env::consts::ARCH != "aarch64" {
        crate::system_packages::ensure_extra(
            "test-neon",
            &["qemu-user", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"],
        )?;
        shell::run(Command::new("rustup").args(["target", "add", TARGET]))?;
        cargo.set_env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
            "aarch64-linux-gnu-gcc",
        );
        cargo.set_env("CC_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-gcc");
        cargo.set_env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
            "qemu-aarch64 -L /usr/aarch64-linux-gnu",
        );
        let target_dir = layout.root.join("target").join("aarch64");
        run.extend(strings(&["--target", TARGET, "--target-dir"]));
        run.push(target_dir.to_string_lossy().into_owned());
    }
    run.extend_from_slice(args);
    cargo.run(&run)
}

/// kvcache-causal's tests with `KVCACHE_DEVICE` set, which they read to pick the device.
fn device_tests(layout: &Layout, device: &str, features: &[&str], args: &[String]) -> Result<()> {
    let mut cargo = prepare_model_only(layout)?;
    cargo.set_env("KVCACHE_DEVICE", device);
    let mut run = strings(&["test", "-p", "kvcache-causal"]);
    run.extend(strings(features));
    run.extend_from_slice(args);
    cargo.run(&run)
}

fn strings(words: &[&str]) -> Vec<String> {
    words.iter().map(|word| word.to_string()).collect()
}

/// Which selections the caller's cargo arguments already make.
struct Chosen {
    /// `-p`, `--package`, `--workspace`, `--exclude`: leave out our `--workspace`.
    packages: bool,
    /// `--lib`, `--test NAME`, `--doc`, ...: leave out our target list and the doc-test run.
    targets: bool,
}

impl Chosen {
    fn scan(args: &[String]) -> Self {
        // Arguments after `--` belong to the test harness, not to cargo.
        let cargo_args = args.iter().take_while(|arg| arg.as_str() != "--");
        let mut chosen = Self {
            packages: false,
            targets: false,
        };
        for arg in cargo_args {
            let arg = arg.as_str();
            let flag = arg.split('=').next().unwrap_or(arg);
            if arg.starts_with("-p") || matches!(flag, "--package" | "--workspace" | "--all" | "--exclude") {
                chosen.packages = true;
            }
            if matches!(
                flag,
                "--lib"
                    | "--bin"
                    | "--bins"
                    | "--test"
                    | "--tests"
                    | "--example"
                    | "--examples"
                    | "--bench"
                    | "--benches"
                    | "--all-targets"
                    | "--doc"
            ) {
                chosen.targets = true;
            }
        }
        chosen
    }

    /// `words`, then `--workspace` unless the caller chose packages, then `args`.
    fn command(&self, words: &[&str], args: &[String]) -> Vec<String> {
        let mut command = strings(words);
        if !self.packages {
            command.push("--workspace".to_owned());
        }
        command.extend_from_slice(args);
        command
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(args: &[&str]) -> (bool, bool) {
        let chosen = Chosen::scan(&strings(args));
        (chosen.packages, chosen.targets)
    }

    #[test]
    fn selections_are_detected() {
        assert_eq!(scan(&[]), (false, false));
        assert_eq!(scan(&["-p", "kvcache-mlx", "--test", "mlx_link"]), (true, true));
        assert_eq!(scan(&["--package=kvcache-api"]), (true, false));
        assert_eq!(scan(&["--release", "--", "--test", "-p"]), (false, false));
        assert_eq!(scan(&["--doc"]), (false, true));
    }

    #[test]
    fn the_demo_asks_for_gemma_by_name_only() {
        let asks = |args: &[&str]| asks_for_gemma(&strings(args));
        assert!(asks(&["--model", "gemma3"]));
        assert!(asks(&["--skip", "shift", "--model=gemma"]));
        assert!(!asks(&[]));
        assert!(!asks(&["--model", "gemma3.gguf"]));
        assert!(!asks(&["--prompt", "gemma3", "--model"]));
    }
}
