//! [`KvCache`]: the full-attention layer cache, a buffer that grows in steps.

use std::fmt;
use std::ops::Range;

use kvcache_api::paging::RowCache;
#[cfg(doc)]
use kvcache_api::SnapshotCache;
use kvcache_api::{CacheError, DType, KvLayout as HostLayout, LayerCache, LayerRows, LayerRowsMut, Result};
use mlx_rs::{Array, Dtype};

use super::arrays::{backend, compact_seq_slices, dim, eval, grow_write, seq_slice, KvLayout, Origin};
use super::buffers::KvBuffers;
use super::snapshot::{KvRows, SnapshotEncoding};
use super::DEFAULT_STEP;

/// Keys and values of every position of one layer, for full attention.
///
/// State: keys `[B, H, capacity, Dk]` and values `[B, H, capacity, Dv]`, of which
/// positions `[0, offset)` are meaningful. The capacity is a multiple of the step
/// (256 by default) and grows when an update does not fit; it never shrinks
/// until [`free`](SnapshotCache::free). The layout (B, H, Dk, Dv and dtypes) is
/// fixed by the first update or restore and released by `free`.
///
/// - [`update`](LayerCache::update) writes `L` positions at the offset and
///   returns views of `[0, offset + L)`; the caller applies the causal mask.
/// - [`snapshot(from)`](SnapshotCache::snapshot) copies just `[from, offset)`.
/// - [`restore`](SnapshotCache::restore) with a snapshot `[a, b)` needs the live
///   cache to hold `[0, a)` (`offset >= a`): it rewinds to `a`, writes the
///   snapshot's positions up to `target` and stops at `target <= b`. Without a
///   snapshot it rewinds to any `target <= offset`.
/// - [`merge`](SnapshotCache::merge) concatenates, [`split`](SnapshotCache::split)
///   makes two compact copies.
/// - [`read_rows`](SnapshotCache::read_rows) copies live rows to the host form
///   `[H, T, D]` (batch 1 only: a cache of several sequences answers `false`);
///   [`append_rows`](SnapshotCache::append_rows) writes host rows at the
///   offset as an update would. Both take f32, f16 and bf16.
pub struct KvCache {
    buf: KvBuffers,
}

impl KvCache {
    /// An empty cache growing in steps of [`DEFAULT_STEP`] positions.
    pub fn new() -> Self {
        KvCache {
            buf: KvBuffers::new(DEFAULT_STEP),
        }
    }

    /// An empty cache growing in steps of `step` positions (`InvalidArgument` if 0).
    pub fn with_step(step: usize) -> Result<Self> {
        if step == 0 {
            return Err(CacheError::InvalidArgument(
                "growth step must be at least 1".into(),
            ));
        }
        Ok(KvCache {
            buf: KvBuffers::new(step),
        })
    }

    /// The same cache keeping its snapshots as `encoding` says
    /// ([`SnapshotEncoding::Full`] by default; `InvalidArgument` for a group
    /// size mlx does not take). Restores from either kind of snapshot work
    /// whatever the cache's own encoding.
    pub fn with_snapshot_encoding(mut self, encoding: SnapshotEncoding) -> Result<Self> {
        self.buf.encoding = encoding.validated()?;
        Ok(self)
    }

    /// How the cache keeps its snapshots.
    pub fn snapshot_encoding(&self) -> SnapshotEncoding {
        self.buf.encoding
    }

    /// Positions the buffers can hold before they grow (0 when empty).
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Views of the live positions, keys `[B, H, offset, Dk]` and values
    /// `[B, H, offset, Dv]`, or `None` when the cache holds nothing.
    pub fn live(&self) -> Result<Option<(Array, Array)>> {
        match (&self.buf.keys, &self.buf.values) {
            (Some(k), Some(v)) if self.buf.offset > 0 => Ok(Some((
                seq_slice(k, 0, self.buf.offset)?,
                seq_slice(v, 0, self.buf.offset)?,
            ))),
            _ => Ok(None),
        }
    }

