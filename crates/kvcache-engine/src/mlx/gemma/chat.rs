//! [`MlxGemmaChatServer`]: multi-conversation chat on Gemma 3 through the
//! prefix trie on mlx.
//!
//! The loop of [`crate::mlx::MlxChatServer`] over [`MlxGemmaLayer`]s (a rotating
//! window per window layer, a full KV cache per global layer), with one
//! difference: each turn keeps a restore point at the end of its prompt
//! ([`trie_turn_resumable`]). A rotating cache cannot rewind from the end of
//! the reply to the end of the prompt once the window has wrapped, and the
//! next turn of the conversation continues the prompt, not the reply; with the
//! restore point it resumes there instead of re-evaluating from the last
//! snapshot before it.

use kvcache_api::Namespace;
use kvcache_mlx::layers::DEFAULT_STEP;
use kvcache_trie::{PrefixCache, Stats as TrieStats};

use super::{MlxGemma, MlxGemmaLayer};
use crate::chat::{trie_turn_resumable, TurnOutcome};
use crate::Result;

/// A chat server in miniature on mlx: one Gemma, one live sequence of
/// [`MlxGemmaLayer`]s, and the prefix trie shared across conversations.
pub struct MlxGemmaChatServer<'m> {
    model: &'m MlxGemma,
    trie: PrefixCache<MlxGemmaLayer>,
}

impl std::fmt::Debug for MlxGemmaChatServer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxGemmaChatServer")
            .field("stats", &self.trie.stats())
            .finish()
    }
}

impl<'m> MlxGemmaChatServer<'m> {
    /// A server whose trie keeps at most `budget_bytes` of snapshots; the layer
    /// caches grow in steps of [`DEFAULT_STEP`] positions.
    pub fn new(model: &'m MlxGemma, budget_bytes: usize) -> Result<Self> {
        Self::with_step(model, budget_bytes, DEFAULT_STEP)
    }

    /// A server whose layer caches grow in steps of `step` positions.
    pub fn with_step(model: &'m MlxGemma, budget_bytes: usize, step: usize) -> Result<Self> {
        Ok(MlxGemmaChatServer {
            model,
            trie: PrefixCache::new(model.new_caches(step)?, budget_bytes)?,
        })
    }

    /// The trie's counters.
    pub fn trie_stats(&self) -> TrieStats {
        self.trie.stats()
    }

    /// The prefix trie (for its invariant checker and inspection).
    pub fn trie(&self) -> &PrefixCache<MlxGemmaLayer> {
        &self.trie
    }

    /// Answers `prompt` with `n_predict` greedy tokens (stopping after `eos` if
    /// given).
    pub fn generate(&mut self, prompt: &[u32], n_predict: usize, eos: Option<u32>) -> Result<TurnOutcome> {
        let model = self.model;
        trie_turn_resumable(
            &mut self.trie,
            &Namespace::shared(),
            prompt,
            n_predict,
            eos,
            |tokens, caches| model.hidden_layers(tokens, caches),
            |h| model.next_token(h),
        )
    }
}
