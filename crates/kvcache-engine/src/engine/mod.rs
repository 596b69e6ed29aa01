//! Greedy generation through a [`CausalCache`], and a continuous-batching engine:
//! requests join free sequence slots as others finish, prompts prefill in chunks
//! beside other sequences' decode steps, and a sequence that fills its context
//! drops half of its middle (a shifting removal, llama.cpp's context shift).
//!
//! With a [`PrefixStore`] ([`Engine::set_store`]) requests reuse prefixes across
//! requests, processes and replicas, through the same [`StoreClient`] as the
//! prefix trie: a joining request imports the longest stored prefix of its
//! prompt into its sequence ([`CausalCache::import_seq`], as the store's
//! model) and evaluates only the rest; once its prompt is evaluated and its
//! first token chosen, the part the store lacks is exported
//! ([`CausalCache::export_seq`]) and written behind the engine's back.
//!
//! With [`Engine::set_prefix_reuse`] the cache itself is the prefix
//! cache, as in Ollama's input cache and llama.cpp's slots: a finished
//! sequence's cells stay where they are, and a joining request starts from the
//! longest prefix of its prompt held by any sequence of its namespace
//! ([`CausalCache::copy_prefix`], which shares cells, or by taking an idle
//! sequence over), evaluating only the rest. Two namespaces never share cells.
//! Idle sequences are dropped, least recently used first, when a request needs
//! their slot or a pass needs their cells.
//!
//! With [`EngineConfig::block_tokens`] set and a cache that
//! [indexes blocks](CausalCache::indexes_blocks), prefixes are kept by block
//! instead: a finished sequence's cells are indexed by chained block key
//! ([`kvcache_api::retention`]) and its sequence id is free at once, so what
//! is kept depends on cells, not on sequence slots. A joining request adopts
//! the longest indexed chain ([`CausalCache::adopt_blocks`]), or shares the
//! cells of a running request when that is longer, then imports whatever the
//! store holds beyond it; one whose prompt extends a prefix a running request
//! is still evaluating waits for it instead of evaluating it again. Blocks are
//! evicted least recently used first when a pass needs their cells.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use kvcache_api::block_key::{BlockKey, KeyChain, Scope};
use kvcache_api::events::{block_hash, KvEvent, KvEventSink, Medium};
use kvcache_api::retention::{block_chain, BlockTokens};
use kvcache_api::{
    CacheError, CausalCache, Fingerprint, Namespace, Pos, PosRange, PrefixStore, SeqId, StoreClient,
    Submitted, WriteBack,
};

use kvcache_models::{argmax, BatchToken, Llama, Model, ModelError, Tokenizer};

use crate::detokenizer::{DecodeError, Detokenizer, Shown};
use crate::published::PublishedBlocks;
use crate::sampling::{Sampler, TokenLogprobs};
use crate::{EngineError, Result};

/// Prefills `prompt` into sequence `seq` (from position 0) and decodes up to
/// `max_new` tokens greedily, stopping after `eos` if given. Returns the new tokens.
/// The sequence is left in the cache.
pub fn greedy<M, C>(
    model: &M,
    cache: &mut C,
    seq: SeqId,
    prompt: &[u32],
    max_new: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>>
where
    M: Model,
    C: CausalCache<Tensor = Tensor> + ?Sized,
{
    if prompt.is_empty() {
        return Err(EngineError::InvalidArgument("empty prompt".into()));
    }
    let batch = BatchToken::run(seq, 0, prompt);
    let mut out = Vec::new();
    let mut next = last_token(model, &batch, cache)?;
    let mut pos = prompt.len() as Pos;
    while out.len() < max_new {
        out.push(next);
        if Some(next) == eos || out.len() == max_new {
            break;
        }
        next = last_token(
            model,
            &[BatchToken {
                seq,
                pos,
                token: next,
            }],
            cache,
        )?;
        pos += 1;
    }
    Ok(out)
}

/// Runs `batch` and returns the greedy choice after its last token.
fn last_token<M, C>(model: &M, batch: &[BatchToken], cache: &mut C) -> Result<u32>
where
    M: Model,
    C: CausalCache<Tensor = Tensor> + ?Sized,
{
    let hidden = model.hidden(batch, cache)?;
    let last = hidden.narrow(0, batch.len() - 1, 1)?;
    let row = model.logits(&last)?.squeeze(0)?.to_vec1::<f32>()?;
    Ok(argmax(&row))
}

/// A generation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Caller's id, echoed in events.
    pub id: usize,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// The tenant's namespace: prefixes are reused within it only.
    pub namespace: Namespace,
    /// Texts that end the request once its generated text contains one
    /// (OpenAI's `stop`); matched on the text a user is shown, so they need
    /// the engine's tokenizer ([`Engine::set_tokenizer`]). The text of the
    /// request's [`Event::Token`]s ends right before the first one found.
    pub stop: Vec<String>,
}

