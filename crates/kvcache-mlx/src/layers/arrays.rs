//! mlx-rs helpers shared by the layer caches: error mapping, sequence-axis
//! slicing and writing, compact copies, and K/V layout checks.

use std::fmt::Display;
use std::ops::Range;

use kvcache_api::{CacheError, Result};
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{Array, Dtype};

/// The sequence axis of `[B, H, L, D]` arrays.
pub(crate) const SEQ_AXIS: i32 = 2;

/// Maps an mlx error to [`CacheError::Backend`].
pub(crate) fn backend(err: impl Display) -> CacheError {
    CacheError::backend(err)
}

/// `n` as an mlx dimension.
pub(crate) fn dim(n: usize) -> Result<i32> {
    i32::try_from(n)
        .map_err(|_| CacheError::InvalidArgument(format!("{n} positions exceed mlx's i32 dimension limit")))
}

/// The shape of `a` as `usize`s, for error messages.
pub(crate) fn shape_of(a: &Array) -> Vec<usize> {
    a.shape().iter().map(|&d| d as usize).collect()
}

/// Length of the sequence axis of a `[B, H, L, D]` array.
pub(crate) fn seq_len(a: &Array) -> usize {
    a.dim(SEQ_AXIS) as usize
}

/// Rounds `n` up to a multiple of `step` (`step > 0`).
pub(crate) fn round_up(n: usize, step: usize) -> usize {
    n.div_ceil(step) * step
}

/// Lazy view of positions `[start, end)` along the sequence axis.
pub(crate) fn seq_slice(a: &Array, start: usize, end: usize) -> Result<Array> {
    a.try_index((.., .., dim(start)?..dim(end)?, ..)).map_err(backend)
}

/// Where an array comes from, which decides how it may be copied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The model's keys/values: possibly strided views, copied element-wise.
    Caller,
    /// The cache's own buffers and snapshot copies: row-contiguous, so they can
    /// be reinterpreted as wide integers at no cost and copied as such. mlx's
    /// CPU copy loop moves one element per step; for f16 rows the u64 view
    /// moves four per step and runs 2-3x faster.
    Owned,
}

/// The widest unsigned integer dtype (up to 8 bytes) that tiles the last axis
/// of `a` and is wider than its elements, if any.
fn wide_dtype(a: &Array) -> Option<Dtype> {
    let row_bytes = a.shape().last().map(|&d| d as usize * a.item_size())?;
    [(8, Dtype::Uint64), (4, Dtype::Uint32), (2, Dtype::Uint16)]
        .into_iter()
        .find(|&(w, _)| w > a.item_size() && row_bytes % w == 0)
        .map(|(_, dtype)| dtype)
}

/// `a` reinterpreted as `dtype` (a free view of a row-contiguous array).
fn reinterpret(a: &Array, dtype: Dtype) -> Result<Array> {
    if a.dtype() == dtype {
        return Ok(a.clone());
    }
    a.view_dtype(dtype).map_err(backend)
}

/// `[B, H, *, D]` arrays of one dtype joined along the sequence axis (lazy),
/// by `Concatenate`, which always allocates its output and copies into it.
/// mlx's `concatenate` hands back a lone input unchanged, so a lone part is
/// joined with an empty slice of itself.
fn concat_fresh(mut parts: Vec<Array>) -> Result<Array> {
    if parts.len() == 1 {
        let empty = seq_slice(&parts[0], 0, 0)?;
        parts.push(empty);
    }
    mlx_rs::ops::concatenate(&parts, SEQ_AXIS).map_err(backend)
}

/// Concatenates `[B, H, *, D]` arrays of one dtype along the sequence axis into
/// a fresh buffer that aliases none of them (lazy).
pub(crate) fn seq_concat(parts: Vec<Array>, origin: Origin) -> Result<Array> {
    let dtype = parts[0].dtype();
    match wide_dtype(&parts[0]).filter(|_| origin == Origin::Owned) {
        Some(wide) => {
            let parts = parts
                .iter()
                .map(|p| reinterpret(p, wide))
                .collect::<Result<Vec<_>>>()?;
            reinterpret(&concat_fresh(parts)?, dtype)
        }
        None => concat_fresh(parts),
    }
}

