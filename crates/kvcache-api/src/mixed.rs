//! One layer's cache in a model with two kinds of layers.
//!
//! Gemma 3 interleaves sliding-window layers with global ones; a prefix trie
//! holds one cache type for every layer, so each layer's cache is a
//! [`MixedLayer`]: a full KV cache for a global layer, a rotating window for a
//! window layer. Every [`SnapshotCache`] call goes to the variant, and a
//! snapshot made by one kind is foreign to the other (an
//! [`InvalidArgument`](crate::CacheError::InvalidArgument) error from the
//! variant's own downcast), so a trie never mixes them up.

use std::ops::Range;

use crate::{BoxedSnapshot, HostState, LayerCache, LayerRows, LayerRowsMut, Result, Snapshot, SnapshotCache};

/// A layer cache that is either a global layer's `G` or a window layer's `W`.
#[derive(Debug)]
pub enum MixedLayer<G, W> {
    /// A layer that attends to every earlier position: all rows are kept.
    Global(G),
    /// A layer that attends to a sliding window: only the window is kept.
    Window(W),
}

impl<G, W> MixedLayer<G, W> {
    /// Whether this is a window layer's cache.
    pub fn is_window(&self) -> bool {
        matches!(self, MixedLayer::Window(_))
    }
}

/// Calls `$body` with `$cache` bound to whichever variant `$self` holds.
macro_rules! either {
    ($self:expr, $cache:ident => $body:expr) => {
        match $self {
            MixedLayer::Global($cache) => $body,
            MixedLayer::Window($cache) => $body,
        }
    };
}

impl<G: SnapshotCache, W: SnapshotCache> SnapshotCache for MixedLayer<G, W> {
    fn offset(&self) -> usize {
        either!(self, cache => cache.offset())
    }
    fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>> {
        either!(self, cache => cache.snapshot(from))
    }
    fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
        either!(self, cache => cache.restore(snapshot, target))
    }
    fn merge(
        &mut self,
        parent: Option<BoxedSnapshot>,
        child: Option<BoxedSnapshot>,
    ) -> Result<Option<BoxedSnapshot>> {
        either!(self, cache => cache.merge(parent, child))
    }
    fn split(
        &mut self,
        snapshot: BoxedSnapshot,
        at: usize,
    ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
        either!(self, cache => cache.split(snapshot, at))
    }
    fn free(&mut self) {
        either!(self, cache => cache.free())
    }
    fn holds_whole_state(&self) -> bool {
        either!(self, cache => cache.holds_whole_state())
    }
    fn read_rows(&self, rows: Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> {
        either!(self, cache => cache.read_rows(rows, out))
    }
    fn append_rows(&mut self, src: LayerRows<'_>, rows: Range<usize>) -> Result<bool> {
        either!(self, cache => cache.append_rows(src, rows))
    }
    fn read_state(&self) -> Result<Option<HostState>> {
        either!(self, cache => cache.read_state())
    }
    fn load_state(&mut self, state: &HostState) -> Result<bool> {
        either!(self, cache => cache.load_state(state))
    }
}

impl<A, G, W> LayerCache for MixedLayer<G, W>
where
    G: LayerCache<Array = A>,
    W: LayerCache<Array = A>,
{
    type Array = A;

    fn update(&mut self, keys: &A, values: &A) -> Result<(A, A)> {
        either!(self, cache => cache.update(keys, values))
    }
    fn state(&self) -> Vec<A> {
        either!(self, cache => cache.state())
    }
}
