//! [`MlxChatServer`]: multi-conversation chat through the prefix trie on mlx,
//! written once for both mlx models ([`MlxTrieModel`]).
//!
//! The same loop as [`crate::chat::ChatServer`] with [`crate::chat::Reuse::Trie`],
//! with [`MlxLlama`] and one `kvcache_mlx::layers::KvCache` per layer, or with
//! [`super::MlxGemma`] over its mixed layers ([`super::MlxGemmaChatServer`]):
//! each request begins a trie session (paging the longest cached prefix in),
//! prefills the rest (pausing where the trie wants branch-point snapshots),
//! then decodes greedily, and closing the session stores what the caches hold.

use kvcache_api::{LayerCache, Namespace, SnapshotCache};
use kvcache_mlx::layers::{KvCache, SnapshotEncoding};
use kvcache_trie::{PrefixCache, Stats as TrieStats};
use mlx_rs::Array;

use super::MlxLlama;
use crate::chat::{trie_turn, trie_turn_resumable, TurnOutcome};
use crate::Result;

/// What the mlx chat server runs: a model over per-layer caches of one live
/// sequence.
pub trait MlxTrieModel {
    /// One layer's cache, as the trie holds it.
    type Layer: LayerCache<Array = Array> + SnapshotCache;

    /// Whether a turn keeps a restore point at its prompt's end
    /// ([`trie_turn_resumable`]): for models whose window layers cannot
    /// rewind from the reply's end to the prompt's.
    const RESUMABLE: bool;

    /// Empty caches for one live sequence, one per layer, as a server made
    /// with [`MlxChatServer::new`] uses them.
    fn new_layers(&self) -> Result<Vec<Self::Layer>>;

    /// Final normed hidden states `[n, dim]` for `tokens` appended to the
    /// sequence `caches` hold (evaluated, with every cache write).
    fn hidden_layers(&self, tokens: &[u32], caches: &mut [Self::Layer]) -> Result<Array>;

    /// The greedy next token after hidden states `[n, dim]`.
    fn next_token(&self, hidden: &Array) -> Result<u32>;
}

/// The Llama over `KvCache`s, which rewind to any offset.
impl MlxTrieModel for MlxLlama {
    type Layer = KvCache;

    const RESUMABLE: bool = false;

    fn new_layers(&self) -> Result<Vec<KvCache>> {
        Ok((0..self.config().n_layers).map(|_| KvCache::new()).collect())
    }

    fn hidden_layers(&self, tokens: &[u32], caches: &mut [KvCache]) -> Result<Array> {
        MlxLlama::hidden_layers(self, tokens, caches)
    }

    fn next_token(&self, hidden: &Array) -> Result<u32> {
        MlxLlama::next_token(self, hidden)
    }
}

/// A chat server in miniature on mlx: one model, one live sequence of its
/// layer caches, and the prefix trie shared across conversations. Without a
/// model type named, the Llama's.
pub struct MlxChatServer<'m, M: MlxTrieModel = MlxLlama> {
    model: &'m M,
    trie: PrefixCache<M::Layer>,
}

impl<M: MlxTrieModel> std::fmt::Debug for MlxChatServer<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxChatServer")
            .field("stats", &self.trie.stats())
            .finish()
    }
}

impl<'m, M: MlxTrieModel> MlxChatServer<'m, M> {
    /// A server whose trie keeps at most `budget_bytes` of snapshots; the layer
    /// caches grow in steps of `kvcache_mlx::layers::DEFAULT_STEP` positions.
    pub fn new(model: &'m M, budget_bytes: usize) -> Result<Self> {
        Self::with_layers(model, model.new_layers()?, budget_bytes)
    }

    /// A server over `layers`, the model's caches however made.
    pub(crate) fn with_layers(model: &'m M, layers: Vec<M::Layer>, budget_bytes: usize) -> Result<Self> {
        Ok(MlxChatServer {
            model,
            trie: PrefixCache::new(layers, budget_bytes)?,
        })
    }

    /// The trie's counters.
    pub fn trie_stats(&self) -> TrieStats {
        self.trie.stats()
    }

    /// The prefix trie (for its invariant checker and inspection).
    pub fn trie(&self) -> &PrefixCache<M::Layer> {
        &self.trie
    }

    /// Answers `prompt` with `n_predict` greedy tokens (stopping after `eos` if
    /// given).
    pub fn generate(&mut self, prompt: &[u32], n_predict: usize, eos: Option<u32>) -> Result<TurnOutcome> {
        let model = self.model;
        let forward = |tokens: &[u32], caches: &mut [M::Layer]| model.hidden_layers(tokens, caches);
        let pick = |hidden: &Array| model.next_token(hidden);
        let turn = if M::RESUMABLE {
            trie_turn_resumable
        } else {
            trie_turn
        };
        turn(
            &mut self.trie,
            &Namespace::shared(),
            prompt,
            n_predict,
            eos,
            forward,
            pick,
        )
    }
}

impl<'m> MlxChatServer<'m, MlxLlama> {
    /// A server whose layer caches keep their snapshots as `encoding` says
    /// ([`SnapshotEncoding::Q8`]: 8-bit, so the same `budget_bytes` holds about
    /// 2x the snapshots of f16 layers, 3.6x of f32 ones).
    pub fn with_snapshot_encoding(
        model: &'m MlxLlama,
        budget_bytes: usize,
        encoding: SnapshotEncoding,
    ) -> Result<Self> {
        let caches = (0..model.config().n_layers)
            .map(|_| KvCache::new().with_snapshot_encoding(encoding))
            .collect::<kvcache_api::Result<Vec<_>>>()?;
        Self::with_layers(model, caches, budget_bytes)
    }
}
