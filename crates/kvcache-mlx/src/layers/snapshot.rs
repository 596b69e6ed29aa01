//! The snapshot types of the layer caches, their byte accounting, the checks
//! that turn a foreign snapshot into an error, and the host copies of whole
//! states ([`HostArray`] to and from an mlx array, through safe mlx-rs calls
//! only).

use std::any::Any;
use std::fmt;
use std::ops::Range;

use kvcache_api::{BoxedSnapshot, CacheError, DType, HostArray, Result, Snapshot};
use mlx_rs::{Array, Dtype};

use super::arrays::{backend, dim};

/// Bytes that `arrays` keep alive. Every snapshot array is a compact copy, so
/// this is exactly the sum of their `nbytes`.
fn retained_bytes<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> usize {
    arrays.into_iter().map(Array::nbytes).sum()
}

/// Paged-out positions `[from, to)` of a [`KvCache`](super::KvCache).
///
/// `keys` is `[B, H, to - from, Dk]` and `values` `[B, H, to - from, Dv]`, each in
/// an evaluated buffer of its own, so [`size_bytes`](Snapshot::size_bytes) is
/// `(to - from) * B * H * (Dk * key_elem + Dv * value_elem)` whatever the size
/// of the buffer it was copied from.
pub struct KvSnapshot {
    pub(crate) keys: Array,
    pub(crate) values: Array,
    pub(crate) range: Range<usize>,
}

impl KvSnapshot {
    /// Keys of positions `[from, to)`: `[B, H, to - from, Dk]`.
    pub fn keys(&self) -> &Array {
        &self.keys
    }

    /// Values of positions `[from, to)`: `[B, H, to - from, Dv]`.
    pub fn values(&self) -> &Array {
        &self.values
    }
}

/// The state of a [`RotatingKvCache`](super::RotatingKvCache) at offset `to`:
/// its whole window, whatever `from` was asked for.
///
/// `keys` is `[B, H, n, Dk]` and `values` `[B, H, n, Dv]` with
/// `n = min(to, window)`, in ring order: position `p` sits at index `p % window`.
/// The write index (the ring slot the next position goes to) is `to % window`.
/// The range `[from, to)` records where the snapshot sits in the token stream;
/// restoring needs nothing before it, since the window is complete.
pub struct RotatingSnapshot {
    pub(crate) keys: Array,
    pub(crate) values: Array,
    pub(crate) range: Range<usize>,
    pub(crate) window: usize,
}

impl RotatingSnapshot {
    /// Ring of keys, `[B, H, min(to, window), Dk]`; position `p` at index `p % window`.
    pub fn keys(&self) -> &Array {
        &self.keys
    }

    /// Ring of values, `[B, H, min(to, window), Dv]`; position `p` at index `p % window`.
    pub fn values(&self) -> &Array {
        &self.values
    }

    /// The window `W` of the cache that took the snapshot.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The ring slot the position after the snapshot is written to: `to % window`.
    pub fn write_index(&self) -> usize {
        self.range.end % self.window
    }
}

/// The state of a [`RecurrentCache`](super::RecurrentCache) after position
/// `to - 1`: one evaluated compact copy of each state array, shaped as the
/// cache's state (`[B, ...]`). It can be restored only at exactly `to`.
pub struct RecurrentSnapshot {
    pub(crate) state: Vec<Array>,
    pub(crate) range: Range<usize>,
}

impl RecurrentSnapshot {
    /// The state arrays at offset `to`.
    pub fn state(&self) -> &[Array] {
        &self.state
    }
}

macro_rules! impl_snapshot {
    ($ty:ty, |$s:ident| $arrays:expr) => {
        impl Snapshot for $ty {
            fn range(&self) -> Range<usize> {
                self.range.clone()
            }

            fn size_bytes(&self) -> usize {
                let $s = self;
                retained_bytes($arrays)
            }

            fn as_any(&self) -> &dyn Any {
                self
            }

            fn into_any(self: Box<Self>) -> Box<dyn Any> {
                self
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let $s = self;
                f.debug_struct(stringify!($ty))
                    .field("range", &self.range)
                    .field(
                        "shapes",
                        &$arrays
                            .map(|a: &Array| a.shape().to_vec())
                            .collect::<Vec<_>>(),
                    )
                    .field("size_bytes", &self.size_bytes())
                    .finish()
            }
        }
    };
}

impl_snapshot!(KvSnapshot, |s| [&s.keys, &s.values].into_iter());
impl_snapshot!(RotatingSnapshot, |s| [&s.keys, &s.values].into_iter());
impl_snapshot!(RecurrentSnapshot, |s| s.state.iter());

fn foreign<T: 'static>(range: Range<usize>) -> CacheError {
    CacheError::InvalidArgument(format!(
        "snapshot of {range:?} was not made by this kind of cache (expected {})",
        std::any::type_name::<T>()
    ))
}

/// The concrete snapshot behind `snapshot`, or `InvalidArgument` for another type.
pub(crate) fn downcast_ref<T: Snapshot>(snapshot: &dyn Snapshot) -> Result<&T> {
    snapshot
        .as_any()
        .downcast_ref::<T>()
        .ok_or_else(|| foreign::<T>(snapshot.range()))
}

/// Takes back ownership of the concrete snapshot, or `InvalidArgument` for
/// another type (the snapshot is dropped).
pub(crate) fn downcast_box<T: Snapshot>(snapshot: BoxedSnapshot) -> Result<Box<T>> {
    let range = snapshot.range();
    snapshot
        .into_any()
        .downcast::<T>()
        .map_err(|_| foreign::<T>(range))
}

/// Checks that `[a, b)` and `[b, c)` are consecutive.
pub(crate) fn check_consecutive(parent: &Range<usize>, child: &Range<usize>) -> Result<()> {
    if parent.end != child.start {
        return Err(CacheError::InvalidArgument(format!(
            "cannot merge snapshots {parent:?} and {child:?}: they are not consecutive"
        )));
    }
    Ok(())
}

/// A snapshot that holds a cache's whole state at its end (a ring window, a
/// recurrent state) rather than the tokens of its range: merging keeps the
/// child, and splitting is refused.
pub(crate) trait WholeStateSnapshot: Snapshot {
    /// The range, for merging to widen.
    fn range_mut(&mut self) -> &mut Range<usize>;
}

impl WholeStateSnapshot for RotatingSnapshot {
    fn range_mut(&mut self) -> &mut Range<usize> {
        &mut self.range
    }
}

impl WholeStateSnapshot for RecurrentSnapshot {
    fn range_mut(&mut self) -> &mut Range<usize> {
        &mut self.range
    }
}

/// `SnapshotCache::merge` for whole-state snapshots: the child, covering both ranges.
pub(crate) fn merge_keep_child<S: WholeStateSnapshot>(
    parent: Option<BoxedSnapshot>,
    child: Option<BoxedSnapshot>,
) -> Result<Option<BoxedSnapshot>> {
    let (Some(parent), Some(child)) = (parent, child) else {
        return Ok(None);
    };
    let parent = downcast_box::<S>(parent)?;
    let mut child = downcast_box::<S>(child)?;
    check_consecutive(&parent.range(), &child.range())?;
    *child.range_mut() = parent.range().start..child.range().end;
    Ok(Some(child))
}

/// `SnapshotCache::split` for whole-state snapshots: refused, `(None, Some(snapshot))`.
pub(crate) fn refuse_split<S: WholeStateSnapshot>(
    snapshot: BoxedSnapshot,
) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
    let snap = downcast_box::<S>(snapshot)?;
    Ok((None, Some(snap)))
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
