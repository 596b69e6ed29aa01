//! Configuration of a causal cache: sizes, attention pattern, storage layout.

use crate::{CacheError, Result};

/// Element type of stored keys/values or of the mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DType {
    /// 32-bit float.
    #[default]
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// How a cache stores keys and values, apart from the dtype a model puts and
/// gets them in ([`CausalConfig::dtype`]).
///
/// The float types store elements as they are named. [`KvStorage::Q8_0`] is
/// ggml's `q8_0`: blocks of 32 consecutive values of one head's dimension, each
/// stored as 32 signed 8-bit integers and one f16 scale (`x ≈ q * d` with
/// `d = max|x| / 127`), 34 bytes per 32 values (8.5 bits a value); the head
/// dimensions must be multiples of 32.
///
/// Parses from the names Ollama's `OLLAMA_KV_CACHE_TYPE` uses:
///
/// ```
/// use kvcache_api::KvStorage;
///
/// let q: KvStorage = "q8_0".parse()?;
/// assert_eq!(q, KvStorage::Q8_0);
/// assert_eq!(q.to_string(), "q8_0");
/// assert!("q4_1".parse::<KvStorage>().is_err());
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvStorage {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// ggml's `q8_0`: blocks of 32 int8 values with one f16 scale.
    Q8_0,
}

impl KvStorage {
    /// Every storage type, in the order of [`KvStorage::NAMES`].
    pub const ALL: [KvStorage; 4] = [KvStorage::F32, KvStorage::F16, KvStorage::BF16, KvStorage::Q8_0];

    /// The names [`str::parse`] accepts.
    pub const NAMES: [&'static str; 4] = ["f32", "f16", "bf16", "q8_0"];

    /// Values per quantization block along the head dimension (1 for float types).
    pub fn block_len(self) -> usize {
        match self {
            KvStorage::Q8_0 => 32,
            _ => 1,
        }
    }

    /// Bytes one block of [`block_len`](Self::block_len) values takes.
    pub fn block_bytes(self) -> usize {
        match self {
            KvStorage::F32 => 4,
            KvStorage::F16 | KvStorage::BF16 => 2,
            KvStorage::Q8_0 => 32 + 2,
        }
    }

    /// The float type of the same name, `None` for a quantized type.
    pub fn float(self) -> Option<DType> {
        match self {
            KvStorage::F32 => Some(DType::F32),
            KvStorage::F16 => Some(DType::F16),
            KvStorage::BF16 => Some(DType::BF16),
            KvStorage::Q8_0 => None,
        }
    }
}

impl From<DType> for KvStorage {
    fn from(dtype: DType) -> Self {
        match dtype {
            DType::F32 => KvStorage::F32,
            DType::F16 => KvStorage::F16,
            DType::BF16 => KvStorage::BF16,
        }
    }
}

impl std::fmt::Display for KvStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = KvStorage::ALL
            .iter()
            .position(|t| t == self)
            .expect("ALL lists every type");
        f.write_str(KvStorage::NAMES[i])
    }
}

impl std::str::FromStr for KvStorage {
    type Err = CacheError;

    /// `"f32"`, `"f16"`, `"bf16"` or `"q8_0"` (ASCII case ignored); anything else
    /// is a [`CacheError::InvalidArgument`] listing them.
    fn from_str(s: &str) -> Result<Self> {
        KvStorage::NAMES
            .iter()
            .position(|name| name.eq_ignore_ascii_case(s))
            .map(|i| KvStorage::ALL[i])
            .ok_or_else(|| {
                CacheError::InvalidArgument(format!(
                    "unknown KV storage type {s:?}: expected one of {}",
                    KvStorage::NAMES.join(", ")
                ))
            })
    }
}

