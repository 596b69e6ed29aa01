//! What the layer caches keep in their snapshots (the [`Rows`] and [`State`]s
//! of [`kvcache_api::paging`], whose bookkeeping is written once there), their
//! byte accounting, and the host copies of whole states ([`HostArray`] to and
//! from an mlx array, through safe mlx-rs calls only).

use std::fmt;
use std::ops::Range;

use kvcache_api::paging::{Payload, Rows, RowsSnapshot, State, StateSnapshot};
use kvcache_api::{CacheError, DType, HostArray, Result};
use mlx_rs::{Array, Dtype};

use super::arrays::{
    backend, compact_seq_concats, compact_seq_slices, dim, eval, seq_len, seq_slice, KvLayout,
};

/// Bytes that `arrays` keep alive. Every snapshot array is a compact copy, so
/// this is exactly the sum of their `nbytes`.
fn retained_bytes<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> usize {
    arrays.into_iter().map(Array::nbytes).sum()
}

/// Shapes of `arrays`, for `Debug`.
fn shapes<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Vec<Vec<i32>> {
    arrays.into_iter().map(|a| a.shape().to_vec()).collect()
}

/// Paged-out positions `[from, to)` of a [`KvCache`](super::KvCache): its
/// [`KvRows`].
pub type KvSnapshot = RowsSnapshot<KvRows>;

/// How a [`KvCache`](super::KvCache) or a
/// [`RotatingKvCache`](super::RotatingKvCache) keeps the keys and values of
/// its snapshots. Chosen per cache with `with_snapshot_encoding`; the live
/// cache is never quantized, only what it pages out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SnapshotEncoding {
    /// As the cache holds them (the default): restores are bit-exact.
    #[default]
    Full,
    /// 8 bits per element, mlx's affine quantization (`mlx_rs::ops::quantize`
    /// with `bits = 8`): each run of `group_size` consecutive elements of a
    /// head's row (along `D`) keeps one scale and one bias in the cache's
    /// dtype. Restores dequantize to the cache's dtype; each element comes
    /// back within half a step of its group, `(max - min) / 510`, plus the
    /// rounding of the scale and bias to that dtype. A snapshot takes
    /// `D + 2 * (D / group_size) * elem` bytes per head row instead of
    /// `D * elem`: for `D = 64` and `group_size = 64`, 0.53x of f16 and 0.27x
    /// of f32. `group_size` is 32, 64 or 128 (others are `InvalidArgument`
    /// where the encoding is set). Keys or values whose head dimension is not
    /// a multiple of `group_size` are kept at full precision instead (then
    /// both are, see [`KvRows::is_quantized`]).
    Q8 {
        /// Elements per scale and bias: 32, 64 or 128.
        group_size: usize,
    },
}

impl SnapshotEncoding {
    /// 8-bit with a group of 64 elements, mlx's default group.
    pub const Q8_64: SnapshotEncoding = SnapshotEncoding::Q8 { group_size: 64 };

    /// Checks the parameters (`InvalidArgument` for a group size mlx does not take).
    pub fn validated(self) -> Result<Self> {
        match self {
            SnapshotEncoding::Q8 { group_size } if ![32, 64, 128].contains(&group_size) => {
                Err(CacheError::InvalidArgument(format!(
                    "8-bit snapshots take a group size of 32, 64 or 128, not {group_size}"
                )))
            }
            _ => Ok(self),
        }
    }

    /// The group size to quantize keys `[.., Dk]` and values `[.., Dv]`
    /// with, or `None` to keep them at full precision.
    fn group_for(self, keys: &Array, values: &Array) -> Option<i32> {
        let SnapshotEncoding::Q8 { group_size } = self else {
            return None;
        };
        let fits = |a: &Array| {
            a.shape()
                .last()
                .is_some_and(|&d| (d as usize).is_multiple_of(group_size))
        };
        (fits(keys) && fits(values)).then_some(group_size as i32)
    }
}

/// Bits per quantized element.
const Q8_BITS: i32 = 8;

