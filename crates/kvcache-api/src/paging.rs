//! Snapshot, restore, merge and split of [`SnapshotCache`]s, written once.
//!
//! Every snapshot cache is one of two kinds, and the bookkeeping of each kind
//! (which range a snapshot covers, which targets a restore can reach, how
//! merge and split treat ranges, which snapshots are foreign) lives here, in
//! plain Rust, generic over what the backend keeps:
//!
//! - **Row caches** ([`RowCache`]: a KV cache) hold one row per token and can
//!   rewind to any earlier offset. A snapshot of `[a, b)` is a
//!   [`RowsSnapshot`] holding those rows ([`Rows`]); merging concatenates,
//!   splitting cuts.
//! - **State caches** ([`StateCache`]: a rotating window, a recurrent state)
//!   hold a state that cannot be cut into token rows. A snapshot of `[a, b)` is
//!   a [`StateSnapshot`] holding the whole state at `b` ([`State`]); merging
//!   keeps the child (its state supersedes the parent's, as in Ollama's
//!   rotating cache), splitting is refused.
//!
//! A backend implements the small trait of its kind (copy rows, write rows,
//! capture or load a state) for its arrays and turns it into a
//! [`SnapshotCache`] with [`row_snapshot_cache!`](crate::row_snapshot_cache) or
//! [`state_snapshot_cache!`](crate::state_snapshot_cache), adding the methods
//! of its own (host rows, host states) in the macro's body.
//!
//! ```
//! use std::ops::Range;
//! use kvcache_api::paging::{RowCache, Rows};
//! use kvcache_api::{Result, SnapshotCache};
//!
//! /// Rows of token ids (a backend would keep key and value arrays).
//! #[derive(Debug)]
//! struct Ids(Vec<u32>);
//!
//! impl Rows for Ids {
//!     fn tokens(&self) -> usize { self.0.len() }
//!     fn size_bytes(&self) -> usize { 4 * self.0.len() }
//!     fn concat(parent: &Self, child: &Self) -> Result<Self> {
//!         Ok(Ids([&parent.0[..], &child.0[..]].concat()))
//!     }
//!     fn split(&self, at: usize) -> Result<(Self, Self)> {
//!         Ok((Ids(self.0[..at].to_vec()), Ids(self.0[at..].to_vec())))
//!     }
//! }
//!
//! #[derive(Default)]
//! struct Live(Vec<u32>);
//!
//! impl RowCache for Live {
//!     type Rows = Ids;
//!     fn live_offset(&self) -> usize { self.0.len() }
//!     fn truncate(&mut self, to: usize) { self.0.truncate(to) }
//!     fn copy_rows(&self, rows: Range<usize>) -> Result<Ids> { Ok(Ids(self.0[rows].to_vec())) }
//!     fn write_rows(&mut self, at: usize, rows: &Ids, take: usize) -> Result<()> {
//!         self.0.truncate(at);
//!         self.0.extend_from_slice(&rows.0[..take]);
//!         Ok(())
//!     }
//!     fn clear(&mut self) { self.0.clear() }
//! }
//! kvcache_api::row_snapshot_cache!(Live {});
//!
//! let mut cache = Live(vec![1, 2, 3, 4]);
//! let tail = cache.snapshot(2)?.expect("rows 2..4");
//! assert!(cache.restore(None, 1)?);
//! // The snapshot of [2, 4) builds on [0, 2), which is no longer live.
//! assert!(!cache.restore(Some(&*tail), 4)?);
//! cache.0.push(2);
//! assert!(cache.restore(Some(&*tail), 4)?);
//! assert_eq!(cache.0, [1, 2, 3, 4]);
//! # Ok::<(), kvcache_api::CacheError>(())
//! ```

use std::any::Any;
use std::fmt;
use std::ops::{Deref, Range};

use crate::{BoxedSnapshot, CacheError, Result, Snapshot};

/// The concrete snapshot behind `snapshot`, or
/// [`InvalidArgument`](CacheError::InvalidArgument) for one of another type.
pub fn downcast_ref<T: Snapshot>(snapshot: &dyn Snapshot) -> Result<&T> {
    snapshot
        .as_any()
        .downcast_ref::<T>()
        .ok_or_else(|| foreign::<T>(snapshot.range()))
}