/// A sliding-window attention pattern.
///
/// **Convention:** a window of `W` lets a query at position `p` see keys at
/// positions `p - W + 1 ..= p`: exactly `W` positions, itself included (Hugging
/// Face's `sliding_window`, llama.cpp, MLX). Ollama's `causal.go` counts one less:
/// its window `w` is our `W = w + 1` (see [`SlidingWindow::from_ollama`]).
///
/// **Memory** `M >= W` is how much of each sequence the cache keeps so that a
/// conversation can resume a little behind its end. Before each forward pass a
/// sequence whose next position is `n` drops the cells with `pos < n - M + 1`.
///
/// ```
/// use kvcache_api::SlidingWindow;
///
/// let w = SlidingWindow::new(4096);
/// assert_eq!((w.window(), w.memory()), (4096, None));
/// let ollama = SlidingWindow::from_ollama(4096);
/// assert_eq!(ollama.window(), 4097);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    window: usize,
    memory: Option<usize>,
}

impl SlidingWindow {
    /// A window of exactly `window` positions; memory equals the window.
    pub fn new(window: usize) -> Self {
        SlidingWindow { window, memory: None }
    }

    /// A window of `window` positions that keeps `memory >= window` positions of
    /// each sequence for resuming.
    pub fn with_memory(window: usize, memory: usize) -> Self {
        SlidingWindow {
            window,
            memory: Some(memory),
        }
    }

    /// Translates Ollama's `NewSWACache(w)`, whose window shows `w + 1` positions.
    pub fn from_ollama(window: usize) -> Self {
        SlidingWindow::new(window + 1)
    }

    /// Translates Ollama's `NewSWAMemCache(w, m)`.
    pub fn from_ollama_with_memory(window: usize, memory: usize) -> Self {
        SlidingWindow::with_memory(window + 1, memory + 1)
    }

    /// Positions a query sees, itself included.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Positions kept per sequence, if set apart from the window.
    pub fn memory(&self) -> Option<usize> {
        self.memory
    }
}

/// How the value tensor is laid out in storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum VLayout {
    /// Values stored like keys: `[cells, kv_heads, head_dim_v]`.
    #[default]
    Normal,
    /// Values stored transposed: `[kv_heads, head_dim_v, cells]`, so that
    /// `softmax(QK^T) @ V` reads V without a transpose (ggml's permuted V).
    Permuted,
}

/// Where a forward pass's tokens are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Placement {
    /// The first free cells, wherever they are (writes may scatter).
    #[default]
    Scattered,
    /// One contiguous run of free cells; the cache compacts itself when no run
    /// is long enough.
    Contiguous,
}

/// Everything a causal cache needs to know before its first forward pass.
///
/// Built with [`CausalConfig::new`] and the `with_*` methods; checked by
/// [`CausalConfig::validate`] when a cache is created or reconfigured.
///
/// ```
/// use kvcache_api::{CausalConfig, DType, SlidingWindow};
///
/// let config = CausalConfig::new(4, 8192, 512)
///     .with_window(SlidingWindow::new(1024))
///     .with_dtype(DType::F16);
/// config.validate()?;
/// // Several sequences keep one spare token each: memory = window + 1.
/// assert_eq!(config.effective_memory(), Some(1025));
/// assert_eq!(config.num_cells(), 4 * 1024 + 512);
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CausalConfig {
    /// Number of sequences; valid ids are `0..max_sequences`.
    pub max_sequences: usize,
    /// Longest context of one sequence, in tokens.
    pub capacity: usize,
    /// Most tokens in one forward pass.
    pub max_batch: usize,
    /// Sliding-window attention, if any.
    pub window: Option<SlidingWindow>,
    /// Chunked attention: a query at `p` sees positions `p - p % c ..= p`.
    pub chunk_size: Option<usize>,
    /// Element type of the keys and values a model puts and gets; also their
    /// storage type unless [`kv_storage`](Self::kv_storage) says otherwise.
    pub dtype: DType,
    /// Storage type of keys and values when it differs from `dtype` (`None`:
    /// stored as `dtype`). See [`CausalConfig::storage`].
    pub kv_storage: Option<KvStorage>,
    /// Element type of the mask.
    pub mask_dtype: DType,
    /// Mask rows are padded to a multiple of this (fully masked rows).
    pub batch_padding: usize,
    /// The cell range (mask columns, K/V views) is aligned to a multiple of this.
    pub cache_padding: usize,
    /// Storage layout of values.
    pub v_layout: VLayout,
    /// Where new tokens go.
    pub placement: Placement,
    /// Compact the cache before a forward pass when free cells make up more than
    /// this fraction of the pass's cell range (holes cost attention work).
    /// `None` compacts only when contiguous placement finds no room.
    pub compact_threshold: Option<f32>,
    /// Cells beyond the sequences' own, for blocks kept for later sequences,
    /// in a cache whose window memory bounds each sequence (a full-attention
    /// cache's `max_sequences * capacity` cells hold kept blocks already, and
    /// ignore this). A layer-group cache's window groups keep the tails of
    /// retained prefixes there.
    pub kept_cells: usize,
}

