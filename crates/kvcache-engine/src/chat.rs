//! Multi-conversation chat over one live sequence of per-layer caches, with three
//! ways of reusing earlier work between requests:
//!
//! - [`Reuse::Trie`]: `kvcache_trie::PrefixCache`, the prefix trie shared
//!   across conversations (pages conversations out to snapshots and back in);
//! - [`Reuse::SingleEntry`]: the live caches keep the previous request; a new
//!   request reuses its longest common prefix with it (seed 003's behaviour);
//! - [`Reuse::None`]: every prompt is evaluated from scratch.
//!
//! It runs any [`LayerModel`]: the layer caches are the model's (candle's
//! `CandleKv`s for the Llama, window and global layers for Gemma, mlx-rs
//! arrays for the mlx models).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvcache_api::{Namespace, PrefixStore, SnapshotCache};
use kvcache_trie::{PrefixCache, Stats as TrieStats};

use crate::{EngineError, Result};
use kvcache_models::{LayerModel, Llama};

/// One chat turn through a prefix trie, for any model: `forward` runs tokens
/// through the session's layer caches and returns its hidden rows (at least the
/// last), `pick` chooses the next token from them. Greedy, `n_predict` tokens,
/// stopping after `eos` if given; the turn's tokens are recorded and the session
/// closed, so the trie keeps the conversation (and writes its prompt to the
/// trie's store, if it has one). Prefixes are reused within `namespace` only.
pub fn trie_turn<C, H>(
    trie: &mut PrefixCache<C>,
    namespace: &Namespace,
    prompt: &[u32],
    n_predict: usize,
    eos: Option<u32>,
    forward: impl FnMut(&[u32], &mut [C]) -> Result<H>,
    pick: impl FnMut(&H) -> Result<u32>,
) -> Result<TurnOutcome>
where
    C: SnapshotCache,
{
    let tokens = (prompt, n_predict, eos);
    turn_through(trie, namespace, tokens, false, forward, pick)
}

/// [`trie_turn`], also keeping a restore point at the end of the prompt (taken
/// after the first token is chosen, so outside the time to first token): the
/// next turn of the conversation, which replaces the reply, resumes there. For
/// models with window layers, whose rotating caches cannot rewind from the
/// reply's end to the prompt's.
pub fn trie_turn_resumable<C, H>(
    trie: &mut PrefixCache<C>,
    namespace: &Namespace,
    prompt: &[u32],
    n_predict: usize,
    eos: Option<u32>,
    forward: impl FnMut(&[u32], &mut [C]) -> Result<H>,
    pick: impl FnMut(&H) -> Result<u32>,
) -> Result<TurnOutcome>
where
    C: SnapshotCache,
{
    let tokens = (prompt, n_predict, eos);
    turn_through(trie, namespace, tokens, true, forward, pick)
}

/// [`trie_turn`] for `(prompt, n_predict, eos)`, with a user snapshot at the
/// prompt's end when `snapshot_prompt_end`.
fn turn_through<C, H>(
    trie: &mut PrefixCache<C>,
    namespace: &Namespace,
    (prompt, n_predict, eos): (&[u32], usize, Option<u32>),
    snapshot_prompt_end: bool,
    mut forward: impl FnMut(&[u32], &mut [C]) -> Result<H>,
    mut pick: impl FnMut(&H) -> Result<u32>,
) -> Result<TurnOutcome>
where
    C: SnapshotCache,
{
    if prompt.is_empty() || n_predict == 0 {
        return Err(EngineError::InvalidArgument(
            "empty prompt or nothing to generate".into(),
        ));
    }
    let t0 = Instant::now();
    let done = |g: &[u32]| g.len() == n_predict || eos.is_some_and(|e| g.last() == Some(&e));
    let mut session = trie.begin_in(namespace, prompt)?;
    let matched = session.cached();
    let restored = session.restored().clone();
    let evaluated = session.remaining().len();
    let mut last = None;
    session.prefill(|tokens, caches| -> Result<()> {
        last = Some(forward(tokens, caches)?);
        Ok(())
    })?;
    let last = last.ok_or_else(|| EngineError::InvalidArgument("nothing evaluated".into()))?;
    let mut token = pick(&last)?;
    drop(last);
    let time_to_first_token = t0.elapsed();
    if snapshot_prompt_end {
        session.snapshot(true)?;
    }
    let mut generated = vec![token];
    session.record(token);
    while !done(&generated) {
        let h = forward(&[token], session.caches_mut())?;
        token = pick(&h)?;
        generated.push(token);
        session.record(token);
    }
    session.close()?;
    Ok(TurnOutcome {
        prompt_tokens: prompt.len(),
        matched,
        restored: restored.store,
        tiers: restored.tiers,
        evaluated,
        time_to_first_token,
        total: t0.elapsed(),
        generated,
    })
}

