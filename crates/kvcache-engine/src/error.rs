//! The crate's error type.

use kvcache_api::CacheError;
use kvcache_models::ModelError;

/// Result alias used throughout the engine crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Everything the engine can fail with: a model's errors (one variant each,
/// as [`ModelError`] has them) and the prefix store's.
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

impl From<ModelError> for EngineError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Candle(e) => EngineError::Candle(e),
            ModelError::Mlx(e) => EngineError::Mlx(e),
            ModelError::Cache(e) => EngineError::Cache(e),
            ModelError::Io { path, source } => EngineError::Io { path, source },
            ModelError::Format(e) => EngineError::Format(e),
            e @ ModelError::UnknownArchitecture { .. } => EngineError::Format(e.to_string()),
            ModelError::Tokenizer(e) => EngineError::Tokenizer(e),
            ModelError::InvalidArgument(e) => EngineError::InvalidArgument(e),
        }
    }
}
