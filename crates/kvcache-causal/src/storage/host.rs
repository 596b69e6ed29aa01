//! Copies between the stored tensors and the canonical host form of
//! [`HostKv`]: per layer, keys `[kv_heads, tokens, head_dim]` then values
//! `[kv_heads, tokens, head_dim_v]`, little-endian bytes of the dtype.
//!
//! The host form is always in the cache's compute dtype ([`CausalConfig::dtype`](kvcache_api::CausalConfig::dtype)),
//! whatever the storage type: a quantized (or otherwise converted) cache exports
//! its values decoded, and an import encodes them as a forward pass's `put` would.
//! So states move between caches of any storage types, and the prefix store keeps
//! float rows.
//!
//! Reads gather a sequence's cells with one `narrow` (one run of cells) or one
//! `index_select` (several) per stored tensor, decode only those cells, transpose
//! to head-major and copy the bytes out once; writes upload each layer's rows once
//! and store them with the run-wise writes of a forward pass.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::{DType as CandleDType, Storage as CandleStorage, Tensor, WithDType};
use kvcache_api::{CacheError, DType, HostKv, KvLayout, Result, VLayout};

use super::{HeadDims, Plane, Storage, MAX_LAYERS};

/// Keys `[rows, kv_heads, head_dim]` and values `[rows, kv_heads, head_dim_v]` of
/// one layer, uploaded to the cache's device (views, shaped like `put`'s input).
pub(crate) type Uploaded = (Tensor, Tensor);

impl Storage {
    /// The layout of the stored layers: layer count = layer slots, head dimensions
    /// of the first stored layer, element type `dtype`. `None` before any layer has
    /// storage.
    pub(crate) fn kv_layout(&self, dtype: DType) -> Option<KvLayout> {
        let (_, first) = self.layers().next()?;
        let (kv_heads, head_dim, head_dim_v) = self.dims_of(first);
        Some(KvLayout {
            layers: self.layers.len(),
            kv_heads,
            head_dim,
            head_dim_v,
            dtype,
        })
    }

    /// Every layer slot, in order.
    pub(crate) fn all_layers(&self) -> Vec<usize> {
        (0..self.layers.len()).collect()
    }

    /// The layout of `layers` (in that order: every slot, or a part of the
    /// layers), for an export: an error unless each has storage, all with
    /// the same head dimensions.
    pub(crate) fn export_layout(&self, dtype: DType, layers: &[usize]) -> Result<KvLayout> {
        let mut want = None;
        for &layer in layers {
            let Some(store) = self.layer(layer) else {
                return Err(CacheError::InvalidState(format!(
                    "layer {layer} has no keys or values yet: only stored layers can be exported"
                )));
            };
            let dims = self.dims_of(store);
            match want {
                None => want = Some(dims),
                Some(want) if want != dims => {
                    return Err(CacheError::InvalidState(format!(
                        "layer {layer} stores (kv_heads, head_dim, head_dim_v) {dims:?} but the first \
                         exported layer {want:?}: layers of one export must share a layout"
                    )))
                }
                Some(_) => {}
            }
        }
        let (kv_heads, head_dim, head_dim_v) = want.ok_or_else(|| {
            CacheError::InvalidState("no layer has keys or values yet: nothing to export".into())
        })?;
        Ok(KvLayout {
            layers: layers.len(),
            kv_heads,
            head_dim,
            head_dim_v,
            dtype,
        })
    }

    /// Checks an imported `layout` against the cache: its dtype against `dtype`
    /// (the configuration's), its layer count and head dimensions against every
    /// stored layer, and that it describes at least one layer, head and dimension.
    pub(crate) fn check_import_layout(&self, layout: &KvLayout, dtype: DType) -> Result<()> {
        self.check_import_layout_of(layout, dtype, self.layers.len())
    }