/// How requests reuse earlier work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Evaluate every prompt from scratch.
    None,
    /// Keep the last request in the live caches; reuse its longest common prefix.
    SingleEntry,
    /// The prefix trie across conversations.
    Trie,
}

impl Reuse {
    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Reuse::None => "no reuse",
            Reuse::SingleEntry => "single-entry",
            Reuse::Trie => "prefix trie",
        }
    }
}

/// What one request did.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnOutcome {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens restored from earlier work.
    pub matched: usize,
    /// Of `matched`, tokens restored from a prefix store (the session's
    /// [`Restored::store`](kvcache_trie::Restored::store)).
    pub restored: usize,
    /// `(tier, tokens)` for each store tier that served some, as the session
    /// reported them ([`Restored::tiers`](kvcache_trie::Restored::tiers)).
    pub tiers: Vec<(&'static str, usize)>,
    /// Prompt tokens evaluated.
    pub evaluated: usize,
    /// From receiving the prompt to the first generated token.
    pub time_to_first_token: Duration,
    /// From receiving the prompt to the last generated token.
    pub total: Duration,
    /// Generated tokens.
    pub generated: Vec<u32>,
}

/// Where a chat's live sequence is: in the trie's session, or in caches it
/// keeps itself.
enum Sequence<L> {
    Trie(Box<PrefixCache<L>>),
    Live { caches: Vec<L>, tokens: Vec<u32> },
}

/// Chat turns of any number of conversations, one at a time, through one
/// model (any [`LayerModel`]: the Llama by default, Gemma, or either on
/// mlx-rs), one live sequence and one reuse policy.
pub struct Chat<'m, M: LayerModel = Llama> {
    model: &'m M,
    reuse: Reuse,
    sequence: Sequence<M::Layer>,
    namespace: Namespace,
}

impl<M: LayerModel> std::fmt::Debug for Chat<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chat").field("reuse", &self.reuse).finish()
    }
}

impl<'m, M: LayerModel> Chat<'m, M> {
    /// A chat with `reuse`; the trie keeps at most `budget_bytes` of snapshots.
    pub fn new(model: &'m M, reuse: Reuse, budget_bytes: usize) -> Result<Self> {
        Self::with_layers(model, reuse, model.new_layers()?, budget_bytes)
    }

    /// [`new`](Self::new) over `caches`, the model's layer caches however
    /// made (one per layer, empty).
    pub fn with_layers(
        model: &'m M,
        reuse: Reuse,
        caches: Vec<M::Layer>,
        budget_bytes: usize,
    ) -> Result<Self> {
        let sequence = match reuse {
            Reuse::Trie => Sequence::Trie(Box::new(PrefixCache::new(caches, budget_bytes)?)),
            Reuse::None | Reuse::SingleEntry => Sequence::Live {
                caches,
                tokens: Vec::new(),
            },
        };
        Ok(Chat {
            model,
            reuse,
            sequence,
            namespace: Namespace::shared(),
        })
    }

