//! [`CausalKvCache`]: the causal cache on candle tensors, bookkeeping plus storage.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use candle_core::{Device, Tensor};
use kvcache_api::block_key::{BlockKey, Scope};
use kvcache_api::retention::{BlockChain, BlockChange, Prefix};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, Fingerprint, ForwardMode, KeyShift, KvView, PagedKv, Pos,
    PosRange, Result, SeqId, SeqKv,
};

use crate::book::{Book, RemovePlan};
use crate::inspect::{CachePicture, CellData, CellInfo, LayerData, PassPicture};
use crate::mask_buffer::MaskBuffer;
use crate::storage::Storage;

/// A shift function as the cache keeps it: shared by deep clones, never mutated.
pub type SharedKeyShift = Arc<dyn KeyShift<Tensor>>;

/// Makes a shift function for a [`CausalKvCache`] of a closure with no parameter
/// types written out: `layer: usize`, `keys: &Tensor` (`[n, kv_heads, head_dim]`,
/// a view of `n` consecutive cells of that layer) and `shifts: &[Pos]` (`[n]`, each
/// cell's position delta, 0 for cells that do not move), returning the re-rotated
/// keys, same shape. [`kvcache_api::key_shift`] with the tensor type fixed to
/// candle's.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kvcache_api::{CacheError, CausalConfig};
/// use kvcache_causal::{key_shift, CausalKvCache};
///
/// let shift = key_shift(|_layer, keys, shifts| {
///     // Stand-in for a real rotation: add each cell's delta to its key.
///     let deltas: Vec<f32> = shifts.iter().map(|&s| s as f32).collect();
///     let deltas = Tensor::from_vec(deltas, (shifts.len(), 1, 1), keys.device());
///     deltas.and_then(|d| keys.broadcast_add(&d)).map_err(CacheError::backend)
/// });
/// let cache = CausalKvCache::new(CausalConfig::new(1, 64, 8), Device::Cpu, Some(shift))?;
/// # Ok::<(), CacheError>(())
/// ```
pub fn key_shift<F>(f: F) -> Box<dyn KeyShift<Tensor>>
where
    F: Fn(usize, &Tensor, &[Pos]) -> Result<Tensor> + Send + Sync + 'static,
{
    kvcache_api::key_shift::<Tensor, F>(f)
}

/// A multi-sequence causal KV cache whose keys and values are candle tensors.
///
/// Cells (one token's keys and values for every layer) are shared by up to
/// `max_sequences` sequences; each forward pass places its tokens in free cells,
/// trims sliding windows and builds the attention mask. See [`CausalCache`] for the
/// call protocol and the crate documentation for the design.
///
/// Shapes: `put` takes keys `[batch, kv_heads, head_dim]` and values
/// `[batch, kv_heads, head_dim_v]` in the configured dtype, on the cache's device.
/// `get` returns views of the pass's cell range: keys `[cells, kv_heads, head_dim]`,
/// values `[cells, kv_heads, head_dim_v]` (or `[kv_heads, head_dim_v, cells]` with
/// [`kvcache_api::VLayout::Permuted`]) and the mask `[batch_padded, cells]`.
///
/// Metadata changes ([`remove`](CausalCache::remove),
/// [`copy_prefix`](CausalCache::copy_prefix), [`configure`](CausalCache::configure))
/// end the pass in progress: `put` and `get` then need a new `start_forward`.
///
/// The cache is deliberately not `Clone`: a shallow clone would share the stored
/// tensors and let one copy overwrite the other's cells. [`CausalKvCache::try_clone`]
/// makes a deep copy.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode};
/// use kvcache_causal::CausalKvCache;
///
/// let mut cache = CausalKvCache::new(CausalConfig::new(2, 64, 8), Device::Cpu, None)?;
/// // Sequence 0 prefills 3 tokens while sequence 1 starts with 1.
/// let batch = Batch::from_tokens([(0, 0), (0, 1), (0, 2), (1, 0)])?;
/// cache.start_forward(&batch, ForwardMode::Compute)?;
/// cache.set_layer(0);
/// let keys = Tensor::ones((4, 2, 16), DType::F32, &Device::Cpu).unwrap(); // [batch, kv_heads, head_dim]
/// cache.put(&keys, &keys)?;
/// let view = cache.get()?;
/// assert_eq!(view.keys.dims(), &[4, 2, 16]); // [cells, kv_heads, head_dim]
/// assert_eq!(view.mask.dims(), &[4, 4]); // [batch, cells]
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
pub struct CausalKvCache {
    pub(crate) book: Book,
    pub(crate) storage: Storage,
    /// The model the stored keys and values belong to (see `crate::transfer`).
    pub(crate) fingerprint: Fingerprint,
    shift: Option<SharedKeyShift>,
    layer: usize,
    /// The pass's dense mask and the buffer it is written into, behind a lock
    /// because `get` (`&self`) builds it on first use.
    masks: Mutex<Masks>,
}

