//! The causal-cache interface: one cache of cells shared by many sequences,
//! driven once per forward pass (the design of Ollama's ggml runner).

use std::ops::{Range, RangeFrom, RangeFull};
use std::time::Duration;

use crate::block_key::{BlockKey, Scope};
use crate::retention::{BlockChain, BlockChange, Prefix};
use crate::{Batch, CausalConfig, PagedKv, Pos, Result, SeqId, SeqKv, StorePart};

/// Whether a forward pass computes or only sizes the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardMode {
    /// A real pass: tokens are placed in cells and the mask reflects them.
    #[default]
    Compute,
    /// A worst-case pass for measuring memory: every cell is in range, the mask is
    /// fully masked, and neither metadata nor stored keys/values change.
    Reserve,
}

/// A half-open range of positions to remove; an open end removes to the end of
/// the sequence without shifting anything.
///
/// ```
/// use kvcache_api::PosRange;
///
/// assert_eq!(PosRange::from(4..8), PosRange { start: 4, end: Some(8) });
/// assert_eq!(PosRange::from(4..), PosRange { start: 4, end: None });
/// assert_eq!(PosRange::from(..), PosRange { start: 0, end: None });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PosRange {
    /// First position removed.
    pub start: Pos,
    /// One past the last position removed, or `None` for "to the end".
    pub end: Option<Pos>,
}

impl PosRange {
    /// Whether `pos` is removed by this range.
    pub fn contains(&self, pos: Pos) -> bool {
        pos >= self.start && self.end.is_none_or(|e| pos < e)
    }

    /// How far later positions move: `start - end` for a closed range, else 0.
    pub fn shift(&self) -> Pos {
        self.end.map_or(0, |e| self.start - e)
    }
}

impl From<Range<Pos>> for PosRange {
    fn from(r: Range<Pos>) -> Self {
        PosRange {
            start: r.start,
            end: Some(r.end),
        }
    }
}

impl From<RangeFrom<Pos>> for PosRange {
    fn from(r: RangeFrom<Pos>) -> Self {
        PosRange {
            start: r.start,
            end: None,
        }
    }
}

impl From<RangeFull> for PosRange {
    fn from(_: RangeFull) -> Self {
        PosRange { start: 0, end: None }
    }
}

/// What [`CausalCache::get`] returns for the current layer and forward pass.
///
/// All three are views into cache-owned storage (no copies) that the cache
/// overwrites in place: they stay valid until the next `start_forward`,
/// `set_causal` or `put` on the same layer. Copy one to keep it longer.
#[derive(Debug, Clone)]
pub struct KvView<T> {
    /// Keys of the pass's cell range: `[cells, kv_heads, head_dim]`.
    pub keys: T,
    /// Values of the pass's cell range: `[cells, kv_heads, head_dim_v]`, or
    /// `[kv_heads, head_dim_v, cells]` with [`crate::VLayout::Permuted`].
    pub values: T,
    /// Attention mask `[batch_padded, cells]`: `0` where token `i` may attend to
    /// cell `j`, `-inf` where not, in the configured mask dtype.
    pub mask: T,
}

/// Re-rotates stored keys after their positions moved (RoPE shift).
///
/// Called by a shifting removal with a view of `n` consecutive cells of one
/// layer, `keys: [n, kv_heads, head_dim]`, and `shifts: [n]`, the position delta of
/// each cell (0 for cells that do not move). Returns the new keys, same shape.
/// Closures with this signature implement it.
pub trait KeyShift<T>: Send + Sync {
    /// Returns `keys` rotated by `shifts` positions.
    fn shift(&self, layer: usize, keys: &T, shifts: &[Pos]) -> Result<T>;
}

impl<T, F> KeyShift<T> for F
where
    F: Fn(usize, &T, &[Pos]) -> Result<T> + Send + Sync,
{
    fn shift(&self, layer: usize, keys: &T, shifts: &[Pos]) -> Result<T> {
        self(layer, keys, shifts)
    }
}

