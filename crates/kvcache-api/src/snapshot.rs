//! The snapshot interface: per-layer caches of one live sequence whose state can
//! be paged out to snapshots and back (the design of Ollama's MLX runner).

use std::any::Any;
use std::ops::Range;

use crate::{HostState, LayerRows, LayerRowsMut, Result};

/// Paged-out state of one layer's cache for the token range [`range`](Self::range).
///
/// A snapshot owns its memory and frees it when dropped. `size_bytes` reports
/// the memory it keeps alive, which must be proportional to its range, not to
/// the buffer it was taken from.
pub trait Snapshot: Any + Send {
    /// The token offsets `[from, to)` this snapshot covers.
    fn range(&self) -> Range<usize>;

    /// Bytes this snapshot keeps alive.
    fn size_bytes(&self) -> usize;

    /// For a cache to recover its own concrete snapshot type.
    fn as_any(&self) -> &dyn Any;

    /// For a cache to take back ownership of its own concrete snapshot type.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

/// An owned, type-erased snapshot.
pub type BoxedSnapshot = Box<dyn Snapshot>;

/// One layer's cache of one live token sequence, able to page state out to
/// [`Snapshot`]s and back in.
///
/// The offset is the number of tokens the live cache holds. Methods that take a
/// snapshot accept only snapshots made by the same kind of cache; a foreign one
/// is an [`InvalidArgument`](crate::CacheError::InvalidArgument) error.
pub trait SnapshotCache: Send {
    /// Tokens the live cache holds.
    fn offset(&self) -> usize;

    /// A snapshot of `[from, offset)`, or `None` when there is nothing to save
    /// (`from >= offset`, or an empty cache). The live cache is unchanged.
    fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>>;

    /// Brings the live cache to offset `target`. With a snapshot, the cache first
    /// rewinds to the snapshot's start and replays it; without one, it rewinds its
    /// own live state. Returns `Ok(false)`, leaving the cache as it was, when
    /// `target` is unreachable that way.
    fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool>;

    /// Joins consecutive snapshots `[a, b)` and `[b, c)` into `[a, c)`, taking
    /// ownership of both.
    ///
    /// A cache whose snapshots hold token rows (a KV cache) concatenates them,
    /// and gives `None` if either was `None`. A cache whose snapshots hold its
    /// whole state at their end (a rotating window, a recurrent state) keeps
    /// the child, whose state supersedes the parent's: `[a, c)` with a parent,
    /// the child's own range without one, `None` without a child (as Ollama's
    /// rotating cache does). Either way the result ends where the child did.
    /// Foreign or non-consecutive snapshots are an
    /// [`InvalidArgument`](crate::CacheError::InvalidArgument) error. The
    /// bookkeeping of both kinds is written once in [`paging`](crate::paging).
    fn merge(
        &mut self,
        parent: Option<BoxedSnapshot>,
        child: Option<BoxedSnapshot>,
    ) -> Result<Option<BoxedSnapshot>>;

    /// Splits `[a, c)` at `at` into `[a, at)` and `[at, c)`. A cache that cannot
    /// split returns `(None, Some(snapshot))`.
    fn split(
        &mut self,
        snapshot: BoxedSnapshot,
        at: usize,
    ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)>;

    /// Drops all live state; the offset becomes 0.
    fn free(&mut self);

    /// Whether this cache's snapshots hold its whole state at their end (a
    /// rotating window, a recurrent state) rather than their range's rows (a
    /// KV cache: the default). A snapshot of such a cache is superseded by a
    /// later one of the same path (see [`merge`](Self::merge)), which is what
    /// lets a prefix cache drop it cheaply.
    fn holds_whole_state(&self) -> bool {
        false
    }