/// The pass's dense mask, built by the first `get` of the pass rather than by
/// `start_forward`: an engine that reads only the paged view never writes a
/// `[rows, cells]` mask (nor, on a GPU, uploads one).
#[derive(Debug, Default)]
struct Masks {
    pass: PassMask,
    /// Where masks are written, kept between passes.
    buffer: MaskBuffer,
}

/// Where the pass's mask stands.
#[derive(Debug, Default, Clone)]
enum PassMask {
    /// No pass in progress whose storage is ready (none begun, or its
    /// `start_forward` failed after placing the batch).
    #[default]
    Absent,
    /// A pass in progress whose mask nobody asked for yet.
    Pending,
    /// The pass's mask `[batch_padded, range]`. After a metadata change ends
    /// the pass it lingers, unreachable, until the next pass replaces it, so
    /// that a removal never pays for freeing a large buffer.
    Built(Tensor),
}

impl std::fmt::Debug for CausalKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CausalKvCache")
            .field("config", self.book.config())
            .field("device", self.storage.device())
            .field("used_cells", &self.used_cells())
            .field("layers", &self.storage.layers().count())
            .field("has_shift", &self.shift.is_some())
            .finish_non_exhaustive()
    }
}

/// Keys a removal rewrote: `keys` replace cells `first..` of `layer`.
struct ShiftedKeys {
    layer: usize,
    first: usize,
    keys: Tensor,
}

/// A removal that passed validation, with its re-rotated keys computed.
pub(crate) struct PreparedRemove {
    plan: RemovePlan,
    shifted: Vec<ShiftedKeys>,
}

impl CausalKvCache {
    /// An empty cache for `config` whose tensors live on `device`; `shift`
    /// re-rotates keys when a removal moves positions (see [`crate::RopeShift`]).
    ///
    /// A closure becomes a shift function through [`crate::key_shift`], with
    /// no parameter types written out (`keys: &Tensor` `[n, kv_heads, head_dim]`,
    /// `shifts: &[Pos]` `[n]`):
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use kvcache_api::{CacheError, CausalConfig};
    /// use kvcache_causal::{key_shift, CausalKvCache};
    ///
    /// let shift = key_shift(|_layer, keys, shifts| {
    ///     // Stand-in for a real rotation: add each cell's delta to its key.
    ///     let deltas: Vec<f32> = shifts.iter().map(|&s| s as f32).collect();
    ///     let deltas = Tensor::from_vec(deltas, (shifts.len(), 1, 1), keys.device());
    ///     deltas.and_then(|d| keys.broadcast_add(&d)).map_err(CacheError::backend)
    /// });
    /// let cache = CausalKvCache::new(CausalConfig::new(1, 64, 8), Device::Cpu, Some(shift))?;
    /// # Ok::<(), CacheError>(())
    /// ```
    pub fn new(
        config: CausalConfig,
        device: Device,
        shift: Option<Box<dyn KeyShift<Tensor>>>,
    ) -> Result<Self> {
        Self::with_shared_shift(config, device, shift.map(SharedKeyShift::from))
    }

    /// Like [`CausalKvCache::new`] with a shift function shared with other caches
    /// (for example every group of a [`crate::LayerGroupCache`]).
    pub fn with_shared_shift(
        config: CausalConfig,
        device: Device,
        shift: Option<SharedKeyShift>,
    ) -> Result<Self> {
        // The book validates the configuration before anything is sized from it.
        let book = Book::new(config)?;
        let storage = Storage::new(book.config(), device);
        Ok(CausalKvCache {
            book,
            storage,
            fingerprint: Fingerprint::default(),
            shift,
            layer: 0,
            masks: Mutex::default(),
        })
    }

    /// The device the tensors live on.
    pub fn device(&self) -> &Device {
        self.storage.device()
    }