/// Positions `rows` of `update`, reinterpreted as `wide` (the whole array is
/// reinterpreted before slicing: free for a row-contiguous array, while a
/// strided slice would be copied).
fn rows_as(update: &Array, rows: &Range<usize>, wide: Dtype) -> Result<Array> {
    let whole = reinterpret(update, wide)?;
    if rows.start == 0 && rows.end == seq_len(update) {
        return Ok(whole);
    }
    seq_slice(&whole, rows.start, rows.end)
}

/// Overwrites positions `[start, start + rows.len())` of `buf` with positions
/// `rows` of `update` (`[B, H, L, D]`). mlx does this in place when `buf` holds
/// the only reference to its buffer.
pub(crate) fn seq_write(
    buf: &mut Array,
    start: usize,
    update: &Array,
    rows: Range<usize>,
    origin: Origin,
) -> Result<()> {
    #[cfg(target_os = "linux")]
    if origin == Origin::Owned && super::host::write_rows(buf, start, update, rows.clone())? {
        return Ok(());
    }
    let end = start + rows.len();
    let range = (.., .., dim(start)?..dim(end)?, ..);
    let dtype = buf.dtype();
    let wide = match origin {
        Origin::Owned if update.dtype() == dtype => wide_dtype(buf).unwrap_or(dtype),
        _ => dtype,
    };
    let src = rows_as(update, &rows, if wide == dtype { update.dtype() } else { wide })?;
    if wide == dtype {
        return buf.try_index_mut(range, &src).map_err(backend);
    }
    let mut wide_buf = reinterpret(buf, wide)?;
    wide_buf.try_index_mut(range, &src).map_err(backend)?;
    *buf = reinterpret(&wide_buf, dtype)?;
    Ok(())
}

/// Evaluated copies of each output's parts (the cache's own row-contiguous
/// `[B, H, *, D]` arrays of one dtype) joined along the sequence axis, each in a
/// buffer of its own (see [`compact_seq_slices`]).
pub(crate) fn compact_seq_concats<const N: usize>(outputs: [&[&Array]; N]) -> Result<[Array; N]> {
    #[cfg(target_os = "linux")]
    {
        let runs: Vec<Vec<(&Array, Range<usize>)>> = outputs
            .iter()
            .map(|parts| parts.iter().map(|&p| (p, 0..seq_len(p))).collect())
            .collect();
        let views: Vec<&[(&Array, Range<usize>)]> = runs.iter().map(Vec::as_slice).collect();
        if let Some(copies) = super::host::compact_rows(&views)? {
            return Ok(copies
                .try_into()
                .unwrap_or_else(|_| unreachable!("one copy per output")));
        }
    }
    let joined = outputs
        .iter()
        .map(|parts| seq_concat(parts.iter().map(|&p| p.clone()).collect(), Origin::Owned))
        .collect::<Result<Vec<_>>>()?;
    eval(&joined)?;
    Ok(joined
        .try_into()
        .unwrap_or_else(|_| unreachable!("one copy per output")))
}

/// `[B, H, n, D]` zeros shaped and typed like `like`.
pub(crate) fn seq_zeros(like: &Array, n: usize) -> Result<Array> {
    let mut shape = like.shape().to_vec();
    shape[SEQ_AXIS as usize] = dim(n)?;
    mlx_rs::ops::zeros_dtype(&shape, like.dtype()).map_err(backend)
}

