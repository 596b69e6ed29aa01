//! Where the tests find the real model files, with one rule for every model:
//!
//! - the file is there: the test runs on it;
//! - it is missing and `CI` or `KVCACHE_REQUIRE_MODELS` is set (to anything
//!   but empty): the test **fails**, naming the file and how to get it (CI
//!   prepares every model, so a missing one there is a broken set-up);
//! - it is missing otherwise (a fresh clone, no network): the test **skips**,
//!   printing one `skipped: ...` line that says why.
//!
//! SmolLM2 is `$KVCACHE_MODEL` or the copy `cargo xtask prepare` caches
//! ([`kvcache_models::paths::model_path`]); Gemma 3 is `$KVCACHE_GEMMA`,
//! which `cargo xtask` sets when it could fetch the file.

use std::path::PathBuf;

use kvcache_models::{gemma, paths};

/// Environment variable that makes a missing model fail a test instead of
/// skipping it (as `CI` does).
pub const REQUIRE_ENV: &str = "KVCACHE_REQUIRE_MODELS";

/// The real models the tests run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestModel {
    /// SmolLM2-135M-Instruct (a Llama), `$KVCACHE_MODEL` or the cached copy.
    SmolLM2,
    /// Gemma 3 270M, `$KVCACHE_GEMMA`.
    Gemma3,
}

impl TestModel {
    /// The file, or why there is none.
    fn find(self) -> Result<PathBuf, String> {
        match self {
            TestModel::SmolLM2 => paths::model_path().ok_or_else(|| {
                format!(
                    "no SmolLM2 ({} unset and nothing cached; `cargo xtask prepare` fetches it)",
                    paths::MODEL_ENV
                )
            }),
            TestModel::Gemma3 => match std::env::var_os(gemma::GEMMA_ENV).filter(|p| !p.is_empty()) {
                Some(path) if PathBuf::from(&path).is_file() => Ok(PathBuf::from(path)),
                Some(path) => Err(format!(
                    "{}={} is not a file",
                    gemma::GEMMA_ENV,
                    PathBuf::from(path).display()
                )),
                None => Err(format!(
                    "no Gemma 3 ({} unset; `cargo xtask prepare` sets it when it can fetch Gemma)",
                    gemma::GEMMA_ENV
                )),
            },
        }
    }
}

/// Whether a missing model fails the test (`CI` or [`REQUIRE_ENV`] set).
pub fn models_required() -> bool {
    ["CI", REQUIRE_ENV]
        .iter()
        .any(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty()))
}

/// The file of `model` for a test, by the module's rule: `Some(path)` when it
/// is there, `None` after printing why the caller skips.
///
/// # Panics
/// When the file is missing and [`models_required`].
pub fn model_file(model: TestModel) -> Option<PathBuf> {
    match model.find() {
        Ok(path) => Some(path),
        Err(why) if models_required() => {
            panic!("{why}, but `CI` or {REQUIRE_ENV} requires every model: prepare them with `cargo xtask prepare`")
        }
        Err(why) => {
            println!("skipped: {why}");
            None
        }
    }
}
