//! [`MlxChatServer`]: multi-conversation chat through the prefix trie on mlx.
//!
//! The same loop as [`crate::chat::ChatServer`] with [`crate::chat::Reuse::Trie`],
//! with [`MlxLlama`] and one `kvcache_mlx::layers::KvCache` per layer: each
//! request begins a trie session (paging the longest cached prefix in), prefills
//! the rest (pausing where the trie wants branch-point snapshots), then decodes
//! greedily, and closing the session stores what the caches hold.

use std::time::Instant;

use kvcache_mlx::layers::KvCache;
use kvcache_mlx::trie::{PrefixCache, Stats as TrieStats};

use super::MlxLlama;
use crate::chat::TurnOutcome;
use crate::{DemoError, Result};

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
        let caches = (0..model.config().n_layers).map(|_| KvCache::new()).collect();
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
        if prompt.is_empty() || n_predict == 0 {
            return Err(DemoError::InvalidArgument(
                "empty prompt or nothing to generate".into(),
            ));
        }
        let t0 = Instant::now();
        let model = self.model;
        let done = |g: &[u32]| g.len() == n_predict || eos.is_some_and(|e| g.last() == Some(&e));
        let mut session = self.trie.begin(prompt)?;
        let matched = session.cached();
        let evaluated = session.remaining().len();
        let mut next = None;
        session.prefill(|tokens, caches| -> Result<()> {
            let h = model.hidden_layers(tokens, caches)?;
            next = Some(h);
            Ok(())
        })?;
        let last = next.ok_or_else(|| DemoError::InvalidArgument("nothing evaluated".into()))?;
        let mut token = model.next_token(&last)?;
        drop(last);
        let ttft = t0.elapsed();
        let mut generated = vec![token];
        session.record(token);
        while !done(&generated) {
            let h = model.hidden_layers(&[token], session.caches_mut())?;
            token = model.next_token(&h)?;
            generated.push(token);
            session.record(token);
        }
        session.close()?;
        Ok(TurnOutcome {
            prompt_tokens: prompt.len(),
            matched,
            evaluated,
            time_to_first_token: ttft,
            total: t0.elapsed(),
            generated,
        })
    }
}