/// Keys `[B, H, n, Dk]` and values `[B, H, n, Dv]` of `n` consecutive
/// positions, each in an evaluated buffer of its own, so
/// [`size_bytes`](Payload::size_bytes) is what they really hold:
/// `n * B * H * (Dk * key_elem + Dv * value_elem)` at full precision, whatever
/// the size of the buffer they were copied from, or for 8-bit rows
/// ([`SnapshotEncoding::Q8`]) the packed elements (1 byte each) plus a scale
/// and a bias per group.
pub struct KvRows {
    /// Full precision: the keys. 8-bit: the packed keys, `u32` `[B, H, n, Dk / 4]`.
    pub(crate) keys: Array,
    /// Full precision: the values. 8-bit: the packed values, `u32` `[B, H, n, Dv / 4]`.
    pub(crate) values: Array,
    /// Scales and biases of 8-bit rows.
    pub(crate) q8: Option<Q8Groups>,
}

/// Scales and biases of 8-bit [`KvRows`], `[B, H, n, D / group_size]` in the
/// cache's dtype.
pub(crate) struct Q8Groups {
    key_scales: Array,
    key_biases: Array,
    value_scales: Array,
    value_biases: Array,
    group_size: i32,
}

impl KvRows {
    /// A compact copy of positions `rows` of the cache's keys `[B, H, *, Dk]`
    /// and values `[B, H, *, Dv]` (`rows` non-empty), encoded as `encoding`
    /// says, evaluated.
    pub(crate) fn copy_of(
        keys: &Array,
        values: &Array,
        rows: Range<usize>,
        encoding: SnapshotEncoding,
    ) -> Result<Self> {
        let Some(group_size) = encoding.group_for(keys, values) else {
            let [keys, values] =
                compact_seq_slices([(keys, rows.start, rows.end), (values, rows.start, rows.end)])?;
            return Ok(KvRows {
                keys,
                values,
                q8: None,
            });
        };
        let (keys, key_scales, key_biases) =
            quantize_rows(&seq_slice(keys, rows.start, rows.end)?, group_size)?;
        let (values, value_scales, value_biases) =
            quantize_rows(&seq_slice(values, rows.start, rows.end)?, group_size)?;
        let copy = KvRows::q8(
            keys,
            values,
            [key_scales, key_biases, value_scales, value_biases],
            group_size,
        );
        eval(copy.arrays())?;
        Ok(copy)
    }

    /// Keys of the positions held: `[B, H, n, Dk]` at full precision, or the
    /// packed `u32` `[B, H, n, Dk / 4]` of 8-bit rows (see [`decoded`](Self::decoded)).
    pub fn keys(&self) -> &Array {
        &self.keys
    }

    /// Values of the positions held: `[B, H, n, Dv]` at full precision, or the
    /// packed `u32` `[B, H, n, Dv / 4]` of 8-bit rows.
    pub fn values(&self) -> &Array {
        &self.values
    }

    /// Whether the rows are kept 8-bit ([`SnapshotEncoding::Q8`]).
    pub fn is_quantized(&self) -> bool {
        self.q8.is_some()
    }

    /// Keys `[B, H, take, Dk]` and values `[B, H, take, Dv]` of the first
    /// `take` positions in the cache's dtype: the rows themselves at full
    /// precision, dequantized (evaluated, fresh buffers) when 8-bit.
    pub fn decoded(&self, take: usize) -> Result<(Array, Array)> {
        let Some(q) = &self.q8 else {
            if take == self.tokens() {
                return Ok((self.keys.clone(), self.values.clone()));
            }
            return Ok((seq_slice(&self.keys, 0, take)?, seq_slice(&self.values, 0, take)?));
        };
        let first = |a: &Array| seq_slice(a, 0, take);
        let dequantize = |packed: &Array, scales: &Array, biases: &Array| {
            mlx_rs::ops::dequantize(
                first(packed)?,
                first(scales)?,
                &first(biases)?,
                q.group_size,
                Q8_BITS,
            )
            .map_err(backend)
        };
        let keys = dequantize(&self.keys, &q.key_scales, &q.key_biases)?;
        let values = dequantize(&self.values, &q.value_scales, &q.value_biases)?;
        eval([&keys, &values])?;
        Ok((keys, values))
    }

    /// Every array held.
    fn arrays(&self) -> Vec<&Array> {
        let mut all = vec![&self.keys, &self.values];
        if let Some(q) = &self.q8 {
            all.extend([&q.key_scales, &q.key_biases, &q.value_scales, &q.value_biases]);
        }
        all
    }
}

