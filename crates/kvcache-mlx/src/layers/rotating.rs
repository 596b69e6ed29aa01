//! [`RotatingKvCache`]: a sliding-window layer cache on a ring of `W` slots.

use std::fmt;

use kvcache_api::paging::{Rewind, Rows, StateCache};
#[cfg(doc)]
use kvcache_api::SnapshotCache;
use kvcache_api::{CacheError, HostState, LayerCache, Result};
use mlx_rs::Array;

use super::arrays::{grow_write, seq_concat, seq_len, seq_slice, seq_write, seq_zeros, KvLayout, Origin};
use super::buffers::KvBuffers;
use super::snapshot::{array_from_host, array_to_host, KvRows, Ring, RotatingSnapshot, SnapshotEncoding};
use super::DEFAULT_STEP;

/// Keys and values of the last `W` positions of one layer, for sliding-window
/// attention with a window of exactly `W` positions: a query at position `p`
/// sees keys `p - W + 1 ..= p` (itself included).
///
/// State: a ring of keys `[B, H, capacity, Dk]` and values `[B, H, capacity, Dv]`
/// where position `p` always sits in slot `p % W`. The ring grows in steps up
/// to `W` slots while the sequence is shorter than the window and is exactly
/// `W` slots once it has wrapped; it retains positions
/// `[max(0, offset - W), offset)`.
///
/// # What [`update`](LayerCache::update) returns
/// Let `o` be the offset before an update of `L` tokens and
/// `E = min(o, W - 1)` the earlier positions the first new token can see.
/// - `L == 1`: views of the ring's first `min(o + 1, W)` slots. Once the ring
///   has wrapped the positions are in ring order, not temporal order, but every
///   one of them is in the window of the single query, so no mask is needed.
/// - `L > 1`: a fresh array of `E + L` positions in temporal order,
///   `o - E .. o + L`: `[B, H, E + L, Dk]` and `[B, H, E + L, Dv]`. It is longer
///   than `W` whenever `E + L > W`, so the caller must mask both causality and
///   the window: query `i` (position `o + i`) may see column `j` (position
///   `o - E + j`) iff `i + E - W < j <= i + E`. [`update_mask`](Self::update_mask)
///   builds that mask.
///
/// Either way the result holds every position the new tokens attend to.
///
/// # Rewind and snapshots
/// - Without a snapshot the cache rewinds only while it has not wrapped
///   (`offset <= W`): after that, positions older than the window are gone.
///   Rewinding to 0 (an empty cache) always works.
/// - A snapshot holds the whole window and the write index, so restoring it
///   does not depend on the live cache. It restores at its end `b`, or at any
///   `target <= b` when `b <= W` (the window then still holds every position).
/// - [`merge`](SnapshotCache::merge) keeps the child (its window supersedes the
///   parent's, so the child is kept also when the parent has no snapshot);
///   [`split`](SnapshotCache::split) is refused with `(None, Some(snapshot))`.
///
/// # On the host
/// The window cannot be cut into token rows from offset 0, so a store keeps it
/// whole: [`read_state`](SnapshotCache::read_state) gives two arrays, the ring's
/// keys `[B, H, n, Dk]` then values `[B, H, n, Dv]` with `n = min(offset, W)`,
/// in ring order (position `p` in slot `p % W`), at the current offset;
/// [`load_state`](SnapshotCache::load_state) takes them back.
pub struct RotatingKvCache {
    window: usize,
    buf: KvBuffers,
}

impl RotatingKvCache {
    /// An empty cache with a window of `window` positions (`InvalidArgument` if
    /// 0), growing in steps of [`DEFAULT_STEP`].
    pub fn new(window: usize) -> Result<Self> {
        Self::with_step(window, DEFAULT_STEP)
    }

    /// An empty cache with a window of `window` positions growing in steps of
    /// `step` (`InvalidArgument` if either is 0).
    pub fn with_step(window: usize, step: usize) -> Result<Self> {
        if window == 0 || step == 0 {
            return Err(CacheError::InvalidArgument(format!(
                "window ({window}) and growth step ({step}) must be at least 1"
            )));
        }
        Ok(RotatingKvCache {
            window,
            buf: KvBuffers::new(step),
        })
    }

    /// The same cache keeping the window of its snapshots as `encoding` says
    /// ([`SnapshotEncoding::Full`] by default; `InvalidArgument` for a group
    /// size mlx does not take). Restores dequantize 8-bit windows.
    pub fn with_snapshot_encoding(mut self, encoding: SnapshotEncoding) -> Result<Self> {
        self.buf.encoding = encoding.validated()?;
        Ok(self)
    }

    /// The window `W`.
    pub fn window(&self) -> usize {
        self.window
    }

    /// How the cache keeps the windows of its snapshots.
    pub fn snapshot_encoding(&self) -> SnapshotEncoding {
        self.buf.encoding
    }

    /// Slots of the ring (at most `W`; 0 when empty).
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Whether position `W` has been written, overwriting position 0: from then
    /// on only snapshots can take the cache back.
    pub fn has_wrapped(&self) -> bool {
        self.buf.offset > self.window
    }

