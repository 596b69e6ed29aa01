//! Retention by idle sequence: a finished sequence's cells stay where they
//! are under its sequence id, for the next turn of its conversation to
//! continue in place or for another request to share by copy-prefix. Idle
//! sequences are dropped, least recently used first, when a request needs a
//! sequence id or a pass needs cells. With an event batch, the full blocks
//! of the idle sequences are reported ([`PublishedBlocks`]).

use std::time::{Duration, Instant};

use candle_core::Tensor;
use kvcache_api::block_key::{KeyChain, Scope};
use kvcache_api::events::block_hash;
use kvcache_api::{CausalCache, Namespace, Pos, PosRange, SeqId};

use super::published::PublishedBlocks;
use super::{empty_seq, longest_resumable, running, Cx, Ended, Retention, Start};
use crate::Result;

/// A finished sequence kept whole.
#[derive(Debug)]
struct Idle {
    namespace: Namespace,
    /// Exactly the tokens in the cache, from position 0.
    tokens: Vec<u32>,
    /// How many of them were the finished request's prompt.
    prompt_len: usize,
    last_used: Instant,
}

/// Keeps finished sequences whole, one per sequence id.
#[derive(Debug)]
pub(in crate::engine) struct IdleSequences {
    /// Per sequence id, the finished sequence kept there, if any.
    idle: Vec<Option<Idle>>,
    /// The blocks of the idle sequences reported as events.
    published: PublishedBlocks,
}

impl IdleSequences {
    /// Room for `sequences` idle sequences.
    pub(in crate::engine) fn new(sequences: usize) -> Self {
        IdleSequences {
            idle: (0..sequences).map(|_| None).collect(),
            published: PublishedBlocks::default(),
        }
    }

    /// The idle sequence holding the longest prefix of `prompt` in
    /// `namespace` that it can be resumed from, or a running one holding
    /// more: `(seq, len)`.
    fn longest_prefix<C: CausalCache>(
        &self,
        cx: &Cx<'_, C>,
        namespace: &Namespace,
        prompt: &[u32],
    ) -> Option<(SeqId, usize)> {
        let idle = self.idle.iter().enumerate().filter_map(|(seq, i)| {
            let i = i.as_ref()?;
            (i.namespace == *namespace).then(|| (seq, &i.tokens[..]))
        });
        longest_resumable(&*cx.cache, running(cx.slots, namespace).chain(idle), prompt)
    }

    /// Drops the idle sequence kept at `seq`, freeing its cells.
    fn drop_idle<C: CausalCache>(&mut self, cx: &mut Cx<'_, C>, seq: SeqId) -> Result<()> {
        cx.cache.remove(seq, PosRange::from(0..))?;
        self.idle[seq] = None;
        self.let_go(cx, seq, 0);
        cx.reuse.evictions += 1;
        Ok(())
    }

    /// Drops the least recently used idle sequence; `false` when there is none.
    fn evict_lru<C: CausalCache>(&mut self, cx: &mut Cx<'_, C>) -> Result<bool> {
        let oldest = (0..self.idle.len())
            .filter_map(|seq| self.idle[seq].as_ref().map(|idle| (idle.last_used, seq)))
            .min();
        match oldest {
            Some((_, seq)) => self.drop_idle(cx, seq).map(|()| true),
            None => Ok(false),
        }
    }

    /// A sequence id for a new request: an empty one, else the idle one
    /// `prefer` (kept for its prefix), else the least recently used idle
    /// one, dropped.
    fn free_seq<C: CausalCache>(
        &mut self,
        cx: &mut Cx<'_, C>,
        prefer: Option<SeqId>,
    ) -> Result<Option<SeqId>> {
        if let Some(seq) = empty_seq(cx.slots, |seq| self.idle[seq].is_none()) {
            return Ok(Some(seq));
        }
        if let Some(seq) = prefer.filter(|&seq| self.idle[seq].is_some()) {
            return Ok(Some(seq));
        }
        if self.evict_lru(cx)? {
            return self.free_seq(cx, None);
        }
        Ok(None)
    }

