//! Gemma 3 (the 270M model as GGUF) on candle: a model with two kinds of
//! layers, sliding-window and global, through [`kvcache_causal::LayerGroupCache`].
//!
//! - [`config`]: the hyper-parameters, the header's and the implicit ones.
//! - [`tokenizer`]: the SentencePiece-style tokenizer of the GGUF and the turn format.
//! - [`model`]: the forward pass, full recompute, through a cache, and through
//!   per-layer caches ([`GemmaLayer`]) for the prefix trie.

pub mod config;
pub mod model;
pub mod tokenizer;

pub use config::{Activation, GemmaConfig};
pub use model::{causal_mask, Attend, Gemma, GemmaFile, GemmaLayer};
pub use tokenizer::{chat_turn, GemmaTokenizer, TokenKind};

use std::path::PathBuf;

/// Environment variable holding the Gemma file's path (`cargo xtask` sets it
/// when it could prepare the model).
pub const GEMMA_ENV: &str = "KVCACHE_GEMMA";

/// The Gemma file for tests and benchmarks: `$KVCACHE_GEMMA` when it names a
/// file, else `None` after printing why the caller skips.
///
/// Kept for the server's tests until they move to
/// `kvcache_testkit::models::model_file`, the one skip-or-fail rule.
pub fn gemma_path_for_tests() -> Option<PathBuf> {
    match std::env::var_os(GEMMA_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
    {
        Some(path) if path.is_file() => Some(path),
        Some(path) => {
            println!("skipped: {GEMMA_ENV}={} is not a file", path.display());
            None
        }
        None => {
            println!(
                "skipped: {GEMMA_ENV} unset (`cargo xtask prepare --model` sets it when it can fetch Gemma)"
            );
            None
        }
    }
}
