//! What every paged kernel checks and reads of a paged view, on any device:
//! the type keys and values are stored in, which axes hold cells, heads and
//! the head dimension, where each element lies in its tensor's storage, and
//! the shapes that must agree ([`Geometry`]).

use candle_core::{DType, Device, Layout, Tensor};
use kvcache_api::{PagedKv, StoredKv, VLayout};

use crate::{ModelError, Result};

/// Which axes of a stored tensor hold cells, heads and the head dimension.
#[derive(Debug, Clone, Copy)]
pub(super) struct Axes {
    cell: usize,
    head: usize,
    dim: usize,
}

impl Axes {
    /// `[cells, heads, dim]`: keys, and values in the normal layout.
    const CELL_HEAD_DIM: Axes = Axes {
        cell: 0,
        head: 1,
        dim: 2,
    };
    /// `[heads, dim, cells]`: values in the permuted layout.
    const HEAD_DIM_CELL: Axes = Axes {
        cell: 2,
        head: 0,
        dim: 1,
    };
}

/// Where element `(cell, head, d)` of a stored tensor lies in its storage:
/// `start + cell * cell_stride + head * head_stride + d * dim_stride` elements.
#[derive(Debug, Clone, Copy)]
pub(super) struct Strides {
    pub(super) start: usize,
    pub(super) cell: usize,
    pub(super) head: usize,
    pub(super) dim: usize,
}

impl Strides {
    fn of(layout: &Layout, axes: Axes) -> Strides {
        let stride = layout.stride();
        Strides {
            start: layout.start_offset(),
            cell: stride[axes.cell],
            head: stride[axes.head],
            dim: stride[axes.dim],
        }
    }

    /// Where element `(cell, head, d)` lies.
    pub(super) fn at(&self, cell: usize, head: usize, d: usize) -> usize {
        self.start + cell * self.cell + head * self.head + d * self.dim
    }
}

/// The type keys or values are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StoredType {
    F32,
    F16,
    BF16,
    /// `u8` holding `q + 128`, and one f16 scale per 32 values of a head.
    Q8_0,
}

/// One layer's keys or values as stored: logical `[cells, heads, dim]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct StoredShape {
    pub(super) ty: StoredType,
    pub(super) at: Strides,
    /// `q8_0`'s scales: element `(cell, head, d / 32)`.
    pub(super) scales_at: Option<Strides>,
    pub(super) cells: usize,
    pub(super) heads: usize,
    pub(super) dim: usize,
}

impl StoredShape {
    /// The type, shape and strides of `stored`, read along `axes`, checked.
    fn of(stored: &StoredKv<Tensor>, axes: Axes) -> Result<StoredShape> {
        let data = stored.data();
        let dims = data.dims();
        if dims.len() != 3 {
            return bad(format!("stored keys or values of shape {dims:?}, not 3 axes"));
        }
        let (cells, heads, dim) = (dims[axes.cell], dims[axes.head], dims[axes.dim]);
        let (ty, scales_at) = match (stored, data.dtype()) {
            (StoredKv::Float(_), DType::F32) => (StoredType::F32, None),
            (StoredKv::Float(_), DType::F16) => (StoredType::F16, None),
            (StoredKv::Float(_), DType::BF16) => (StoredType::BF16, None),
            (StoredKv::Q8_0 { scales, .. }, DType::U8) => {
                let mut want = dims.to_vec();
                want[axes.dim] = dim / 32;
                if scales.dtype() != DType::F16 || dim % 32 != 0 || scales.dims() != want.as_slice() {
                    return bad(format!(
                        "q8_0 quants {dims:?} with {:?} scales {:?} (want f16 {want:?})",
                        scales.dtype(),
                        scales.dims()
                    ));
                }
                (StoredType::Q8_0, Some(Strides::of(scales.layout(), axes)))
            }
            (_, other) => return bad(format!("stored keys or values in {other:?}")),
        };
        Ok(StoredShape {
            ty,
            at: Strides::of(data.layout(), axes),
            scales_at,
            cells,
            heads,
            dim,
        })
    }

