//! The stored keys and values: one pair of planes per layer, created on the first
//! `put` of that layer and written in place.
//!
//! Keys are `[cells, kv_heads, head_dim]`; values `[cells, kv_heads, head_dim_v]`,
//! or `[kv_heads, head_dim_v, cells]` with [`VLayout::Permuted`]. Each is a
//! [`Plane`]: one tensor of a float type, or `q8_0` integers and scales
//! ([`KvStorage`], [`CausalConfig::storage`]). A batch is encoded once in the
//! storage type and written with one `slice_set` per run of consecutive cells.
//! Reads return the compute dtype ([`CausalConfig::dtype`]): `narrow` views when
//! the storage type is the compute dtype, else the range asked for, decoded.
//! Moving cells (compaction, copies) moves the stored parts, never decoding them.

use std::ops::Range;

use candle_core::{DType as CandleDType, Device, Storage as CandleStorage, Tensor};
use kvcache_api::{CacheError, CausalConfig, DType, KvStorage, Result, VLayout};

use crate::placement::Move;

mod host;
mod plane;
mod q8_0;

pub(crate) use host::Uploaded;
pub(crate) use plane::Plane;

/// The candle element type for a kvcache dtype.
pub(crate) fn candle_dtype(dtype: DType) -> CandleDType {
    match dtype {
        DType::F32 => CandleDType::F32,
        DType::F16 => CandleDType::F16,
        DType::BF16 => CandleDType::BF16,
    }
}

/// Whether two tensors are views of the same allocation.
pub(crate) fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    let address = |t: &Tensor| {
        let (storage, _) = t.storage_and_layout();
        std::ptr::from_ref::<CandleStorage>(&storage).addr()
    };
    address(a) == address(b)
}

/// Layer indices a cache accepts (`0..MAX_LAYERS`); `put` on a layer past them is
/// rejected, so a corrupt index cannot size the per-layer table.
pub const MAX_LAYERS: usize = 1 << 16;

/// The keys and values of one layer.
#[derive(Debug)]
pub(crate) struct LayerStore {
    /// `[cells, kv_heads, head_dim]`.
    pub keys: Plane,
    /// `[cells, kv_heads, head_dim_v]` or `[kv_heads, head_dim_v, cells]`.
    pub values: Plane,
}

/// Per-layer key/value storage on one device.
#[derive(Debug)]
pub(crate) struct Storage {
    device: Device,
    /// What `put` takes and `get` returns.
    dtype: CandleDType,
    /// How keys and values are kept.
    kind: KvStorage,
    layout: VLayout,
    cells: usize,
    layers: Vec<Option<LayerStore>>,
}

/// Dimensions of a `put`: `(kv_heads, head_dim, head_dim_v)`.
pub(crate) type HeadDims = (usize, usize, usize);

impl Storage {
    /// Empty storage for `config` on `device`.
    pub(crate) fn new(config: &CausalConfig, device: Device) -> Self {
        Storage {
            device,
            dtype: candle_dtype(config.dtype),
            kind: config.storage(),
            layout: config.v_layout,
            cells: config.num_cells(),
            layers: Vec::new(),
        }
    }