impl Request {
    /// A request in the shared namespace, without stop sequences.
    pub fn new(id: usize, prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            id,
            prompt,
            max_new_tokens,
            namespace: Namespace::shared(),
            stop: Vec::new(),
        }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated one of [`EngineConfig::stop_tokens`] (the model ended its
    /// turn), the last of its generated tokens.
    StopToken,
    /// Its text came to contain `Request::stop[index]`.
    StopSequence(usize),
    /// It generated `max_new_tokens`.
    Length,
}

impl FinishReason {
    /// OpenAI's name for it: `stop` or `length`.
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::StopToken | FinishReason::StopSequence(_) => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// How the engine schedules passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most tokens per forward pass (decode tokens first, then prefill chunks).
    pub max_batch: usize,
    /// Longest prefill chunk of one sequence in one pass.
    pub prefill_chunk: usize,
    /// Positions a sequence may reach; a sequence at the limit drops half of
    /// the tokens after its first `keep` (shifting the rest down). `None`: never.
    pub context: Option<usize>,
    /// Tokens kept at the start of a sequence by a context shift.
    pub keep: usize,
    /// Tokens that end a request when generated (end of turn, end of
    /// sequence); the token is kept as its last generated one.
    pub stop_tokens: Vec<u32>,
    /// With prefix reuse ([`Engine::set_prefix_reuse`]) on a cache that
    /// indexes blocks: keep finished sequences by blocks of this many tokens
    /// (their last, shorter block too), not as idle sequences. `None`: keep
    /// idle sequences, one per sequence id.
    pub block_tokens: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 256,
            prefill_chunk: 128,
            context: None,
            keep: 4,
            stop_tokens: Vec::new(),
            block_tokens: None,
        }
    }
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The request's id.
    pub id: usize,
    /// The sequence slot it ran in.
    pub seq: SeqId,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated: Vec<u32>,
    /// From joining to the first generated token.
    pub time_to_first_token: Duration,
    /// From joining to the last token.
    pub total: Duration,
    /// Context shifts the sequence went through.
    pub context_shifts: usize,
    /// Prompt tokens imported from the prefix store instead of evaluated.
    pub restored: usize,
    /// Prompt tokens taken from another sequence's cells instead of evaluated
    /// ([`Engine::set_prefix_reuse`]).
    pub reused: usize,
    /// Why it ended.
    pub reason: FinishReason,
}

/// What happened during [`Engine::run`], in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A request took a free sequence slot.
    Joined {
        /// The request's id.
        id: usize,
        /// Its slot.
        seq: SeqId,
        /// Prompt length.
        prompt_tokens: usize,
        /// How long it waited in the queue for a slot.
        waited: Duration,
        /// Prompt tokens taken from cached cells instead of evaluated
        /// ([`Engine::set_prefix_reuse`]).
        reused: usize,
        /// Prompt tokens imported from the prefix store instead of evaluated.
        restored: usize,
        /// The store tiers those came from: `(tier, tokens)`, in order.
        restored_from: Vec<(&'static str, usize)>,
    },
    /// Part of a prompt was evaluated.
    Prefilled {
        /// The request's id.
        id: usize,
        /// Prompt tokens evaluated so far.
        done: usize,
        /// Prompt length.
        total: usize,
    },
    /// A token was generated.
    Token {
        /// The request's id.
        id: usize,
        /// The token.
        token: u32,
        /// The text it adds to the answer ([`crate::detokenizer`]): complete
        /// characters only (the bytes of one it starts are held until a
        /// later token completes it), nothing of a stop sequence or after
        /// it, nothing for control and stop tokens; the last token of a
        /// request carries what was still held. Empty without the engine's
        /// tokenizer ([`Engine::set_tokenizer`]).
        text: String,
        /// Its log-probabilities, when the request's sampler asked for them
        /// ([`crate::sampling::SamplingOptions::logprobs`]); never for a
        /// stop token or a control token, which the text leaves out too.
        logprobs: Option<TokenLogprobs>,
    },
    /// A request's text could not be decoded: it was dropped and its cells
    /// freed.
    Failed {
        /// The request's id.
        id: usize,
        /// What the tokenizer said.
        error: DecodeError,
    },
    /// A sequence reached its context and dropped `removed` positions.
    ContextShift {
        /// The request's id.
        id: usize,
        /// Its slot.
        seq: SeqId,
        /// The removed positions; later ones moved down by its length.
        removed: std::ops::Range<Pos>,
    },
    /// A request finished and left its slot.
    Finished(Finished),
    /// One forward pass ran.
    Pass {
        /// Decode tokens in the pass.
        decode: usize,
        /// Prefill tokens in the pass.
        prefill: usize,
        /// Its duration.
        elapsed: Duration,
    },
}