    /// Checks that every element (and scale) lies within `len` (and
    /// `scales_len`) elements of storage: what a kernel indexing plain slices
    /// needs before it reads.
    pub(super) fn check_within(&self, len: usize, scales_len: usize) -> Result<()> {
        let last = |at: &Strides, dim: usize| {
            at.at(
                self.cells.saturating_sub(1),
                self.heads.saturating_sub(1),
                dim.saturating_sub(1),
            )
        };
        let empty = self.cells == 0 || self.heads == 0 || self.dim == 0;
        if !empty && last(&self.at, self.dim) >= len {
            return bad(format!(
                "stored elements {:?} run past their {len} elements",
                self.at
            ));
        }
        if let Some(s) = &self.scales_at {
            if !empty && last(s, self.dim / 32) >= scales_len {
                return bad(format!("q8_0 scales {s:?} run past their {scales_len} elements"));
            }
        }
        Ok(())
    }
}

/// One paged attention's shapes, checked to agree: queries `[n, n_heads,
/// head_dim]` over `kv_heads` key/value heads of `cells` cells, query head
/// `j * group + i` using key/value head `j`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    pub(super) n: usize,
    pub(super) n_heads: usize,
    pub(super) kv_heads: usize,
    pub(super) group: usize,
    pub(super) head_dim: usize,
    pub(super) head_dim_v: usize,
    pub(super) keys: StoredShape,
    pub(super) values: StoredShape,
}

impl Geometry {
    /// The shapes of `q` attending through `view`, or
    /// [`ModelError::InvalidArgument`] when they do not fit: queries not
    /// `[n, heads, head_dim]` in f32, `n != view.runs.rows()`, a stored type
    /// or shape the kernels do not read, head counts or dimensions that
    /// disagree, a run past the stored cells.
    pub(super) fn of(q: &Tensor, view: &PagedKv<'_, Tensor>) -> Result<Geometry> {
        let &[n, n_heads, head_dim] = q.dims() else {
            return bad(format!(
                "queries of shape {:?}, not [n, heads, head_dim]",
                q.dims()
            ));
        };
        if q.dtype() != DType::F32 {
            return bad(format!("queries in {:?}, not f32", q.dtype()));
        }
        let runs = view.runs;
        if runs.rows() != n {
            return bad(format!("{n} query rows for {} rows of runs", runs.rows()));
        }
        let keys = StoredShape::of(&view.keys, Axes::CELL_HEAD_DIM)?;
        let value_axes = match view.v_layout {
            VLayout::Normal => Axes::CELL_HEAD_DIM,
            VLayout::Permuted => Axes::HEAD_DIM_CELL,
        };
        let values = StoredShape::of(&view.values, value_axes)?;
        let (cells, kv_heads, head_dim_v) = (keys.cells, keys.heads, values.dim);
        if keys.dim != head_dim || head_dim == 0 || head_dim_v == 0 {
            return bad(format!(
                "queries of head dim {head_dim}, keys of {}, values of {head_dim_v}",
                keys.dim
            ));
        }
        if values.cells != cells || values.heads != kv_heads {
            return bad(format!(
                "keys of {cells} cells x {kv_heads} heads, values of {} x {}",
                values.cells, values.heads
            ));
        }
        if kv_heads == 0 || n_heads % kv_heads != 0 {
            return bad(format!("{n_heads} query heads over {kv_heads} key/value heads"));
        }
        if let Some(run) = runs.runs().iter().find(|r| r.end as usize > cells) {
            return bad(format!("run {run:?} past the {cells} stored cells"));
        }
        Ok(Geometry {
            n,
            n_heads,
            kv_heads,
            group: n_heads / kv_heads,
            head_dim,
            head_dim_v,
            keys,
            values,
        })
    }
}

/// Whether the queries and every stored tensor of `view` live where `on` says
/// yes (the device a kernel runs on).
pub(super) fn all_on(q: &Tensor, view: &PagedKv<'_, Tensor>, on: impl Fn(&Device) -> bool) -> bool {
    let stored_on = |s: &StoredKv<Tensor>| match s {
        StoredKv::Float(t) => on(t.device()),
        StoredKv::Q8_0 { quants, scales } => on(quants.device()) && on(scales.device()),
    };
    on(q.device()) && stored_on(&view.keys) && stored_on(&view.values)
}

fn bad<T>(msg: String) -> Result<T> {
    Err(ModelError::InvalidArgument(format!("paged attention: {msg}")))
}