    /// Number of cells.
    pub fn num_cells(&self) -> usize {
        self.book.cells().len()
    }

    /// Cells held by at least one sequence.
    pub fn used_cells(&self) -> usize {
        self.book.cells().occupancy().used()
    }

    /// The layer `put` and `get` address.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The position and sequences of `cell`, or `None` when it is free (or past
    /// the last cell).
    pub fn cell(&self, cell: usize) -> Option<CellInfo> {
        let cells = self.book.cells();
        if cell >= cells.len() {
            return None;
        }
        let pos = cells
            .position_of(cell)
            .or_else(|| self.book.block_position(cell))?;
        Some(CellInfo {
            pos,
            sequences: cells.sequences(cell).collect(),
            blocks: usize::from(cells.pins(cell)),
        })
    }

    /// The positions `seq` holds, ascending, each with its cell. Empty for an
    /// unknown sequence.
    pub fn positions(&self, seq: SeqId) -> Vec<(Pos, usize)> {
        if seq >= self.book.cells().max_sequences() {
            return Vec::new();
        }
        let index = self.book.cells().index(seq);
        let mut out = Vec::with_capacity(index.len());
        for r in index.runs() {
            out.extend((0..r.len).map(|k| (r.pos + k as Pos, (r.cell + k) as usize)));
        }
        out
    }

    /// The cell of each token of the pass in progress, in batch order (empty
    /// between passes and in reserve passes).
    pub fn pass_cells(&self) -> &[u32] {
        match self.book.pass().mode() {
            Some(_) => self.book.pass().cells(),
            None => &[],
        }
    }

    /// The cell range the pass in progress attends to (mask columns, views).
    pub fn pass_range(&self) -> Option<Range<usize>> {
        self.book.pass().mode().map(|_| self.book.pass().range())
    }

    /// The cells row `row` of the pass's mask may attend to, read from the mask's
    /// plan (no tensor is read or converted): sorted, disjoint, non-adjacent
    /// ranges of **mask columns**, i.e. cell indices relative to the start of
    /// [`pass_range`](Self::pass_range) (add `pass_range().start` for absolute
    /// cells). Column `j` is visible exactly where the dense mask
    /// `[batch_padded, cells]` holds `0` in row `row`, and the same column
    /// indexes the first axis of [`KvView::keys`] (`[cells, kv_heads, head_dim]`).
    ///
    /// Rows follow the batch order of [`start_forward`](CausalCache::start_forward)
    /// (and [`set_causal`](CausalCache::set_causal) exemptions); padding rows
    /// (`batch.len() <= row < batch_padded`) and every row of a reserve pass are
    /// fully masked: an empty list.
    ///
    /// Errors: [`CacheError::InvalidState`] with no pass in progress (before
    /// `start_forward`, or after a metadata change ended the pass),
    /// [`CacheError::InvalidArgument`] for `row >= batch_padded`.
    ///
    /// ```
    /// use candle_core::Device;
    /// use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode};
    /// use kvcache_causal::CausalKvCache;
    ///
    /// let mut cache = CausalKvCache::new(CausalConfig::new(2, 64, 8), Device::Cpu, None)?;
    /// assert!(cache.visible_cells(0).is_err()); // no pass yet
    /// let batch = Batch::from_tokens([(0, 0), (0, 1), (1, 0)])?;
    /// cache.start_forward(&batch, ForwardMode::Compute)?;
    /// assert_eq!(cache.visible_cells(1)?, vec![0..2]); // sequence 0, positions 0 and 1
    /// assert_eq!(cache.visible_cells(2)?, vec![2..3]); // sequence 1 alone
    /// # Ok::<(), kvcache_api::CacheError>(())
    /// ```
    pub fn visible_cells(&self, row: usize) -> Result<Vec<Range<usize>>> {
        self.book.visible_cells(row)
    }

    /// The stored keys and values of `cell` in `layer`, as f32.
    pub fn read_cell(&self, layer: usize, cell: usize) -> Result<CellData> {
        let (keys, values) = self.storage.read_cell(layer, cell)?;
        Ok(CellData { keys, values })
    }