    /// The retained positions `[max(0, offset - W), offset)` in temporal order:
    /// keys `[B, H, min(offset, W), Dk]` and values `[B, H, min(offset, W), Dv]`,
    /// or `None` when the cache holds nothing.
    pub fn ordered_window(&self) -> Result<Option<(Array, Array)>> {
        if self.buf.offset == 0 || self.buf.keys.is_none() {
            return Ok(None);
        }
        let from = self.buf.offset.saturating_sub(self.window);
        Ok(Some(self.ordered(from, self.buf.offset)?))
    }

    /// Additive mask for the next [`update`](LayerCache::update) of `tokens`
    /// positions, `[tokens, min(offset, W - 1) + tokens]` f32: `0` where query `i`
    /// may attend to column `j` of the returned keys, `-inf` where not (see the
    /// type's docs). All zeros when `tokens == 1`. Cast it for f16/bf16 models.
    pub fn update_mask(&self, tokens: usize) -> Result<Array> {
        let earlier = self.buf.offset.min(self.window - 1);
        let cols = earlier + tokens;
        let mut mask = vec![f32::NEG_INFINITY; tokens * cols];
        for i in 0..tokens {
            let last = i + earlier;
            let first = (last + 1).saturating_sub(self.window);
            mask[i * cols + first..=i * cols + last].fill(0.0);
        }
        let shape = [super::arrays::dim(tokens)?, super::arrays::dim(cols)?];
        Ok(Array::from_slice(&mask, &shape))
    }

    /// Positions `[from, to)` (all retained, `to - from <= W`) in temporal order.
    fn ordered(&self, from: usize, to: usize) -> Result<(Array, Array)> {
        let (Some(k), Some(v)) = (&self.buf.keys, &self.buf.values) else {
            unreachable!("ordered() on an empty ring");
        };
        let start = from % self.window;
        let len = to - from;
        if start + len <= self.window {
            return Ok((
                seq_slice(k, start, start + len)?,
                seq_slice(v, start, start + len)?,
            ));
        }
        let head = self.window - start;
        let join = |a: &Array| -> Result<Array> {
            seq_concat(
                vec![seq_slice(a, start, self.window)?, seq_slice(a, 0, len - head)?],
                Origin::Caller,
            )
        };
        Ok((join(k)?, join(v)?))
    }

    /// Writes the new positions `[o, o + L)` into the ring, keeping only the
    /// last `W` of them.
    fn write(&mut self, keys: &Array, values: &Array) -> Result<()> {
        let w = self.window;
        let o = self.buf.offset;
        let tokens = seq_len(keys);
        let end = o + tokens;
        if end <= w {
            // No wrap yet: the ring is a plain growable buffer capped at W.
            let growth = (self.buf.step, w);
            grow_write(&mut self.buf.keys, o, keys, 0..tokens, Origin::Caller, growth)?;
            grow_write(&mut self.buf.values, o, values, 0..tokens, Origin::Caller, growth)?;
            self.buf.offset = end;
            return Ok(());
        }
        // The ring must have all W slots before it wraps; before a wrap only
        // [0, o) is meaningful.
        if self.capacity() < w {
            for (buf, like) in [(&mut self.buf.keys, keys), (&mut self.buf.values, values)] {
                let mut parts = Vec::with_capacity(2);
                if o > 0 {
                    parts.push(seq_slice(buf.as_ref().expect("o > 0 implies a ring"), 0, o)?);
                }
                parts.push(seq_zeros(like, w - o)?);
                *buf = Some(seq_concat(parts, Origin::Caller)?);
            }
        }
        // Only the last min(L, W) new positions survive; they fill the slots
        // from `slot` to the end of the ring, then wrap to slot 0.
        let kept = tokens.min(w);
        let first = tokens - kept;
        let slot = (end - kept) % w;
        let head = kept.min(w - slot);
        for (buf, src) in [(&mut self.buf.keys, keys), (&mut self.buf.values, values)] {
            let ring = buf.as_mut().expect("ring has W slots");
            seq_write(ring, slot, src, first..first + head, Origin::Caller)?;
            if head < kept {
                seq_write(ring, 0, src, first + head..tokens, Origin::Caller)?;
            }
        }
        self.buf.offset = end;
        Ok(())
    }
}

impl fmt::Debug for RotatingKvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RotatingKvCache")
            .field("window", &self.window)
            .field("buffers", &self.buf)
            .finish()
    }
}

impl StateCache for RotatingKvCache {
    type State = Ring;

    fn capture(&self) -> Result<Option<Ring>> {
        let (Some(k), Some(v)) = (&self.buf.keys, &self.buf.values) else {
            return Ok(None);
        };
        let n = self.buf.offset.min(self.window);
        Ok(Some(Ring {
            slots: KvRows::copy_of(k, v, 0..n, self.buf.encoding)?,
            window: self.window,
            write_index: self.buf.offset % self.window,
        }))
    }