    /// Writes the first `n` positions of `keys`/`values` at `[start, start + n)`,
    /// the cache holding `[0, start)`.
    fn write(&mut self, start: usize, keys: &Array, values: &Array, n: usize, origin: Origin) -> Result<()> {
        let growth = (self.buf.step, usize::MAX);
        grow_write(&mut self.buf.keys, start, keys, 0..n, origin, growth)?;
        grow_write(&mut self.buf.values, start, values, 0..n, origin, growth)?;
        self.buf.offset = start + n;
        Ok(())
    }
}

/// The mlx dtype of a host dtype.
fn mlx_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::Float32,
        DType::F16 => Dtype::Float16,
        DType::BF16 => Dtype::Bfloat16,
    }
}

/// Checks that host rows of `host` fit a cache of `layout` (batch 1).
fn check_host(layout: &KvLayout, host: &HostLayout) -> Result<()> {
    let mismatch = |what, expected: String, got: String| CacheError::LayoutMismatch { what, expected, got };
    let fields = [
        ("kv_heads", layout.heads, host.kv_heads),
        ("head_dim", layout.k_dim, host.head_dim),
        ("head_dim_v", layout.v_dim, host.head_dim_v),
    ];
    for (what, cache, rows) in fields {
        if usize::try_from(cache).ok() != Some(rows) {
            return Err(mismatch(what, cache.to_string(), rows.to_string()));
        }
    }
    let want = mlx_dtype(host.dtype);
    for dtype in [layout.k_dtype, layout.v_dtype] {
        if dtype != want {
            return Err(mismatch("dtype", format!("{dtype:?}"), host.dtype.to_string()));
        }
    }
    Ok(())
}

/// Copies the evaluated, row-contiguous array `a` into `out` as little-endian bytes.
fn to_host(a: &Array, out: &mut [u8]) -> Result<()> {
    macro_rules! copy {
        ($t:ty) => {{
            let data = a.try_as_slice::<$t>().map_err(backend)?;
            let size = std::mem::size_of::<$t>();
            if data.len() * size != out.len() {
                return Err(CacheError::InvalidArgument(format!(
                    "{} elements read into {} bytes",
                    data.len(),
                    out.len()
                )));
            }
            for (dst, x) in out.chunks_exact_mut(size).zip(data) {
                dst.copy_from_slice(&x.to_le_bytes());
            }
        }};
    }
    match a.dtype() {
        Dtype::Float32 => copy!(f32),
        Dtype::Float16 => copy!(half::f16),
        Dtype::Bfloat16 => copy!(half::bf16),
        other => {
            return Err(CacheError::DTypeMismatch {
                what: "cache rows",
                expected: "f32, f16 or bf16".into(),
                got: format!("{other:?}"),
            })
        }
    }
    Ok(())
}

/// A `[1, H, n, D]` array of host rows: for each head, the bytes `head(h)` gives.
fn from_host<'a>(
    dtype: DType,
    heads: usize,
    n: usize,
    d: usize,
    head: impl Fn(usize) -> &'a [u8],
) -> Result<Array> {
    let shape = [1, dim(heads)?, dim(n)?, dim(d)?];
    macro_rules! build {
        ($t:ty) => {{
            let size = std::mem::size_of::<$t>();
            let mut data: Vec<$t> = Vec::with_capacity(heads * n * d);
            for h in 0..heads {
                data.extend(
                    head(h)
                        .chunks_exact(size)
                        .map(|b| <$t>::from_le_bytes(b.try_into().expect("element-sized chunk"))),
                );
            }
            Array::from_slice(&data, &shape)
        }};
    }
    Ok(match dtype {
        DType::F32 => build!(f32),
        DType::F16 => build!(half::f16),
        DType::BF16 => build!(half::bf16),
    })
}

impl Default for KvCache {
    fn default() -> Self {
        KvCache::new()
    }
}

impl fmt::Debug for KvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KvCache").field(&self.buf).finish()
    }
}

impl RowCache for KvCache {
    type Rows = KvRows;

    fn copy_rows(&self, rows: Range<usize>) -> Result<KvRows> {
        let (Some(k), Some(v)) = (&self.buf.keys, &self.buf.values) else {
            unreachable!("a cache holding rows has buffers");
        };
        KvRows::copy_of(k, v, rows, self.buf.encoding)
    }

    fn live_offset(&self) -> usize {
        self.buf.offset
    }