impl CausalConfig {
    /// A full-attention cache for `max_sequences` sequences of up to `capacity`
    /// tokens each, in f32, with batches of up to `max_batch` tokens.
    pub fn new(max_sequences: usize, capacity: usize, max_batch: usize) -> Self {
        CausalConfig {
            max_sequences,
            capacity,
            max_batch,
            window: None,
            chunk_size: None,
            dtype: DType::F32,
            kv_storage: None,
            mask_dtype: DType::F32,
            batch_padding: 1,
            cache_padding: 1,
            v_layout: VLayout::Normal,
            placement: Placement::Scattered,
            compact_threshold: None,
            kept_cells: 0,
        }
    }

    /// Sets [`kept_cells`](Self::kept_cells).
    pub fn with_kept_cells(mut self, cells: usize) -> Self {
        self.kept_cells = cells;
        self
    }

    /// Sets a sliding window.
    pub fn with_window(mut self, window: SlidingWindow) -> Self {
        self.window = Some(window);
        self
    }

    /// Sets chunked attention.
    pub fn with_chunk_size(mut self, chunk: usize) -> Self {
        self.chunk_size = Some(chunk);
        self
    }

    /// Sets the key/value element type (`put`'s input, `get`'s output, and the
    /// storage type unless [`with_kv_storage`](Self::with_kv_storage) sets one).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Stores keys and values as `storage` whatever dtype `put` and `get` use:
    /// `put` converts (or quantizes) what it writes, `get` converts (or
    /// dequantizes) the pass's cell range.
    pub fn with_kv_storage(mut self, storage: KvStorage) -> Self {
        self.kv_storage = Some(storage);
        self
    }

    /// How keys and values are stored: [`kv_storage`](Self::kv_storage), or
    /// `dtype` when it is not set.
    pub fn storage(&self) -> KvStorage {
        self.kv_storage.unwrap_or(self.dtype.into())
    }

    /// Sets the mask element type.
    pub fn with_mask_dtype(mut self, dtype: DType) -> Self {
        self.mask_dtype = dtype;
        self
    }

    /// Sets batch (mask row) and cache (mask column) padding.
    pub fn with_padding(mut self, batch_padding: usize, cache_padding: usize) -> Self {
        self.batch_padding = batch_padding;
        self.cache_padding = cache_padding;
        self
    }

    /// Sets the value layout.
    pub fn with_v_layout(mut self, layout: VLayout) -> Self {
        self.v_layout = layout;
        self
    }

    /// Sets the placement policy.
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Sets the hole fraction above which the cache compacts itself.
    pub fn with_compact_threshold(mut self, threshold: Option<f32>) -> Self {
        self.compact_threshold = threshold;
        self
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(CacheError::InvalidArgument(msg));
        if self.max_sequences == 0 || self.capacity == 0 || self.max_batch == 0 {
            return bad(format!(
                "max_sequences ({}), capacity ({}) and max_batch ({}) must all be at least 1",
                self.max_sequences, self.capacity, self.max_batch
            ));
        }
        if self.batch_padding == 0 || self.cache_padding == 0 {
            return bad("paddings must be at least 1".into());
        }
        if self.capacity > i32::MAX as usize {
            return bad(format!("capacity {} exceeds the position range", self.capacity));
        }
        if let Some(w) = self.window {
            if w.window == 0 {
                return bad("a sliding window must be at least 1 position".into());
            }
            if let Some(m) = w.memory {
                if m < w.window {
                    return bad(format!(
                        "sliding-window memory ({m}) must be at least the window ({})",
                        w.window
                    ));
                }
            }
        }
        if self.chunk_size == Some(0) {
            return bad("chunk size must be at least 1".into());
        }
        if let Some(t) = self.compact_threshold {
            if !(0.0..=1.0).contains(&t) {
                return bad(format!("compact threshold {t} must lie in 0..=1"));
            }
        }
        Ok(())
    }

