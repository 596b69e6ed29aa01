//! Candle-backed [`LayerCache`]s: one layer's keys and values of one live
//! sequence, pageable to [`Snapshot`](kvcache_api::Snapshot)s, so that `kvcache_trie::PrefixCache`
//! (written against [`SnapshotCache`](kvcache_api::SnapshotCache) only) can drive the candle model.
//!
//! - [`CandleKv`], a global layer's cache (a row cache): keys and values
//!   `[kv_heads, capacity, head_dim]` with the first `offset` rows along
//!   dimension 1 live; capacity doubles as needed. A snapshot owns a compact
//!   copy of its range ([`KvRows`]).
//! - [`CandleWindow`], a sliding-window layer's cache (a state cache): only
//!   the last `W` positions, in temporal order; a snapshot holds that whole
//!   window (the same [`KvRows`]).
//!
//! Snapshot, restore, merge and split are [`kvcache_api::paging`]'s, written
//! once for every row cache and every state cache.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use kvcache_api::paging::{Payload, Rewind, RowCache, Rows, RowsSnapshot, State, StateCache, StateSnapshot};
use kvcache_api::{CacheError, KvLayout, LayerCache, LayerRows, LayerRowsMut, Result};

fn be(e: candle_core::Error) -> CacheError {
    CacheError::backend(e)
}

/// Paged-out keys and values of one layer for tokens `[from, to)`: its [`KvRows`].
pub type KvSnapshot = RowsSnapshot<KvRows>;

/// Keys and values of `n` consecutive tokens, `[kv_heads, n, head_dim]` each,
/// in compact storage of their own.
#[derive(Debug)]
pub struct KvRows {
    keys: Tensor,
    values: Tensor,
}

impl KvRows {
    /// Keys, `[kv_heads, n, head_dim]`.
    pub fn keys(&self) -> &Tensor {
        &self.keys
    }

    /// Values, `[kv_heads, n, head_dim]`.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    /// Compact copies of rows `[from, from + n)` of `keys` and `values`.
    fn copy_of(keys: &Tensor, values: &Tensor, from: usize, n: usize) -> Result<Self> {
        // `force_contiguous` makes compact, owned storage: the rows keep only
        // their range (`copy` would clone the whole buffer on the CPU).
        let part = |t: &Tensor| {
            t.narrow(1, from, n)
                .and_then(|t| t.force_contiguous())
                .map_err(be)
        };
        Ok(KvRows {
            keys: part(keys)?,
            values: part(values)?,
        })
    }
}

impl Payload for KvRows {
    fn size_bytes(&self) -> usize {
        (self.keys.elem_count() + self.values.elem_count()) * self.keys.dtype().size_in_bytes()
    }
}

/// A window cache's snapshot holds its whole window as rows.
impl State for KvRows {}

impl Rows for KvRows {
    fn tokens(&self) -> usize {
        self.keys.dims()[1]
    }

    fn concat(parent: &Self, child: &Self) -> Result<Self> {
        let (p, c) = (parent.keys.dims(), child.keys.dims());
        if (p[0], p[2]) != (c[0], c[2]) {
            return Err(CacheError::InvalidArgument(format!(
                "cannot merge rows of shape {p:?} and {c:?}"
            )));
        }
        Ok(KvRows {
            keys: Tensor::cat(&[&parent.keys, &child.keys], 1).map_err(be)?,
            values: Tensor::cat(&[&parent.values, &child.values], 1).map_err(be)?,
        })
    }

    fn split(&self, at: usize) -> Result<(Self, Self)> {
        let rest = self.tokens() - at;
        Ok((
            KvRows::copy_of(&self.keys, &self.values, 0, at)?,
            KvRows::copy_of(&self.keys, &self.values, at, rest)?,
        ))
    }
}

/// One layer's cache of one live sequence (see the module docs).
#[derive(Debug)]
pub struct CandleKv {
    kv_heads: usize,
    head_dim: usize,
    device: Device,
    /// `[kv_heads, capacity, head_dim]`, or `None` before the first token.
    keys: Option<Tensor>,
    values: Option<Tensor>,
    offset: usize,
}

