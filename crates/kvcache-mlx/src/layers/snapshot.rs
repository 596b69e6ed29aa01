//! What the layer caches keep in their snapshots (the [`Rows`] and [`State`]s
//! of [`kvcache_api::paging`], whose bookkeeping is written once there), their
//! byte accounting, and the host copies of whole states ([`HostArray`] to and
//! from an mlx array, through safe mlx-rs calls only).

use std::fmt;

use kvcache_api::paging::{Payload, Rows, RowsSnapshot, State, StateSnapshot};
use kvcache_api::{CacheError, DType, HostArray, Result};
use mlx_rs::{Array, Dtype};

use super::arrays::{backend, compact_seq_concats, compact_seq_slices, dim, seq_len, KvLayout};

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

/// Keys `[B, H, n, Dk]` and values `[B, H, n, Dv]` of `n` consecutive
/// positions, each in an evaluated buffer of its own, so
/// [`size_bytes`](Payload::size_bytes) is `n * B * H * (Dk * key_elem + Dv * value_elem)`
/// whatever the size of the buffer they were copied from.
pub struct KvRows {
    pub(crate) keys: Array,
    pub(crate) values: Array,
}

impl KvRows {
    /// Keys of the positions held: `[B, H, n, Dk]`.
    pub fn keys(&self) -> &Array {
        &self.keys
    }

    /// Values of the positions held: `[B, H, n, Dv]`.
    pub fn values(&self) -> &Array {
        &self.values
    }
}

impl Payload for KvRows {
    fn size_bytes(&self) -> usize {
        retained_bytes([&self.keys, &self.values])
    }
}

impl Rows for KvRows {
    fn tokens(&self) -> usize {
        seq_len(&self.keys)
    }

    fn concat(parent: &Self, child: &Self) -> Result<Self> {
        let (p, _) = KvLayout::of(&parent.keys, &parent.values)?;
        let (c, tokens) = KvLayout::of(&child.keys, &child.values)?;
        p.check(&c, tokens)
            .map_err(|e| CacheError::InvalidArgument(format!("cannot merge: {e}")))?;
        let [keys, values] =
            compact_seq_concats([&[&parent.keys, &child.keys], &[&parent.values, &child.values]])?;
        Ok(KvRows { keys, values })
    }

    fn split(&self, at: usize) -> Result<(Self, Self)> {
        let len = self.tokens();
        let [pk, pv, ck, cv] = compact_seq_slices([
            (&self.keys, 0, at),
            (&self.values, 0, at),
            (&self.keys, at, len),
            (&self.values, at, len),
        ])?;
        Ok((KvRows { keys: pk, values: pv }, KvRows { keys: ck, values: cv }))
    }
}

impl fmt::Debug for KvRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvRows")
            .field("shapes", &shapes([&self.keys, &self.values]))
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
