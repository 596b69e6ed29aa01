//! The one error type every cache operation returns.

use crate::{Pos, SeqId};

/// Result alias used throughout kvcache-rs.
pub type Result<T, E = CacheError> = std::result::Result<T, E>;

/// Everything a cache operation can reject.
///
/// Every variant except [`CacheError::Backend`] is caused by caller input, and an
/// operation that returns one of them leaves the cache exactly as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// No room for the batch even after compaction. Free sequences (or remove old
    /// tokens) and retry, or create the cache with more capacity.
    #[error(
        "KV cache full: {cells} cells, {used} in use, batch of {batch} does not fit \
         (remove finished sequences or raise capacity)"
    )]
    Full {
        /// Total number of cells in the cache.
        cells: usize,
        /// Cells holding at least one sequence.
        used: usize,
        /// Tokens in the rejected batch.
        batch: usize,
    },

    /// The operation is valid in general but not for this cache's configuration
    /// (for example a shifting removal without a shift function).
    #[error("not supported: {0}")]
    NotSupported(String),

    /// The batch itself is malformed (lengths differ, negative or duplicate
    /// positions, empty, larger than the cache's maximum batch).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),

    /// A sequence id at or beyond the cache's `max_sequences`.
    #[error("sequence {seq} out of range: the cache was configured for {max_sequences} sequences")]
    SequenceOutOfRange {
        /// The offending sequence id.
        seq: SeqId,
        /// The configured number of sequences (valid ids are `0..max_sequences`).
        max_sequences: usize,
    },

    /// A tensor's shape differs from what the cache expects or already stores.
    #[error("shape mismatch for {what}: expected {expected:?}, got {got:?}")]
    ShapeMismatch {
        /// Which tensor (`"keys"`, `"values"`, ...).
        what: &'static str,
        /// The expected dimensions.
        expected: Vec<usize>,
        /// The dimensions received.
        got: Vec<usize>,
    },

    /// A tensor's element type differs from the cache's storage type.
    #[error("dtype mismatch for {what}: the cache stores {expected}, got {got}")]
    DTypeMismatch {
        /// Which tensor (`"keys"`, `"values"`, ...).
        what: &'static str,
        /// The cache's dtype.
        expected: String,
        /// The dtype received.
        got: String,
    },

    /// A removal would shift cells that other sequences share (after
    /// `copy_prefix`); shifting them would corrupt the other sequences.
    #[error(
        "cannot shift sequence {seq}: position {pos} is shared with other sequences \
         (remove the sharing sequences first, or remove to the end instead)"
    )]
    SharedCellShift {
        /// The sequence being removed from.
        seq: SeqId,
        /// The first shared position that would have been shifted.
        pos: Pos,
    },

    /// The call is out of order, e.g. `put`/`get` before `start_forward`.
    #[error("invalid state: {0}")]
    InvalidState(String),

    /// Keys and values of another shape than the cache's (or the store's): another
    /// model, another number of layers or heads, another dtype.
    #[error("layout mismatch in {what}: expected {expected}, got {got}")]
    LayoutMismatch {
        /// The field that differs (`"layers"`, `"kv_heads"`, `"dtype"`, `"model"`, ...).
        what: &'static str,
        /// The cache's value.
        expected: String,
        /// The value received.
        got: String,
    },

    /// A namespace (a tenant's cache salt) that is empty, too long or has a
    /// character outside the allowed set; see `Namespace`.
    #[error("invalid namespace: {0}")]
    InvalidNamespace(String),

    /// Any other argument the cache rejects (an inverted range, a bad config value).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The tensor backend failed (out of memory, device error). The cache may have
    /// been partially updated; treat it as needing a reset.
    #[error("backend error: {0}")]
    Backend(String),
}

impl CacheError {
    /// Wraps any backend error.
    pub fn backend(err: impl std::fmt::Display) -> Self {
        CacheError::Backend(err.to_string())
    }
}
