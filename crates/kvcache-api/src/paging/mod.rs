//! Snapshot, restore, merge and split of [`SnapshotCache`](crate::SnapshotCache)s, written once.
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
//! [`SnapshotCache`](crate::SnapshotCache) with
//! [`snapshot_cache!`](crate::snapshot_cache), adding the methods of its own
//! (host rows, host states) in the macro's body. The functions of [`rows`]
//! and [`state`] are that macro's methods.
//!
//! ```
//! use std::ops::Range;
//! use kvcache_api::paging::{Payload, RowCache, Rows};
//! use kvcache_api::{Result, SnapshotCache};
//!
//! /// Rows of token ids (a backend would keep key and value arrays).
//! #[derive(Debug)]
//! struct Ids(Vec<u32>);
//!
//! impl Payload for Ids {
//!     fn size_bytes(&self) -> usize { 4 * self.0.len() }
//! }
//!
//! impl Rows for Ids {
//!     fn tokens(&self) -> usize { self.0.len() }
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
//! kvcache_api::snapshot_cache!(rows: Live {});
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

pub mod rows;
pub mod state;

pub use rows::{RowCache, Rows, RowsSnapshot};
pub use state::{Rewind, State, StateCache, StateSnapshot};

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

/// What a snapshot keeps alive: compact copies made for it alone, freed
/// when it is dropped.
pub trait Payload: Send + 'static {
    /// Bytes kept alive.
    fn size_bytes(&self) -> usize;
}

/// A snapshot of the token range [`range`](Snapshot::range) and what the
/// cache kept of it: the rows of the range ([`Rows`], a
/// [`RowsSnapshot`]) or the whole state at its end ([`State`], a
/// [`StateSnapshot`]). It dereferences to what it holds.
pub struct PagedSnapshot<P> {
    range: Range<usize>,
    payload: P,
}

impl<P> PagedSnapshot<P> {
    /// What the snapshot holds.
    pub fn payload(&self) -> &P {
        &self.payload
    }
}

impl<P> Deref for PagedSnapshot<P> {
    type Target = P;

    fn deref(&self) -> &P {
        &self.payload
    }
}

impl<P: Payload> Snapshot for PagedSnapshot<P> {
    fn range(&self) -> Range<usize> {
        self.range.clone()
    }
    fn size_bytes(&self) -> usize {
        self.payload.size_bytes()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

impl<P: Payload + fmt::Debug> fmt::Debug for PagedSnapshot<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagedSnapshot")
            .field("range", &self.range)
            .field("size_bytes", &self.payload.size_bytes())
            .field("payload", &self.payload)
            .finish()
    }
}

/// Both halves of a split, as [`SnapshotCache::split`](crate::SnapshotCache::split) returns them.
pub type Halves = (Option<BoxedSnapshot>, Option<BoxedSnapshot>);

/// Implements [`SnapshotCache`](crate::SnapshotCache) for a
/// [`RowCache`](crate::paging::RowCache) (`rows: Type { ... }`) or a
/// [`StateCache`](crate::paging::StateCache) (`state: Type { ... }`), with
/// the items in braces (the methods with defaults it overrides: host rows,
/// host states) added to the impl.
///
/// ```text
/// kvcache_api::snapshot_cache!(rows: MyKv {
///     fn read_rows(&self, rows: Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> { ... }
/// });
/// ```
#[macro_export]
macro_rules! snapshot_cache {
    ($kind:ident: $ty:ty { $($extra:tt)* }) => {
        impl $crate::SnapshotCache for $ty {
            fn offset(&self) -> usize {
                $crate::paging::$kind::offset(self)
            }
            fn snapshot(&mut self, from: usize) -> $crate::Result<Option<$crate::BoxedSnapshot>> {
                $crate::paging::$kind::snapshot(self, from)
            }
            fn restore(&mut self, snapshot: Option<&dyn $crate::Snapshot>, target: usize) -> $crate::Result<bool> {
                $crate::paging::$kind::restore(self, snapshot, target)
            }
            fn merge(
                &mut self,
                parent: Option<$crate::BoxedSnapshot>,
                child: Option<$crate::BoxedSnapshot>,
            ) -> $crate::Result<Option<$crate::BoxedSnapshot>> {
                $crate::paging::$kind::merge::<$ty>(parent, child)
            }
            fn split(&mut self, snapshot: $crate::BoxedSnapshot, at: usize) -> $crate::Result<$crate::paging::Halves> {
                $crate::paging::$kind::split::<$ty>(snapshot, at)
            }
            fn free(&mut self) {
                $crate::paging::$kind::free(self)
            }
            fn holds_whole_state(&self) -> bool {
                $crate::paging::$kind::HOLDS_WHOLE_STATE
            }
            $($extra)*
        }
    };
}