/// mlx's 8-bit affine quantization of `rows` `[B, H, n, D]` along `D` in
/// groups of `group_size`: packed `u32` `[B, H, n, D / 4]`, scales and biases
/// `[B, H, n, D / group_size]` in `rows`' dtype (lazy). mlx quantizes
/// matrices, so the rows go through it as `[B * H * n, D]`.
fn quantize_rows(rows: &Array, group_size: i32) -> Result<(Array, Array, Array)> {
    let shape = rows.shape().to_vec();
    let d = shape[3];
    let matrix = rows.reshape(&[-1, d]).map_err(backend)?;
    let (packed, scales, biases) = mlx_rs::ops::quantize(&matrix, group_size, Q8_BITS).map_err(backend)?;
    let back = |a: Array| {
        let last = a.dim(-1);
        a.reshape(&[shape[0], shape[1], shape[2], last]).map_err(backend)
    };
    Ok((back(packed)?, back(scales)?, back(biases)?))
}

impl Payload for KvRows {
    fn size_bytes(&self) -> usize {
        retained_bytes(self.arrays())
    }
}

impl Rows for KvRows {
    fn tokens(&self) -> usize {
        seq_len(&self.keys)
    }

    fn concat(parent: &Self, child: &Self) -> Result<Self> {
        let cannot = |e: &dyn fmt::Display| CacheError::InvalidArgument(format!("cannot merge: {e}"));
        let (p, _) = KvLayout::of(&parent.keys, &parent.values)?;
        let (c, tokens) = KvLayout::of(&child.keys, &child.values)?;
        p.check(&c, tokens).map_err(|e| cannot(&e))?;
        match (&parent.q8, &child.q8) {
            (None, None) => {
                let [keys, values] =
                    compact_seq_concats([&[&parent.keys, &child.keys], &[&parent.values, &child.values]])?;
                Ok(KvRows {
                    keys,
                    values,
                    q8: None,
                })
            }
            (Some(pq), Some(cq)) => {
                if pq.group_size != cq.group_size {
                    return Err(cannot(&format!(
                        "8-bit rows of groups of {} and {}",
                        pq.group_size, cq.group_size
                    )));
                }
                let (p, _) = KvLayout::of(&pq.key_scales, &pq.value_scales)?;
                let (c, tokens) = KvLayout::of(&cq.key_scales, &cq.value_scales)?;
                p.check(&c, tokens).map_err(|e| cannot(&e))?;
                let [keys, values, ks, kb, vs, vb] = compact_seq_concats([
                    &[&parent.keys, &child.keys],
                    &[&parent.values, &child.values],
                    &[&pq.key_scales, &cq.key_scales],
                    &[&pq.key_biases, &cq.key_biases],
                    &[&pq.value_scales, &cq.value_scales],
                    &[&pq.value_biases, &cq.value_biases],
                ])?;
                Ok(KvRows::q8(keys, values, [ks, kb, vs, vb], pq.group_size))
            }
            _ => Err(cannot(&"8-bit rows and full-precision rows")),
        }
    }

    fn split(&self, at: usize) -> Result<(Self, Self)> {
        let len = self.tokens();
        let Some(q) = &self.q8 else {
            let [pk, pv, ck, cv] = compact_seq_slices([
                (&self.keys, 0, at),
                (&self.values, 0, at),
                (&self.keys, at, len),
                (&self.values, at, len),
            ])?;
            return Ok((
                KvRows {
                    keys: pk,
                    values: pv,
                    q8: None,
                },
                KvRows {
                    keys: ck,
                    values: cv,
                    q8: None,
                },
            ));
        };
        let [pk, pv, pks, pkb, pvs, pvb, ck, cv, cks, ckb, cvs, cvb] = compact_seq_slices([
            (&self.keys, 0, at),
            (&self.values, 0, at),
            (&q.key_scales, 0, at),
            (&q.key_biases, 0, at),
            (&q.value_scales, 0, at),
            (&q.value_biases, 0, at),
            (&self.keys, at, len),
            (&self.values, at, len),
            (&q.key_scales, at, len),
            (&q.key_biases, at, len),
            (&q.value_scales, at, len),
            (&q.value_biases, at, len),
        ])?;
        Ok((
            KvRows::q8(pk, pv, [pks, pkb, pvs, pvb], q.group_size),
            KvRows::q8(ck, cv, [cks, ckb, cvs, cvb], q.group_size),
        ))
    }
}