    /// A picture of everything observable about the cache (metadata, pass,
    /// mask, stored data), for comparing two caches or one before and after.
    /// Copies every tensor to the host: meant for tests.
    pub fn picture(&self) -> Result<CachePicture> {
        let cells = self.book.cells();
        let pass = match self.book.pass().mode() {
            None => None,
            Some(mode) => {
                let p = self.book.pass();
                let mask = match self.mask()? {
                    Some(m) => m
                        .to_dtype(candle_core::DType::F32)
                        .and_then(|m| m.flatten_all()?.to_vec1::<f32>())
                        .map_err(CacheError::backend)?,
                    None => Vec::new(),
                };
                Some(PassPicture {
                    mode,
                    cells: p.cells().iter().map(|&c| c as usize).collect(),
                    exempt: p
                        .exempt()
                        .iter()
                        .enumerate()
                        .filter(|e| *e.1)
                        .map(|e| e.0)
                        .collect(),
                    range: p.range(),
                    mask,
                })
            }
        };
        let mut layers = Vec::new();
        for layer in 0..self.storage.layer_slots() {
            layers.push(match self.storage.layer(layer) {
                None => None,
                Some(store) => Some(LayerData::read(&store.keys, &store.values)?),
            });
        }
        Ok(CachePicture {
            config: self.book.config().clone(),
            cells: (0..cells.len()).map(|c| self.cell(c)).collect(),
            pass,
            layer: self.layer,
            layers,
            exact: (
                cells.clone(),
                self.book.pass().clone(),
                self.book.blocks().clone(),
            ),
        })
    }

    /// Panics with a precise message unless every bookkeeping invariant holds and
    /// the stored tensors match the configuration.
    pub fn check(&self) {
        self.book.check();
        self.storage.check();
        let config = self.book.config();
        for (layer, store) in self.storage.layers() {
            assert_eq!(
                store.keys.dims()[0],
                self.num_cells(),
                "layer {layer}: keys have {} cells",
                store.keys.dims()[0]
            );
            let v_cells = match config.v_layout {
                kvcache_api::VLayout::Normal => store.values.dims()[0],
                kvcache_api::VLayout::Permuted => store.values.dims()[2],
            };
            assert_eq!(
                v_cells,
                self.num_cells(),
                "layer {layer}: values have {v_cells} cells"
            );
        }
        if self.book.pass().mode().is_some() {
            let masks = self.lock_masks();
            assert!(
                !matches!(masks.pass, PassMask::Absent),
                "a pass in progress has a mask, built or pending"
            );
            if let PassMask::Built(mask) = &masks.pass {
                assert_eq!(
                    mask.dims(),
                    &[self.book.mask_rows(), self.book.pass().range().len()],
                    "mask shape disagrees with the pass"
                );
            }
        }
    }

    /// A deep copy: new tensors on the same device, the same shift function.
    pub fn try_clone(&self) -> Result<Self> {
        let masks = {
            let masks = self.lock_masks();
            let built = match &masks.pass {
                PassMask::Built(mask) => Some(mask),
                _ => None,
            };
            let (buffer, mask) = masks.buffer.share(built);
            let pass = match (&masks.pass, mask) {
                (_, Some(mask)) => PassMask::Built(mask),
                (other, None) => other.clone(),
            };
            Masks { pass, buffer }
        };
        Ok(CausalKvCache {
            book: self.book.clone(),
            storage: self.storage.try_clone()?,
            fingerprint: self.fingerprint,
            shift: self.shift.clone(),
            layer: self.layer,
            masks: Mutex::new(masks),
        })
    }

    /// Makes this cache a deep copy of `source` (configuration, cells, the pass in
    /// progress, stored keys and values, shift function, fingerprint), reusing this cache's
    /// tensors and mask buffer where shapes allow: the cheap way for an engine to
    /// checkpoint a cache and roll back to it. Views taken from this cache before
    /// the call see the copied data.
    ///
    /// # Errors
    /// [`CacheError::InvalidArgument`] if the caches live on different devices
    /// (nothing changes); [`CacheError::Backend`] if a tensor copy fails, which
    /// leaves this cache empty, configured like `source`.
    pub fn try_clone_from(&mut self, source: &CausalKvCache) -> Result<()> {
        if !self.device().same_device(source.device()) {
            return Err(CacheError::InvalidArgument(format!(
                "cannot copy a cache on {:?} into one on {:?}",
                source.device().location(),
                self.device().location()
            )));
        }
        let dtype = source.book.config().mask_dtype;
        let copied = self.storage.copy_from(&source.storage).and_then(|()| {
            let source = source.lock_masks();
            let masks = self.masks.get_mut().unwrap_or_else(PoisonError::into_inner);
            match &source.pass {
                PassMask::Built(mask) => {
                    let copy = masks.buffer.copy_from(&source.buffer, Some(mask), dtype)?;
                    Ok(copy.map_or(PassMask::Absent, PassMask::Built))
                }
                other => Ok(other.clone()),
            }
        });
        match copied {
            Ok(pass) => {
                self.book.clone_from(&source.book);
                self.fingerprint = source.fingerprint;
                self.shift.clone_from(&source.shift);
                self.layer = source.layer;
                self.masks.get_mut().unwrap_or_else(PoisonError::into_inner).pass = pass;
                Ok(())
            }
            Err(error) => {
                self.configure(source.book.config().clone())?;
                Err(error)
            }
        }
    }

