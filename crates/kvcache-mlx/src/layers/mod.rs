//! Per-layer caches of one live sequence on mlx-rs arrays, able to page their
//! state out to [`Snapshot`](kvcache_api::Snapshot)s and back in.
//!
//! | cache | state | rewind without a snapshot | split |
//! |---|---|---|---|
//! | [`KvCache`] | keys/values `[B, H, capacity, D]`, growing in steps | to any earlier offset | yes |
//! | [`RotatingKvCache`] | a ring of the last `W` positions (sliding window) | before the first wrap, or to 0 | refused |
//! | [`RecurrentCache`] | arrays replaced by every step (conv/SSM state) | only to 0 | refused |
//!
//! Shapes follow mlx attention: `B` batch, `H` KV heads, `L` tokens of one
//! update, `D` head dimension (`Dk` for keys and `Dv` for values may differ).
//!
//! The bookkeeping of snapshot, restore, merge and split is
//! [`kvcache_api::paging`]'s, written once for these caches, the candle one
//! and the fakes: [`KvCache`] is a row cache ([`KvSnapshot`] holds
//! [`KvRows`]), the other two are state caches (a [`Ring`], a
//! [`RecurrentState`]). Each implements the small backend trait of its kind
//! over mlx arrays. All three keep `kvcache_api::contract`.
//!
//! Rules shared by every cache here:
//! - A snapshot owns a *compact copy* of what it needs, made with a fresh
//!   allocation and evaluated before it is returned, so it never keeps the live
//!   buffer (or the graph that produced it) alive.
//!   [`size_bytes`](kvcache_api::Snapshot::size_bytes) is the sum of its arrays'
//!   `nbytes`, which for [`KvSnapshot`] is exactly `(to - from) * B * H * (Dk + Dv) * elem`.
//! - Snapshots free their arrays when dropped; there is nothing to close.
//! - A snapshot made by another kind of cache is
//!   [`CacheError::InvalidArgument`](kvcache_api::CacheError::InvalidArgument);
//!   K/V arrays whose shapes or dtypes differ from what the cache holds are
//!   `ShapeMismatch`/`DTypeMismatch`; all of those leave the cache as it was.
//!   mlx failures are [`CacheError::Backend`](kvcache_api::CacheError::Backend).
//! - Writes are lazy like any mlx op; the caller evaluates the arrays `update`
//!   returns. Snapshots, merges and splits evaluate their copies at once.
//! - Writes go through `slice_update`, which mlx performs in place when the cache
//!   holds the only reference to its buffer. Keeping the views `update` returned
//!   alive across the next `update` makes mlx copy the whole buffer instead: drop
//!   them once attention is evaluated.
//! - Paging copies (snapshot, restore, merge, split) move the cache's own
//!   row-contiguous arrays as the widest unsigned integers that tile a row (u64
//!   for f16 rows of 64): mlx's CPU copy loop moves one element per step, so
//!   this is 2-3x faster than copying f16 elements, and bit-exact. On Linux,
//!   paging copies use `memcpy`-class host copies instead where they can:
//!   snapshots, merges and splits into new buffers that mlx allocates for a
//!   `load` from a reader of ours, restores into a buffer made exclusive the
//!   way mlx decides to write in place, or into a new buffer that is exactly
//!   the snapshot (see `host.rs`).
//!
//! Every type here is `Send` (mlx arrays are `Send`, not `Sync`).

mod arrays;
mod buffers;
#[cfg(target_os = "linux")]
mod host;
mod kv;
mod recurrent;
mod rotating;
mod snapshot;

pub use kv::KvCache;
pub use recurrent::RecurrentCache;
pub use rotating::RotatingKvCache;
pub use snapshot::{
    KvRows, KvSnapshot, RecurrentSnapshot, RecurrentState, Ring, RotatingSnapshot, SnapshotEncoding,
};

/// Growth step of [`KvCache`] and [`RotatingKvCache`] buffers, in positions.
pub const DEFAULT_STEP: usize = 256;