/// Totals of a run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Forward passes.
    pub passes: usize,
    /// Prompt tokens evaluated.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Decode tokens evaluated (generated tokens fed back).
    pub decode_tokens: usize,
    /// Context shifts.
    pub context_shifts: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Time in passes that contained decode tokens only.
    pub decode_time: Duration,
    /// Prompt tokens imported from the prefix store.
    pub restored_tokens: usize,
    /// Prompt tokens exported to the prefix store.
    pub stored_tokens: usize,
    /// Store answers that did not fit or the cache refused to import (the
    /// request evaluated its whole prompt instead), and evaluated prompts
    /// that could not be exported as the store's model (not stored).
    pub store_errors: usize,
    /// Evaluated prompts the store did not take (its writer queue full, or
    /// the input refused): not stored.
    pub store_refused: usize,
}

impl Stats {
    /// Generated tokens per second over the whole run.
    pub fn tokens_per_second(&self) -> f64 {
        self.generated_tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

#[derive(Debug)]
struct Slot {
    req: Request,
    /// Tokens of the sequence: those in the cache, then at most one pending
    /// generated token, or the prompt's rest while prefilling.
    tokens: Vec<u32>,
    /// Tokens in the cache (the next position).
    cached: usize,
    generated: Vec<u32>,
    joined: Instant,
    first_token: Option<Duration>,
    shifts: usize,
    restored: usize,
    reused: usize,
    /// Picks the request's tokens; `None` is greedy.
    sampler: Option<Sampler>,
    /// The answer's text, with the engine's tokenizer.
    text: Option<Detokenizer>,
}

/// A finished sequence whose cells stay in the cache for later requests of
/// its namespace to start from ([`Engine::set_prefix_reuse`]).
#[derive(Debug)]
struct Idle {
    namespace: Namespace,
    /// Exactly the tokens in the cache, from position 0.
    tokens: Vec<u32>,
    /// How many of them were the finished request's prompt.
    prompt_len: usize,
    last_used: Instant,
}

/// How a queued request starts.
enum Start {
    /// In sequence `seq`, holding the first `reused` prompt tokens.
    Join { seq: SeqId, reused: usize },
    /// Not yet: a running request is evaluating a longer prefix it shares.
    Wait,
    /// No sequence id is free.
    NoRoom,
}

/// A queued request and its token picker.
#[derive(Debug)]
struct Queued {
    req: Request,
    sampler: Option<Sampler>,
    submitted: Instant,
}

/// Prefix reuse across requests, counted since the engine was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReuseStats {
    /// Requests that started from another sequence's cells.
    pub hits: usize,
    /// Requests that found nothing to start from.
    pub misses: usize,
    /// Prompt tokens taken from other sequences' cells instead of evaluated.
    pub reused_tokens: usize,
    /// Prompt tokens evaluated.
    pub evaluated_tokens: usize,
    /// Idle sequences dropped to make room (slots or cells) or for age.
    pub evictions: usize,
    /// Requests cancelled before they finished.
    pub cancelled: usize,
    /// Blocks evicted from the cache's block index to make room.
    pub blocks_evicted: usize,
    /// Requests that waited for a running request to evaluate the prefix
    /// they share instead of evaluating it too (counted once per request).
    pub waited_for_prefix: usize,
    /// Requests that imported part of their prompt from the prefix store.
    pub store_restores: usize,
    /// Prompt tokens imported from the prefix store.
    pub store_restored_tokens: usize,
    /// Time spent restoring from the prefix store (asking it, reading the
    /// answer and importing it into the cache), whether or not it answered:
    /// part of each such request's time to first token.
    pub store_restore_time: Duration,
}

/// A continuous-batching engine over one causal cache with one slot per
/// sequence id.
///
/// Drive it all at once ([`Engine::run`]) or one pass at a time
/// ([`Engine::step`], with [`Engine::submit_sampled`] and [`Engine::cancel`]
/// between steps, as a server does).
#[derive(Debug)]
pub struct Engine<'m, C, M = Llama> {
    model: &'m M,
    cache: C,
    config: EngineConfig,
    queue: VecDeque<Queued>,
    slots: Vec<Option<Slot>>,
    /// Per sequence id: the finished sequence kept there for reuse, if any.
    idle: Vec<Option<Idle>>,
    store: Option<StoreClient>,
    /// Store counters of the run in progress.
    restored_tokens: usize,
    stored_tokens: usize,
    store_errors: usize,
    store_refused: usize,
    reuse: ReuseStats,
    reuse_prefixes: bool,
    /// Turns generated tokens into the answers' text.
    tokenizer: Option<Arc<dyn Tokenizer>>,
    /// The model blocks are keyed under (the store's, once one is set).
    fingerprint: Fingerprint,
    /// Ids of queued requests already counted as waiting for a prefix.
    waiting: Vec<usize>,
    /// The tokens of each block the cache indexes, and their last use.
    block_tokens: BlockTokens,
    /// Where changes of the block index are reported, if anywhere.
    events: Option<Arc<dyn KvEventSink>>,
    /// The blocks of kept whole sequences reported to `events` (caches
    /// without a block index).
    published: PublishedBlocks,
}