/// Takes back ownership of the concrete snapshot, or
/// [`InvalidArgument`](CacheError::InvalidArgument) for one of another type
/// (which is dropped).
pub fn downcast_box<T: Snapshot>(snapshot: BoxedSnapshot) -> Result<Box<T>> {
    let range = snapshot.range();
    snapshot
        .into_any()
        .downcast::<T>()
        .map_err(|_| foreign::<T>(range))
}

fn foreign<T>(range: Range<usize>) -> CacheError {
    CacheError::InvalidArgument(format!(
        "snapshot of {range:?} was not made by this kind of cache (expected {})",
        std::any::type_name::<T>()
    ))
}

/// Checks that `[a, b)` and `[b, c)` are consecutive, for a merge.
fn check_consecutive(parent: &Range<usize>, child: &Range<usize>) -> Result<()> {
    if parent.end != child.start {
        return Err(CacheError::InvalidArgument(format!(
            "cannot merge snapshots {parent:?} and {child:?}: they are not consecutive"
        )));
    }
    Ok(())
}

// ---- row caches ----

/// The rows of a run of consecutive tokens, as a backend keeps them in a
/// snapshot: compact copies of keys and values along the token axis, which
/// keep alive only what they hold.
pub trait Rows: Sized + Send + 'static {
    /// Tokens (rows) held.
    fn tokens(&self) -> usize;

    /// Bytes kept alive.
    fn size_bytes(&self) -> usize;

    /// A compact copy of `parent`'s rows followed by `child`'s. Rows of
    /// another layout are an [`InvalidArgument`](CacheError::InvalidArgument)
    /// error.
    fn concat(parent: &Self, child: &Self) -> Result<Self>;

    /// Compact copies of rows `[0, at)` and `[at, tokens)`, `0 < at < tokens`.
    fn split(&self, at: usize) -> Result<(Self, Self)>;
}

/// A snapshot of the token range [`range`](Snapshot::range) holding exactly
/// its rows. It dereferences to the rows.
pub struct RowsSnapshot<R> {
    range: Range<usize>,
    rows: R,
}

impl<R: Rows> RowsSnapshot<R> {
    /// A snapshot of `rows` standing at token offsets `from..from + rows.tokens()`.
    pub fn new(from: usize, rows: R) -> Self {
        let range = from..from + rows.tokens();
        RowsSnapshot { range, rows }
    }

    /// The rows held.
    pub fn rows(&self) -> &R {
        &self.rows
    }
}

impl<R> Deref for RowsSnapshot<R> {
    type Target = R;

    fn deref(&self) -> &R {
        &self.rows
    }
}

impl<R: Rows> Snapshot for RowsSnapshot<R> {
    fn range(&self) -> Range<usize> {
        self.range.clone()
    }
    fn size_bytes(&self) -> usize {
        self.rows.size_bytes()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

impl<R: Rows + fmt::Debug> fmt::Debug for RowsSnapshot<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RowsSnapshot")
            .field("range", &self.range)
            .field("size_bytes", &self.rows.size_bytes())
            .field("rows", &self.rows)
            .finish()
    }
}

/// The backend of a cache of token rows (a KV cache) that rewinds to any
/// earlier offset. [`row_snapshot_cache!`](crate::row_snapshot_cache) makes
/// it a [`SnapshotCache`](crate::SnapshotCache) whose snapshots are
/// [`RowsSnapshot`]s of its [`Rows`].
pub trait RowCache: Send {
    /// What a snapshot of this cache holds.
    type Rows: Rows;

    /// Tokens the live cache holds (its [`offset`](crate::SnapshotCache::offset)).
    fn live_offset(&self) -> usize;

    /// Keeps the first `to` live rows, `to <= live_offset()`.
    fn truncate(&mut self, to: usize);

    /// A compact copy of the live rows `rows` (non-empty, `rows.end <= live_offset()`).
    fn copy_rows(&self, rows: Range<usize>) -> Result<Self::Rows>;

    /// Replaces the live rows from `at` on (`at <= live_offset()`) with the
    /// first `take` rows of `rows`; the offset becomes `at + take`. Rows the
    /// cache cannot hold (another layout) are an error that changes nothing,
    /// also when `take` is 0.
    fn write_rows(&mut self, at: usize, rows: &Self::Rows, take: usize) -> Result<()>;

    /// Drops all live state; the offset becomes 0.
    fn clear(&mut self);
}