impl KvRows {
    /// 8-bit rows of packed keys and values and their `[key scales, key
    /// biases, value scales, value biases]`.
    fn q8(keys: Array, values: Array, groups: [Array; 4], group_size: i32) -> Self {
        let [key_scales, key_biases, value_scales, value_biases] = groups;
        KvRows {
            keys,
            values,
            q8: Some(Q8Groups {
                key_scales,
                key_biases,
                value_scales,
                value_biases,
                group_size,
            }),
        }
    }
}

impl fmt::Debug for KvRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvRows")
            .field("q8_group_size", &self.q8.as_ref().map(|q| q.group_size))
            .field("shapes", &shapes(self.arrays()))
            .finish()
    }
}

/// The state of a [`RotatingKvCache`](super::RotatingKvCache) at offset `to`
/// (its whole window, whatever `from` was asked for): its [`Ring`].
pub type RotatingSnapshot = StateSnapshot<Ring>;

/// A rotating cache's window: the [`KvRows`] of its `n = min(to, window)`
/// slots, in ring order (position `p` at index `p % window`). Restoring needs
/// nothing before it, since the window is complete.
#[derive(Debug)]
pub struct Ring {
    pub(crate) slots: KvRows,
    pub(crate) window: usize,
    pub(crate) write_index: usize,
}

impl Ring {
    /// The ring's slots: keys `[B, H, n, Dk]` and values `[B, H, n, Dv]`.
    pub fn slots(&self) -> &KvRows {
        &self.slots
    }

    /// The window `W` of the cache that took the snapshot.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The ring slot the position after the snapshot is written to: `to % window`.
    pub fn write_index(&self) -> usize {
        self.write_index
    }
}

impl Payload for Ring {
    fn size_bytes(&self) -> usize {
        self.slots.size_bytes()
    }
}

impl State for Ring {}

/// The state of a [`RecurrentCache`](super::RecurrentCache) after position
/// `to - 1`, restorable only at exactly `to`: its [`RecurrentState`].
pub type RecurrentSnapshot = StateSnapshot<RecurrentState>;

/// One evaluated compact copy of each state array of a recurrent cache,
/// shaped as the cache's state (`[B, ...]`).
pub struct RecurrentState(pub(crate) Vec<Array>);

impl RecurrentState {
    /// The state arrays.
    pub fn arrays(&self) -> &[Array] {
        &self.0
    }
}

impl Payload for RecurrentState {
    fn size_bytes(&self) -> usize {
        retained_bytes(&self.0)
    }
}

impl State for RecurrentState {}

impl fmt::Debug for RecurrentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RecurrentState").field(&shapes(&self.0)).finish()
    }
}

/// A host copy of `a` (any shape; f32, f16 or bf16): its shape, dtype and
/// row-major little-endian bytes. Evaluates a row-contiguous copy and reads it.
pub(crate) fn array_to_host(a: &Array) -> Result<HostArray> {
    let contiguous = a.contiguous().map_err(backend)?;
    contiguous.eval().map_err(backend)?;
    let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
    macro_rules! bytes {
        ($t:ty, $dtype:expr) => {{
            let data = contiguous.try_as_slice::<$t>().map_err(backend)?;
            (
                data.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
                $dtype,
            )
        }};
    }
    let (data, dtype) = match a.dtype() {
        Dtype::Float32 => bytes!(f32, DType::F32),
        Dtype::Float16 => bytes!(half::f16, DType::F16),
        Dtype::Bfloat16 => bytes!(half::bf16, DType::BF16),
        other => {
            return Err(CacheError::DTypeMismatch {
                what: "state",
                expected: "f32, f16 or bf16".into(),
                got: format!("{other:?}"),
            })
        }
    };
    HostArray::new(shape, dtype, data)
}

/// An mlx array of `host`'s shape, dtype and elements (checked first: bytes
/// that do not fit the shape are an `InvalidArgument` error).
pub(crate) fn array_from_host(host: &HostArray) -> Result<Array> {
    host.check()?;
    let shape = host.shape.iter().map(|&d| dim(d)).collect::<Result<Vec<i32>>>()?;
    macro_rules! build {
        ($t:ty) => {{
            let size = std::mem::size_of::<$t>();
            let data: Vec<$t> = host
                .data
                .chunks_exact(size)
                .map(|b| <$t>::from_le_bytes(b.try_into().expect("element-sized chunk")))
                .collect();
            Array::from_slice(&data, &shape)
        }};
    }
    Ok(match host.dtype {
        DType::F32 => build!(f32),
        DType::F16 => build!(half::f16),
        DType::BF16 => build!(half::bf16),
    })
}