    /// Copies the live rows `rows` (token offsets, `rows.end <= offset`) into
    /// `out`, one layer of a [`HostKv`](crate::HostKv) holding `rows.len()` tokens.
    ///
    /// Returns `Ok(false)`, writing nothing, when this cache cannot cut its state
    /// into token rows (a rotating window, a recurrent state: the default), or
    /// when `rows` is not live. A shape or dtype other than `out`'s is a
    /// [`LayoutMismatch`](crate::CacheError::LayoutMismatch) error.
    fn read_rows(&self, rows: Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> {
        let _ = (rows, out);
        Ok(false)
    }

    /// Appends rows `rows` of `src` (indices into `src`, one layer of a
    /// [`HostKv`](crate::HostKv)) after the live state, advancing the offset by
    /// `rows.len()`.
    ///
    /// Returns `Ok(false)`, changing nothing, when this cache cannot take rows
    /// (the default). A shape or dtype other than the cache's is a
    /// [`LayoutMismatch`](crate::CacheError::LayoutMismatch) error that changes
    /// nothing.
    fn append_rows(&mut self, src: LayerRows<'_>, rows: Range<usize>) -> Result<bool> {
        let _ = (src, rows);
        Ok(false)
    }

    /// The whole live state at the current offset, on the host, for a cache
    /// that cannot cut its state into token rows (a rotating window, a
    /// recurrent state): `Ok(None)` when it holds nothing or cannot give its
    /// state out (the default). The live cache is unchanged.
    fn read_state(&self) -> Result<Option<HostState>> {
        Ok(None)
    }

    /// Replaces the whole live state with `state` (as [`read_state`](Self::read_state)
    /// of a cache of the same kind and shape gave it); the offset becomes
    /// `state.offset`.
    ///
    /// Returns `Ok(false)`, changing nothing, when this cache cannot take a
    /// whole state (the default). Arrays of another number, shape or dtype than
    /// the cache's are a [`ShapeMismatch`](crate::CacheError::ShapeMismatch) or
    /// [`DTypeMismatch`](crate::CacheError::DTypeMismatch) error that changes
    /// nothing.
    fn load_state(&mut self, state: &HostState) -> Result<bool> {
        let _ = state;
        Ok(false)
    }
}

impl<C: SnapshotCache + ?Sized> SnapshotCache for Box<C> {
    fn offset(&self) -> usize {
        (**self).offset()
    }
    fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>> {
        (**self).snapshot(from)
    }
    fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
        (**self).restore(snapshot, target)
    }
    fn merge(
        &mut self,
        parent: Option<BoxedSnapshot>,
        child: Option<BoxedSnapshot>,
    ) -> Result<Option<BoxedSnapshot>> {
        (**self).merge(parent, child)
    }
    fn split(
        &mut self,
        snapshot: BoxedSnapshot,
        at: usize,
    ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
        (**self).split(snapshot, at)
    }
    fn free(&mut self) {
        (**self).free()
    }
    fn holds_whole_state(&self) -> bool {
        (**self).holds_whole_state()
    }
    fn read_rows(&self, rows: Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> {
        (**self).read_rows(rows, out)
    }
    fn append_rows(&mut self, src: LayerRows<'_>, rows: Range<usize>) -> Result<bool> {
        (**self).append_rows(src, rows)
    }
    fn read_state(&self) -> Result<Option<HostState>> {
        (**self).read_state()
    }
    fn load_state(&mut self, state: &HostState) -> Result<bool> {
        (**self).load_state(state)
    }
}

/// A layer cache that stores keys and values: the model writes each step's
/// keys/values and attends over what [`update`](Self::update) returns.
///
/// Shapes: `keys: [batch, kv_heads, tokens, head_dim]`,
/// `values: [batch, kv_heads, tokens, head_dim_v]`.
pub trait LayerCache: SnapshotCache {
    /// The backend's array type.
    type Array;

    /// Appends `tokens` new positions and returns views of everything the new
    /// tokens attend to, `[batch, kv_heads, visible, head_dim]` each.
    fn update(&mut self, keys: &Self::Array, values: &Self::Array) -> Result<(Self::Array, Self::Array)>;

    /// The arrays holding the live state, for evaluating or measuring them.
    fn state(&self) -> Vec<Self::Array>;
}