/// [`SnapshotCache::snapshot`](crate::SnapshotCache::snapshot) of a row cache:
/// the rows `[from, offset)`.
pub fn snapshot_rows<C: RowCache>(cache: &C, from: usize) -> Result<Option<BoxedSnapshot>> {
    let offset = cache.live_offset();
    if from >= offset {
        return Ok(None);
    }
    let rows = cache.copy_rows(from..offset)?;
    Ok(Some(Box::new(RowsSnapshot::new(from, rows))))
}

/// [`SnapshotCache::restore`](crate::SnapshotCache::restore) of a row cache:
/// without a snapshot, a rewind to any `target <= offset`; with a snapshot of
/// `[a, b)`, which needs `[0, a)` live (`offset >= a`), the rows up to
/// `target <= b` written from `a` on (a `target <= a` only rewinds).
pub fn restore_rows<C: RowCache>(
    cache: &mut C,
    snapshot: Option<&dyn Snapshot>,
    target: usize,
) -> Result<bool> {
    let Some(snapshot) = snapshot else {
        if target > cache.live_offset() {
            return Ok(false);
        }
        cache.truncate(target);
        return Ok(true);
    };
    let snap = downcast_ref::<RowsSnapshot<C::Rows>>(snapshot)?;
    let range = snap.range();
    if target > range.end || cache.live_offset() < range.start {
        return Ok(false);
    }
    let (at, take) = if target <= range.start {
        (target, 0)
    } else {
        (range.start, target - range.start)
    };
    cache.write_rows(at, &snap.rows, take)?;
    Ok(true)
}

/// [`SnapshotCache::merge`](crate::SnapshotCache::merge) of a row cache: the
/// rows of `[a, b)` and `[b, c)` concatenated into `[a, c)`; `None` when
/// either is missing (the rows of one cannot stand for both).
pub fn merge_rows<R: Rows>(
    parent: Option<BoxedSnapshot>,
    child: Option<BoxedSnapshot>,
) -> Result<Option<BoxedSnapshot>> {
    let (Some(parent), Some(child)) = (parent, child) else {
        return Ok(None);
    };
    let parent = downcast_box::<RowsSnapshot<R>>(parent)?;
    let child = downcast_box::<RowsSnapshot<R>>(child)?;
    check_consecutive(&parent.range, &child.range)?;
    let rows = R::concat(&parent.rows, &child.rows)?;
    Ok(Some(Box::new(RowsSnapshot::new(parent.range.start, rows))))
}

/// Both halves of a split, as [`SnapshotCache::split`](crate::SnapshotCache::split) returns them.
pub type Halves = (Option<BoxedSnapshot>, Option<BoxedSnapshot>);

/// [`SnapshotCache::split`](crate::SnapshotCache::split) of a row cache:
/// `[a, c)` cut at `at` into two compact copies; at or outside an end, the
/// snapshot whole on that side.
pub fn split_rows<R: Rows>(snapshot: BoxedSnapshot, at: usize) -> Result<Halves> {
    let snap = downcast_box::<RowsSnapshot<R>>(snapshot)?;
    let range = snap.range();
    if at <= range.start {
        return Ok((None, Some(snap)));
    }
    if at >= range.end {
        return Ok((Some(snap), None));
    }
    let (upper, lower) = snap.rows.split(at - range.start)?;
    Ok((
        Some(Box::new(RowsSnapshot::new(range.start, upper))),
        Some(Box::new(RowsSnapshot::new(at, lower))),
    ))
}

// ---- state caches ----

/// The whole state of a state cache at one offset, as a backend keeps it in a
/// snapshot (compact copies).
pub trait State: Send + 'static {
    /// Bytes kept alive.
    fn size_bytes(&self) -> usize;
}

/// A snapshot of the token range [`range`](Snapshot::range) `[a, b)` holding
/// the cache's whole state at `b`. It dereferences to the state.
pub struct StateSnapshot<S> {
    range: Range<usize>,
    state: S,
}

impl<S> StateSnapshot<S> {
    /// The state held (at the range's end).
    pub fn state(&self) -> &S {
        &self.state
    }
}

impl<S> Deref for StateSnapshot<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.state
    }
}

