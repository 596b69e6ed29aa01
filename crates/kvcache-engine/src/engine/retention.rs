//! What the engine keeps of finished requests for later ones to start from,
//! and where a request starts: no retention, idle sequences (a finished
//! sequence's cells kept whole, one per sequence id, continued in place or
//! shared by copy-prefix) or blocks (a finished sequence's cells indexed by
//! chained block key, its sequence id free at once); what makes room when a
//! pass needs cells or a request a sequence id, what ages out, and the KV
//! events that report what is kept.
//!
//! **Invariant:** two namespaces never share cells; every block the cache
//! stops keeping is forgotten by `block_tokens` and, when full, reported
//! removed to the event sink.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use kvcache_api::block_key::{BlockKey, KeyChain, Scope};
use kvcache_api::events::{block_hash, KvEvent, Medium};
use kvcache_api::retention::block_chain;
use kvcache_api::{CacheError, CausalCache, Namespace, Pos, PosRange, SeqId};
use kvcache_models::{BatchToken, Model, ModelError};

use super::Engine;
use crate::Result;

/// A finished sequence whose cells stay in the cache for later requests of
/// its namespace to start from ([`Engine::set_prefix_reuse`]).
#[derive(Debug)]
pub(super) struct Idle {
    pub(super) namespace: Namespace,
    /// Exactly the tokens in the cache, from position 0.
    pub(super) tokens: Vec<u32>,
    /// How many of them were the finished request's prompt.
    pub(super) prompt_len: usize,
    pub(super) last_used: Instant,
}

/// How a queued request starts.
pub(super) enum Start {
    /// In sequence `seq`, holding the first `reused` prompt tokens.
    Join { seq: SeqId, reused: usize },
    /// Not yet: a running request is evaluating a longer prefix it shares.
    Wait,
    /// No sequence id is free.
    NoRoom,
}