/// Writes positions `rows` of `update` at `[start, start + rows.len())` of a
/// growable buffer whose meaningful content is `[0, start)`.
///
/// When the buffer is missing or too short, a new one of
/// `min(round_up(start + rows.len(), step), max_len)` positions is built in one
/// pass (kept prefix, update, zero tail) rather than zero-filled and then
/// written; the new buffer never aliases `update`, which may be a view of a
/// larger array (a fused QKV projection) that the cache must not pin.
/// `max_len` must be at least `start + rows.len()`; `update` must have the
/// buffer's dtype.
pub(crate) fn grow_write(
    buf: &mut Option<Array>,
    start: usize,
    update: &Array,
    rows: Range<usize>,
    origin: Origin,
    growth: (usize, usize),
) -> Result<()> {
    let (step, max_len) = growth;
    let end = start + rows.len();
    debug_assert!(end <= max_len);
    match buf {
        Some(b) if seq_len(b) >= end => seq_write(b, start, update, rows, origin),
        _ => {
            let len = round_up(end, step).min(max_len);
            // A new buffer that is exactly all of an owned `update`: one memcpy.
            #[cfg(target_os = "linux")]
            if origin == Origin::Owned && start == 0 && rows == (0..seq_len(update)) && len == end {
                if let Some(copy) = super::host::whole_copy(update)? {
                    *buf = Some(copy);
                    return Ok(());
                }
            }
            let dtype = update.dtype();
            let wide = match origin {
                Origin::Owned => wide_dtype(update).unwrap_or(dtype),
                Origin::Caller => dtype,
            };
            let mut parts = Vec::with_capacity(3);
            if start > 0 {
                let old = buf.as_ref().expect("a cache with content has a buffer");
                parts.push(rows_as(old, &(0..start), wide)?);
            }
            let src = rows_as(update, &rows, wide)?;
            if len > end {
                let zeros = seq_zeros(&src, len - end)?;
                parts.push(src);
                parts.push(zeros);
            } else {
                parts.push(src);
            }
            *buf = Some(reinterpret(&concat_fresh(parts)?, dtype)?);
            Ok(())
        }
    }
}