    /// A prefix-trie chat whose trie also reads from and writes to `store`,
    /// waiting at most `deadline` for a read: conversations outlive the process
    /// and are shared by every chat (and server) on the same store.
    pub fn with_store(
        model: &'m M,
        budget_bytes: usize,
        store: Arc<dyn PrefixStore>,
        deadline: Duration,
    ) -> Result<Self> {
        let mut chat = Self::new(model, Reuse::Trie, budget_bytes)?;
        if let Sequence::Trie(trie) = &mut chat.sequence {
            trie.set_store(store, deadline)?;
        }
        Ok(chat)
    }

    /// Answers the following requests in `namespace` (a tenant's cache salt):
    /// they reuse only prefixes of the same namespace.
    pub fn set_namespace(&mut self, namespace: Namespace) {
        self.namespace = namespace;
    }

    /// The reuse policy.
    pub fn reuse(&self) -> Reuse {
        self.reuse
    }

    /// The prefix trie, with [`Reuse::Trie`] (for its invariant checker and
    /// inspection).
    pub fn trie(&self) -> Option<&PrefixCache<M::Layer>> {
        match &self.sequence {
            Sequence::Trie(t) => Some(t),
            Sequence::Live { .. } => None,
        }
    }

    /// The prefix trie, mutably, with [`Reuse::Trie`]: to report its blocks
    /// to a router ([`PrefixCache::set_event_sink`]) or change its budget.
    pub fn trie_mut(&mut self) -> Option<&mut PrefixCache<M::Layer>> {
        match &mut self.sequence {
            Sequence::Trie(t) => Some(t),
            Sequence::Live { .. } => None,
        }
    }

    /// The trie's counters, with [`Reuse::Trie`].
    pub fn trie_stats(&self) -> Option<TrieStats> {
        match &self.sequence {
            Sequence::Trie(t) => Some(t.stats()),
            Sequence::Live { .. } => None,
        }
    }

    /// Answers `prompt` with `n_predict` greedy tokens (stopping after `eos` if
    /// given).
    pub fn generate(&mut self, prompt: &[u32], n_predict: usize, eos: Option<u32>) -> Result<TurnOutcome> {
        if prompt.is_empty() || n_predict == 0 {
            return Err(EngineError::InvalidArgument(
                "empty prompt or nothing to generate".into(),
            ));
        }
        let t0 = Instant::now();
        let model = self.model;
        let done = |g: &[u32]| g.len() == n_predict || eos.is_some_and(|e| g.last() == Some(&e));
        match &mut self.sequence {
            Sequence::Trie(trie) => {
                let forward =
                    |tokens: &[u32], caches: &mut [M::Layer]| Ok(model.hidden_layers(tokens, caches)?);
                let pick = |hidden: &M::Array| Ok(model.next_token(hidden)?);
                let turn = if M::RESUMABLE {
                    trie_turn_resumable
                } else {
                    trie_turn
                };
                turn(trie, &self.namespace, prompt, n_predict, eos, forward, pick)
            }
            Sequence::Live { caches, tokens } => {
                let matched = if self.reuse == Reuse::SingleEntry {
                    let common = tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
                    common.min(prompt.len() - 1)
                } else {
                    0
                };
                for c in caches.iter_mut() {
                    if matched == 0 {
                        c.free();
                    } else if !c.restore(None, matched)? {
                        return Err(EngineError::InvalidArgument(format!(
                            "cannot rewind to {matched}"
                        )));
                    }
                }
                let rest = &prompt[matched..];
                let h = model.hidden_layers(rest, caches)?;
                let mut token = model.next_token(&h)?;
                let ttft = t0.elapsed();
                let mut generated = vec![token];
                while !done(&generated) {
                    let h = model.hidden_layers(&[token], caches)?;
                    token = model.next_token(&h)?;
                    generated.push(token);
                }
                // The caches hold the prompt and every generated token but the last.
                *tokens = prompt.to_vec();
                tokens.extend_from_slice(&generated[..generated.len() - 1]);
                Ok(TurnOutcome {
                    prompt_tokens: prompt.len(),
                    matched,
                    restored: 0,
                    tiers: Vec::new(),
                    evaluated: rest.len(),
                    time_to_first_token: ttft,
                    total: t0.elapsed(),
                    generated,
                })
            }
        }
    }
}