    /// Bytes of heap memory held by the bookkeeping (not the tensors); it does not
    /// grow with the number of passes.
    pub fn metadata_bytes(&self) -> usize {
        self.book.capacity_bytes()
    }

    /// Bytes of key/value tensors allocated.
    pub fn storage_bytes(&self) -> usize {
        self.storage.bytes()
    }

    /// Bytes of key/value storage one cell (one cached token) takes across every
    /// stored layer, in the configured storage type
    /// ([`CausalConfig::storage`](kvcache_api::CausalConfig::storage)); 0 before
    /// the first `put`.
    pub fn storage_bytes_per_cell(&self) -> usize {
        self.storage.bytes_per_cell()
    }

    /// Bytes kept between passes to write masks into: room for the largest mask
    /// of a non-reserve pass so far (grown by doubling, so up to twice its size).
    pub fn mask_buffer_bytes(&self) -> usize {
        self.lock_masks().buffer.bytes()
    }

    // ---- two-phase operations, shared with the layer-group wrapper ----

    pub(crate) fn prepare_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Result<()> {
        self.book.prepare_forward(batch, mode)
    }

    pub(crate) fn commit_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Result<()> {
        let moves = self.book.commit_forward(batch, mode);
        self.set_pass_mask(PassMask::Absent);
        self.storage.apply_moves(&moves)?;
        self.set_pass_mask(PassMask::Pending);
        Ok(())
    }

    fn set_pass_mask(&mut self, pass: PassMask) {
        self.masks.get_mut().unwrap_or_else(PoisonError::into_inner).pass = pass;
    }

    fn lock_masks(&self) -> MutexGuard<'_, Masks> {
        // A panic while a mask was written leaves at worst a stale `Built` mask
        // of the pass that panicked; the next pass replaces it.
        self.masks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The pass's dense mask `[batch_padded, range]`, built on the first call
    /// of the pass; `None` without a pass whose storage is ready.
    fn mask(&self) -> Result<Option<Tensor>> {
        let mut masks = self.lock_masks();
        match &masks.pass {
            PassMask::Absent => Ok(None),
            PassMask::Built(mask) => Ok(Some(mask.clone())),
            PassMask::Pending => {
                let mask = masks.buffer.build(&self.book, self.storage.device())?;
                masks.pass = PassMask::Built(mask.clone());
                Ok(Some(mask))
            }
        }
    }

    pub(crate) fn prepare_set_causal(&self, except: &[usize]) -> Result<bool> {
        self.book.prepare_set_causal(except)
    }

    pub(crate) fn commit_set_causal(&mut self, except: &[usize], changed: bool) -> Result<()> {
        if changed {
            self.book.commit_set_causal(except);
            self.set_pass_mask(PassMask::Pending);
        }
        Ok(())
    }