/// Evaluated copies of positions `[start, end)` of each `buf`, one of the
/// cache's own row-contiguous `[B, H, L, D]` arrays, each in a buffer of its own
/// exactly `nbytes()` long.
///
/// mlx's `copy` always shares the source buffer, and `contiguous` shares it
/// when the slice is row-contiguous and the buffer at most 16 KiB larger;
/// either would let a snapshot keep the live cache's whole buffer alive (a
/// leak the size of the cache per snapshot). The copy is made by
/// `Concatenate`, which always allocates, on a wide integer view of the
/// buffer (see [`Origin::Owned`]), and then checked: should
/// an mlx version hand back a shared buffer anyway, the data is copied on the
/// host instead. All copies are evaluated together: every evaluation hands the
/// work to mlx's stream thread and waits for it, which on a loaded machine
/// costs as much as a small copy.
pub(crate) fn compact_seq_slices<const N: usize>(parts: [(&Array, usize, usize); N]) -> Result<[Array; N]> {
    // On Linux, one memcpy-class pass straight into mlx's new buffers.
    #[cfg(target_os = "linux")]
    {
        let runs = parts.map(|(buf, start, end)| [(buf, start..end)]);
        let outputs: Vec<&[(&Array, Range<usize>)]> = runs.iter().map(|r| &r[..]).collect();
        if let Some(copies) = super::host::compact_rows(&outputs)? {
            return Ok(copies
                .try_into()
                .unwrap_or_else(|_| unreachable!("one copy per part")));
        }
    }
    let mut slices = Vec::with_capacity(N);
    let mut copies = Vec::with_capacity(N);
    for &(buf, start, end) in &parts {
        let dtype = buf.dtype();
        let wide = wide_dtype(buf).unwrap_or(dtype);
        // Reinterpret the whole buffer before slicing: a view of a row-contiguous
        // array is free, a view of a strided slice would copy.
        let slice = seq_slice(&reinterpret(buf, wide)?, start, end)?;
        copies.push(reinterpret(&concat_fresh(vec![slice.clone()])?, dtype)?);
        slices.push(slice);
    }
    eval(&copies)?;
    let copies = copies
        .into_iter()
        .zip(&slices)
        .zip(parts)
        .map(|((copy, slice), (buf, start, end))| {
            if owns_its_buffer(&copy, slice) {
                Ok(copy)
            } else {
                host_copy(&seq_slice(buf, start, end)?)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(copies
        .try_into()
        .unwrap_or_else(|_| unreachable!("one copy per part")))
}

/// An evaluated copy of any array `a` in a buffer of its own, exactly
/// `a.nbytes()` long (see [`compact_seq_slices`]), copied element-wise.
pub(crate) fn compact_copy(a: &Array) -> Result<Array> {
    if a.ndim() == 0 {
        let flat = compact_copy(&a.reshape(&[1]).map_err(backend)?)?;
        return flat.reshape(&[]).map_err(backend);
    }
    let empty = a.try_index(0..0).map_err(backend)?;
    let copy = mlx_rs::ops::concatenate(&[a, &empty], 0).map_err(backend)?;
    copy.eval().map_err(backend)?;
    if owns_its_buffer(&copy, a) {
        return Ok(copy);
    }
    host_copy(a)
}

/// Copies `a` through host memory into a new array (evaluated).
fn host_copy(a: &Array) -> Result<Array> {
    let contiguous = a.contiguous().map_err(backend)?;
    contiguous.eval().map_err(backend)?;
    // `deep_clone` copies evaluated row-contiguous data into a new array.
    let copy = contiguous.deep_clone();
    copy.eval().map_err(backend)?;
    Ok(copy)
}

/// Whether `copy` (evaluated, same shape as `src`) is row-contiguous data that
/// does not start where `src`'s does, i.e. not a view of `src`'s buffer.
fn owns_its_buffer(copy: &Array, src: &Array) -> bool {
    match (data_address(copy), data_address(src)) {
        (Some(c), Some(s)) => c != s,
        // A row-contiguous array cannot share a strided view's buffer layout.
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// The address of an evaluated row-contiguous array's first element, or
/// `None` when it is strided, empty or fails to evaluate.
fn data_address(a: &Array) -> Option<usize> {
    macro_rules! address {
        ($t:ty) => {
            a.try_as_slice::<$t>().ok().map(|s| s.as_ptr() as usize)
        };
    }
    match a.dtype() {
        Dtype::Bool => address!(bool),
        Dtype::Uint8 => address!(u8),
        Dtype::Uint16 => address!(u16),
        Dtype::Uint32 => address!(u32),
        Dtype::Uint64 => address!(u64),
        Dtype::Int8 => address!(i8),
        Dtype::Int16 => address!(i16),
        Dtype::Int32 => address!(i32),
        Dtype::Int64 => address!(i64),
        Dtype::Float16 => address!(half::f16),
        Dtype::Float32 => address!(f32),
        Dtype::Float64 => address!(f64),
        Dtype::Bfloat16 => address!(half::bf16),
        Dtype::Complex64 => address!(mlx_rs::complex64),
    }
}

/// Evaluates `arrays` together.
pub(crate) fn eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    mlx_rs::transforms::eval(arrays).map_err(backend)
}

/// Shapes and dtypes a K/V cache accepts: keys `[B, H, L, Dk]`, values `[B, H, L, Dv]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KvLayout {
    pub(crate) batch: i32,
    pub(crate) heads: i32,
    pub(crate) k_dim: i32,
    pub(crate) v_dim: i32,
    pub(crate) k_dtype: Dtype,
    pub(crate) v_dtype: Dtype,
}

impl KvLayout {
    /// The layout of a keys/values pair and its token count, checking that both
    /// are 4-D with the same batch, heads and tokens.
    pub(crate) fn of(keys: &Array, values: &Array) -> Result<(Self, usize)> {
        if keys.ndim() != 4 {
            return Err(CacheError::InvalidArgument(format!(
                "keys must be [batch, kv_heads, tokens, head_dim], got shape {:?}",
                keys.shape()
            )));
        }
        let k = keys.shape();
        let expected_values = [k[0] as usize, k[1] as usize, k[2] as usize];
        let v = values.shape();
        if values.ndim() != 4 || v[..3].iter().map(|&d| d as usize).ne(expected_values) {
            let mut expected = expected_values.to_vec();
            expected.push(v.last().copied().unwrap_or(0) as usize);
            return Err(CacheError::ShapeMismatch {
                what: "values",
                expected,
                got: shape_of(values),
            });
        }
        let layout = KvLayout {
            batch: k[0],
            heads: k[1],
            k_dim: k[3],
            v_dim: v[3],
            k_dtype: keys.dtype(),
            v_dtype: values.dtype(),
        };
        Ok((layout, k[2] as usize))
    }

    /// Checks that `other` (of an update of `tokens` positions) matches `self`.
    pub(crate) fn check(&self, other: &KvLayout, tokens: usize) -> Result<()> {
        let shape = |d: i32| vec![self.batch as usize, self.heads as usize, tokens, d as usize];
        let got = |d: i32| vec![other.batch as usize, other.heads as usize, tokens, d as usize];
        if (self.batch, self.heads, self.k_dim) != (other.batch, other.heads, other.k_dim) {
            return Err(CacheError::ShapeMismatch {
                what: "keys",
                expected: shape(self.k_dim),
                got: got(other.k_dim),
            });
        }
        if self.v_dim != other.v_dim {
            return Err(CacheError::ShapeMismatch {
                what: "values",
                expected: shape(self.v_dim),
                got: got(other.v_dim),
            });
        }
        for (what, expected, got) in [
            ("keys", self.k_dtype, other.k_dtype),
            ("values", self.v_dtype, other.v_dtype),
        ] {
            if expected != got {
                return Err(CacheError::DTypeMismatch {
                    what,
                    expected: format!("{expected:?}"),
                    got: format!("{got:?}"),
                });
            }
        }
        Ok(())
    }

    /// Checks an optional stored layout against `other`; `None` accepts anything.
    pub(crate) fn check_opt(stored: Option<&KvLayout>, other: &KvLayout, tokens: usize) -> Result<()> {
        stored.map_or(Ok(()), |s| s.check(other, tokens))
    }

    /// The layout of a keys/values pair and its token count, checked against
    /// the layout a cache holds (`stored`, any when `None`).
    pub(crate) fn fitting(keys: &Array, values: &Array, stored: Option<&KvLayout>) -> Result<(Self, usize)> {
        let (layout, tokens) = Self::of(keys, values)?;
        Self::check_opt(stored, &layout, tokens)?;
        Ok((layout, tokens))
    }

    /// [`fitting`](Self::fitting) for the keys/values of an update, which
    /// must hold at least one token.
    pub(crate) fn of_update(
        keys: &Array,
        values: &Array,
        stored: Option<&KvLayout>,
    ) -> Result<(Self, usize)> {
        let (layout, tokens) = Self::of(keys, values)?;
        if tokens == 0 {
            return Err(CacheError::InvalidArgument("update with no tokens".into()));
        }
        Self::check_opt(stored, &layout, tokens)?;
        Ok((layout, tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[i32]) -> Array {
        let n: i32 = shape.iter().product();
        let a = Array::from_slice(&(0..n).map(|i| i as f32).collect::<Vec<_>>(), shape);
        a.eval().unwrap();
        a
    }

    fn values(a: &Array) -> Vec<f32> {
        let c = a.contiguous().unwrap();
        c.eval().unwrap();
        c.as_slice::<f32>().to_vec()
    }

    #[test]
    fn sharing_is_detected() {
        let buf = iota(&[1, 1, 16, 4]);
        // Row-contiguous and small: mlx's `contiguous` shares the buffer.
        let view = seq_slice(&buf, 2, 10).unwrap();
        let shared = view.contiguous().unwrap();
        shared.eval().unwrap();
        assert!(!owns_its_buffer(&shared, &view));
        assert!(!owns_its_buffer(&view, &view));
        // A strided view is never mistaken for a copy of itself.
        let strided = seq_slice(&iota(&[1, 3, 16, 4]), 2, 10).unwrap();
        assert!(!owns_its_buffer(&strided, &strided));
    }

    #[test]
    fn copies_own_their_buffers() {
        for shape in [[1, 1, 16, 4], [2, 3, 16, 4]] {
            let buf = iota(&shape);
            let view = seq_slice(&buf, 2, 10).unwrap();
            let copies = [
                compact_copy(&view).unwrap(),
                compact_seq_slices([(&buf, 2, 10)]).unwrap()[0].clone(),
                host_copy(&view).unwrap(),
            ];
            for copy in copies {
                assert!(owns_its_buffer(&copy, &view), "{shape:?}");
                assert_eq!(copy.shape(), view.shape());
                assert_eq!(values(&copy), values(&view));
            }
        }
        let scalar = Array::from_f32(3.5);
        let copy = compact_copy(&scalar).unwrap();
        assert_eq!(copy.shape(), &[] as &[i32]);
        assert_eq!(copy.item_exact::<f32>(), 3.5);
    }

    #[test]
    fn lone_parts_are_copied_too() {
        let buf = iota(&[2, 3, 16, 4]);
        for origin in [Origin::Caller, Origin::Owned] {
            let joined = seq_concat(vec![buf.clone()], origin).unwrap();
            joined.eval().unwrap();
            assert!(owns_its_buffer(&joined, &buf));
            assert_eq!(joined.dtype(), Dtype::Float32);
            assert_eq!(values(&joined), values(&buf));
        }
    }
}
