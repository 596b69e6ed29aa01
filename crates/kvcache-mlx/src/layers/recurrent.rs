//! [`RecurrentCache`]: the state of a recurrent layer, which cannot be rewound.

use std::fmt;

use kvcache_api::paging::StateCache;
#[cfg(doc)]
use kvcache_api::SnapshotCache;
use kvcache_api::{CacheError, HostState, Result};
use mlx_rs::Array;

use super::arrays::{compact_copy, shape_of};
use super::snapshot::{array_from_host, array_to_host, RecurrentSnapshot, RecurrentState};

/// The state of a recurrent layer (a convolution window, an SSM state, ...)
/// after `offset` tokens: one or more arrays `[B, ...]` that the model replaces
/// as a whole at every step.
///
/// Such a state summarises every token seen, so it cannot be rewound: it is
/// only ever valid at the offset it was computed for.
/// - [`restore(None, target)`](SnapshotCache::restore) succeeds only when
///   `target == offset` (nothing to do) or `target == 0` (back to the initial,
///   empty state); any other target is `Ok(false)`.
/// - [`restore(Some(s), target)`](SnapshotCache::restore) succeeds only when
///   `target` is exactly the snapshot's end; the live cache does not matter.
/// - [`snapshot(from)`](SnapshotCache::snapshot) covers `[from, offset)` but
///   holds the state at `offset` only (compact, evaluated copies).
/// - [`merge`](SnapshotCache::merge) keeps the child (also when the parent has
///   no snapshot);
///   [`split`](SnapshotCache::split) is refused with `(None, Some(snapshot))`.
///
/// # Why it is not a [`LayerCache`](kvcache_api::LayerCache)
/// `LayerCache::update` takes keys/values `[B, H, L, D]` and returns what the new
/// tokens attend to. A recurrent layer has neither: it reads its previous state
/// and hands back a new one, and the token count is not part of the state's
/// shape. So the layer reads [`state`](Self::state) and stores its result with
/// [`advance`](Self::advance), which says how many tokens it consumed.
///
/// # On the host
/// [`read_state`](SnapshotCache::read_state) gives the state arrays in order,
/// each with its own shape (`[B, ...]`) and dtype (f32, f16 or bf16), at the
/// current offset; [`load_state`](SnapshotCache::load_state) takes them back.
/// That is how a store keeps a recurrent layer: whole, at a prompt's end.
pub struct RecurrentCache {
    state: Vec<Array>,
    offset: usize,
}

impl RecurrentCache {
    /// An empty cache: no state, offset 0.
    pub fn new() -> Self {
        RecurrentCache {
            state: Vec::new(),
            offset: 0,
        }
    }

    /// The state after `offset` tokens (empty before the first
    /// [`advance`](Self::advance)), for the layer to compute the next one from.
    pub fn state(&self) -> &[Array] {
        &self.state
    }

    /// Replaces the state with the one the layer computed after consuming
    /// `tokens` more tokens, and advances the offset by `tokens`.
    ///
    /// `state` must be non-empty and, once the cache holds a state, have as many
    /// arrays with the same shapes and dtypes (`ShapeMismatch`, `DTypeMismatch`);
    /// `tokens` must be at least 1 (`InvalidArgument`). On error the cache is
    /// unchanged. The arrays are kept as given (lazy); they are copied only into
    /// snapshots.
    pub fn advance(&mut self, tokens: usize, state: Vec<Array>) -> Result<()> {
        if tokens == 0 {
            return Err(CacheError::InvalidArgument("advance by 0 tokens".into()));
        }
        if state.is_empty() {
            return Err(CacheError::InvalidArgument(
                "a recurrent state needs at least one array".into(),
            ));
        }
        self.check_compatible(&state)?;
        self.state = state;
        self.offset += tokens;
        Ok(())
    }

    /// Checks `state` against the current state, if any.
    fn check_compatible(&self, state: &[Array]) -> Result<()> {
        if self.state.is_empty() {
            return Ok(());
        }
        if state.len() != self.state.len() {
            return Err(CacheError::ShapeMismatch {
                what: "state (number of arrays)",
                expected: vec![self.state.len()],
                got: vec![state.len()],
            });
        }
        for (old, new) in self.state.iter().zip(state) {
            if old.shape() != new.shape() {
                return Err(CacheError::ShapeMismatch {
                    what: "state",
                    expected: shape_of(old),
                    got: shape_of(new),
                });
            }
            if old.dtype() != new.dtype() {
                return Err(CacheError::DTypeMismatch {
                    what: "state",
                    expected: format!("{:?}", old.dtype()),
                    got: format!("{:?}", new.dtype()),
                });
            }
        }
        Ok(())
    }
}

impl Default for RecurrentCache {
    fn default() -> Self {
        RecurrentCache::new()
    }
}

impl fmt::Debug for RecurrentCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shapes: Vec<_> = self.state.iter().map(|a| a.shape().to_vec()).collect();
        f.debug_struct("RecurrentCache")
            .field("offset", &self.offset)
            .field("state_shapes", &shapes)
            .finish()
    }
}

impl StateCache for RecurrentCache {
    type State = RecurrentState;

    fn capture(&self) -> Result<Option<RecurrentState>> {
        if self.state.is_empty() {
            return Ok(None);
        }
        let state = self.state.iter().map(compact_copy).collect::<Result<Vec<_>>>()?;
        Ok(Some(RecurrentState(state)))
    }

    fn live_offset(&self) -> usize {
        self.offset
    }

    fn load(&mut self, snap: &RecurrentSnapshot, target: usize) -> Result<()> {
        self.check_compatible(snap.arrays())?;
        // Arrays are values: sharing the snapshot's copies is safe, and the layer
        // replaces them at its next step.
        self.state = snap.arrays().to_vec();
        self.offset = target;
        Ok(())
    }

    fn clear(&mut self) {
        self.state.clear();
        self.offset = 0;
    }
}

kvcache_api::snapshot_cache!(state: RecurrentCache {
    /// The state arrays at the current offset, in order; `None` when the cache
    /// holds no state.
    fn read_state(&self) -> Result<Option<HostState>> {
        if self.state.is_empty() {
            return Ok(None);
        }
        let arrays = self.state.iter().map(array_to_host).collect::<Result<Vec<_>>>()?;
        Ok(Some(HostState {
            offset: self.offset,
            arrays,
        }))
    }

    /// Replaces the state with `state`'s arrays: as many, of the same shapes
    /// and dtypes as the state held (any, when the cache is empty), at an
    /// offset of at least 1. Anything else is an error that changes nothing.
    fn load_state(&mut self, state: &HostState) -> Result<bool> {
        if state.offset == 0 || state.arrays.is_empty() {
            return Err(CacheError::InvalidArgument(format!(
                "a recurrent state of {} arrays at offset {}",
                state.arrays.len(),
                state.offset
            )));
        }
        let arrays = state
            .arrays
            .iter()
            .map(array_from_host)
            .collect::<Result<Vec<_>>>()?;
        self.check_compatible(&arrays)?;
        self.state = arrays;
        self.offset = state.offset;
        Ok(true)
    }
});