/// Makes a boxed [`KeyShift`] of a closure, fixing its parameter types so that
/// none needs writing out: `layer: usize`, `keys: &T` (`[n, kv_heads, head_dim]`)
/// and `shifts: &[Pos]` (`[n]`), returning `Result<T>` of the same shape.
///
/// A bare closure passed where a `Box<dyn KeyShift<T>>` is expected needs its
/// parameters annotated (`|layer: usize, keys: &Tensor, shifts: &[Pos]|`), since
/// Rust infers a closure's signature only from a bound it is passed to directly;
/// this function is that bound. Name the tensor type once, `key_shift::<T, _>`
/// (Rust checks the closure's body before it sees where the box goes); a backend
/// crate can fix it for you, as `kvcache_causal::key_shift` does for candle.
///
/// ```
/// use kvcache_api::{key_shift, KeyShift};
///
/// // Keys as plain numbers, one per cell: a "rotation" adds the shift.
/// let shift = key_shift::<Vec<f32>, _>(|_layer, keys, shifts| {
///     Ok(keys.iter().zip(shifts).map(|(k, &s)| k + s as f32).collect())
/// });
/// assert_eq!(shift.shift(0, &vec![1.0, 2.0], &[0, -1])?, vec![1.0, 1.0]);
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
pub fn key_shift<T, F>(f: F) -> Box<dyn KeyShift<T>>
where
    T: 'static,
    F: Fn(usize, &T, &[Pos]) -> Result<T> + Send + Sync + 'static,
{
    Box::new(f)
}

/// A KV cache whose cells are shared by several sequences, driven one forward
/// pass at a time.
///
/// Per forward pass an engine calls [`start_forward`](Self::start_forward) once,
/// then for each layer [`set_layer`](Self::set_layer), [`put`](Self::put) with the
/// batch's new keys/values, and [`get`](Self::get) for everything the batch may
/// attend to. Between passes it edits sequences with
/// [`remove`](Self::remove) and [`copy_prefix`](Self::copy_prefix).
///
/// Every method that takes caller input validates it first: on error the cache is
/// exactly as it was.
///
/// Tensor shapes (row-major, outermost first): `put` takes
/// `keys: [batch, kv_heads, head_dim]` and `values: [batch, kv_heads, head_dim_v]`;
/// `get` returns a [`KvView`].
pub trait CausalCache {
    /// The backend's tensor type.
    type Tensor;

    /// The configuration in force.
    fn config(&self) -> &CausalConfig;

    /// Number of cells the cache holds: the most columns a pass's mask and
    /// [`KvView`] can have (`[batch_padded, cells]`), whatever the pass.
    ///
    /// The default is the sizing rule of the configuration in force,
    /// [`CausalConfig::num_cells`]; a cache that sizes itself otherwise (or holds
    /// several configurations) answers for itself.
    fn num_cells(&self) -> usize {
        self.config().num_cells()
    }

    /// Replaces the configuration, dropping every stored token.
    fn configure(&mut self, config: CausalConfig) -> Result<()>;

    /// Begins a forward pass over `batch`: trims sliding windows, places the
    /// batch's tokens in free cells (compacting if needed) and builds the mask.
    fn start_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Result<()>;

    /// Selects the layer that `put` and `get` address.
    fn set_layer(&mut self, layer: usize);

    /// Exempts batch tokens `except` (indices into the batch) from causality for
    /// the rest of this pass: they see later positions of their sequence too (e.g.
    /// image tokens attending bidirectionally). An empty slice restores causality.
    fn set_causal(&mut self, except: &[usize]) -> Result<()>;

    /// Stores the current layer's keys `[batch, kv_heads, head_dim]` and values
    /// `[batch, kv_heads, head_dim_v]` for the batch's tokens.
    fn put(&mut self, keys: &Self::Tensor, values: &Self::Tensor) -> Result<()>;

    /// Keys, values and mask of the current layer for this pass.
    fn get(&self) -> Result<KvView<Self::Tensor>>;