impl CandleKv {
    /// An empty cache for `kv_heads` heads of `head_dim` (f32) on `device`.
    pub fn new(kv_heads: usize, head_dim: usize, device: &Device) -> Self {
        CandleKv {
            kv_heads,
            head_dim,
            device: device.clone(),
            keys: None,
            values: None,
            offset: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dim(1).unwrap_or(0))
    }

    /// Bytes the live buffers hold (their whole capacity, live rows or not).
    pub fn held_bytes(&self) -> usize {
        2 * self.kv_heads * self.capacity() * self.head_dim * DType::F32.size_in_bytes()
    }

    /// Makes room for `need` tokens, keeping the live ones.
    fn reserve(&mut self, need: usize) -> Result<()> {
        if need <= self.capacity() {
            return Ok(());
        }
        let cap = need.max(2 * self.capacity()).max(64);
        let shape = (self.kv_heads, cap, self.head_dim);
        let k = Tensor::zeros(shape, DType::F32, &self.device).map_err(be)?;
        let v = Tensor::zeros(shape, DType::F32, &self.device).map_err(be)?;
        if self.offset > 0 {
            let (ok, ov) = self.live().map_err(be)?;
            k.slice_set(&ok.contiguous().map_err(be)?, 1, 0).map_err(be)?;
            v.slice_set(&ov.contiguous().map_err(be)?, 1, 0).map_err(be)?;
        }
        self.keys = Some(k);
        self.values = Some(v);
        Ok(())
    }

    /// Views of the live rows, `[kv_heads, offset, head_dim]` each.
    fn live(&self) -> candle_core::Result<(Tensor, Tensor)> {
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Ok((k.narrow(1, 0, self.offset)?, v.narrow(1, 0, self.offset)?)),
            _ => candle_core::bail!("empty layer cache"),
        }
    }

    /// Checks that host rows of `layout` fit this cache (f32, same heads and dims).
    fn expect_layout(&self, layout: &KvLayout) -> Result<()> {
        let mine = KvLayout::new(
            layout.layers,
            self.kv_heads,
            self.head_dim,
            kvcache_api::DType::F32,
        );
        mine.expect(layout)
    }

    /// Writes `[kv_heads, n, head_dim]` keys and values at offset `at`
    /// (`at <= offset`); the offset becomes `at + n`.
    fn write(&mut self, at: usize, keys: &Tensor, values: &Tensor) -> Result<()> {
        let n = keys.dim(1).map_err(be)?;
        self.offset = self.offset.min(at);
        self.reserve(at + n)?;
        let (k, v) = (
            self.keys.as_ref().expect("reserved"),
            self.values.as_ref().expect("reserved"),
        );
        k.slice_set(&keys.contiguous().map_err(be)?, 1, at).map_err(be)?;
        v.slice_set(&values.contiguous().map_err(be)?, 1, at)
            .map_err(be)?;
        self.offset = at + n;
        Ok(())
    }

    /// Appends `[kv_heads, n, head_dim]` keys and values.
    fn append(&mut self, keys: &Tensor, values: &Tensor) -> Result<()> {
        self.write(self.offset, keys, values)
    }
}

impl RowCache for CandleKv {
    type Rows = KvRows;

    fn copy_rows(&self, rows: Range<usize>) -> Result<KvRows> {
        let (k, v) = self.live().map_err(be)?;
        KvRows::copy_of(&k, &v, rows.start, rows.len())
    }

    fn live_offset(&self) -> usize {
        self.offset
    }

    fn write_rows(&mut self, at: usize, rows: &KvRows, take: usize) -> Result<()> {
        expect_rows(rows, self.kv_heads, self.head_dim)?;
        if take == 0 {
            self.offset = at;
            return Ok(());
        }
        let k = rows.keys.narrow(1, 0, take).map_err(be)?;
        let v = rows.values.narrow(1, 0, take).map_err(be)?;
        self.write(at, &k, &v)
    }

    fn clear(&mut self) {
        self.keys = None;
        self.values = None;
        self.offset = 0;
    }

    fn truncate(&mut self, to: usize) {
        self.offset = to;
    }
}

