//! Read-only pictures of a cache, for tests, benchmarks and debugging.

use std::ops::Range;

use candle_core::DType;
use kvcache_api::{CacheError, CausalConfig, ForwardMode, Pos, Result, SeqId};

use crate::blocks::BlockIndex;
use crate::book::Pass;
use crate::cells::Cells;
use crate::storage::Plane;

/// What the bookkeeping records for one used cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellInfo {
    /// Position of the token the cell holds.
    pub pos: Pos,
    /// Sequences sharing the cell, ascending.
    pub sequences: Vec<SeqId>,
    /// Indexed blocks keeping the cell (block retention); a cell no sequence
    /// holds is used while one does.
    pub blocks: usize,
}

/// The stored keys and values of one cell in one layer, as f32.
#[derive(Debug, Clone, PartialEq)]
pub struct CellData {
    /// `[kv_heads * head_dim]`, head-major.
    pub keys: Vec<f32>,
    /// `[kv_heads * head_dim_v]`, head-major, whatever the value layout.
    pub values: Vec<f32>,
}

/// The forward pass in progress.
#[derive(Debug, Clone, PartialEq)]
pub struct PassPicture {
    /// Compute or reserve.
    pub mode: ForwardMode,
    /// Cell of each token, in batch order (empty for reserve passes).
    pub cells: Vec<usize>,
    /// Batch indices exempt from causality.
    pub exempt: Vec<usize>,
    /// Cells the pass attends to.
    pub range: Range<usize>,
    /// The mask `[batch_padded, range.len()]`, row-major, as f32.
    pub mask: Vec<f32>,
}

/// One layer's stored tensors, copied to the host as f32 (decoded when stored
/// quantized).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerData {
    /// Shape of the key tensor, `[cells, kv_heads, head_dim]`.
    pub key_shape: Vec<usize>,
    /// Every key element, row-major.
    pub keys: Vec<f32>,
    /// Shape of the value tensor (`[cells, kv_heads, head_dim_v]` or permuted).
    pub value_shape: Vec<usize>,
    /// Every value element, row-major.
    pub values: Vec<f32>,
}

impl LayerData {
    pub(crate) fn read(keys: &Plane, values: &Plane) -> Result<Self> {
        let flat = |p: &Plane| {
            p.decode(DType::F32)
                .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                .map_err(CacheError::backend)
        };
        Ok(LayerData {
            key_shape: keys.dims().to_vec(),
            keys: flat(keys)?,
            value_shape: values.dims().to_vec(),
            values: flat(values)?,
        })
    }
}

/// Everything observable about a [`crate::CausalKvCache`]: configuration, every
/// cell, the pass in progress with its mask, the selected layer and every stored
/// tensor. Two pictures compare equal only if the caches are indistinguishable, which
/// is how tests prove that a rejected call changed nothing.
#[derive(Clone, PartialEq)]
pub struct CachePicture {
    /// The configuration.
    pub config: CausalConfig,
    /// Each cell's position and sequences, `None` when free.
    pub cells: Vec<Option<CellInfo>>,
    /// The pass in progress.
    pub pass: Option<PassPicture>,
    /// The selected layer.
    pub layer: usize,
    /// Stored tensors per layer (`None` for layers never written).
    pub layers: Vec<Option<LayerData>>,
    /// The exact bookkeeping, so that equality also covers internal indexes.
    pub(crate) exact: (Cells, Pass, BlockIndex),
}

impl std::fmt::Debug for CachePicture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let used: Vec<(usize, &CellInfo)> = self
            .cells
            .iter()
            .enumerate()
            .filter_map(|(c, info)| info.as_ref().map(|i| (c, i)))
            .collect();
        f.debug_struct("CachePicture")
            .field("config", &self.config)
            .field("used_cells", &used)
            .field("pass", &self.pass)
            .field("layer", &self.layer)
            .field("layers", &self.layers)
            .finish_non_exhaustive()
    }
}
