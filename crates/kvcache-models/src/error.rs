//! The crate's error type.

use kvcache_api::CacheError;

/// Result alias used throughout the models crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Everything loading, tokenizing or running a model can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// An mlx-rs operation failed (the `mlx` backend).
    #[error("mlx error: {0}")]
    Mlx(String),
    /// The KV cache rejected an operation.
    #[error("cache error: {0}")]
    Cache(#[from] CacheError),
    /// Reading a file failed.
    #[error("io error on {path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The model file lacks something or holds something unexpected.
    #[error("bad model file: {0}")]
    Format(String),
    /// The file's header names an architecture the loader does not build
    /// (`crate::loader`: `llama`, `gemma3`), or none.
    #[error("{path}: architecture {} is not one this build loads (llama, gemma3)", found.as_deref().map_or("(none)".to_string(), |a| format!("{a:?}")))]
    UnknownArchitecture {
        /// The file.
        path: String,
        /// What `general.architecture` says, if anything.
        found: Option<String>,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// Invalid input from the caller (a token outside the vocabulary, a bad
    /// shape, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl ModelError {
    /// An I/O error on `path`.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// Converts a candle error into a cache error, for [`kvcache_api::KeyShift`] closures.
pub(crate) fn to_cache_err(e: candle_core::Error) -> CacheError {
    CacheError::backend(e)
}