kvcache_api::snapshot_cache!(rows: CandleKv {
    /// Host rows are `[kv_heads, rows, head_dim]` f32, like the live buffers.
    fn read_rows(&self, rows: Range<usize>, mut out: LayerRowsMut<'_>) -> Result<bool> {
        self.expect_layout(&out.layout)?;
        if rows.end > self.offset || rows.start > rows.end || out.tokens != rows.len() {
            return Ok(false);
        }
        let (k, v) = self.live().map_err(be)?;
        let n = rows.len();
        for (tensor, keys) in [(k, true), (v, false)] {
            let data = tensor
                .narrow(1, rows.start, n)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(be)?;
            for head in 0..self.kv_heads {
                let dst = if keys {
                    out.head_keys(head, 0..n)
                } else {
                    out.head_values(head, 0..n)
                };
                let src = &data[head * n * self.head_dim..(head + 1) * n * self.head_dim];
                for (d, x) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        Ok(true)
    }

    fn append_rows(&mut self, src: LayerRows<'_>, rows: Range<usize>) -> Result<bool> {
        self.expect_layout(&src.layout)?;
        if rows.end > src.tokens || rows.start > rows.end {
            return Err(CacheError::InvalidArgument(format!(
                "rows {rows:?} outside the {} held",
                src.tokens
            )));
        }
        if rows.is_empty() {
            return Ok(true);
        }
        let n = rows.len();
        let gather = |keys: bool| -> Result<Tensor> {
            let mut data = Vec::with_capacity(self.kv_heads * n * self.head_dim);
            for head in 0..self.kv_heads {
                let bytes = if keys {
                    src.head_keys(head, rows.clone())
                } else {
                    src.head_values(head, rows.clone())
                };
                data.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
            }
            Tensor::from_vec(data, (self.kv_heads, n, self.head_dim), &self.device).map_err(be)
        };
        let (k, v) = (gather(true)?, gather(false)?);
        self.append(&k, &v)?;
        Ok(true)
    }
});

impl LayerCache for CandleKv {
    type Array = Tensor;

    /// `keys`/`values`: `[1, kv_heads, n, head_dim]`; returns everything the new
    /// tokens attend to, `[1, kv_heads, offset + n, head_dim]` each.
    fn update(&mut self, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        let k = expect_update(keys, "keys", self.kv_heads, self.head_dim)?;
        let v = expect_update(values, "values", self.kv_heads, self.head_dim)?;
        self.append(&k, &v)?;
        let (k, v) = self.live().map_err(be)?;
        Ok((k.unsqueeze(0).map_err(be)?, v.unsqueeze(0).map_err(be)?))
    }

    fn state(&self) -> Vec<Tensor> {
        self.live().map(|(k, v)| vec![k, v]).unwrap_or_default()
    }
}

/// Checks that `rows` are `[kv_heads, _, head_dim]` f32 keys and values.
fn expect_rows(rows: &KvRows, kv_heads: usize, head_dim: usize) -> Result<()> {
    for (what, t) in [("keys", &rows.keys), ("values", &rows.values)] {
        match t.dims() {
            &[h, _, d] if h == kv_heads && d == head_dim && t.dtype() == DType::F32 => {}
            dims => {
                return Err(CacheError::ShapeMismatch {
                    what,
                    expected: vec![kv_heads, 0, head_dim],
                    got: dims.to_vec(),
                })
            }
        }
    }
    Ok(())
}

/// Checks an update's keys or values, `[1, kv_heads, n, head_dim]`, and
/// drops the batch dimension.
fn expect_update(t: &Tensor, what: &'static str, kv_heads: usize, head_dim: usize) -> Result<Tensor> {
    match t.dims() {
        &[1, h, _, d] if h == kv_heads && d == head_dim => t.squeeze(0).map_err(be),
        dims => Err(CacheError::ShapeMismatch {
            what,
            expected: vec![1, kv_heads, 0, head_dim],
            got: dims.to_vec(),
        }),
    }
}

/// One sliding-window layer's cache of one live sequence: a query at
/// position `p` sees keys `p - W + 1 ..= p`, so only the last `W` positions
/// are kept.
///
/// State: keys and values `[kv_heads, n, head_dim]` (f32) of positions
/// `[offset - n, offset)` in temporal order, `n = min(offset, W)`, each in
/// compact storage of its own that is never written in place (an update
/// builds new tensors), so snapshots share it.
///
/// # What [`update`](LayerCache::update) returns
/// Let `o` be the offset before an update of `L` tokens and
/// `E = min(o, W - 1)` the earlier positions the first new token can see: keys
/// and values `[1, kv_heads, E + L, head_dim]` of positions `o - E .. o + L`
/// in temporal order. When `E + L > W` the caller masks the window as well as
/// causality: query `i` (position `o + i`) sees column `j` (position
/// `o - E + j`) iff `i + E - W < j <= i + E`.
///
/// # Rewind and snapshots
/// As `kvcache_mlx`'s rotating cache ([`Rewind::Window`]): without a snapshot
/// the cache rewinds only while nothing has left the window
/// (`offset <= W`), or to 0; a snapshot holds the whole window and restores
/// at its end `b`, or at any earlier target when `b <= W`; merging keeps the
/// child, splitting is refused.
#[derive(Debug)]
pub struct CandleWindow {
    window: usize,
    kv_heads: usize,
    head_dim: usize,
    device: Device,
    /// The retained positions, `None` when empty.
    rows: Option<KvRows>,
    offset: usize,
}

impl CandleWindow {
    /// An empty cache with a window of `window` positions for `kv_heads`
    /// heads of `head_dim` (f32) on `device` (`InvalidArgument` if `window`
    /// is 0).
    pub fn new(window: usize, kv_heads: usize, head_dim: usize, device: &Device) -> Result<Self> {
        if window == 0 {
            return Err(CacheError::InvalidArgument("a window of 0 positions".into()));
        }
        Ok(CandleWindow {
            window,
            kv_heads,
            head_dim,
            device: device.clone(),
            rows: None,
            offset: 0,
        })
    }

    /// The window `W`.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Bytes the live window holds.
    pub fn held_bytes(&self) -> usize {
        self.rows.as_ref().map_or(0, Payload::size_bytes)
    }

    /// The device of the cache.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Keeps the last `n` rows of `keys` and `values` (`[kv_heads, m, head_dim]`,
    /// `n <= m`) as the live window, in storage of their own.
    fn keep_last(&mut self, keys: &Tensor, values: &Tensor, n: usize) -> Result<()> {
        let m = keys.dim(1).map_err(be)?;
        self.rows = if n == 0 {
            None
        } else {
            Some(KvRows::copy_of(keys, values, m - n, n)?)
        };
        Ok(())
    }
}

impl StateCache for CandleWindow {
    type State = KvRows;

    fn live_offset(&self) -> usize {
        self.offset
    }

    fn rewind(&self) -> Rewind {
        Rewind::Window(self.window)
    }

    /// `to < offset <= W`: the window still holds every position.
    fn truncate(&mut self, to: usize) {
        if let Some(rows) = self.rows.take() {
            let kept = KvRows::copy_of(&rows.keys, &rows.values, 0, to);
            // Narrowing evaluated rows of the cache's own shape cannot fail.
            self.rows = (to > 0).then(|| kept.expect("rows within the window"));
        }
        self.offset = to;
    }

    fn capture(&self) -> Result<Option<KvRows>> {
        // The live rows are never written in place: the snapshot shares them.
        Ok(self.rows.as_ref().map(|r| KvRows {
            keys: r.keys.clone(),
            values: r.values.clone(),
        }))
    }

    fn load(&mut self, snapshot: &StateSnapshot<KvRows>, target: usize) -> Result<()> {
        let rows = snapshot.payload();
        expect_rows(rows, self.kv_heads, self.head_dim)?;
        let end = kvcache_api::Snapshot::range(snapshot).end;
        if rows.tokens() != end.min(self.window) {
            return Err(CacheError::InvalidArgument(format!(
                "a window snapshot ending at {end} holds {} rows, expected {}",
                rows.tokens(),
                end.min(self.window)
            )));
        }
        self.rows = if target == end {
            Some(KvRows {
                keys: rows.keys.clone(),
                values: rows.values.clone(),
            })
        } else if target == 0 {
            None
        } else {
            // `target < end <= W`: the snapshot holds positions [0, end).
            Some(KvRows::copy_of(&rows.keys, &rows.values, 0, target)?)
        };
        self.offset = target;
        Ok(())
    }

    fn clear(&mut self) {
        self.rows = None;
        self.offset = 0;
    }
}

kvcache_api::snapshot_cache!(state: CandleWindow {});

impl LayerCache for CandleWindow {
    type Array = Tensor;

    /// `keys`/`values`: `[1, kv_heads, L, head_dim]`; returns the positions the
    /// new tokens attend to, `[1, kv_heads, E + L, head_dim]` each (see the
    /// type's docs for `E` and the mask).
    fn update(&mut self, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        let k = expect_update(keys, "keys", self.kv_heads, self.head_dim)?;
        let v = expect_update(values, "values", self.kv_heads, self.head_dim)?;
        let tokens = k.dim(1).map_err(be)?;
        let o = self.offset;
        let earlier = o.min(self.window - 1);
        let (k, v) = match &self.rows {
            Some(rows) if earlier > 0 => {
                let held = rows.tokens();
                let old = |t: &Tensor| t.narrow(1, held - earlier, earlier);
                let cat = |old: Tensor, new: &Tensor| Tensor::cat(&[&old, new], 1);
                (
                    cat(old(&rows.keys).map_err(be)?, &k).map_err(be)?,
                    cat(old(&rows.values).map_err(be)?, &v).map_err(be)?,
                )
            }
            _ => (k, v),
        };
        self.keep_last(&k, &v, (o + tokens).min(self.window))?;
        self.offset = o + tokens;
        Ok((k.unsqueeze(0).map_err(be)?, v.unsqueeze(0).map_err(be)?))
    }

    /// Keys and values `[kv_heads, min(offset, W), head_dim]` of the retained
    /// positions in temporal order, or nothing when empty.
    fn state(&self) -> Vec<Tensor> {
        self.rows
            .as_ref()
            .map(|r| vec![r.keys.clone(), r.values.clone()])
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcache_api::{DType as KvDType, HostKv, SnapshotCache};

    fn filled(tokens: usize) -> CandleKv {
        let mut cache = CandleKv::new(2, 4, &Device::Cpu);
        let n = 2 * tokens * 4;
        let keys = Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap();
        let keys = keys.reshape((1, 2, tokens, 4)).unwrap();
        let values = (&keys * -1.0).unwrap();
        cache.update(&keys, &values).unwrap();
        cache
    }

    #[test]
    fn rows_go_to_the_host_and_back() {
        let source = filled(7);
        let layout = KvLayout::new(1, 2, 4, KvDType::F32);
        let mut kv = HostKv::zeroed(layout, 2, 5);
        assert!(source.read_rows(2..7, kv.layer_mut(0)).unwrap());
        // Head 1, token 2 of the source: elements (1 * 7 + 2) * 4 ..
        let first = f32::from_le_bytes(kv.layer(0).head_keys(1, 0..1)[..4].try_into().unwrap());
        assert_eq!(first, 36.0);

        // A cache holding the first two rows takes the other five from the host.
        let mut target = filled(7);
        target.restore(None, 2).unwrap();
        assert!(target.append_rows(kv.layer(0), 0..5).unwrap());
        assert_eq!(target.offset(), 7);
        for (a, b) in source.state().iter().zip(target.state()) {
            let diff = (a - &b).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
        }
        // Rows that are not live, and host rows of another shape, are refused.
        assert!(!source
            .read_rows(5..9, HostKv::zeroed(layout, 5, 4).layer_mut(0))
            .unwrap());
        let other = KvLayout::new(1, 3, 4, KvDType::F32);
        assert!(target
            .append_rows(HostKv::zeroed(other, 0, 1).layer(0), 0..1)
            .is_err());
        assert_eq!(target.offset(), 7);
    }
}