    /// The device tensors live on.
    /// Makes the device's context current on the calling thread. CUDA runs
    /// work in a context each thread must bind first, and candle binds it only
    /// where the device was made; a cache handed between threads (through
    /// `kvcache_api::Shared`, say) binds it on every entry that touches the
    /// device. Nothing to do elsewhere.
    pub(crate) fn bind_to_thread(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = &self.device {
            cuda.cuda_stream().context().bind_to_thread().map_err(|e| {
                CacheError::Backend(format!("binding the CUDA context to this thread: {e:?}"))
            })?;
        }
        Ok(())
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// The storage of `layer`, if it was created.
    pub(crate) fn layer(&self, layer: usize) -> Option<&LayerStore> {
        self.layers.get(layer).and_then(Option::as_ref)
    }

    /// Layers that have storage, with their index.
    pub(crate) fn layers(&self) -> impl Iterator<Item = (usize, &LayerStore)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.as_ref().map(|l| (i, l)))
    }

    /// Number of layer slots (layers with storage are below this).
    pub(crate) fn layer_slots(&self) -> usize {
        self.layers.len()
    }

    /// The axis of cells in the value plane.
    fn value_cell_axis(&self) -> usize {
        match self.layout {
            VLayout::Normal => 0,
            VLayout::Permuted => 2,
        }
    }

    /// The head-dimension axis of the value plane (where `q8_0` blocks run).
    fn value_block_axis(&self) -> usize {
        match self.layout {
            VLayout::Normal => 2,
            VLayout::Permuted => 1,
        }
    }

    /// Checks head dimensions against the storage type: `q8_0` needs multiples
    /// of 32.
    pub(crate) fn check_head_dims(&self, head_dim: usize, head_dim_v: usize) -> Result<()> {
        let block = self.kind.block_len();
        if head_dim.is_multiple_of(block) && head_dim_v.is_multiple_of(block) {
            return Ok(());
        }
        Err(CacheError::InvalidArgument(format!(
            "{} storage needs head dimensions that are multiples of {block}, got head_dim {head_dim} \
             and head_dim_v {head_dim_v}",
            self.kind
        )))
    }

    fn dims_of(&self, layer: &LayerStore) -> HeadDims {
        let k = layer.keys.dims();
        let v = layer.values.dims();
        match self.layout {
            VLayout::Normal => (k[1], k[2], v[2]),
            VLayout::Permuted => (k[1], k[2], v[1]),
        }
    }

    /// Checks `put`'s keys `[batch, kv_heads, head_dim]` and values
    /// `[batch, kv_heads, head_dim_v]` against the pass and the layer's storage.
    pub(crate) fn check_put(
        &self,
        layer: usize,
        keys: &Tensor,
        values: &Tensor,
        batch: usize,
    ) -> Result<HeadDims> {
        if layer >= MAX_LAYERS {
            return Err(CacheError::InvalidArgument(format!(
                "layer {layer} is past the supported {MAX_LAYERS} layers"
            )));
        }
        for (what, t) in [("keys", keys), ("values", values)] {
            if t.dtype() != self.dtype {
                return Err(CacheError::DTypeMismatch {
                    what,
                    expected: format!("{:?}", self.dtype).to_lowercase(),
                    got: format!("{:?}", t.dtype()).to_lowercase(),
                });
            }
            if !t.device().same_device(&self.device) {
                let (theirs, ours) = (t.device().location(), self.device.location());
                let hint = if theirs == ours {
                    " (another handle of the same GPU: each `Device::new_cuda` call makes a new \
                     device whose tensors do not mix with others'; clone one device instead)"
                } else {
                    ""
                };
                return Err(CacheError::InvalidArgument(format!(
                    "{what} are on {theirs:?} but the cache lives on {ours:?}{hint}"
                )));
            }
        }
        let dim = |t: &Tensor, i: usize| t.dims().get(i).copied().unwrap_or(0);
        let expect = |what: &'static str, t: &Tensor, expected: [usize; 3]| {
            if t.dims() == expected {
                Ok(())
            } else {
                Err(CacheError::ShapeMismatch {
                    what,
                    expected: expected.to_vec(),
                    got: t.dims().to_vec(),
                })
            }
        };
        let stored = self.layer(layer).map(|l| self.dims_of(l));
        let (kv_heads, head_dim) = stored.map_or((dim(keys, 1), dim(keys, 2)), |(h, d, _)| (h, d));
        expect("keys", keys, [batch, kv_heads, head_dim])?;
        let head_dim_v = stored.map_or(dim(values, 2), |s| s.2);
        expect("values", values, [batch, kv_heads, head_dim_v])?;
        if kv_heads == 0 || head_dim == 0 || head_dim_v == 0 {
            return Err(CacheError::InvalidArgument(format!(
                "keys {:?} and values {:?} must have at least one head and one dimension",
                keys.dims(),
                values.dims()
            )));
        }
        self.check_head_dims(head_dim, head_dim_v)?;
        Ok((kv_heads, head_dim, head_dim_v))
    }

    /// Creates `layer`'s zeroed planes if they do not exist yet.
    pub(crate) fn ensure_layer(
        &mut self,
        layer: usize,
        (kv_heads, head_dim, head_dim_v): HeadDims,
    ) -> Result<()> {
        if self.layer(layer).is_some() {
            return Ok(());
        }
        let keys = Plane::zeros(&[self.cells, kv_heads, head_dim], 2, self.kind, &self.device);
        let value_shape = match self.layout {
            VLayout::Normal => [self.cells, kv_heads, head_dim_v],
            VLayout::Permuted => [kv_heads, head_dim_v, self.cells],
        };
        let values = Plane::zeros(&value_shape, self.value_block_axis(), self.kind, &self.device);
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        self.layers[layer] = Some(LayerStore {
            keys: keys.map_err(CacheError::backend)?,
            values: values.map_err(CacheError::backend)?,
        });
        Ok(())
    }

    /// Writes token `i` of checked `keys`/`values` into cell `cells[i]` of `layer`,
    /// encoding the batch in the storage type once.
    pub(crate) fn write(&self, layer: usize, keys: &Tensor, values: &Tensor, cells: &[u32]) -> Result<()> {
        let store = self.layer(layer).expect("ensure_layer before write");
        let run = || -> candle_core::Result<()> {
            // Encoding copies, so a view from `get` is read before it is overwritten.
            let keys = Plane::encode(keys, 2, self.kind)?;
            let values = Plane::encode(values, 2, self.kind)?;
            let mut i = 0;
            while i < cells.len() {
                let first = cells[i] as usize;
                let mut len = 1;
                while i + len < cells.len() && cells[i + len] as usize == first + len {
                    len += 1;
                }
                let rows = |p: &Plane| p.map(|t| t.narrow(0, i, len)?.contiguous());
                store.keys.slice_set(&rows(&keys)?, 0, first)?;
                match self.layout {
                    VLayout::Normal => store.values.slice_set(&rows(&values)?, 0, first)?,
                    VLayout::Permuted => store.values.slice_set(&rows(&values)?.cells_last()?, 2, first)?,
                }
                i += len;
            }
            Ok(())
        };
        run().map_err(CacheError::backend)
    }

    /// Applies compaction `moves` to every layer: the cells from the first move's
    /// source on are gathered in one pass and written back from its destination.
    pub(crate) fn apply_moves(&self, moves: &[Move]) -> Result<()> {
        let Some(first) = moves.first() else {
            return Ok(());
        };
        debug_assert!(
            moves.windows(2).all(|w| w[0].dst + w[0].len == w[1].dst),
            "after the first move every used run moves, back to back"
        );
        let sources: Vec<u32> = moves.iter().flat_map(|m| m.src..m.src + m.len).collect();
        let count = sources.len();
        let run = || -> candle_core::Result<()> {
            let index = Tensor::from_vec(sources, count, &self.device)?;
            let dim = self.value_cell_axis();
            for (_, store) in self.layers() {
                let keys = store.keys.map(|t| t.index_select(&index, 0))?;
                store.keys.slice_set(&keys, 0, first.dst as usize)?;
                let values = store.values.map(|t| t.index_select(&index, dim))?;
                store.values.slice_set(&values, dim, first.dst as usize)?;
            }
            Ok(())
        };
        run().map_err(CacheError::backend)
    }

    /// Keys of cells `range` of `layer` in the compute dtype, `[range.len(),
    /// kv_heads, head_dim]`: a view when stored in that dtype, else decoded.
    pub(crate) fn key_view(&self, layer: &LayerStore, range: Range<usize>) -> Result<Tensor> {
        let run = || {
            layer
                .keys
                .map(|t| t.narrow(0, range.start, range.len()))?
                .decode(self.dtype)
        };
        run().map_err(CacheError::backend)
    }

    /// Keys and values of cells `range` of `layer` in the compute dtype: views
    /// when stored in that dtype, else only those cells, decoded.
    pub(crate) fn views(&self, layer: &LayerStore, range: Range<usize>) -> Result<(Tensor, Tensor)> {
        let keys = self.key_view(layer, range.clone())?;
        let dim = self.value_cell_axis();
        let run = || {
            layer
                .values
                .map(|t| t.narrow(dim, range.start, range.len()))?
                .decode(self.dtype)
        };
        let values = run().map_err(CacheError::backend)?;
        Ok((keys, values))
    }

    /// Overwrites the keys of cells `first..` of `layer` with `keys`
    /// `[n, kv_heads, head_dim]` (encoded in the storage type).
    pub(crate) fn write_keys(&self, layer: usize, first: usize, keys: &Tensor) -> Result<()> {
        let store = self.layer(layer).expect("shifted layers have storage");
        let run = || {
            store
                .keys
                .slice_set(&Plane::encode(keys, 2, self.kind)?, 0, first)
        };
        run().map_err(CacheError::backend)
    }

    /// Keys and values of one cell as f32, each `[kv_heads * head_dim]` in
    /// `(head, dim)` order whatever the layout.
    pub(crate) fn read_cell(&self, layer: usize, cell: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let store = self
            .layer(layer)
            .ok_or_else(|| CacheError::InvalidArgument(format!("layer {layer} has no storage")))?;
        if cell >= self.cells {
            return Err(CacheError::InvalidArgument(format!(
                "cell {cell} is past the last of {} cells",
                self.cells
            )));
        }
        let flat = |plane: &Plane, dim: usize| -> Result<Vec<f32>> {
            let run = || {
                let cell = plane.map(|t| t.narrow(dim, cell, 1))?;
                cell.decode(CandleDType::F32)?.flatten_all()?.to_vec1::<f32>()
            };
            run().map_err(CacheError::backend)
        };
        Ok((
            flat(&store.keys, 0)?,
            flat(&store.values, self.value_cell_axis())?,
        ))
    }

    /// A deep copy (new tensors, same device).
    pub(crate) fn try_clone(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|l| {
                        Ok(LayerStore {
                            keys: l.keys.map(Tensor::copy)?,
                            values: l.values.map(Tensor::copy)?,
                        })
                    })
                    .transpose()
            })
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(CacheError::backend)?;
        Ok(Storage {
            device: self.device.clone(),
            dtype: self.dtype,
            kind: self.kind,
            layout: self.layout,
            cells: self.cells,
            layers,
        })
    }

    /// Makes this storage a deep copy of `source` (on the same device), writing into
    /// this storage's tensors where a layer's shapes match and copying otherwise.
    pub(crate) fn copy_from(&mut self, source: &Storage) -> Result<()> {
        let same_kind = self.dtype == source.dtype
            && self.kind == source.kind
            && self.layout == source.layout
            && self.cells == source.cells;
        self.layers.resize_with(source.layers.len(), || None);
        for (mine, theirs) in self.layers.iter_mut().zip(&source.layers) {
            *mine = match (mine.take(), theirs) {
                (_, None) => None,
                (Some(kept), Some(theirs))
                    if same_kind
                        && kept.keys.dims() == theirs.keys.dims()
                        && kept.values.dims() == theirs.values.dims() =>
                {
                    kept.keys
                        .slice_set(&theirs.keys, 0, 0)
                        .map_err(CacheError::backend)?;
                    kept.values
                        .slice_set(&theirs.values, 0, 0)
                        .map_err(CacheError::backend)?;
                    Some(kept)
                }
                (_, Some(theirs)) => Some(LayerStore {
                    keys: theirs.keys.map(Tensor::copy).map_err(CacheError::backend)?,
                    values: theirs.values.map(Tensor::copy).map_err(CacheError::backend)?,
                }),
            };
        }
        self.dtype = source.dtype;
        self.kind = source.kind;
        self.layout = source.layout;
        self.cells = source.cells;
        Ok(())
    }

    /// Panics unless every layer's planes have the configured cell count, storage
    /// type and parts that agree.
    pub(crate) fn check(&self) {
        for (layer, store) in self.layers() {
            store.keys.check(self.kind, &format!("layer {layer} keys"));
            store.values.check(self.kind, &format!("layer {layer} values"));
            assert_eq!(store.keys.dims()[0], self.cells, "layer {layer}: key cells");
            let cells = store.values.dims()[self.value_cell_axis()];
            assert_eq!(cells, self.cells, "layer {layer}: value cells");
        }
    }

    /// Bytes of key/value storage allocated.
    pub(crate) fn bytes(&self) -> usize {
        self.layers()
            .map(|(_, l)| l.keys.bytes() + l.values.bytes())
            .sum()
    }

    /// Bytes one cell takes in every stored layer (keys and values).
    pub(crate) fn bytes_per_cell(&self) -> usize {
        self.bytes().checked_div(self.cells).unwrap_or(0)
    }
}