    fn live_offset(&self) -> usize {
        self.buf.offset
    }

    fn load(&mut self, snap: &RotatingSnapshot, target: usize) -> Result<()> {
        if snap.window != self.window {
            return Err(CacheError::InvalidArgument(format!(
                "snapshot of a window of {} positions given to a cache with a window of {}",
                snap.window, self.window
            )));
        }
        // Full-precision slots come back as they are, 8-bit ones dequantized.
        let (keys, values) = snap.slots.decoded(snap.slots.tokens())?;
        let (layout, _) = KvLayout::fitting(&keys, &values, self.buf.layout.as_ref())?;
        // mlx arrays are values: sharing the snapshot's buffers is safe, and the
        // next write copies them (they are not donatable while the snapshot lives).
        self.buf.keys = Some(keys);
        self.buf.values = Some(values);
        self.buf.layout = Some(layout);
        self.buf.offset = target;
        Ok(())
    }

    fn clear(&mut self) {
        self.buf.clear();
    }

    fn rewind(&self) -> Rewind {
        Rewind::Window(self.window)
    }

    fn truncate(&mut self, to: usize) {
        self.buf.offset = to;
    }
}

kvcache_api::snapshot_cache!(state: RotatingKvCache {
    /// The ring's `n = min(offset, W)` slots: keys `[B, H, n, Dk]`, values
    /// `[B, H, n, Dv]`; `None` when the cache is empty.
    fn read_state(&self) -> Result<Option<HostState>> {
        let (Some(k), Some(v)) = (&self.buf.keys, &self.buf.values) else {
            return Ok(None);
        };
        if self.buf.offset == 0 {
            return Ok(None);
        }
        let n = self.buf.offset.min(self.window);
        let arrays = vec![
            array_to_host(&seq_slice(k, 0, n)?)?,
            array_to_host(&seq_slice(v, 0, n)?)?,
        ];
        Ok(Some(HostState {
            offset: self.buf.offset,
            arrays,
        }))
    }

    /// Takes a ring as [`read_state`](SnapshotCache::read_state) gives it: two
    /// arrays, keys `[B, H, n, Dk]` and values `[B, H, n, Dv]` with
    /// `n = min(offset, W)`, of the cache's batch, heads, dims and dtypes
    /// (any, when empty). Anything else is an error that changes nothing.
    fn load_state(&mut self, state: &HostState) -> Result<bool> {
        let [keys, values] = &state.arrays[..] else {
            return Err(CacheError::ShapeMismatch {
                what: "rotating state (number of arrays)",
                expected: vec![2],
                got: vec![state.arrays.len()],
            });
        };
        let n = state.offset.min(self.window);
        if state.offset == 0 || keys.shape.len() != 4 || keys.shape[2] != n {
            let mut expected = keys.shape.clone();
            expected.resize(4, 0);
            expected[2] = n;
            return Err(CacheError::ShapeMismatch {
                what: "keys",
                expected,
                got: keys.shape.clone(),
            });
        }
        let (keys, values) = (array_from_host(keys)?, array_from_host(values)?);
        let (layout, _) = KvLayout::fitting(&keys, &values, self.buf.layout.as_ref())?;
        self.buf.keys = Some(keys);
        self.buf.values = Some(values);
        self.buf.layout = Some(layout);
        self.buf.offset = state.offset;
        Ok(true)
    }
});

impl LayerCache for RotatingKvCache {
    type Array = Array;

    /// Writes keys `[B, H, L, Dk]` and values `[B, H, L, Dv]` for positions
    /// `[offset, offset + L)` and returns what they attend to: see the type's
    /// docs for the shapes and the mask the batched case needs.
    fn update(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (layout, tokens) = KvLayout::of_update(keys, values, self.buf.layout.as_ref())?;
        let o = self.buf.offset;
        // The batched view is built from the ring before the write overwrites
        // slots the first new tokens still need.
        let batched = if tokens > 1 {
            let earlier = o.min(self.window - 1);
            Some(if earlier == 0 {
                (keys.clone(), values.clone())
            } else {
                let (old_k, old_v) = self.ordered(o - earlier, o)?;
                (
                    seq_concat(vec![old_k, keys.clone()], Origin::Caller)?,
                    seq_concat(vec![old_v, values.clone()], Origin::Caller)?,
                )
            })
        } else {
            None
        };
        self.write(keys, values)?;
        self.buf.layout = Some(layout);
        if let Some(view) = batched {
            return Ok(view);
        }
        let n = self.buf.offset.min(self.window);
        let (k, v) = (self.buf.keys.as_ref(), self.buf.values.as_ref());
        let (k, v) = (k.expect("written ring"), v.expect("written ring"));
        Ok((seq_slice(k, 0, n)?, seq_slice(v, 0, n)?))
    }

    /// The ring, keys `[B, H, capacity, Dk]` and values `[B, H, capacity, Dv]`
    /// (position `p` in slot `p % W`), or nothing when empty.
    fn state(&self) -> Vec<Array> {
        self.buf.arrays()
    }
}
