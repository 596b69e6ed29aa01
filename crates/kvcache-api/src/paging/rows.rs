//! Row caches (a KV cache): one row per token, rewindable to any earlier
//! offset; a snapshot of `[a, b)` holds exactly those rows.

use std::ops::Range;

use super::{check_consecutive, downcast_box, downcast_ref, Halves, PagedSnapshot, Payload};
use crate::{BoxedSnapshot, Result, Snapshot};

/// The rows of a run of consecutive tokens, as a backend keeps them in a
/// snapshot: compact copies of keys and values along the token axis.
pub trait Rows: Payload + Sized {
    /// Tokens (rows) held.
    fn tokens(&self) -> usize;

    /// A compact copy of `parent`'s rows followed by `child`'s. Rows of
    /// another layout are an [`InvalidArgument`](crate::CacheError::InvalidArgument)
    /// error.
    fn concat(parent: &Self, child: &Self) -> Result<Self>;

    /// Compact copies of rows `[0, at)` and `[at, tokens)`, `0 < at < tokens`.
    fn split(&self, at: usize) -> Result<(Self, Self)>;
}

/// A snapshot of a row cache: exactly the rows of its range.
pub type RowsSnapshot<R> = PagedSnapshot<R>;

impl<R: Rows> PagedSnapshot<R> {
    /// A snapshot of `rows` standing at token offsets `from..from + rows.tokens()`.
    pub fn of_rows(from: usize, rows: R) -> Self {
        let range = from..from + rows.tokens();
        PagedSnapshot { range, payload: rows }
    }
}

/// The backend of a cache of token rows (a KV cache) that rewinds to any
/// earlier offset. [`snapshot_cache!`](crate::snapshot_cache)`(rows: ...)` makes
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
pub fn snapshot<C: RowCache>(cache: &C, from: usize) -> Result<Option<BoxedSnapshot>> {
    let offset = cache.live_offset();
    if from >= offset {
        return Ok(None);
    }
    let rows = cache.copy_rows(from..offset)?;
    Ok(Some(Box::new(RowsSnapshot::of_rows(from, rows))))
}

/// [`SnapshotCache::restore`](crate::SnapshotCache::restore) of a row cache:
/// without a snapshot, a rewind to any `target <= offset`; with a snapshot of
/// `[a, b)`, which needs `[0, a)` live (`offset >= a`), the rows up to
/// `target <= b` written from `a` on (a `target <= a` only rewinds).
pub fn restore<C: RowCache>(cache: &mut C, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
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
    cache.write_rows(at, &snap.payload, take)?;
    Ok(true)
}

/// [`SnapshotCache::merge`](crate::SnapshotCache::merge) of a row cache: the
/// rows of `[a, b)` and `[b, c)` concatenated into `[a, c)`; `None` when
/// either is missing (the rows of one cannot stand for both).
pub fn merge<C: RowCache>(
    parent: Option<BoxedSnapshot>,
    child: Option<BoxedSnapshot>,
) -> Result<Option<BoxedSnapshot>> {
    let (Some(parent), Some(child)) = (parent, child) else {
        return Ok(None);
    };
    let parent = downcast_box::<RowsSnapshot<C::Rows>>(parent)?;
    let child = downcast_box::<RowsSnapshot<C::Rows>>(child)?;
    check_consecutive(&parent.range, &child.range)?;
    let rows = C::Rows::concat(&parent.payload, &child.payload)?;
    Ok(Some(Box::new(RowsSnapshot::of_rows(parent.range.start, rows))))
}

/// [`SnapshotCache::split`](crate::SnapshotCache::split) of a row cache:
/// `[a, c)` cut at `at` into two compact copies; at or outside an end, the
/// snapshot whole on that side.
pub fn split<C: RowCache>(snapshot: BoxedSnapshot, at: usize) -> Result<Halves> {
    let snap = downcast_box::<RowsSnapshot<C::Rows>>(snapshot)?;
    let range = snap.range();
    if at <= range.start {
        return Ok((None, Some(snap)));
    }
    if at >= range.end {
        return Ok((Some(snap), None));
    }
    let (upper, lower) = snap.payload.split(at - range.start)?;
    Ok((
        Some(Box::new(RowsSnapshot::of_rows(range.start, upper))),
        Some(Box::new(RowsSnapshot::of_rows(at, lower))),
    ))
}

/// [`SnapshotCache::holds_whole_state`](crate::SnapshotCache::holds_whole_state) of
/// row caches: their snapshots hold rows.
pub const HOLDS_WHOLE_STATE: bool = false;

/// [`SnapshotCache::offset`](crate::SnapshotCache::offset) of a row cache.
pub fn offset<C: RowCache>(cache: &C) -> usize {
    cache.live_offset()
}

/// [`SnapshotCache::free`](crate::SnapshotCache::free) of a row cache.
pub fn free<C: RowCache>(cache: &mut C) {
    cache.clear()
}