    /// Positions kept per sequence, or `None` when the cache keeps everything.
    ///
    /// Memory is the window's memory (or the window); with several sequences it is
    /// at least `window + 1`, one spare token per sequence; a memory that would
    /// reach `capacity` means unbounded. Meaningless, but no panic, for a
    /// configuration that [`CausalConfig::validate`] rejects.
    pub fn effective_memory(&self) -> Option<usize> {
        let w = self.window?;
        let mut memory = w.memory.unwrap_or(w.window);
        if self.max_sequences > 1 {
            memory = memory.max(w.window + 1);
        }
        // Ollama compares its memory (ours minus one) with the capacity.
        (memory.saturating_sub(1) < self.capacity).then_some(memory)
    }

    /// Number of cells the cache allocates: `max_sequences * (M - 1) + max_batch
    /// + kept_cells` with bounded memory `M`, else `max_sequences * capacity`,
    /// rounded up to the cache padding. Saturates rather than panics for a configuration that
    /// [`CausalConfig::validate`] rejects.
    pub fn num_cells(&self) -> usize {
        let cells = match self.effective_memory() {
            Some(m) => self
                .max_sequences
                .saturating_mul(m.saturating_sub(1))
                .saturating_add(self.max_batch)
                .saturating_add(self.kept_cells),
            None => self.max_sequences.saturating_mul(self.capacity),
        };
        let padding = self.cache_padding.max(1);
        cells.div_ceil(padding).saturating_mul(padding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizing_matches_the_conventions() {
        // SCENARIOS S2: window 2, one sequence, capacity 16, batch 16 -> 17 cells.
        let s2 = CausalConfig::new(1, 16, 16).with_window(SlidingWindow::new(2));
        assert_eq!(s2.effective_memory(), Some(2));
        assert_eq!(s2.num_cells(), 17);
        // BENCHMARKS W3: Ollama window 4096, 16 sequences, capacity 32768, batch 512.
        let w3 = CausalConfig::new(16, 32768, 512).with_window(SlidingWindow::from_ollama(4096));
        assert_eq!(w3.num_cells(), 66064);
        // Memory reaching capacity means unbounded.
        let big = CausalConfig::new(2, 100, 8).with_window(SlidingWindow::new(200));
        assert_eq!(big.effective_memory(), None);
        assert_eq!(big.num_cells(), 200);
        assert_eq!(CausalConfig::new(3, 10, 4).with_padding(1, 8).num_cells(), 32);
    }

    #[test]
    fn storage_defaults_to_the_dtype_and_parses_from_its_name() {
        let config = CausalConfig::new(1, 16, 16).with_dtype(DType::BF16);
        assert_eq!(config.storage(), KvStorage::BF16);
        assert_eq!(config.with_kv_storage(KvStorage::Q8_0).storage(), KvStorage::Q8_0);
        for t in KvStorage::ALL {
            assert_eq!(t.to_string().parse::<KvStorage>(), Ok(t));
            assert_eq!(t.to_string().to_uppercase().parse::<KvStorage>(), Ok(t));
        }
        let e = "q4_0".parse::<KvStorage>().unwrap_err();
        assert!(
            matches!(&e, CacheError::InvalidArgument(m) if m.contains("q8_0")),
            "{e}"
        );
        assert_eq!(KvStorage::Q8_0.float(), None);
        assert_eq!(
            (KvStorage::Q8_0.block_len(), KvStorage::Q8_0.block_bytes()),
            (32, 34)
        );
    }

    #[test]
    fn validation_names_the_problem() {
        let e = CausalConfig::new(1, 16, 16)
            .with_window(SlidingWindow::with_memory(8, 4))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("memory (4)"));
        assert!(CausalConfig::new(0, 16, 16).validate().is_err());
        assert!(CausalConfig::new(1, 16, 16)
            .with_chunk_size(0)
            .validate()
            .is_err());
        assert!(CausalConfig::new(1, 16, 16).validate().is_ok());
    }
}