impl<S: State> Snapshot for StateSnapshot<S> {
    fn range(&self) -> Range<usize> {
        self.range.clone()
    }
    fn size_bytes(&self) -> usize {
        self.state.size_bytes()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

impl<S: State + fmt::Debug> fmt::Debug for StateSnapshot<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateSnapshot")
            .field("range", &self.range)
            .field("size_bytes", &self.state.size_bytes())
            .field("state", &self.state)
            .finish()
    }
}

/// How far a state cache rewinds its live state without a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rewind {
    /// A recurrent state: only to its own offset, or to 0 (the initial state).
    Never,
    /// A window of `W` positions: to any earlier offset while nothing has
    /// left the window (`offset <= W`), and to 0 always. A snapshot restores
    /// at its end `b`, or at any earlier target when `b <= W`.
    Window(usize),
}

impl Rewind {
    /// Whether a snapshot of the state at `end` can bring a cache to `target`.
    pub fn reaches(self, end: usize, target: usize) -> bool {
        match self {
            Rewind::Never => target == end,
            Rewind::Window(w) => target == end || (target < end && end <= w),
        }
    }
}

/// The backend of a cache whose state cannot be cut into token rows (a
/// rotating window, a recurrent state).
/// [`state_snapshot_cache!`](crate::state_snapshot_cache) makes it a
/// [`SnapshotCache`](crate::SnapshotCache) whose snapshots are
/// [`StateSnapshot`]s of its [`State`].
pub trait StateCache: Send {
    /// What a snapshot of this cache holds.
    type State: State;

    /// Tokens the live cache has consumed (its [`offset`](crate::SnapshotCache::offset)).
    fn live_offset(&self) -> usize;

    /// How the live state rewinds.
    fn rewind(&self) -> Rewind;

    /// Rewinds a window that still holds every position to offset `to`
    /// (`to < live_offset()`); called only when [`rewind`](Self::rewind) allows it.
    fn truncate(&mut self, to: usize);

    /// A compact copy of the whole live state, `None` when it holds nothing.
    fn capture(&self) -> Result<Option<Self::State>>;

    /// Replaces the live state with `snapshot`'s, standing at offset `target`
    /// (one [`Rewind::reaches`] allows). A state the cache cannot hold is an
    /// error that changes nothing.
    fn load(&mut self, snapshot: &StateSnapshot<Self::State>, target: usize) -> Result<()>;

    /// Drops all live state; the offset becomes 0.
    fn clear(&mut self);
}

/// [`SnapshotCache::snapshot`](crate::SnapshotCache::snapshot) of a state
/// cache: the whole state, covering `[from, offset)`.
pub fn snapshot_state<C: StateCache>(cache: &C, from: usize) -> Result<Option<BoxedSnapshot>> {
    let offset = cache.live_offset();
    if from >= offset {
        return Ok(None);
    }
    Ok(cache.capture()?.map(|state| {
        Box::new(StateSnapshot {
            range: from..offset,
            state,
        }) as BoxedSnapshot
    }))
}

/// [`SnapshotCache::restore`](crate::SnapshotCache::restore) of a state cache:
/// without a snapshot, the rewinds [`StateCache::rewind`] allows (a recurrent
/// state to 0 frees it); with one, its state at a target [`Rewind::reaches`]
/// allows, whatever the live cache holds.
pub fn restore_state<C: StateCache>(
    cache: &mut C,
    snapshot: Option<&dyn Snapshot>,
    target: usize,
) -> Result<bool> {
    let Some(snapshot) = snapshot else {
        let offset = cache.live_offset();
        if target >= offset {
            return Ok(target == offset);
        }
        match cache.rewind() {
            Rewind::Never if target == 0 => cache.clear(),
            Rewind::Window(w) if offset <= w || target == 0 => cache.truncate(target),
            _ => return Ok(false),
        }
        return Ok(true);
    };
    let snap = downcast_ref::<StateSnapshot<C::State>>(snapshot)?;
    if !cache.rewind().reaches(snap.range.end, target) {
        return Ok(false);
    }
    cache.load(snap, target)?;
    Ok(true)
}