impl<'m, C, M> Engine<'m, C, M>
where
    C: CausalCache<Tensor = Tensor>,
    M: Model,
{
    /// An engine with `cache.config().max_sequences` slots.
    pub fn new(model: &'m M, cache: C, config: EngineConfig) -> Result<Self> {
        let slots = cache.config().max_sequences;
        if config.max_batch == 0 || config.prefill_chunk == 0 || config.block_tokens == Some(0) {
            return Err(EngineError::InvalidArgument(
                "max_batch, prefill_chunk and block_tokens must be positive".into(),
            ));
        }
        if config.max_batch > cache.config().max_batch {
            return Err(EngineError::InvalidArgument(format!(
                "engine batch {} exceeds the cache's max batch {}",
                config.max_batch,
                cache.config().max_batch
            )));
        }
        Ok(Engine {
            model,
            cache,
            config,
            queue: VecDeque::new(),
            slots: (0..slots).map(|_| None).collect(),
            idle: (0..slots).map(|_| None).collect(),
            store: None,
            restored_tokens: 0,
            stored_tokens: 0,
            store_errors: 0,
            store_refused: 0,
            reuse: ReuseStats::default(),
            reuse_prefixes: false,
            tokenizer: None,
            fingerprint: Fingerprint::default(),
            waiting: Vec::new(),
            block_tokens: BlockTokens::default(),
            published: PublishedBlocks::default(),
            events: None,
        })
    }

    /// Reuses prefixes through `store`, waiting at most `deadline` for a
    /// read. Its entries belong to the model of its
    /// [`fingerprint`](PrefixStore::fingerprint): the cache must carry the
    /// same one, or every import and every export is refused and counted
    /// ([`Stats::store_errors`]).
    pub fn set_store(&mut self, store: Arc<dyn PrefixStore>, deadline: Duration) {
        let client = StoreClient::new(store, deadline);
        self.fingerprint = client.fingerprint();
        self.store = Some(client);
    }

    /// Whether finished sequences are kept by block: prefix reuse on,
    /// [`EngineConfig::block_tokens`] set, and a cache that indexes blocks.
    pub fn keeps_blocks(&self) -> bool {
        self.reuse_prefixes && self.config.block_tokens.is_some() && self.cache.indexes_blocks()
    }

    /// Reports the blocks kept for reuse to `sink` as KV events in vLLM's
    /// schema ([`kvcache_api::events`]; `kvcache-events` publishes them over
    /// ZMQ for a cache-aware router such as NVIDIA Dynamo's), in full blocks
    /// of [`EngineConfig::block_tokens`] tokens: every block kept is
    /// `BlockStored` (with its tokens, its parent and its namespace), every
    /// one evicted, aged out or forgotten `BlockRemoved`; tails, shorter than
    /// a block, are kept but not reported (a router counts whole blocks).
    /// With a block index ([`keeps_blocks`](Self::keeps_blocks)) these are
    /// the index's blocks; otherwise (a cache that keeps finished requests
    /// as whole idle sequences, Gemma 3's) the full blocks of the idle
    /// sequences, a prefix two of them share reported once and removed with
    /// the last. Set it before the first request: blocks kept earlier are
    /// never reported.
    pub fn set_event_sink(&mut self, sink: Arc<dyn KvEventSink>) {
        self.events = Some(sink);
    }

    /// Blocks in the cache's index and the cells they keep.
    pub fn indexed_blocks(&self) -> (usize, usize) {
        self.cache.indexed_blocks()
    }

    /// The client the engine reads and writes its store through, if it has one.
    pub fn store_client(&self) -> Option<&StoreClient> {
        self.store.as_ref()
    }

    /// Keeps finished sequences' cells (when `on`) and starts new requests from
    /// the longest prefix any sequence of their namespace holds. Off by default.
    /// Turning it off drops the sequences kept so far.
    pub fn set_prefix_reuse(&mut self, on: bool) -> Result<()> {
        self.reuse_prefixes = on;
        if !on {
            self.evict_idle(Duration::ZERO)?;
            let gone = self.cache.clear_blocks();
            self.blocks_gone(&gone);
        }
        Ok(())
    }

    /// Turns generated tokens into text with `tokenizer`: the text of each
    /// [`Event::Token`], which requests' stop sequences ([`Request::stop`])
    /// are matched on.
    pub fn set_tokenizer(&mut self, tokenizer: Arc<dyn Tokenizer>) {
        self.tokenizer = Some(tokenizer);
    }

    /// Queues a greedy request; it joins when a slot is free.
    pub fn submit(&mut self, req: Request) -> Result<()> {
        self.submit_sampled(req, None)
    }

    /// Queues a request whose tokens `sampler` picks (`None`: greedy). Request
    /// ids must be unique among queued and running requests for
    /// [`Engine::cancel`] to name one.
    pub fn submit_sampled(&mut self, req: Request, sampler: Option<Sampler>) -> Result<()> {
        if req.prompt.is_empty() || req.max_new_tokens == 0 {
            return Err(EngineError::InvalidArgument(format!(
                "request {}: empty prompt or nothing to generate",
                req.id
            )));
        }
        if !req.stop.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::InvalidArgument(format!(
                "request {}: stop sequences need the engine's tokenizer (Engine::set_tokenizer)",
                req.id
            )));
        }
        if req.stop.iter().any(String::is_empty) {
            return Err(EngineError::InvalidArgument(format!(
                "request {}: an empty stop sequence",
                req.id
            )));
        }
        if let Some(ctx) = self.config.context {
            if req.prompt.len() + 1 > ctx || self.config.keep + 2 > ctx {
                return Err(EngineError::InvalidArgument(format!(
                    "request {}: prompt of {} tokens does not fit a context of {ctx}",
                    req.id,
                    req.prompt.len()
                )));
            }
        }
        self.queue.push_back(Queued {
            req,
            sampler,
            submitted: Instant::now(),
        });
        Ok(())
    }

    /// Drops request `id`, queued or running; a running one's cells are freed.
    /// Returns whether it was found.
    pub fn cancel(&mut self, id: usize) -> Result<bool> {
        if let Some(i) = self.queue.iter().position(|q| q.req.id == id) {
            self.queue.remove(i);
            self.waiting.retain(|&w| w != id);
            self.reuse.cancelled += 1;
            return Ok(true);
        }
        let Some(seq) = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.req.id == id))
        else {
            return Ok(false);
        };
        self.cache.remove(seq, PosRange::from(0..))?;
        self.slots[seq] = None;
        self.release_blocks_of(seq, 0);
        self.reuse.cancelled += 1;
        Ok(true)
    }

    /// The cache.
    pub fn cache(&self) -> &C {
        &self.cache
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Requests holding a slot.
    pub fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Tokens of the running request `id` in the cache so far: those taken
    /// from cached cells or imported from the prefix store when it joined
    /// ([`Event::Joined`] counts them), then those evaluated; `None` when it
    /// is not running.
    pub fn cached_tokens(&self, id: usize) -> Option<usize> {
        self.slots
            .iter()
            .flatten()
            .find(|s| s.req.id == id)
            .map(|s| s.cached)
    }

    /// Finished sequences kept for reuse.
    pub fn idle_sequences(&self) -> usize {
        self.idle.iter().filter(|s| s.is_some()).count()
    }

    /// Prefix reuse counters since the engine was made.
    pub fn reuse_stats(&self) -> ReuseStats {
        self.reuse
    }

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

    /// Runs until every queued request has finished.
    pub fn run(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<Stats> {
        let start = Instant::now();
        let mut stats = Stats::default();
        while self.step(&mut stats, on_event)? {}
        stats.elapsed = start.elapsed();
        stats.restored_tokens = std::mem::take(&mut self.restored_tokens);
        stats.stored_tokens = std::mem::take(&mut self.stored_tokens);
        stats.store_errors = std::mem::take(&mut self.store_errors);
        stats.store_refused = std::mem::take(&mut self.store_refused);
        Ok(stats)
    }

    /// Admits queued requests into free slots, then runs one forward pass over
    /// every running request (a decode token each, then prompt chunks).
    /// Returns `false`, having done nothing, when no request is running.
    pub fn step(&mut self, stats: &mut Stats, on_event: &mut dyn FnMut(&Event)) -> Result<bool> {
        self.admit(on_event)?;
        if self.slots.iter().all(Option::is_none) {
            return Ok(false);
        }
        stats.context_shifts += self.context_shifts(on_event)?;
        self.pass(stats, on_event)?;
        Ok(true)
    }

    /// Imports the stored run of `prompt` past `from` into `seq`, which holds
    /// exactly its first `from` tokens, leaving at least the last prompt token
    /// to evaluate. Returns the tokens imported and the tiers that served
    /// them; any failure imports nothing.
    fn restore(
        &mut self,
        seq: SeqId,
        namespace: &Namespace,
        prompt: &[u32],
        from: usize,
    ) -> (usize, Vec<(&'static str, usize)>) {
        if self.store.is_none() {
            return (0, Vec::new());
        }
        let started = Instant::now();
        let (restored, tiers) = self.restore_from_store(seq, namespace, prompt, from);
        self.reuse.store_restore_time += started.elapsed();
        if restored > 0 {
            self.reuse.store_restores += 1;
            self.reuse.store_restored_tokens += restored;
        }
        (restored, tiers)
    }

    /// [`restore`](Self::restore)'s work, untimed.
    fn restore_from_store(
        &mut self,
        seq: SeqId,
        namespace: &Namespace,
        prompt: &[u32],
        from: usize,
    ) -> (usize, Vec<(&'static str, usize)>) {
        let Some(client) = &self.store else {
            return (0, Vec::new());
        };
        let fetched = match client.restore(namespace, prompt, from) {
            Ok(Some(fetched)) => fetched,
            Ok(None) => return (0, Vec::new()),
            Err(error) => {
                tracing::warn!(%error, seq, "prefix store: answer refused, evaluating the whole prompt");
                self.store_errors += 1;
                return (0, Vec::new());
            }
        };
        let state = client.seq_state(fetched.kv);
        match self.cache.import_seq(seq, &state) {
            Ok(()) => {
                self.restored_tokens += state.kv.tokens();
                (state.kv.tokens(), fetched.tiers)
            }
            Err(error) => {
                tracing::warn!(%error, seq, "prefix store: import refused, evaluating the whole prompt");
                self.store_errors += 1;
                (0, Vec::new())
            }
        }
    }

    /// Writes back the part of the evaluated `prompt` of `seq` (or any run of
    /// its tokens from position 0) that the store lacks ([`StoreClient::write_back`]), exported as the store's model.
    fn store_prompt(&mut self, seq: SeqId, namespace: &Namespace, prompt: &[u32]) {
        let Some(client) = &self.store else { return };
        let cache = &self.cache;
        let wrote = client.write_back(namespace, prompt, |range| {
            let state = cache.export_seq(seq, range.start as Pos..range.end as Pos)?;
            if state.fingerprint != client.fingerprint() {
                return Err(CacheError::LayoutMismatch {
                    what: "model",
                    expected: client.fingerprint().to_hex(),
                    got: state.fingerprint.to_hex(),
                });
            }
            Ok(state.kv)
        });
        match wrote {
            Ok(WriteBack::Held) => {}
            Ok(WriteBack::Sent {
                range,
                outcome: Submitted::Queued,
            }) => self.stored_tokens += range.len(),
            Ok(WriteBack::Sent { outcome, .. }) => {
                tracing::debug!(?outcome, seq, "prefix store: prompt not stored");
                self.store_refused += 1;
            }
            Err(error) => {
                tracing::warn!(%error, seq, "prefix store: export failed, prompt not stored");
                self.store_errors += 1;
            }
        }
    }

    /// Drops the idle sequence kept at `seq`, freeing its cells.
    fn drop_idle(&mut self, seq: SeqId) -> Result<()> {
        self.cache.remove(seq, PosRange::from(0..))?;
        self.idle[seq] = None;
        self.release_blocks_of(seq, 0);
        self.reuse.evictions += 1;
        Ok(())
    }

    /// Evicts indexed blocks until `cells` cells are free; whether any was.
    fn evict_blocks(&mut self, cells: usize) -> bool {
        let evicted = self.cache.evict_blocks(cells);
        self.reuse.blocks_evicted += evicted.len();
        let any = !evicted.is_empty();
        self.blocks_gone(&evicted);
        any
    }

    /// Forgets the tokens of blocks the cache no longer keeps, reporting the
    /// full ones removed.
    fn blocks_gone(&mut self, keys: &[BlockKey]) {
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
    fn hold_blocks_of(&mut self, seq: SeqId, namespace: &Namespace, tokens: &[u32]) {
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
    fn release_blocks_of(&mut self, seq: SeqId, tokens: usize) {
        let keep = self.config.block_tokens.map_or(0, |block| tokens / block);
        let events = self.published.release(seq, keep);
        if let (Some(sink), false) = (&self.events, events.is_empty()) {
            sink.publish(events);
        }
    }

    /// Reports the full blocks among `new` (indices into `chain`, which
    /// covers `tokens` from position 0) as stored.
    fn blocks_stored(
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
    fn evict_lru(&mut self) -> Result<bool> {
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
    fn longest_prefix(&self, namespace: &Namespace, prompt: &[u32]) -> Option<(SeqId, usize)> {
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
    fn free_seq(&mut self, prefer: Option<SeqId>) -> Result<Option<SeqId>> {
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
    /// a request waiting for a running request's prefix lets later ones by.
    fn admit(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let mut i = 0;
        while i < self.queue.len() {
            let (namespace, prompt) = (
                self.queue[i].req.namespace.clone(),
                self.queue[i].req.prompt.clone(),
            );
            let start = if self.keeps_blocks() {
                self.start_by_blocks(i, &namespace, &prompt)?
            } else {
                self.start_by_sequences(&namespace, &prompt)?
            };
            let (seq, reused) = match start {
                Start::Join { seq, reused } => (seq, reused),
                Start::Wait => {
                    i += 1;
                    continue;
                }
                Start::NoRoom => break,
            };
            let Queued {
                req,
                sampler,
                submitted,
            } = self.queue.remove(i).expect("a queued request");
            self.waiting.retain(|&id| id != req.id);
            if self.reuse_prefixes {
                if reused > 0 {
                    self.reuse.hits += 1;
                } else {
                    self.reuse.misses += 1;
                }
                self.reuse.reused_tokens += reused;
            }
            // The longer of what memory and the store hold: the store's run
            // past what the cache gave.
            let (restored, restored_from) = self.restore(seq, &namespace, &prompt, reused);
            on_event(&Event::Joined {
                id: req.id,
                seq,
                prompt_tokens: req.prompt.len(),
                waited: submitted.elapsed(),
                reused,
                restored,
                restored_from,
            });
            let text = self
                .tokenizer
                .as_ref()
                .map(|t| Detokenizer::new(t.clone(), req.stop.clone()));
            self.slots[seq] = Some(Slot {
                tokens: req.prompt.clone(),
                req,
                cached: reused + restored,
                generated: Vec::new(),
                joined: Instant::now(),
                first_token: None,
                shifts: 0,
                restored,
                reused,
                sampler,
                text,
            });
        }
        Ok(())
    }

    /// Starts a request on idle sequences: the sequence holding the longest
    /// prefix is continued in place (a request extending a finished one's
    /// whole prompt: the next turn of a conversation, whose finished turn's
    /// cells are then not kept twice) or shared by copy-prefix.
    fn start_by_sequences(&mut self, namespace: &Namespace, prompt: &[u32]) -> Result<Start> {
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
    fn start_by_blocks(&mut self, i: usize, namespace: &Namespace, prompt: &[u32]) -> Result<Start> {
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
    fn retain(
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

    fn context_shifts(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<usize> {
        let Some(ctx) = self.config.context else {
            return Ok(0);
        };
        let mut n = 0;
        let mut dropped = Vec::new();
        let mut shifted = Vec::new();
        for (seq, slot) in self.slots.iter_mut().enumerate() {
            let Some(s) = slot else { continue };
            // Only decoding sequences (one pending token) reach the limit.
            if s.cached < s.tokens.len() - 1 || s.cached < ctx {
                continue;
            }
            let keep = self.config.keep.min(s.cached);
            let discard = (s.cached - keep) / 2;
            if discard == 0 {
                continue;
            }
            let removed = keep as Pos..(keep + discard) as Pos;
            self.cache.remove(seq, PosRange::from(removed.clone()))?;
            // Blocks whose cells the shift moved are no longer what their keys say.
            dropped.extend(self.cache.take_dropped_blocks());
            s.tokens.drain(keep..keep + discard);
            s.cached -= discard;
            s.shifts += 1;
            shifted.push((seq, keep));
            n += 1;
            on_event(&Event::ContextShift {
                id: s.req.id,
                seq,
                removed,
            });
        }
        self.blocks_gone(&dropped);
        for (seq, keep) in shifted {
            self.release_blocks_of(seq, keep);
        }
        Ok(n)
    }

    /// Runs `batch`, dropping idle sequences while the cache is too full for it.
    fn hidden_making_room(&mut self, batch: &[BatchToken]) -> Result<Tensor> {
        loop {
            match self.model.hidden(batch, &mut self.cache) {
                Err(ModelError::Cache(CacheError::Full { .. })) if self.evict_blocks(batch.len()) => continue,
                Err(ModelError::Cache(CacheError::Full { .. })) if self.evict_lru()? => continue,
                result => return Ok(result?),
            }
        }
    }

    fn pass(&mut self, stats: &mut Stats, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let budget = self.config.max_batch;
        let mut batch = Vec::new();
        // (slot, tokens in this pass, row of its last token if it needs logits)
        let mut plan: Vec<(SeqId, usize, Option<usize>)> = Vec::new();
        let mut decode = 0;
        // Decode steps first: one pending token each.
        for (seq, slot) in self.slots.iter().enumerate() {
            if batch.len() == budget {
                break;
            }
            let Some(s) = slot else { continue };
            if s.cached + 1 == s.tokens.len() && !s.generated.is_empty() {
                batch.push(BatchToken {
                    seq,
                    pos: s.cached as Pos,
                    token: s.tokens[s.cached],
                });
                plan.push((seq, 1, Some(batch.len() - 1)));
                decode += 1;
            }
        }
        // Then prompt chunks in the room left, the longest-waiting request
        // first: a new request's wait is bounded by the prompts before it,
        // and decode steps never wait for a prompt.
        let mut prefilling: Vec<(Instant, SeqId)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(seq, s)| {
                s.as_ref()
                    .filter(|s| s.generated.is_empty())
                    .map(|s| (s.joined, seq))
            })
            .collect();
        prefilling.sort_unstable();
        for (_, seq) in prefilling {
            let room = budget - batch.len();
            if room == 0 {
                break;
            }
            let s = self.slots[seq].as_ref().expect("a prefilling slot");
            let n = (s.tokens.len() - s.cached)
                .min(self.config.prefill_chunk)
                .min(room);
            for i in 0..n {
                let p = s.cached + i;
                batch.push(BatchToken {
                    seq,
                    pos: p as Pos,
                    token: s.tokens[p],
                });
            }
            let completes = s.cached + n == s.tokens.len();
            plan.push((seq, n, completes.then(|| batch.len() - 1)));
        }
        let prefill = batch.len() - decode;
        let t0 = Instant::now();
        let hidden = self.hidden_making_room(&batch)?;
        let rows: Vec<u32> = plan.iter().filter_map(|p| p.2).map(|r| r as u32).collect();
        let logits = if rows.is_empty() {
            Vec::new()
        } else {
            let idx = Tensor::from_vec(rows.clone(), rows.len(), hidden.device())?;
            self.model
                .logits(&hidden.index_select(&idx, 0)?)?
                .to_vec2::<f32>()?
        };
        let elapsed = t0.elapsed();
        stats.passes += 1;
        stats.prefill_tokens += prefill;
        stats.decode_tokens += decode;
        self.reuse.evaluated_tokens += prefill;
        if prefill == 0 {
            stats.decode_time += elapsed;
        }
        on_event(&Event::Pass {
            decode,
            prefill,
            elapsed,
        });
        let mut logits = logits.iter();
        for (seq, n, row) in plan {
            let slot = self.slots[seq].as_mut().expect("planned slots are live");
            slot.cached += n;
            if row.is_none() {
                on_event(&Event::Prefilled {
                    id: slot.req.id,
                    done: slot.cached,
                    total: slot.req.prompt.len(),
                });
                continue;
            }
            let first = slot.generated.is_empty();
            if first {
                on_event(&Event::Prefilled {
                    id: slot.req.id,
                    done: slot.cached,
                    total: slot.req.prompt.len(),
                });
            }
            let row = logits.next().expect("one row of logits per pick");
            let (token, logprobs) = match slot.sampler.as_mut() {
                Some(sampler) => (sampler.sample(row), sampler.take_logprobs()),
                None => (argmax(row), None),
            };
            slot.first_token.get_or_insert_with(|| slot.joined.elapsed());
            slot.generated.push(token);
            slot.tokens.push(token);
            stats.generated_tokens += 1;
            let stop_token = self.config.stop_tokens.contains(&token);
            let length = slot.generated.len() == slot.req.max_new_tokens;
            let shown = match slot.text.as_mut() {
                Some(text) => text.token(token, stop_token, length, logprobs),
                None => Ok(Shown::untold(logprobs)),
            };
            let Shown { text, stop, logprobs } = match shown {
                Ok(shown) => shown,
                Err(error) => {
                    self.fail(seq, error, on_event)?;
                    continue;
                }
            };
            on_event(&Event::Token {
                id: slot.req.id,
                token,
                text,
                logprobs,
            });
            if first && self.store.is_some() {
                // The prompt is evaluated and its first token chosen: the
                // cache holds exactly the prompt, share it (before the request
                // may end and free its cells).
                let (namespace, prompt) = (slot.req.namespace.clone(), slot.req.prompt.clone());
                self.store_prompt(seq, &namespace, &prompt);
            }
            let reason = if stop_token {
                Some(FinishReason::StopToken)
            } else if let Some(i) = stop {
                Some(FinishReason::StopSequence(i))
            } else if length {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                self.finish(seq, reason, on_event)?;
            }
        }
        Ok(())
    }

    /// Drops the request in `seq`, whose text could not be decoded, freeing
    /// its cells, and says so.
    fn fail(&mut self, seq: SeqId, error: DecodeError, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let s = self.slots[seq].take().expect("live");
        tracing::warn!(%error, id = s.req.id, "a request's text could not be decoded: dropped");
        self.cache.remove(seq, PosRange::from(0..))?;
        self.release_blocks_of(seq, 0);
        on_event(&Event::Failed { id: s.req.id, error });
        Ok(())
    }

    /// Ends the request in `seq`: its cells are kept for reuse (when enabled and
    /// never shifted) or freed.
    fn finish(&mut self, seq: SeqId, reason: FinishReason, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let mut s = self.slots[seq].take().expect("live");
        if self.keeps_blocks() && s.shifts == 0 {
            if self.store.is_some() {
                // What the cache keeps is in the store too (its memory tier
                // first), so a block evicted later costs a fetch, not a
                // recompute: the prompt went at its first token, now the rest.
                self.store_prompt(seq, &s.req.namespace, &s.tokens[..s.cached]);
            }
            self.retain(seq, &s.req.namespace, &s.tokens[..s.cached])?;
        } else if self.reuse_prefixes && s.shifts == 0 {
            s.tokens.truncate(s.cached);
            self.hold_blocks_of(seq, &s.req.namespace, &s.tokens);
            self.idle[seq] = Some(Idle {
                namespace: s.req.namespace.clone(),
                prompt_len: s.req.prompt.len().min(s.tokens.len()),
                tokens: s.tokens,
                last_used: Instant::now(),
            });
        } else {
            self.cache.remove(seq, PosRange::from(0..))?;
            self.release_blocks_of(seq, 0);
        }
        on_event(&Event::Finished(Finished {
            id: s.req.id,
            seq,
            prompt_tokens: s.req.prompt.len(),
            generated: s.generated,
            time_to_first_token: s.first_token.unwrap_or_default(),
            total: s.joined.elapsed(),
            context_shifts: s.shifts,
            restored: s.restored,
            reused: s.reused,
            reason,
        }));
        Ok(())
    }
}

/// Length of the longest common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