    /// Replays a snapshot's rows in place (layout checked first; 8-bit rows
    /// dequantized to the cache's dtype first).
    fn write_rows(&mut self, at: usize, rows: &KvRows, take: usize) -> Result<()> {
        // The layout check needs the dtype rows decode to: of one row at least.
        let (keys, values) = rows.decoded(take.max(1))?;
        let (layout, _) = KvLayout::fitting(&keys, &values, self.buf.layout.as_ref())?;
        if take == 0 {
            // Everything up to `at` is already live.
            self.buf.offset = at;
            return Ok(());
        }
        self.write(at, &keys, &values, take, Origin::Owned)?;
        self.buf.layout = Some(layout);
        Ok(())
    }

    fn clear(&mut self) {
        self.buf.clear();
    }

    fn truncate(&mut self, to: usize) {
        self.buf.offset = to;
    }
}

kvcache_api::snapshot_cache!(rows: KvCache {
    /// Copies live rows `rows` into `out` (`[H, rows.len(), D]` keys and values).
    fn read_rows(&self, rows: Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> {
        if rows.start > rows.end || rows.end > self.buf.offset {
            return Ok(false);
        }
        let (Some(k), Some(v), Some(layout)) = (&self.buf.keys, &self.buf.values, &self.buf.layout) else {
            return Ok(rows.is_empty());
        };
        if layout.batch != 1 {
            return Ok(false);
        }
        check_host(layout, &out.layout)?;
        if out.tokens != rows.len() {
            return Err(CacheError::InvalidArgument(format!(
                "{} rows read into a layer of {} tokens",
                rows.len(),
                out.tokens
            )));
        }
        if rows.is_empty() {
            return Ok(true);
        }
        let [keys, values] = compact_seq_slices([(k, rows.start, rows.end), (v, rows.start, rows.end)])?;
        to_host(&keys, out.keys)?;
        to_host(&values, out.values)?;
        Ok(true)
    }

    /// Appends rows `rows` of `src` at the offset, as an update of them would.
    fn append_rows(&mut self, src: LayerRows<'_>, rows: Range<usize>) -> Result<bool> {
        if rows.start > rows.end || rows.end > src.tokens {
            return Err(CacheError::InvalidArgument(format!(
                "rows {rows:?} of a layer holding {} tokens",
                src.tokens
            )));
        }
        let host = src.layout;
        if let Some(layout) = &self.buf.layout {
            if layout.batch != 1 {
                return Ok(false);
            }
            check_host(layout, &host)?;
        }
        if rows.is_empty() {
            return Ok(true);
        }
        let n = rows.len();
        let keys = from_host(host.dtype, host.kv_heads, n, host.head_dim, |h| {
            src.head_keys(h, rows.clone())
        })?;
        let values = from_host(host.dtype, host.kv_heads, n, host.head_dim_v, |h| {
            src.head_values(h, rows.clone())
        })?;
        let (layout, _) = KvLayout::fitting(&keys, &values, self.buf.layout.as_ref())?;
        self.write(self.buf.offset, &keys, &values, n, Origin::Caller)?;
        self.buf.layout = Some(layout);
        eval(self.buf.keys.iter().chain(self.buf.values.iter()))?;
        Ok(true)
    }
});

impl LayerCache for KvCache {
    type Array = Array;

    /// Writes keys `[B, H, L, Dk]` and values `[B, H, L, Dv]` at positions
    /// `[offset, offset + L)` and returns views of `[0, offset + L)`:
    /// `[B, H, offset + L, Dk]` and `[B, H, offset + L, Dv]`. Query `i` of the
    /// update (position `offset + i`) may attend to columns `0..=offset + i`.
    fn update(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (layout, tokens) = KvLayout::of_update(keys, values, self.buf.layout.as_ref())?;
        self.write(self.buf.offset, keys, values, tokens, Origin::Caller)?;
        self.buf.layout = Some(layout);
        let (k, v) = self.live()?.expect("a cache just written to holds positions");
        Ok((k, v))
    }

    /// The whole buffers, keys `[B, H, capacity, Dk]` and values
    /// `[B, H, capacity, Dv]` (only `[0, offset)` is meaningful), or nothing when
    /// empty: what the cache keeps alive.
    fn state(&self) -> Vec<Array> {
        self.buf.arrays()
    }
}