    /// Validates a removal and computes every re-rotated key, changing nothing.
    pub(crate) fn prepare_remove(&self, seq: SeqId, range: PosRange) -> Result<PreparedRemove> {
        let plan = self.book.prepare_remove(seq, range, self.shift.is_some())?;
        let mut shifted = Vec::new();
        if plan.chunks.is_empty() {
            return Ok(PreparedRemove { plan, shifted });
        }
        let shift = self.shift.as_ref().expect("validated: a shift function exists");
        for (layer, store) in self.storage.layers() {
            for chunk in &plan.chunks {
                let view = self
                    .storage
                    .key_view(store, chunk.first..chunk.first + chunk.offsets.len())?;
                let keys = shift.shift(layer, &view, plan.offsets(chunk))?;
                if keys.id() == view.id() {
                    continue; // returned unchanged: nothing to write
                }
                if keys.dims() != view.dims() {
                    return Err(CacheError::ShapeMismatch {
                        what: "shifted keys",
                        expected: view.dims().to_vec(),
                        got: keys.dims().to_vec(),
                    });
                }
                if keys.dtype() != view.dtype() || !keys.device().same_device(view.device()) {
                    return Err(CacheError::DTypeMismatch {
                        what: "shifted keys",
                        expected: format!("{:?} on {:?}", view.dtype(), view.device().location()),
                        got: format!("{:?} on {:?}", keys.dtype(), keys.device().location()),
                    });
                }
                // A result aliasing the cache must not be read while it is overwritten.
                let keys = if store.keys.aliases(&keys) {
                    keys.force_contiguous().map_err(CacheError::backend)?
                } else {
                    keys
                };
                shifted.push(ShiftedKeys {
                    layer,
                    first: chunk.first,
                    keys,
                });
            }
        }
        Ok(PreparedRemove { plan, shifted })
    }

    pub(crate) fn commit_remove(&mut self, prepared: PreparedRemove) -> Result<()> {
        self.book.commit_remove(&prepared.plan);
        for s in &prepared.shifted {
            self.storage.write_keys(s.layer, s.first, &s.keys)?;
        }
        Ok(())
    }

    pub(crate) fn prepare_copy_prefix(&self, src: SeqId, dst: SeqId, len: Pos) -> Result<()> {
        self.book.prepare_copy_prefix(src, dst, len)
    }

    pub(crate) fn commit_copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) {
        self.book.commit_copy_prefix(src, dst, len);
    }

    pub(crate) fn shared_shift(&self) -> Option<&SharedKeyShift> {
        self.shift.as_ref()
    }

    /// The current layer's storage, for a read of the pass in progress by `what`
    /// (`get`, `get_paged`): an error without a pass or before the layer's `put`.
    fn pass_layer(&self, what: &str) -> Result<&crate::storage::LayerStore> {
        let ready = !matches!(self.lock_masks().pass, PassMask::Absent);
        if self.book.pass().mode().is_none() || !ready {
            return Err(CacheError::InvalidState(format!(
                "{what} needs a forward pass in progress: call start_forward first"
            )));
        }
        self.storage.bind_to_thread()?;
        self.storage.layer(self.layer).ok_or_else(|| {
            CacheError::InvalidState(format!(
                "layer {} has no keys or values yet: put them before {what}",
                self.layer
            ))
        })
    }
}

impl CausalCache for CausalKvCache {
    type Tensor = Tensor;

    fn config(&self) -> &CausalConfig {
        self.book.config()
    }

    /// The cells the bookkeeping allocated ([`CausalKvCache::num_cells`]).
    fn num_cells(&self) -> usize {
        self.book.cells().len()
    }

    /// Replaces the configuration; every stored token and tensor is dropped (the
    /// device and shift function stay).
    fn configure(&mut self, config: CausalConfig) -> Result<()> {
        let book = Book::new(config)?;
        self.storage = Storage::new(book.config(), self.storage.device().clone());
        self.book = book;
        *self.masks.get_mut().unwrap_or_else(PoisonError::into_inner) = Masks::default();
        Ok(())
    }

    fn start_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Result<()> {
        self.storage.bind_to_thread()?;
        self.prepare_forward(batch, mode)?;
        self.commit_forward(batch, mode)
    }

    fn set_layer(&mut self, layer: usize) {
        self.layer = layer;
    }

    fn set_causal(&mut self, except: &[usize]) -> Result<()> {
        self.storage.bind_to_thread()?;
        let changed = self.prepare_set_causal(except)?;
        self.commit_set_causal(except, changed)
    }

    fn put(&mut self, keys: &Tensor, values: &Tensor) -> Result<()> {
        let Some(mode) = self.book.pass().mode() else {
            return Err(CacheError::InvalidState(
                "put needs a forward pass in progress: call start_forward first".into(),
            ));
        };
        self.storage.bind_to_thread()?;
        let dims = self
            .storage
            .check_put(self.layer, keys, values, self.book.pass().len())?;
        self.storage.ensure_layer(self.layer, dims)?;
        if mode == ForwardMode::Compute {
            self.storage
                .write(self.layer, keys, values, self.book.pass().cells())?;
        }
        Ok(())
    }

