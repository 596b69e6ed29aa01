//! The one error type of the store: what a tier or the store's set-up can fail with.
//!
//! Reads never surface these to a [`PrefixStore`](kvcache_api::PrefixStore) caller:
//! the store counts them and answers what it found so far. They reach callers
//! from constructors (a directory that cannot be opened, a tier built for another
//! model) and from the [`Tier`](crate::Tier) methods used directly.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Everything the store and its tiers can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A configuration value is out of range (a zero block size, say).
    #[error("invalid store configuration: {0}")]
    Config(String),

    /// A tier was built for another model, layout or block size than the store
    /// it is given to.
    #[error("tier `{tier}` was built for another {what} than the store")]
    TierMismatch {
        /// The tier's name.
        tier: &'static str,
        /// What differs: `fingerprint`, `layout` or `block size`.
        what: &'static str,
    },

    /// A file system operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`create`, `rename`, `read`, ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The Redis server could not be reached or refused a command.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),

    /// The tier is not trying for now (a connection attempt failed moments ago).
    #[error("tier `{0}` unavailable: its last connection attempt failed moments ago")]
    Unavailable(&'static str),

    /// The deadline passed before the tier answered.
    #[error("deadline passed")]
    Timeout,

    /// A stored entry is damaged or does not belong to this store (the tier
    /// treats it as a miss and, where it can, removes it).
    #[error("bad entry: {0}")]
    Corrupt(String),

    /// Keys and values did not fit the layout they were given with.
    #[error(transparent)]
    Cache(#[from] kvcache_api::CacheError),

    /// The background writer thread could not be started.
    #[error("cannot start the store's writer thread: {0}")]
    Spawn(#[source] std::io::Error),
}

impl StoreError {
    /// An [`Io`](StoreError::Io) error for `op` on `path`.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
