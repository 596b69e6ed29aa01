//! [`MlxGemmaChat`]: multi-conversation chat on Gemma 3 through the
//! prefix trie on mlx.
//!
//! The loop of [`crate::mlx::MlxChat`] over
//! [`kvcache_models::mlx::MlxGemmaLayer`]s (a rotating
//! window per window layer, a full KV cache per global layer), with one
//! difference: each turn keeps a restore point at the end of its prompt
//! ([`crate::chat::trie_turn_resumable`]). A rotating cache cannot rewind from
//! the end of the reply to the end of the prompt once the window has wrapped,
//! and the next turn of the conversation continues the prompt, not the reply;
//! with the restore point it resumes there instead of re-evaluating from the
//! last snapshot before it.

use kvcache_models::mlx::MlxGemma;

use crate::chat::Reuse;
use crate::mlx::chat::MlxChat;
use crate::Result;

/// The chat on mlx over Gemma: one live sequence of
/// [`kvcache_models::mlx::MlxGemmaLayer`]s, and the prefix trie shared across conversations.
pub type MlxGemmaChat<'m> = MlxChat<'m, MlxGemma>;

impl<'m> MlxChat<'m, MlxGemma> {
    /// A prefix-trie chat whose layer caches grow in steps of `step`
    /// positions.
    pub fn with_step(model: &'m MlxGemma, budget_bytes: usize, step: usize) -> Result<Self> {
        Self::with_layers(model, Reuse::Trie, model.new_caches(step)?, budget_bytes)
    }
}
