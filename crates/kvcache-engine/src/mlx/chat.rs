//! [`MlxChatServer`]: multi-conversation chat through the prefix trie on mlx.
//!
//! The same loop as [`crate::chat::ChatServer`] with [`crate::chat::Reuse::Trie`],
//! with [`MlxLlama`] and one `kvcache_mlx::layers::KvCache` per layer: each
//! request begins a trie session (paging the longest cached prefix in), prefills
//! the rest (pausing where the trie wants branch-point snapshots), then decodes
//! greedily, and closing the session stores what the caches hold.

use kvcache_mlx::layers::{KvCache, SnapshotEncoding};
use kvcache_trie::{PrefixCache, Stats as TrieStats};

use super::MlxLlama;
use crate::chat::{trie_turn, TurnOutcome};
use crate::Result;

/// A chat server in miniature on mlx: one model, one live sequence of mlx
/// `KvCache`s, and the prefix trie shared across conversations.
pub struct MlxChatServer<'m> {
    model: &'m MlxLlama,
    trie: PrefixCache<KvCache>,
}

impl std::fmt::Debug for MlxChatServer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxChatServer")
            .field("stats", &self.trie.stats())
            .finish()
    }
}

impl<'m> MlxChatServer<'m> {
    /// A server whose trie keeps at most `budget_bytes` of snapshots; the layer
    /// caches grow in steps of `kvcache_mlx::layers::DEFAULT_STEP` positions.
    pub fn new(model: &'m MlxLlama, budget_bytes: usize) -> Result<Self> {
        Self::with_snapshot_encoding(model, budget_bytes, SnapshotEncoding::Full)
    }

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
        Ok(MlxChatServer {
            model,
            trie: PrefixCache::new(caches, budget_bytes)?,
        })
    }

    /// The trie's counters.
    pub fn trie_stats(&self) -> TrieStats {
        self.trie.stats()
    }

    /// The prefix trie (for its invariant checker and inspection).
    pub fn trie(&self) -> &PrefixCache<KvCache> {
        &self.trie
    }

    /// Answers `prompt` with `n_predict` greedy tokens (stopping after `eos` if
    /// given).
    pub fn generate(&mut self, prompt: &[u32], n_predict: usize, eos: Option<u32>) -> Result<TurnOutcome> {
        let model = self.model;
        trie_turn(
            &mut self.trie,
            &kvcache_api::Namespace::shared(),
            prompt,
            n_predict,
            eos,
            |tokens, caches| model.hidden_layers(tokens, caches),
            |h| model.next_token(h),
        )
    }
}
