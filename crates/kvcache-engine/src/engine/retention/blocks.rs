//! Retention by block: a finished sequence's cells go into the cache's block
//! index (each block with its tokens, under its chained key) and its sequence
//! id is free at once, so what is kept depends on cells, not on sequence
//! slots. A new request adopts the longest indexed chain of its prompt, or
//! shares a running request's cells where those go further, and waits while
//! a running request is still evaluating a longer prefix it shares. Where
//! kept blocks go further than the cache can resume (window layers keep
//! only the tails of kept ends), the request keeps its prefix up to there
//! once evaluated: a junction the next prompt sharing it resumes at. The
//! index evicts its least recently used blocks itself when a pass needs their
//! cells and journals every change, so this policy has no eviction and no
//! events of its own.

use std::time::Duration;

use candle_core::Tensor;
use kvcache_api::block_key::Scope;
use kvcache_api::retention::BlockChain;
use kvcache_api::{CausalCache, Namespace, Pos, PosRange, SeqId};

use super::{common_prefix, empty_seq, longest_resumable, running, Cx, Ended, Retention, Start};
use crate::Result;

/// Keeps finished sequences in the cache's block index, in blocks of
/// `block_tokens`.
#[derive(Debug)]
pub(in crate::engine) struct Blocks {
    block_tokens: usize,
}

impl Blocks {
    /// Keeps blocks of `block_tokens` tokens (positive).
    pub(in crate::engine) fn new(block_tokens: usize) -> Self {
        assert!(block_tokens > 0, "blocks of no tokens");
        Blocks { block_tokens }
    }
}

impl<C: CausalCache<Tensor = Tensor>> Retention<C> for Blocks {
    fn start(&mut self, cx: &mut Cx<'_, C>, namespace: &Namespace, prompt: &[u32]) -> Result<Start> {
        let limit = prompt.len() - 1;
        let scope = Scope::new(cx.fingerprint, namespace);
        let kept = cx.cache.longest_prefix(scope, prompt, limit);
        let held = cx.cache.held_prefix(scope, prompt, limit);
        let running = longest_resumable(&*cx.cache, running(cx.slots, namespace), prompt);
        let best = kept.len.max(running.map_or(0, |r| r.1));
        // A running request still evaluating its prompt that shares more of
        // this one: wait for it rather than evaluate the same tokens twice.
        let pending = cx
            .slots
            .iter()
            .flatten()
            .filter(|s| s.req.namespace == *namespace && s.generated.is_empty() && s.shifts == 0)
            .map(|s| common_prefix(&s.req.prompt, prompt).min(limit))
            .max()
            .unwrap_or(0);
        if pending > best {
            return Ok(Start::Wait);
        }
        let Some(seq) = empty_seq(cx.slots, |_| true) else {
            return Ok(Start::NoRoom);
        };
        cx.cache.remove(seq, PosRange::from(0..))?;
        let reused = match running {
            Some((src, len)) if len > kept.len => {
                cx.cache.copy_prefix(src, seq, len as Pos)?;
                len
            }
            _ if kept.len > 0 => {
                cx.cache.adopt_blocks(seq, &kept.keys, kept.len as Pos)?;
                kept.len
            }
            _ => 0,
        };
        // Kept blocks go further than the request resumes (a cache whose
        // window layers keep only kept ends' tails): keep a junction there.
        let junction = (held > reused).then_some(held);
        Ok(Start::Join {
            seq,
            reused,
            junction,
        })
    }

    fn keep_prefix(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, namespace: &Namespace, tokens: &[u32]) {
        let chain = BlockChain::new(*cx.fingerprint, namespace.clone(), self.block_tokens, tokens);
        if let Err(error) = cx.cache.retain_blocks(seq, &chain) {
            tracing::warn!(%error, seq, "block retention refused: the junction is not kept");
        }
    }

    fn finish(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, ended: Ended<'_>) -> Result<()> {
        if !ended.shifted {
            let chain = BlockChain::new(
                *cx.fingerprint,
                ended.namespace.clone(),
                self.block_tokens,
                ended.tokens,
            );
            if let Err(error) = cx.cache.retain_blocks(seq, &chain) {
                tracing::warn!(%error, seq, "block retention refused: the finished sequence is not kept");
            }
        }
        cx.cache.remove(seq, PosRange::from(0..))?;
        Ok(())
    }

    fn age(&mut self, cx: &mut Cx<'_, C>, age: Duration) -> Result<usize> {
        Ok(cx.cache.forget_blocks_unused_for(age).len())
    }

    fn keeps_blocks(&self) -> bool {
        true
    }
}
