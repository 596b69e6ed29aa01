//! Where the model file and the fixtures are.

use std::path::PathBuf;

/// Environment variable holding the model's path (`cargo xtask` sets it).
pub const MODEL_ENV: &str = "KVCACHE_MODEL";

/// The model file name inside the download cache.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model path: `$KVCACHE_MODEL` if set, else where `cargo xtask prepare`
/// caches it (`$KVCACHE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvcache-rs`, else
/// `~/.cache/kvcache-rs`, then `models/SmolLM2-135M-Instruct.Q4_1.gguf`).
/// `None` when neither is set nor present.
pub fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(MODEL_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("KVCACHE_CACHE_DIR")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .filter(|p| !p.is_empty())
                .map(|p| PathBuf::from(p).join("kvcache-rs"))
        })
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kvcache-rs")))?;
    let path = cache.join("models").join(MODEL_FILE);
    path.is_file().then_some(path)
}

/// The project's copy of the E1 trace (`fixtures/e1_trace.json` at the repository root).
pub fn e1_trace_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/e1_trace.json")
}

/// A new directory `kvcache-LABEL-PID` under the system's temporary directory,
/// for a run's scratch files (a benchmark's store); the caller removes it.
pub fn scratch_dir(label: &str) -> crate::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvcache-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| crate::ModelError::io(&dir, e))?;
    Ok(dir)
}