    fn get(&self) -> Result<KvView<Tensor>> {
        let store = self.pass_layer("get")?;
        let mask = self.mask()?.expect("a ready pass has a mask");
        let (keys, values) = self.storage.views(store, self.book.pass().range())?;
        Ok(KvView { keys, values, mask })
    }

    /// The paged view: every row's visible cells and the layer's keys and values
    /// in their stored type (no decoding, no copy: the planes themselves).
    fn get_paged(&self) -> Result<PagedKv<'_, Tensor>> {
        let store = self.pass_layer("get_paged")?;
        let (keys, values) = (store.keys.stored(), store.values.stored());
        Ok(PagedKv {
            keys,
            values,
            v_layout: self.book.config().v_layout,
            runs: self.book.pass().runs(),
        })
    }

    fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) -> Result<()> {
        self.storage.bind_to_thread()?;
        self.prepare_copy_prefix(src, dst, len)?;
        self.commit_copy_prefix(src, dst, len);
        Ok(())
    }

    fn can_resume(&self, seq: SeqId, pos: Pos) -> bool {
        self.book.can_resume(seq, pos)
    }

    fn remove(&mut self, seq: SeqId, range: PosRange) -> Result<()> {
        self.storage.bind_to_thread()?;
        let prepared = self.prepare_remove(seq, range)?;
        self.commit_remove(prepared)
    }

    /// Yes without a sliding window or chunked attention (which trim the
    /// positions a chain of blocks starts with).
    fn indexes_blocks(&self) -> bool {
        self.book.indexes_blocks()
    }

    fn block_children(&self, parent: &BlockKey) -> Vec<(BlockKey, usize)> {
        self.book.block_children(parent)
    }

    fn holds_block(&self, key: &BlockKey) -> bool {
        self.book.holds_block(key)
    }

    fn longest_prefix(&self, scope: Scope<'_>, tokens: &[u32], limit: usize) -> Prefix {
        self.book.longest_prefix(scope, tokens, limit)
    }

    /// Bookkeeping only: the cells stay where they are, pinned.
    fn retain_blocks(&mut self, seq: SeqId, chain: &BlockChain) -> Result<Vec<usize>> {
        let plan = self.book.prepare_retain(seq, chain)?;
        Ok(self.book.commit_retain(chain, plan))
    }

    /// Bookkeeping only, like `copy_prefix`; ends any pass in progress.
    fn adopt_blocks(&mut self, seq: SeqId, blocks: &[BlockKey], len: Pos) -> Result<()> {
        self.book.blocks_supported()?;
        self.book.prepare_adopt(seq, blocks, len)?;
        self.book.commit_adopt(seq, blocks, len);
        Ok(())
    }

    fn forget_blocks(&mut self, keys: &[BlockKey]) -> Vec<BlockKey> {
        self.book.forget_blocks(keys)
    }

    fn forget_blocks_unused_for(&mut self, age: Duration) -> Vec<BlockKey> {
        self.book.forget_blocks_unused_for(age)
    }

    fn evict_blocks(&mut self, cells: usize) -> Vec<BlockKey> {
        self.book.evict_blocks(cells)
    }

    fn clear_blocks(&mut self) -> Vec<BlockKey> {
        self.book.clear_blocks()
    }

    fn indexed_blocks(&self) -> (usize, usize) {
        self.book.indexed_blocks()
    }

    fn drain_block_changes(&mut self) -> Vec<BlockChange> {
        self.book.drain_block_changes()
    }

    fn export_seq(&self, seq: SeqId, range: std::ops::Range<Pos>) -> Result<SeqKv> {
        self.storage.bind_to_thread()?;
        CausalKvCache::export_seq(self, seq, range)
    }

    fn import_seq(&mut self, seq: SeqId, state: &SeqKv) -> Result<()> {
        self.storage.bind_to_thread()?;
        CausalKvCache::import_seq(self, seq, state)
    }

    /// The whole cache, its window (if any) and memory: a cache with a
    /// window cannot export every position from 0, so a store of whole
    /// prompts ([`kvcache_api::StoreParts`]) refuses it.
    fn store_parts(&self) -> Vec<kvcache_api::StorePart> {
        let config = self.book.config();
        vec![kvcache_api::StorePart {
            layers: None,
            window: config.window.map(|w| w.window()),
            memory: config.effective_memory(),
        }]
    }
}