    /// Reports the full blocks of `tokens`, which `seq` now keeps idle, as
    /// held by it.
    fn hold<C: CausalCache>(
        &mut self,
        cx: &mut Cx<'_, C>,
        seq: SeqId,
        namespace: &Namespace,
        tokens: &[u32],
    ) {
        let (Some(events), Some(block)) = (cx.events.as_deref_mut(), cx.block_tokens) else {
            return;
        };
        let names = KeyChain::new(Scope::new(cx.fingerprint, namespace), block, tokens)
            .map(|(_, key)| block_hash(&key.0))
            .collect();
        self.published.hold(seq, names, tokens, namespace, events);
    }

    /// `seq` keeps its first `tokens` tokens only: the blocks past them that
    /// no sequence holds now are reported removed.
    fn let_go<C: CausalCache>(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, tokens: usize) {
        let (Some(events), Some(block)) = (cx.events.as_deref_mut(), cx.block_tokens) else {
            return;
        };
        self.published.release(seq, tokens / block, events);
    }
}

impl<C: CausalCache<Tensor = Tensor>> Retention<C> for IdleSequences {
    /// The longest prefix held by a sequence of the namespace: an idle one
    /// whose whole prompt the new one repeats is taken over in place (the next
    /// turn of a conversation, whose finished turn's cells are then not kept
    /// twice); otherwise the prefix is shared by copy-prefix.
    fn start(&mut self, cx: &mut Cx<'_, C>, namespace: &Namespace, prompt: &[u32]) -> Result<Start> {
        let source = self.longest_prefix(cx, namespace, prompt);
        let continues =
            source.filter(|&(src, len)| self.idle[src].as_ref().is_some_and(|idle| len >= idle.prompt_len));
        let seq = match continues {
            Some((src, _)) => src,
            None => match self.free_seq(cx, source.map(|s| s.0))? {
                Some(seq) => seq,
                None => return Ok(Start::NoRoom),
            },
        };
        let reused = match source {
            Some((src, len)) if src == seq => {
                // Take the idle sequence over, keeping its shared prefix.
                cx.cache.remove(seq, PosRange::from(len as Pos..))?;
                self.idle[seq] = None;
                self.let_go(cx, seq, len);
                len
            }
            Some((src, len)) => {
                cx.cache.copy_prefix(src, seq, len as Pos)?;
                if let Some(idle) = self.idle[src].as_mut() {
                    idle.last_used = Instant::now();
                }
                len
            }
            None => {
                cx.cache.remove(seq, PosRange::from(0..))?;
                0
            }
        };
        Ok(Start::Join {
            seq,
            reused,
            junction: None,
        })
    }

    fn finish(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, ended: Ended<'_>) -> Result<()> {
        if ended.shifted {
            cx.cache.remove(seq, PosRange::from(0..))?;
            self.let_go(cx, seq, 0);
            return Ok(());
        }
        self.hold(cx, seq, ended.namespace, ended.tokens);
        self.idle[seq] = Some(Idle {
            namespace: ended.namespace.clone(),
            prompt_len: ended.prompt_len.min(ended.tokens.len()),
            tokens: ended.tokens.to_vec(),
            last_used: Instant::now(),
        });
        Ok(())
    }

    fn release(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, tokens: usize) {
        self.let_go(cx, seq, tokens);
    }

    fn make_room(&mut self, cx: &mut Cx<'_, C>) -> Result<bool> {
        self.evict_lru(cx)
    }

    fn age(&mut self, cx: &mut Cx<'_, C>, age: Duration) -> Result<usize> {
        let mut n = 0;
        for seq in 0..self.idle.len() {
            if self.idle[seq]
                .as_ref()
                .is_some_and(|idle| idle.last_used.elapsed() >= age)
            {
                self.drop_idle(cx, seq)?;
                n += 1;
            }
        }
        Ok(n)
    }

    fn idle_sequences(&self) -> usize {
        self.idle.iter().filter(|s| s.is_some()).count()
    }
}
