//! The crate's error type.

use kvcache_api::CacheError;

/// Result alias used throughout the engine crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Everything loading, tokenizing or running the model can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// An mlx-rs operation failed (the `mlx` backend).
    #[error("mlx error: {0}")]
    Mlx(String),
    /// The KV cache rejected an operation.
    #[error("cache error: {0}")]
    Cache(#[from] CacheError),
    /// The prefix store could not be opened.
    #[error("store error: {0}")]
    Store(#[from] kvcache_store::StoreError),
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
    /// Building or running the tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// Invalid input from the caller (a bad flag, an empty prompt, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl EngineError {
    /// An I/O error on `path`.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// Converts a candle error into a cache error, for [`kvcache_api::KeyShift`] closures.
pub(crate) fn to_cache_err(e: candle_core::Error) -> CacheError {
    CacheError::backend(e)
}