/// [`SnapshotCache::merge`](crate::SnapshotCache::merge) of a state cache:
/// the child, whose state supersedes the parent's, covering `[a, c)` (or its
/// own range when there is no parent); `None` without a child. Foreign or
/// non-consecutive snapshots are errors.
pub fn merge_keep_child<S: State>(
    parent: Option<BoxedSnapshot>,
    child: Option<BoxedSnapshot>,
) -> Result<Option<BoxedSnapshot>> {
    let parent = parent.map(downcast_box::<StateSnapshot<S>>).transpose()?;
    let Some(child) = child else {
        return Ok(None);
    };
    let mut child = downcast_box::<StateSnapshot<S>>(child)?;
    if let Some(parent) = parent {
        check_consecutive(&parent.range, &child.range)?;
        child.range.start = parent.range.start;
    }
    Ok(Some(child))
}

/// [`SnapshotCache::split`](crate::SnapshotCache::split) of a state cache:
/// refused, `(None, Some(snapshot))` (a whole state cannot be cut).
pub fn refuse_split<S: State>(snapshot: BoxedSnapshot) -> Result<Halves> {
    let snap = downcast_box::<StateSnapshot<S>>(snapshot)?;
    Ok((None, Some(snap)))
}

// ---- the SnapshotCache impls ----

/// Implements [`SnapshotCache`](crate::SnapshotCache) for a type that is a
/// [`RowCache`](crate::paging::RowCache), with the items in braces (the
/// methods with defaults it overrides: host rows) added to the impl.
///
/// ```ignore
/// kvcache_api::row_snapshot_cache!(MyKv {
///     fn read_rows(&self, rows: Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> { ... }
/// });
/// ```
#[macro_export]
macro_rules! row_snapshot_cache {
    ($ty:ty { $($extra:tt)* }) => {
        impl $crate::SnapshotCache for $ty {
            fn offset(&self) -> usize {
                $crate::paging::RowCache::live_offset(self)
            }
            fn snapshot(&mut self, from: usize) -> $crate::Result<Option<$crate::BoxedSnapshot>> {
                $crate::paging::snapshot_rows(self, from)
            }
            fn restore(&mut self, snapshot: Option<&dyn $crate::Snapshot>, target: usize) -> $crate::Result<bool> {
                $crate::paging::restore_rows(self, snapshot, target)
            }
            fn merge(
                &mut self,
                parent: Option<$crate::BoxedSnapshot>,
                child: Option<$crate::BoxedSnapshot>,
            ) -> $crate::Result<Option<$crate::BoxedSnapshot>> {
                $crate::paging::merge_rows::<<$ty as $crate::paging::RowCache>::Rows>(parent, child)
            }
            fn split(&mut self, snapshot: $crate::BoxedSnapshot, at: usize) -> $crate::Result<$crate::paging::Halves> {
                $crate::paging::split_rows::<<$ty as $crate::paging::RowCache>::Rows>(snapshot, at)
            }
            fn free(&mut self) {
                $crate::paging::RowCache::clear(self)
            }
            $($extra)*
        }
    };
}

/// Implements [`SnapshotCache`](crate::SnapshotCache) for a type that is a
/// [`StateCache`](crate::paging::StateCache), with the items in braces (the
/// methods with defaults it overrides: host states) added to the impl.
#[macro_export]
macro_rules! state_snapshot_cache {
    ($ty:ty { $($extra:tt)* }) => {
        impl $crate::SnapshotCache for $ty {
            fn offset(&self) -> usize {
                $crate::paging::StateCache::live_offset(self)
            }
            fn snapshot(&mut self, from: usize) -> $crate::Result<Option<$crate::BoxedSnapshot>> {
                $crate::paging::snapshot_state(self, from)
            }
            fn restore(&mut self, snapshot: Option<&dyn $crate::Snapshot>, target: usize) -> $crate::Result<bool> {
                $crate::paging::restore_state(self, snapshot, target)
            }
            fn merge(
                &mut self,
                parent: Option<$crate::BoxedSnapshot>,
                child: Option<$crate::BoxedSnapshot>,
            ) -> $crate::Result<Option<$crate::BoxedSnapshot>> {
                $crate::paging::merge_keep_child::<<$ty as $crate::paging::StateCache>::State>(parent, child)
            }
            fn split(&mut self, snapshot: $crate::BoxedSnapshot, _at: usize) -> $crate::Result<$crate::paging::Halves> {
                $crate::paging::refuse_split::<<$ty as $crate::paging::StateCache>::State>(snapshot)
            }
            fn free(&mut self) {
                $crate::paging::StateCache::clear(self)
            }
            $($extra)*
        }
    };
}