impl<C, M> Engine<'_, C, M>
where
    C: CausalCache<Tensor = Tensor>,
    M: Model,
{
    /// Drops the sequences and blocks kept for reuse that have not been used
    /// for `age`; returns how many.
    pub fn evict_idle(&mut self, age: Duration) -> Result<usize> {
        let old = self.block_tokens.unused_for(age);
        let gone = self.cache.forget_blocks(&old);
        self.reuse.blocks_evicted += gone.len();
        self.blocks_gone(&gone);
        let mut n = gone.len();
        for seq in 0..self.idle.len() {
            if self.idle[seq]
                .as_ref()
                .is_some_and(|idle| idle.last_used.elapsed() >= age)
            {
                self.drop_idle(seq)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Drops the idle sequence kept at `seq`, freeing its cells.
    pub(super) fn drop_idle(&mut self, seq: SeqId) -> Result<()> {
        self.cache.remove(seq, PosRange::from(0..))?;
        self.idle[seq] = None;
        self.release_blocks_of(seq, 0);
        self.reuse.evictions += 1;
        Ok(())
    }

    /// Evicts indexed blocks until `cells` cells are free; whether any was.
    pub(super) fn evict_blocks(&mut self, cells: usize) -> bool {
        let evicted = self.cache.evict_blocks(cells);
        self.reuse.blocks_evicted += evicted.len();
        let any = !evicted.is_empty();
        self.blocks_gone(&evicted);
        any
    }

    /// Forgets the tokens of blocks the cache no longer keeps, reporting the
    /// full ones removed.
    pub(super) fn blocks_gone(&mut self, keys: &[BlockKey]) {
        if keys.is_empty() {
            return;
        }
        if let (Some(sink), Some(block)) = (&self.events, self.config.block_tokens) {
            let removed: Vec<u64> = keys
                .iter()
                .filter(|k| self.block_tokens.tokens(k).is_some_and(|t| t.len() == block))
                .map(|k| block_hash(&k.0))
                .collect();
            if !removed.is_empty() {
                sink.publish(vec![KvEvent::BlockRemoved {
                    block_hashes: removed,
                    medium: Medium::Device,
                }]);
            }
        }
        self.block_tokens.forget(keys);
    }

    /// Reports the full blocks of `tokens`, which idle sequence `seq` keeps
    /// whole, as held by it (a cache without a block index, with an event
    /// sink): those no other sequence holds are stored, and those it held
    /// before and no sequence holds now removed.
    pub(super) fn hold_blocks_of(&mut self, seq: SeqId, namespace: &Namespace, tokens: &[u32]) {
        let (Some(sink), Some(block)) = (&self.events, self.config.block_tokens) else {
            return;
        };
        if self.cache.indexes_blocks() {
            return;
        }
        let scope = Scope::new(&self.fingerprint, namespace);
        let names = KeyChain::new(scope, block, tokens)
            .map(|(_, key)| block_hash(&key.0))
            .collect();
        let events = self.published.hold(seq, names, tokens, block, namespace);
        if !events.is_empty() {
            sink.publish(events);
        }
    }

    /// Sequence `seq` keeps its first `tokens` tokens only, or none: the
    /// blocks past them it held and no sequence holds now are reported
    /// removed.
    pub(super) fn release_blocks_of(&mut self, seq: SeqId, tokens: usize) {
        let keep = self.config.block_tokens.map_or(0, |block| tokens / block);
        let events = self.published.release(seq, keep);
        if let (Some(sink), false) = (&self.events, events.is_empty()) {
            sink.publish(events);
        }
    }

    /// Reports the full blocks among `new` (indices into `chain`, which
    /// covers `tokens` from position 0) as stored.
    pub(super) fn blocks_stored(
        &self,
        namespace: &Namespace,
        chain: &[(BlockKey, usize)],
        tokens: &[u32],
        new: &[usize],
    ) {
        let (Some(sink), Some(block)) = (&self.events, self.config.block_tokens) else {
            return;
        };
        let full: Vec<usize> = new.iter().copied().filter(|&i| chain[i].1 == block).collect();
        if full.is_empty() {
            return;
        }
        // New full blocks follow each other (a chain's kept part comes first).
        let (first, last) = (full[0], full[full.len() - 1]);
        let names: Vec<u64> = chain[..=last].iter().map(|(key, _)| block_hash(&key.0)).collect();
        sink.publish(vec![KvEvent::stored_run(
            &names,
            first,
            tokens,
            block,
            Medium::Device,
            namespace,
        )]);
    }

    /// Drops the least recently used idle sequence; `false` when there is none.
    pub(super) fn evict_lru(&mut self) -> Result<bool> {
        let oldest = (0..self.idle.len())
            .filter_map(|seq| self.idle[seq].as_ref().map(|idle| (idle.last_used, seq)))
            .min();
        match oldest {
            Some((_, seq)) => self.drop_idle(seq).map(|()| true),
            None => Ok(false),
        }
    }

    /// The sequence holding the longest prefix of `prompt` in `namespace`
    /// (running or idle) that it can resume from, leaving the last prompt
    /// token to evaluate: `(seq, len)`.
    pub(super) fn longest_prefix(&self, namespace: &Namespace, prompt: &[u32]) -> Option<(SeqId, usize)> {
        let limit = prompt.len() - 1;
        let running = self.slots.iter().enumerate().filter_map(|(seq, s)| {
            let s = s.as_ref()?;
            // A shifted sequence's positions no longer match its tokens.
            (s.shifts == 0 && s.req.namespace == *namespace).then(|| (seq, &s.tokens[..s.cached]))
        });
        let idle = self.idle.iter().enumerate().filter_map(|(seq, i)| {
            let i = i.as_ref()?;
            (i.namespace == *namespace).then(|| (seq, &i.tokens[..]))
        });
        // A sequence whose window layers no longer hold the positions just
        // before `len` cannot be resumed there (nor anywhere before).
        running
            .chain(idle)
            .map(|(seq, tokens)| (seq, common_prefix(tokens, prompt).min(limit)))
            .filter(|&(seq, len)| len > 0 && self.cache.can_resume(seq, len as Pos))
            .max_by_key(|&(seq, len)| (len, std::cmp::Reverse(seq)))
    }

    /// A sequence id for a new request: an empty one, else the idle one `prefer`
    /// (kept for its prefix), else the least recently used idle one, dropped.
    pub(super) fn free_seq(&mut self, prefer: Option<SeqId>) -> Result<Option<SeqId>> {
        let empty = (0..self.slots.len()).find(|&seq| self.slots[seq].is_none() && self.idle[seq].is_none());
        if empty.is_some() {
            return Ok(empty);
        }
        if let Some(seq) = prefer.filter(|&seq| self.idle[seq].is_some()) {
            return Ok(Some(seq));
        }
        if self.evict_lru()? {
            return self.free_seq(None);
        }
        Ok(None)
    }

    /// Admits queued requests, oldest first, while sequence ids are free;
    /// whole prompt: the next turn of a conversation, whose finished turn's
    /// cells are then not kept twice) or shared by copy-prefix.
    pub(super) fn start_by_sequences(&mut self, namespace: &Namespace, prompt: &[u32]) -> Result<Start> {
        let source = if self.reuse_prefixes {
            self.longest_prefix(namespace, prompt)
        } else {
            None
        };
        let continues =
            source.filter(|&(src, len)| self.idle[src].as_ref().is_some_and(|idle| len >= idle.prompt_len));
        let seq = match continues {
            Some((src, _)) => src,
            None => match self.free_seq(source.map(|s| s.0))? {
                Some(seq) => seq,
                None => return Ok(Start::NoRoom),
            },
        };
        let reused = match source {
            Some((src, len)) if src == seq => {
                // Take the idle sequence over, keeping its shared prefix.
                self.cache.remove(seq, PosRange::from(len as Pos..))?;
                self.idle[seq] = None;
                self.release_blocks_of(seq, len);
                len
            }
            Some((src, len)) => {
                self.cache.copy_prefix(src, seq, len as Pos)?;
                if let Some(idle) = self.idle[src].as_mut() {
                    idle.last_used = Instant::now();
                }
                len
            }
            None => {
                self.cache.remove(seq, PosRange::from(0..))?;
                0
            }
        };
        Ok(Start::Join { seq, reused })
    }

    /// Starts queued request `i` on the block index: the longest indexed
    /// chain, or a running request's cells where those go further; it waits
    /// while a running request is still evaluating a longer shared prefix.
    pub(super) fn start_by_blocks(
        &mut self,
        i: usize,
        namespace: &Namespace,
        prompt: &[u32],
    ) -> Result<Start> {
        let limit = prompt.len() - 1;
        let scope = Scope::new(&self.fingerprint, namespace);
        let kept = self
            .block_tokens
            .longest_prefix(&self.cache, scope, prompt, limit);
        let adopted = kept.len;
        let running = self.longest_prefix(namespace, prompt);
        let best = adopted.max(running.map_or(0, |r| r.1));
        let pending = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.req.namespace == *namespace && s.generated.is_empty() && s.shifts == 0)
            .map(|s| common_prefix(&s.req.prompt, prompt).min(limit))
            .max()
            .unwrap_or(0);
        if pending > best {
            let id = self.queue[i].req.id;
            if !self.waiting.contains(&id) {
                self.waiting.push(id);
                self.reuse.waited_for_prefix += 1;
            }
            return Ok(Start::Wait);
        }
        let Some(seq) = self.free_seq(None)? else {
            return Ok(Start::NoRoom);
        };
        self.cache.remove(seq, PosRange::from(0..))?;
        let reused = match running {
            Some((src, len)) if len > adopted => {
                self.cache.copy_prefix(src, seq, len as Pos)?;
                len
            }
            _ if adopted > 0 => {
                self.cache.adopt_blocks(seq, &kept.keys, adopted as Pos)?;
                self.block_tokens.touch(&kept.keys);
                adopted
            }
            _ => 0,
        };
        Ok(Start::Join { seq, reused })
    }

    /// Keeps the finished `seq`'s cells by block ([`EngineConfig::block_tokens`])
    /// and frees its sequence id. Returns the blocks newly indexed.
    pub(super) fn retain(
        &mut self,
        seq: SeqId,
        namespace: &Namespace,
        tokens: &[u32],
    ) -> Result<Vec<(BlockKey, usize)>> {
        let block = self.config.block_tokens.expect("keeping blocks");
        let chain = block_chain(Scope::new(&self.fingerprint, namespace), block, tokens);
        let kept = match self.cache.retain_blocks(seq, &chain) {
            Ok(new) => {
                self.block_tokens.record(&chain, tokens, &new);
                self.blocks_stored(namespace, &chain, tokens, &new);
                new.into_iter().map(|i| chain[i]).collect()
            }
            Err(error) => {
                tracing::warn!(%error, seq, "block retention refused: the finished sequence is not kept");
                Vec::new()
            }
        };
        self.cache.remove(seq, PosRange::from(0..))?;
        Ok(kept)
    }

    /// Runs `batch`, dropping idle sequences while the cache is too full for it.
    pub(super) fn hidden_making_room(&mut self, batch: &[BatchToken]) -> Result<Tensor> {
        loop {
            match self.model.hidden(batch, &mut self.cache) {
                Err(ModelError::Cache(CacheError::Full { .. })) if self.evict_blocks(batch.len()) => continue,
                Err(ModelError::Cache(CacheError::Full { .. })) if self.evict_lru()? => continue,
                result => return Ok(result?),
            }
        }
    }
}

/// Length of the longest common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