    /// [`check_import_layout`](Self::check_import_layout) of the keys and
    /// values of `layers` layers (a part of the cache's).
    pub(crate) fn check_import_layout_of(
        &self,
        layout: &KvLayout,
        dtype: DType,
        layers: usize,
    ) -> Result<()> {
        if layout.dtype != dtype {
            return Err(CacheError::LayoutMismatch {
                what: "dtype",
                expected: dtype.to_string(),
                got: layout.dtype.to_string(),
            });
        }
        for (_, store) in self.layers() {
            let (kv_heads, head_dim, head_dim_v) = self.dims_of(store);
            let stored = KvLayout {
                layers,
                kv_heads,
                head_dim,
                head_dim_v,
                dtype,
            };
            stored.expect(layout)?;
        }
        let dims = [layout.layers, layout.kv_heads, layout.head_dim, layout.head_dim_v];
        if dims.contains(&0) || layout.layers > MAX_LAYERS {
            return Err(CacheError::InvalidArgument(format!(
                "cannot import a layout of {} layers (at most {MAX_LAYERS}), {} kv heads, head dims \
                 {} and {}: every one must be at least 1",
                layout.layers, layout.kv_heads, layout.head_dim, layout.head_dim_v
            )));
        }
        self.check_head_dims(layout.head_dim, layout.head_dim_v)
    }

    /// Copies cells `runs` (cell ranges, in the order of the rows of `out`) of
    /// layers `layers` into `out` (layer `layers[i]` into its layer `i`), whose
    /// layout is [`Storage::export_layout`]'s for them and whose token count is
    /// the cells' total.
    pub(crate) fn read_rows(&self, runs: &[Range<usize>], out: &mut HostKv, layers: &[usize]) -> Result<()> {
        let n: usize = runs.iter().map(Range::len).sum();
        debug_assert_eq!(n, out.tokens(), "one row per cell");
        let mut run = || -> candle_core::Result<()> {
            let index = match runs {
                [_] => None,
                _ => {
                    let cells: Vec<u32> = runs.iter().flat_map(|r| r.start as u32..r.end as u32).collect();
                    Some(Tensor::from_vec(cells, n, &self.device)?)
                }
            };
            // The cells of `runs`, decoded to the compute dtype.
            let gather = |plane: &Plane, dim: usize| {
                let cells = match &index {
                    Some(index) => plane.map(|t| t.index_select(index, dim))?,
                    None => plane.map(|t| t.narrow(dim, runs[0].start, n))?,
                };
                cells.decode(self.dtype)
            };
            for (i, &layer) in layers.iter().enumerate() {
                let store = self.layer(layer).expect("export_layout checked every layer");
                // [cells, H, D] -> [H, n, D]
                let keys = gather(&store.keys, 0)?.transpose(0, 1)?;
                let values = match self.layout {
                    VLayout::Normal => gather(&store.values, 0)?.transpose(0, 1)?,
                    // [H, Dv, cells] -> [H, Dv, n] -> [H, n, Dv]
                    VLayout::Permuted => gather(&store.values, 2)?.transpose(1, 2)?,
                };
                let dst = out.layer_mut(i);
                copy_out(&keys, dst.keys)?;
                copy_out(&values, dst.values)?;
            }
            Ok(())
        };
        run().map_err(CacheError::backend)
    }

    /// Uploads rows `rows` of every layer of `kv` to the device, shaped like
    /// `put`'s keys and values; changes nothing in the cache.
    pub(crate) fn upload_rows(&self, kv: &HostKv, rows: Range<usize>) -> Result<Vec<Uploaded>> {
        let layout = *kv.layout();
        let shape = |dim: usize| [layout.kv_heads, rows.len(), dim];
        let run = || -> candle_core::Result<Vec<Uploaded>> {
            (0..layout.layers)
                .map(|layer| {
                    let src = kv.layer(layer);
                    let keys = select_rows(src.keys, &layout, src.tokens, layout.head_dim, &rows);
                    let values = select_rows(src.values, &layout, src.tokens, layout.head_dim_v, &rows);
                    // [H, n, D] -> [n, H, D]
                    let keys = from_le_bytes(&keys, self.dtype, &shape(layout.head_dim), &self.device)?;
                    let values = from_le_bytes(&values, self.dtype, &shape(layout.head_dim_v), &self.device)?;
                    Ok((keys.transpose(0, 1)?, values.transpose(0, 1)?))
                })
                .collect()
        };
        run().map_err(CacheError::backend)
    }

