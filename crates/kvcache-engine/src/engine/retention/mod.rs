//! What the engine keeps of finished requests for later ones to start from,
//! behind one trait ([`Retention`]) with three policies:
//!
//! - [`Nothing`]: a finished request's cells are freed;
//! - [`IdleSequences`]: a finished sequence's cells are kept whole, one per
//!   sequence id, continued in place or shared by copy-prefix (Ollama's input
//!   cache, llama.cpp's slots; for a cache that keeps no blocks);
//! - [`Blocks`]: a finished sequence's cells are indexed by chained block
//!   key in the cache's own block index and its sequence id is free at once
//!   (vLLM's automatic prefix caching on Ollama's cells).
//!
//! The engine calls its policy when a request is admitted ([`Retention::start`]:
//! which sequence, holding how much of the prompt already), when one
//! finishes ([`Retention::finish`]) or lets go of cells
//! ([`Retention::release`]), when a pass lacks cells
//! ([`Retention::make_room`]) and when old entries should go
//! ([`Retention::age`]). Every policy also resumes from a *running* request's
//! cells where those hold more of a prompt.
//!
//! **Invariant:** two namespaces never share cells; everything a policy
//! stops keeping is reported removed to the event batch it is given (the
//! block index journals its own changes, which the engine drains after each
//! call).

mod blocks;
mod idle;
mod published;

pub(super) use blocks::Blocks;
pub(super) use idle::IdleSequences;

use std::fmt::Debug;
use std::time::Duration;

use candle_core::Tensor;
use kvcache_api::events::EventBatch;
use kvcache_api::{CausalCache, Fingerprint, Namespace, Pos, PosRange, SeqId};

use super::{ReuseStats, Slot};
use crate::Result;

/// How a queued request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// In sequence `seq`, holding the first `reused` prompt tokens; once
    /// the first `junction` are in the cache, the policy keeps them
    /// ([`Retention::keep_prefix`]): kept tokens of other prompts go that
    /// far, but could not be resumed.
    Join {
        seq: SeqId,
        reused: usize,
        junction: Option<usize>,
    },
    /// Not yet: a running request is evaluating a longer prefix it shares.
    Wait,
    /// No sequence id is free.
    NoRoom,
}

/// What a policy works on: the cache, the running requests, and where its
/// counters and events go.
pub(super) struct Cx<'a, C> {
    pub cache: &'a mut C,
    /// Per sequence id, the request running there.
    pub slots: &'a [Option<Slot>],
    /// The model blocks are keyed under.
    pub fingerprint: &'a Fingerprint,
    /// Tokens per reported block, when blocks are reported.
    pub block_tokens: Option<usize>,
    /// The events of this call, when a sink wants them.
    pub events: Option<&'a mut EventBatch>,
    pub reuse: &'a mut ReuseStats,
}

/// A finished request as its policy sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ended<'a> {
    pub namespace: &'a Namespace,
    /// Exactly the tokens in the cache, from position 0.
    pub tokens: &'a [u32],
    /// How many of them were the prompt.
    pub prompt_len: usize,
    /// Whether a context shift moved its positions (its cells then no longer
    /// match a prompt's).
    pub shifted: bool,
}

/// What the engine keeps of finished requests, and where a new one starts.
pub(super) trait Retention<C: CausalCache<Tensor = Tensor>>: Debug + Send {
    /// Where a request of `namespace` with `prompt` starts: a sequence id,
    /// emptied and holding the prefix it reuses, or why not yet.
    fn start(&mut self, cx: &mut Cx<'_, C>, namespace: &Namespace, prompt: &[u32]) -> Result<Start>;

    /// The request in `seq` ended: keep what the policy keeps, free the rest
    /// (the sequence id is free afterwards unless the policy keeps it idle).
    fn finish(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, ended: Ended<'_>) -> Result<()>;

    /// The running request in `seq` has its first `tokens.len()` tokens in
    /// the cache, `tokens`, a prefix other prompts share: keep it (the
    /// request goes on).
    fn keep_prefix(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, namespace: &Namespace, tokens: &[u32]) {
        let _ = (cx, seq, namespace, tokens);
    }

    /// Sequence `seq` now holds only its first `tokens` tokens (cancelled or
    /// failed: 0; shifted: the ones the shift kept in place).
    fn release(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, tokens: usize) {
        let _ = (cx, seq, tokens);
    }

    /// A pass lacks cells: free some, if the policy holds any; whether it did.
    fn make_room(&mut self, cx: &mut Cx<'_, C>) -> Result<bool> {
        let _ = cx;
        Ok(false)
    }

    /// Drops what was not used for `age`; returns how many entries went.
    fn age(&mut self, cx: &mut Cx<'_, C>, age: Duration) -> Result<usize> {
        let _ = (cx, age);
        Ok(0)
    }

    /// Finished sequences kept whole.
    fn idle_sequences(&self) -> usize {
        0
    }

    /// Whether the policy keeps finished sequences by block (what it keeps
    /// then belongs in the prefix store too).
    fn keeps_blocks(&self) -> bool {
        false
    }
}

/// No reuse: every request starts in an empty sequence, and a finished
/// one's cells are freed.
#[derive(Debug, Default)]
pub(super) struct Nothing;

impl<C: CausalCache<Tensor = Tensor>> Retention<C> for Nothing {
    fn start(&mut self, cx: &mut Cx<'_, C>, _: &Namespace, _: &[u32]) -> Result<Start> {
        match empty_seq(cx.slots, |_| true) {
            Some(seq) => {
                cx.cache.remove(seq, PosRange::from(0..))?;
                Ok(Start::Join {
                    seq,
                    reused: 0,
                    junction: None,
                })
            }
            None => Ok(Start::NoRoom),
        }
    }

    fn finish(&mut self, cx: &mut Cx<'_, C>, seq: SeqId, _: Ended<'_>) -> Result<()> {
        cx.cache.remove(seq, PosRange::from(0..))?;
        Ok(())
    }
}

/// The first sequence id with no running request for which `free` holds.
fn empty_seq(slots: &[Option<Slot>], mut free: impl FnMut(SeqId) -> bool) -> Option<SeqId> {
    (0..slots.len()).find(|&seq| slots[seq].is_none() && free(seq))
}

/// The tokens in the cache of each running request of `namespace` whose
/// positions still match its tokens (a shifted sequence's do not):
/// `(seq, tokens)`.
fn running<'s>(
    slots: &'s [Option<Slot>],
    namespace: &'s Namespace,
) -> impl Iterator<Item = (SeqId, &'s [u32])> + 's {
    slots.iter().enumerate().filter_map(move |(seq, s)| {
        let s = s.as_ref()?;
        (s.shifts == 0 && s.req.namespace == *namespace).then(|| (seq, &s.tokens[..s.cached]))
    })
}

/// Among `held` sequences' tokens, the longest common prefix with `prompt`
/// (short of its last token) that the cache can resume: `(seq, len)`, the
/// lowest sequence id on ties. A sequence whose window layers no longer hold
/// the positions just before `len` cannot be resumed there.
fn longest_resumable<'t, C: CausalCache>(
    cache: &C,
    held: impl Iterator<Item = (SeqId, &'t [u32])>,
    prompt: &[u32],
) -> Option<(SeqId, usize)> {
    let limit = prompt.len() - 1;
    held.map(|(seq, tokens)| (seq, common_prefix(tokens, prompt).min(limit)))
        .filter(|&(seq, len)| len > 0 && cache.can_resume(seq, len as Pos))
        .max_by_key(|&(seq, len)| (len, std::cmp::Reverse(seq)))
}

/// Length of the longest common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
