//! State caches (a rotating window, a recurrent state): a state that cannot
//! be cut into token rows; a snapshot of `[a, b)` holds the whole state at
//! `b`, merging keeps the child and splitting is refused.

use super::{check_consecutive, downcast_box, downcast_ref, Halves, PagedSnapshot, Payload};
use crate::{BoxedSnapshot, Result, Snapshot};

/// The whole state of a state cache at one offset, as a backend keeps it in a
/// snapshot (compact copies).
pub trait State: Payload {}

/// A snapshot of a state cache: the range `[a, b)` it stands for and the
/// cache's whole state at `b`.
pub type StateSnapshot<S> = PagedSnapshot<S>;

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
/// [`snapshot_cache!`](crate::snapshot_cache)`(state: ...)` makes it a
/// [`SnapshotCache`](crate::SnapshotCache) whose snapshots are
/// [`StateSnapshot`]s of its [`State`].
pub trait StateCache: Send {
    /// What a snapshot of this cache holds.
    type State: State;

    /// Tokens the live cache has consumed (its [`offset`](crate::SnapshotCache::offset)).
    fn live_offset(&self) -> usize;

    /// How the live state rewinds: [`Rewind::Never`] unless the cache says
    /// otherwise.
    fn rewind(&self) -> Rewind {
        Rewind::Never
    }

    /// Rewinds a window that still holds every position to offset `to`
    /// (`to < live_offset()`); called only when [`rewind`](Self::rewind)
    /// allows it, so never for a cache that keeps the default [`Rewind::Never`].
    fn truncate(&mut self, to: usize) {
        unreachable!("truncate({to}) on a cache that never rewinds");
    }

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
pub fn snapshot<C: StateCache>(cache: &C, from: usize) -> Result<Option<BoxedSnapshot>> {
    let offset = cache.live_offset();
    if from >= offset {
        return Ok(None);
    }
    Ok(cache.capture()?.map(|state| {
        Box::new(PagedSnapshot {
            range: from..offset,
            payload: state,
        }) as BoxedSnapshot
    }))
}

/// [`SnapshotCache::restore`](crate::SnapshotCache::restore) of a state cache:
/// without a snapshot, the rewinds [`StateCache::rewind`] allows (a recurrent
/// state to 0 frees it); with one, its state at a target [`Rewind::reaches`]
/// allows, whatever the live cache holds.
pub fn restore<C: StateCache>(cache: &mut C, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
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
pub fn merge<C: StateCache>(
    parent: Option<BoxedSnapshot>,
    child: Option<BoxedSnapshot>,
) -> Result<Option<BoxedSnapshot>> {
    let parent = parent.map(downcast_box::<StateSnapshot<C::State>>).transpose()?;
    let Some(child) = child else {
        return Ok(None);
    };
    let mut child = downcast_box::<StateSnapshot<C::State>>(child)?;
    if let Some(parent) = parent {
        check_consecutive(&parent.range, &child.range)?;
        child.range.start = parent.range.start;
    }
    Ok(Some(child))
}

/// [`SnapshotCache::split`](crate::SnapshotCache::split) of a state cache:
/// refused, `(None, Some(snapshot))` (a whole state cannot be cut).
pub fn split<C: StateCache>(snapshot: BoxedSnapshot, _at: usize) -> Result<Halves> {
    let snap = downcast_box::<StateSnapshot<C::State>>(snapshot)?;
    Ok((None, Some(snap)))
}

/// [`SnapshotCache::holds_whole_state`](crate::SnapshotCache::holds_whole_state) of
/// state caches: their snapshots hold the whole state at their end.
pub const HOLDS_WHOLE_STATE: bool = true;

/// [`SnapshotCache::offset`](crate::SnapshotCache::offset) of a state cache.
pub fn offset<C: StateCache>(cache: &C) -> usize {
    cache.live_offset()
}

/// [`SnapshotCache::free`](crate::SnapshotCache::free) of a state cache.
pub fn free<C: StateCache>(cache: &mut C) {
    cache.clear()
}
