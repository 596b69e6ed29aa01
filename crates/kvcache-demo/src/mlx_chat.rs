//! `--backend mlx`: the prefix-trie chat on `kvcache_engine::mlx`, in builds
//! that have mlx-rs (macOS, or Linux through `cargo xtask`).

use std::path::Path;

use kvcache_engine::Result;
use kvcache_models::ChatTokenizer;

use crate::cli::Cli;

/// Whether this build has the mlx backend.
pub const AVAILABLE: bool = cfg!(any(target_os = "macos", kvcache_mlx));

/// Loads the model on mlx (f32) and runs the chat's conversations through the trie.
#[cfg(any(target_os = "macos", kvcache_mlx))]
pub fn run(path: &Path, tokenizer: &ChatTokenizer, cli: &Cli) -> Result<()> {
    use std::time::Instant;

    use kvcache_engine::chat::Reuse;
    use kvcache_engine::mlx::MlxChat;
    use kvcache_models::mlx::MlxLlama;
    use kvcache_models::ModelFile;

    use crate::{parts, progress, report};

    let t0 = Instant::now();
    let file = ModelFile::open(path)?;
    let (bar, mut on_load) = progress::loading("loading weights into mlx-rs (F32)");
    let model = MlxLlama::load(&file, &mut on_load);
    bar.finish_and_clear();
    let model = model?;
    let device = mlx_rs::Device::try_default()
        .map(|d| format!("{d:?}"))
        .unwrap_or_else(|e| format!("<{e}>"));
    println!(
        "loaded the mlx model in {:.2} s (mlx default device: {device})",
        t0.elapsed().as_secs_f64()
    );
    let mut chat = MlxChat::new(&model, Reuse::Trie, 1 << 30)?;
    parts::conversations(
        "mlx-rs KvCaches (kvcache-mlx)",
        tokenizer,
        cli,
        &mut |prompt, n, eos| chat.generate(prompt, n, eos),
    )?;
    report::trie_stats(&chat.trie_stats().expect("a trie chat"));
    Ok(())
}

/// Never called: the caller checks [`AVAILABLE`] first.
#[cfg(not(any(target_os = "macos", kvcache_mlx)))]
pub fn run(_path: &Path, _tokenizer: &ChatTokenizer, _cli: &Cli) -> Result<()> {
    unreachable!("no mlx backend in this build")
}