    /// The paged view of the current layer for this pass: each batch row's
    /// visible cells as sorted runs ([`crate::RowRuns`]) and the layer's keys and
    /// values as stored ([`crate::StoredKv`]), for kernels whose cost follows
    /// what each row sees rather than the pass's whole cell range. Row `r` sees
    /// cell `c` exactly where [`get`](Self::get)'s mask is `0` at
    /// `[r, c - range.start]`.
    ///
    /// Errors as `get` does (no pass in progress, a layer with nothing `put`);
    /// changes nothing. The default answers
    /// [`NotSupported`](crate::CacheError::NotSupported): use `get`.
    fn get_paged(&self) -> Result<PagedKv<'_, Self::Tensor>> {
        Err(crate::CacheError::NotSupported("paged view".into()))
    }

    /// Makes `dst` share the first `len` positions of `src` (metadata only, no
    /// tensor copy); `dst`'s previous tokens are dropped.
    fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) -> Result<()>;

    /// Whether `seq` can continue at `pos` with every position its window needs
    /// still stored. Always true without a bounded sliding-window memory.
    fn can_resume(&self, seq: SeqId, pos: Pos) -> bool;

    /// Removes `range` from `seq`. A closed range shifts later positions down by
    /// its length and re-rotates their keys through the cache's [`KeyShift`].
    fn remove(&mut self, seq: SeqId, range: PosRange) -> Result<()>;

    /// Whether the cache keeps blocks of finished sequences for later ones
    /// ([`retain_blocks`](Self::retain_blocks)): a prefix cache by block,
    /// independent of sequence ids, that evicts its least recently used
    /// blocks itself when a pass needs their cells. The default: no, and the
    /// block methods below refuse or find nothing.
    fn indexes_blocks(&self) -> bool {
        false
    }

    /// The indexed blocks that follow `parent` ([`BlockKey::ROOT`] for a
    /// prompt's first block) with their lengths.
    fn block_children(&self, parent: &BlockKey) -> Vec<(BlockKey, usize)> {
        let _ = parent;
        Vec::new()
    }

    /// Whether block `key` is indexed.
    fn holds_block(&self, key: &BlockKey) -> bool {
        let _ = key;
        false
    }

    /// The longest prefix of `tokens`, at most `limit` of them, held in
    /// indexed blocks of `scope`: down the chain of blocks whose tokens the
    /// prompt repeats, then as far into one more block as the prompt follows
    /// it. Changes nothing (an adoption marks the blocks used).
    fn longest_prefix(&self, scope: Scope<'_>, tokens: &[u32], limit: usize) -> Prefix {
        let _ = (scope, tokens, limit);
        Prefix::default()
    }

    /// How far indexed blocks of `scope` hold `tokens` (at most `limit`),
    /// whether or not a prompt can resume there: the length of
    /// [`longest_prefix`](Self::longest_prefix) in a cache that resumes any
    /// chain it keeps; more in one that resumes a chain only near the ends it
    /// keeps (window layers). A driver that evaluates a prompt past this
    /// point may keep the prefix up to it ([`retain_blocks`](Self::retain_blocks)
    /// of the sequence, which goes on), so the next prompt sharing it
    /// resumes there: a shared-prefix junction.
    fn held_prefix(&self, scope: Scope<'_>, tokens: &[u32], limit: usize) -> usize {
        self.longest_prefix(scope, tokens, limit).len
    }

    /// Indexes the cells holding `seq`'s positions as the blocks of `chain`
    /// (consecutive from position 0), with their tokens, so they outlive the
    /// sequence until evicted. Blocks already indexed are only marked used.
    /// Returns the indices of the blocks newly indexed. Every position must
    /// be held by `seq` and every key must be the one its scope, parent and
    /// tokens hash to ([`BlockChain::keys_match`]); on error nothing changes.
    fn retain_blocks(&mut self, seq: SeqId, chain: &BlockChain) -> Result<Vec<usize>> {
        let _ = (seq, chain);
        Err(crate::CacheError::NotSupported("block retention".into()))
    }

    /// Makes the empty sequence `seq` hold the first `len` positions of the
    /// indexed chain `blocks` (the first at position 0, each following the
    /// previous; `len` within the last block, which may be adopted in part)
    /// in their cells, with no copy ([`copy_prefix`](Self::copy_prefix)'s
    /// semantics), and marks them used. On error nothing changes.
    fn adopt_blocks(&mut self, seq: SeqId, blocks: &[BlockKey], len: Pos) -> Result<()> {
        let _ = (seq, blocks, len);
        Err(crate::CacheError::NotSupported("block retention".into()))
    }

    /// Forgets the indexed blocks among `keys` and every block below them
    /// (cells sequences still hold stay); returns the keys forgotten.
    fn forget_blocks(&mut self, keys: &[BlockKey]) -> Vec<BlockKey> {
        let _ = keys;
        Vec::new()
    }

    /// Forgets the blocks not stored or adopted for `age` (and every block
    /// below them); returns the keys forgotten.
    fn forget_blocks_unused_for(&mut self, age: Duration) -> Vec<BlockKey> {
        let _ = age;
        Vec::new()
    }

    /// Evicts indexed blocks, least recently used first (leaves before their
    /// parents, and only blocks whose eviction frees a cell), until `cells`
    /// cells are free or nothing more can be freed. Returns the evicted keys
    /// in order. A pass that needs cells evicts this way by itself.
    fn evict_blocks(&mut self, cells: usize) -> Vec<BlockKey> {
        let _ = cells;
        Vec::new()
    }

    /// Forgets every indexed block (cells sequences still hold stay); returns
    /// their keys.
    fn clear_blocks(&mut self) -> Vec<BlockKey> {
        Vec::new()
    }

    /// Indexed blocks and the cells they keep (once per block).
    fn indexed_blocks(&self) -> (usize, usize) {
        (0, 0)
    }

    /// What the index stored and removed since the last call, in order,
    /// whatever caused it (a retention, an eviction by a pass, a shifting
    /// removal that moved a block's cells, an explicit forget): the one
    /// journal a driver reports to a router from.
    fn drain_block_changes(&mut self) -> Vec<BlockChange> {
        Vec::new()
    }

    /// Copies positions `range` of `seq`, every layer, into a host
    /// [`SeqKv`] (llama.cpp's per-sequence state get), for a store or
    /// another cache of the same model. Changes nothing. The default answers
    /// [`NotSupported`](crate::CacheError::NotSupported).
    fn export_seq(&self, seq: SeqId, range: Range<Pos>) -> Result<SeqKv> {
        let _ = (seq, range);
        Err(crate::CacheError::NotSupported("sequence export".into()))
    }

    /// Writes `state` into `seq`, which must be empty or end right before the
    /// state's first position (llama.cpp's per-sequence state set). Another
    /// model or layout is a [`LayoutMismatch`](crate::CacheError::LayoutMismatch)
    /// error that changes nothing. The default answers
    /// [`NotSupported`](crate::CacheError::NotSupported).
    fn import_seq(&mut self, seq: SeqId, state: &SeqKv) -> Result<()> {
        let _ = (seq, state);
        Err(crate::CacheError::NotSupported("sequence import".into()))
    }

    /// The parts a prefix store keeps of this cache apart, in order (see
    /// [`StorePart`]): by default one, the whole cache, exported and
    /// imported as [`export_seq`](Self::export_seq) and
    /// [`import_seq`](Self::import_seq) do. A cache whose layers keep
    /// different spans of a sequence (global and sliding-window layers)
    /// names one part per kind.
    fn store_parts(&self) -> Vec<StorePart> {
        vec![StorePart::whole()]
    }

    /// Copies positions `range` of `seq` in the layers of part `part` of
    /// [`store_parts`](Self::store_parts) into a host [`SeqKv`] (keys and
    /// values of those layers, in order), carrying the part's fingerprint.
    /// Changes nothing. The default exports part 0 as
    /// [`export_seq`](Self::export_seq); another part is an
    /// [`InvalidArgument`](crate::CacheError::InvalidArgument) error.
    fn export_part(&self, part: usize, seq: SeqId, range: Range<Pos>) -> Result<SeqKv> {
        match part {
            0 => self.export_seq(seq, range),
            _ => Err(crate::CacheError::InvalidArgument(format!(
                "part {part} of a cache stored whole"
            ))),
        }
    }

    /// The first position of `seq` that part `part` of
    /// [`store_parts`](Self::store_parts) holds: where an export of the
    /// part can start. A part with a window may hold less than its memory
    /// (a sequence resumed from a kept tail holds what it adopted, then what
    /// it computed). The default, for a cache stored whole, is 0.
    fn part_start(&self, part: usize, seq: SeqId) -> Pos {
        let _ = (part, seq);
        0
    }

    /// Writes `parts` (one state per part of
    /// [`store_parts`](Self::store_parts), in order, all ending at the same
    /// position) into `seq`, which must hold in each part nothing or
    /// exactly the positions before that part's state. A window part's state
    /// may start late, as long as it covers what a query at the end needs.
    /// All or nothing: an error changes no part. The default imports the
    /// single state of a cache stored whole as
    /// [`import_seq`](Self::import_seq).
    fn import_parts(&mut self, seq: SeqId, parts: &[SeqKv]) -> Result<()> {
        match parts {
            [whole] => self.import_seq(seq, whole),
            _ => Err(crate::CacheError::InvalidArgument(format!(
                "{} parts given to a cache stored whole",
                parts.len()
            ))),
        }
    }
}