    /// Creates the layers `layers` that have no storage yet, with head
    /// dimensions `dims`.
    pub(crate) fn ensure_layers(&mut self, layers: &[usize], dims: HeadDims) -> Result<()> {
        layers
            .iter()
            .try_for_each(|&layer| self.ensure_layer(layer, dims))
    }

    /// Writes uploaded rows into `cells` (the cell of each row): row layer
    /// `i` into layer `layers[i]`, each with storage ([`Storage::ensure_layers`]).
    pub(crate) fn write_uploaded(
        &self,
        uploaded: &[Uploaded],
        cells: &[u32],
        layers: &[usize],
    ) -> Result<()> {
        for ((keys, values), &layer) in uploaded.iter().zip(layers) {
            self.write(layer, keys, values, cells)?;
        }
        Ok(())
    }
}

/// Rows `rows` of each head of one layer's `[kv_heads, tokens, dim]` bytes, as
/// `[kv_heads, rows.len(), dim]` (borrowed when that is all of them).
fn select_rows<'a>(
    bytes: &'a [u8],
    layout: &KvLayout,
    tokens: usize,
    dim: usize,
    rows: &Range<usize>,
) -> Cow<'a, [u8]> {
    if rows.start == 0 && rows.end == tokens {
        return Cow::Borrowed(bytes);
    }
    let row = dim * layout.dtype.size_in_bytes();
    let mut out = Vec::with_capacity(layout.kv_heads * rows.len() * row);
    for head in 0..layout.kv_heads {
        let base = head * tokens * row;
        out.extend_from_slice(&bytes[base + rows.start * row..base + rows.end * row]);
    }
    Cow::Owned(out)
}

/// A tensor of `shape` from little-endian bytes of `dtype`.
fn from_le_bytes(
    bytes: &[u8],
    dtype: CandleDType,
    shape: &[usize],
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    if cfg!(target_endian = "little") {
        return Tensor::from_raw_buffer(bytes, dtype, shape, device);
    }
    let size = dtype.size_in_bytes();
    let native: Vec<u8> = bytes
        .chunks_exact(size)
        .flat_map(|c| c.iter().rev().copied())
        .collect();
    Tensor::from_raw_buffer(&native, dtype, shape, device)
}

/// Writes the elements of `t` in row-major order into `dst` as little-endian bytes.
fn copy_out(t: &Tensor, dst: &mut [u8]) -> candle_core::Result<()> {
    match t.dtype() {
        CandleDType::F32 => copy_elements(t, dst, f32::to_le_bytes),
        CandleDType::F16 => copy_elements(t, dst, half::f16::to_le_bytes),
        CandleDType::BF16 => copy_elements(t, dst, half::bf16::to_le_bytes),
        other => candle_core::bail!("keys and values of dtype {other:?} are not stored"),
    }
}

/// [`copy_out`] for one element type: on the CPU straight from the tensor's
/// memory, elsewhere through one host copy.
fn copy_elements<T: WithDType, const N: usize>(
    t: &Tensor,
    dst: &mut [u8],
    to_le: fn(T) -> [u8; N],
) -> candle_core::Result<()> {
    let t = t.contiguous()?;
    let encode = |src: &[T], dst: &mut [u8]| {
        assert_eq!(src.len() * N, dst.len(), "host rows sized for the tensor");
        for (d, &s) in dst.chunks_exact_mut(N).zip(src) {
            d.copy_from_slice(&to_le(s));
        }
    };
    {
        let (storage, layout) = t.storage_and_layout();
        if let (CandleStorage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            encode(&cpu.as_slice::<T>()?[start..end], dst);
            return Ok(());
        }
    }
    encode(&t.flatten_all()?.to_vec1::<T>()?, dst);
    Ok(())
}
