//! What the engine asks of a model, whatever its architecture: [`Model`].
//!
//! A model turns a batch of tokens of many sequences into hidden states
//! through a [`CausalCache`] (the batching engine's path), or the tokens of
//! one sequence through per-layer caches (the prefix trie's path), and hidden
//! states into logits. It also says how its cache is shaped: which layers
//! see a sliding window, how keys are rotated when positions shift, what a
//! token's keys and values weigh. The engine, the chat session and the
//! server are written once over this trait; [`crate::Llama`] (SmolLM2) and
//! [`crate::gemma::Gemma`] (Gemma 3: window and global layers) implement it.
//!
//! Shapes: a batch of `n` tokens gives hidden states `[n, dim]`; logits are
//! `[n, vocab_size]`.

use candle_core::{Device, Tensor};
use kvcache_api::{CausalCache, CausalConfig, Fingerprint, KvLayout, LayerCache, Pos, SeqId, SnapshotCache};
use kvcache_causal::{CausalKvCache, LayerGroupCache};

use crate::attention::AttentionPath;
use crate::Result;

/// The greedy pick: the index of the largest of `row`, the first of equal
/// maxima (0 for an empty row).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// One token of a batch: which sequence, at which position, which token id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchToken {
    /// The sequence the token belongs to.
    pub seq: SeqId,
    /// Its position inside the sequence.
    pub pos: Pos,
    /// Its token id.
    pub token: u32,
}

impl BatchToken {
    /// `tokens` of sequence `seq` at consecutive positions from `first`.
    pub fn run(seq: SeqId, first: Pos, tokens: &[u32]) -> Vec<BatchToken> {
        tokens
            .iter()
            .zip(first..)
            .map(|(&token, pos)| BatchToken { seq, pos, token })
            .collect()
    }
}

/// What the prefix trie's path asks of a model, on any backend (candle
/// tensors or mlx-rs arrays): the tokens of one live sequence through its
/// per-layer caches, and the next token. The chat session and the trie's turn
/// are written over it; all four models implement it.
pub trait LayerModel {
    /// The backend's array type.
    type Array;
    /// One layer's cache of one live sequence, as the prefix trie holds it.
    type Layer: LayerCache<Array = Self::Array> + SnapshotCache;

    /// Whether a turn keeps a restore point at its prompt's end
    /// (`chat::trie_turn_resumable`): for models whose window layers cannot
    /// rewind from the reply's end to the prompt's.
    const RESUMABLE: bool;

    /// Empty per-layer caches of one sequence, in layer order.
    fn new_layers(&self) -> Result<Vec<Self::Layer>>;

    /// Final normed hidden states `[n, dim]` for `tokens` appended to the
    /// sequence `layers` hold (one per layer, at the same offset).
    fn hidden_layers(&self, tokens: &[u32], layers: &mut [Self::Layer]) -> Result<Self::Array>;

    /// The greedy next token after the last row of hidden states `[n, dim]`.
    fn next_token(&self, hidden: &Self::Array) -> Result<u32>;
}

/// A decoder the batching engine can run on candle: the forward pass
/// through a causal cache, the logits, and the shape of its cache (and, as a
/// [`LayerModel`], the trie's path).
pub trait Model: LayerModel<Array = Tensor> {
    /// The cache the batching engine drives for this model: one
    /// [`CausalKvCache`] when every layer sees the same positions, a
    /// [`LayerGroupCache`] when layers differ (window and global).
    type Cache: CausalCache<Tensor = Tensor> + CellUse;

    /// The architecture's name as GGUF writes it (`llama`, `gemma3`).
    fn architecture(&self) -> &'static str;

    /// The device the weights live on.
    fn device(&self) -> &Device;

    /// Rows of the logits.
    fn vocab_size(&self) -> usize;

    /// The keys and values of one token, every layer, as they leave a cache
    /// for the prefix store.
    fn kv_layout(&self) -> KvLayout;

    /// Chooses how the pass through a causal cache attends (paged by default).
    fn set_attention(&mut self, path: AttentionPath);

    /// How the pass through a causal cache attends.
    fn attention_path(&self) -> AttentionPath;

    /// The widest sliding window of its layers (what a window memory counts
    /// from), `None` when every layer sees every position.
    fn window(&self) -> Option<usize> {
        None
    }

    /// A causal cache on `device` for this model: `base` gives the sequences,
    /// the cells, the batch size and the storage; layers with a sliding
    /// window keep `window_memory` positions of each sequence (at least the
    /// window), so a conversation resumes up to `window_memory - window`
    /// positions behind a sequence's end. Keys shift with the model's RoPE.
    /// A model without window layers ignores `window_memory`.
    fn new_cache(&self, base: &CausalConfig, window_memory: usize, device: &Device) -> Result<Self::Cache>;

    /// Final normed hidden states `[n, dim]` for a batch of tokens of any
    /// sequences through `cache` (one `start_forward`, then every layer).
    fn hidden<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized;

    /// Logits `[n, vocab_size]` from hidden states `[n, dim]`.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor>;

    /// Logits `[n, vocab_size]` for a batch through `cache`:
    /// [`hidden`](Model::hidden), then [`logits`](Model::logits).
    fn forward_batch<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        self.logits(&self.hidden(batch, cache)?)
    }
}

/// What a server needs of a model's cache beyond [`CausalCache`]: how full
/// it is over all its layer groups, and the model its exported prefixes
/// belong to.
pub trait CellUse {
    /// Cells held by at least one sequence.
    fn cells_in_use(&self) -> usize;
    /// Cells the cache has.
    fn cells_total(&self) -> usize;
    /// Bytes of keys and values the cells in use hold, in their stored type.
    fn bytes_in_use(&self) -> usize;
    /// Sets the model fingerprint exported prefixes carry and imported ones
    /// must match.
    fn set_fingerprint(&mut self, fingerprint: Fingerprint);
}

impl CellUse for CausalKvCache {
    fn cells_in_use(&self) -> usize {
        self.used_cells()
    }

    fn cells_total(&self) -> usize {
        self.num_cells()
    }

    fn bytes_in_use(&self) -> usize {
        self.used_cells() * self.storage_bytes_per_cell()
    }

    fn set_fingerprint(&mut self, fingerprint: Fingerprint) {
        CausalKvCache::set_fingerprint(self, fingerprint);
    }
}

impl CellUse for LayerGroupCache {
    fn cells_in_use(&self) -> usize {
        self.groups().iter().map(CausalKvCache::used_cells).sum()
    }

    fn cells_total(&self) -> usize {
        self.groups().iter().map(CausalKvCache::num_cells).sum()
    }

    fn bytes_in_use(&self) -> usize {
        self.groups().iter().map(CellUse::bytes_in_use).sum()
    }

    fn set_fingerprint(&mut self, fingerprint: Fingerprint) {
        LayerGroupCache::set_fingerprint(self, fingerprint);
    }
}
