//! Greedy generation through a [`CausalCache`], and a continuous-batching engine:
//! requests join free sequence slots as others finish, prompts prefill in chunks
//! beside other sequences' decode steps, and a sequence that fills its context
//! drops half of its middle (a shifting removal, llama.cpp's context shift).
//!
//! With a [`PrefixStore`] ([`Engine::set_store`]) requests reuse prefixes across
//! requests, processes and replicas, through the same [`StoreClient`] as the
//! prefix trie: a joining request imports the longest stored prefix of its
//! prompt into its sequence ([`CausalCache::import_parts`], as the store's
//! model) and evaluates only the rest; once its prompt is evaluated and its
//! first token chosen, the part the store lacks is exported
//! ([`CausalCache::export_part`]) and written behind the engine's back. A
//! cache whose layers keep different spans (Gemma 3's global and window
//! layers) has one store per part ([`Engine::set_store_parts`],
//! [`StoreParts`]): the window layers store and restore the tail before a
//! prompt's end, so a prompt restores as far as every part serves it.
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
//! evicted least recently used first when a pass needs their cells. A
//! [`LayerGroupCache`](kvcache_causal::LayerGroupCache) with window groups
//! (Gemma 3) keeps blocks per group, and its longest prefix is one every
//! group can resume at: the engine drives it as any other.
//!
//! The engine is a module per job: [`Engine`] here (submit, cancel, step),
//! `scheduler` (what a pass evaluates, as a `Plan`), `store_io` (the prefix
//! store's reads, write-backs and counters), `retention` (what is kept of
//! finished requests and where a new one starts, one trait with a policy per
//! way of keeping), the request's types and the statistics beside them,
//! `picks` (a pass's logits brought to the host as sampling needs them: on a
//! GPU greedy picks are made there) and `greedy` (one sequence decoded without
//! the engine, the reference).

mod greedy;
mod picks;
mod request;
mod retention;
mod scheduler;
mod stats;
mod store_io;

pub use greedy::greedy;
pub use request::{Event, FinishReason, Finished, Request};
pub use stats::{ReuseStats, Stats};

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use kvcache_api::events::{EventBatch, KvEventSink, Medium};
use kvcache_api::retention::BlockChange;
use kvcache_api::{
    CacheError, CausalCache, Fingerprint, PosRange, PrefixStore, SeqId, StoreClient, StoreParts,
};

use kvcache_models::{argmax, BatchToken, Llama, Model, ModelError, Tokenizer};

use crate::detokenizer::{DecodeError, Detokenizer, Shown};
use crate::sampling::Sampler;
use crate::{EngineError, Result};

use picks::Pick;
use retention::{Blocks, Cx, Ended, IdleSequences, Nothing, Retention, Start};
use scheduler::Plan;
use store_io::StoreIo;

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
    /// Where its prompt parts from kept prefixes it could not resume, to
    /// keep once evaluated ([`Start::Join`]).
    junction: Option<usize>,
    /// Picks the request's tokens; `None` is greedy.
    sampler: Option<Sampler>,
    /// The answer's text, with the engine's tokenizer.
    text: Option<Detokenizer>,
}

/// A queued request and its token picker.
#[derive(Debug)]
struct Queued {
    req: Request,
    sampler: Option<Sampler>,
    submitted: Instant,
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
    /// What is kept of finished requests, and where new ones start.
    retention: Box<dyn Retention<C>>,
    /// The prefix store, if any, and its counters.
    store: StoreIo,
    /// The passes' counters since the engine was made (the store's are
    /// `store`'s).
    stats: Stats,
    /// When the engine was made.
    made: Instant,
    reuse: ReuseStats,
    reuse_prefixes: bool,
    /// Turns generated tokens into the answers' text.
    tokenizer: Option<Arc<dyn Tokenizer>>,
    /// The model blocks are keyed under (the store's, once one is set).
    fingerprint: Fingerprint,
    /// Ids of queued requests already counted as waiting for a prefix.
    waiting: Vec<usize>,
    /// Where what is kept is reported, if anywhere.
    events: Option<Arc<dyn KvEventSink>>,
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
            retention: Box::new(Nothing),
            store: StoreIo::default(),
            stats: Stats::default(),
            made: Instant::now(),
            reuse: ReuseStats::default(),
            reuse_prefixes: false,
            tokenizer: None,
            fingerprint: Fingerprint::default(),
            waiting: Vec::new(),
            events: None,
        })
    }

    /// Reuses prefixes through `store`, waiting at most `deadline` for a
    /// read. Its entries belong to the model of its
    /// [`fingerprint`](PrefixStore::fingerprint): the cache must carry the
    /// same one, or every import and every export is refused and counted
    /// ([`Stats::store_errors`]).
    pub fn set_store(&mut self, store: Arc<dyn PrefixStore>, deadline: Duration) {
        let parts = StoreParts::whole(StoreClient::new(store, deadline));
        self.fingerprint = parts.model();
        self.store.set_parts(parts);
    }

    /// Reuses prefixes through one store per part of the cache
    /// ([`CausalCache::store_parts`]: a sliding-window model's global and
    /// window layers), as [`set_store`](Self::set_store) does through one.
    /// Blocks are keyed under the parts' model.
    ///
    /// # Errors
    /// [`EngineError::InvalidArgument`] when `parts` are not the cache's
    /// parts, in order: nothing changes then.
    pub fn set_store_parts(&mut self, parts: StoreParts) -> Result<()> {
        let want = self.cache.store_parts();
        if parts.layout() != want {
            return Err(EngineError::InvalidArgument(format!(
                "store parts {:?} for a cache of parts {want:?}",
                parts.layout()
            )));
        }
        self.fingerprint = parts.model();
        self.store.set_parts(parts);
        Ok(())
    }

    /// Whether finished sequences are kept by block: prefix reuse on,
    /// [`EngineConfig::block_tokens`] set, and a cache that indexes blocks.
    pub fn keeps_blocks(&self) -> bool {
        self.retention.keeps_blocks()
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

    /// The client the engine reads and writes its store through, if it has
    /// one (with store parts, the first part's without a window).
    pub fn store_client(&self) -> Option<&StoreClient> {
        self.store.client()
    }

    /// The stores the engine reads and writes, one per part of the cache,
    /// if it has them.
    pub fn store_parts(&self) -> Option<&StoreParts> {
        self.store.parts()
    }

    /// Keeps finished sequences' cells (when `on`) and starts new requests from
    /// the longest prefix any sequence of their namespace holds. Off by default.
    /// Turning it off drops the sequences kept so far.
    pub fn set_prefix_reuse(&mut self, on: bool) -> Result<()> {
        if on == self.reuse_prefixes {
            return Ok(());
        }
        // What the policy kept goes with it.
        self.evict_idle(Duration::ZERO)?;
        self.cache.clear_blocks();
        self.retention = match (on, self.config.block_tokens) {
            (false, _) => Box::new(Nothing),
            (true, Some(block)) if self.cache.indexes_blocks() => Box::new(Blocks::new(block)),
            (true, _) => Box::new(IdleSequences::new(self.slots.len())),
        };
        self.reuse_prefixes = on;
        self.publish(None);
        Ok(())
    }

    /// Drops the sequences and blocks kept for reuse that have not been used
    /// for `age`; returns how many.
    pub fn evict_idle(&mut self, age: Duration) -> Result<usize> {
        self.with_retention(|policy, cx| policy.age(cx, age))
    }

    /// Runs `f` on the retention policy, then reports what it and the
    /// cache's block index changed.
    fn with_retention<T>(
        &mut self,
        f: impl FnOnce(&mut dyn Retention<C>, &mut Cx<'_, C>) -> Result<T>,
    ) -> Result<T> {
        let mut events = self.event_batch();
        let mut cx = Cx {
            cache: &mut self.cache,
            slots: &self.slots,
            fingerprint: &self.fingerprint,
            block_tokens: self.config.block_tokens,
            events: events.as_mut(),
            reuse: &mut self.reuse,
        };
        let result = f(self.retention.as_mut(), &mut cx);
        self.publish(events);
        result
    }

    /// An empty batch for the events of one operation, when a sink wants them.
    fn event_batch(&self) -> Option<EventBatch> {
        match (&self.events, self.config.block_tokens) {
            (Some(_), Some(block)) => Some(EventBatch::new(block, Medium::Device)),
            _ => None,
        }
    }

    /// Drains the block index's journal (counting what left it) and hands
    /// it, after `events`, to the sink if there is one.
    fn publish(&mut self, events: Option<EventBatch>) {
        let changes = self.cache.drain_block_changes();
        self.reuse.blocks_evicted += changes
            .iter()
            .filter(|c| matches!(c, BlockChange::Removed { .. }))
            .count();
        let Some(sink) = &self.events else { return };
        let Some(mut batch) = events.or_else(|| self.event_batch()) else {
            return;
        };
        batch.block_changes(&changes);
        batch.publish(sink.as_ref());
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
        if req.min_tokens > req.max_new_tokens {
            return Err(EngineError::InvalidArgument(format!(
                "request {}: min_tokens {} exceeds max_new_tokens {}",
                req.id, req.min_tokens, req.max_new_tokens
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
        self.with_retention(|policy, cx| {
            policy.release(cx, seq, 0);
            Ok(())
        })?;
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
        self.retention.idle_sequences()
    }

    /// Prefix reuse counters since the engine was made.
    pub fn reuse_stats(&self) -> ReuseStats {
        let store = self.store.counters();
        ReuseStats {
            store_restores: store.restores as usize,
            store_restored_tokens: store.restored_tokens as usize,
            store_restore_time: store.restore_time,
            ..self.reuse
        }
    }

    /// The totals of every pass since the engine was made
    /// ([`Stats::elapsed`]: the time since then).
    pub fn stats(&self) -> Stats {
        let store = self.store.counters();
        Stats {
            elapsed: self.made.elapsed(),
            restored_tokens: store.restored_tokens as usize,
            stored_tokens: store.written_tokens as usize,
            store_errors: (store.rejected + store.write_errors) as usize,
            store_refused: store.refused as usize,
            ..self.stats
        }
    }

    /// Runs until every queued request has finished; returns the totals of
    /// this run.
    pub fn run(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<Stats> {
        let start = Instant::now();
        let before = self.stats();
        while self.step(on_event)? {}
        Ok(Stats {
            elapsed: start.elapsed(),
            ..self.stats().since(&before)
        })
    }

    /// Admits queued requests into free slots, then runs one forward pass over
    /// every running request (a decode token each, then prompt chunks).
    /// Returns `false`, having done nothing, when no request is running.
    /// The engine counts what it did ([`Engine::stats`]).
    pub fn step(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<bool> {
        self.admit(on_event)?;
        if self.slots.iter().all(Option::is_none) {
            return Ok(false);
        }
        self.stats.context_shifts += self.context_shifts(on_event)?;
        self.pass(on_event)?;
        Ok(true)
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
            let start = self.with_retention(|policy, cx| policy.start(cx, &namespace, &prompt))?;
            let (seq, reused, junction) = match start {
                Start::Join {
                    seq,
                    reused,
                    junction,
                } => (seq, reused, junction),
                Start::Wait => {
                    let id = self.queue[i].req.id;
                    if !self.waiting.contains(&id) {
                        self.waiting.push(id);
                        self.reuse.waited_for_prefix += 1;
                    }
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
            let (restored, restored_from) =
                self.store
                    .restore(&mut self.cache, seq, &namespace, &prompt, reused);
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
                .map(|t| Detokenizer::new(t.clone(), req.stop.clone()).matching_from(req.min_tokens));
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
                junction: junction.filter(|&j| j > reused + restored),
                sampler,
                text,
            });
        }
        Ok(())
    }

    /// Runs one forward pass over what the scheduler planned and picks the
    /// next token of every sequence whose pick row it reached.
    fn pass(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let plan = Plan::schedule(&self.slots, self.config.max_batch, self.config.prefill_chunk);
        let (decode, prefill) = (plan.decode, plan.prefill());
        let t0 = Instant::now();
        let hidden = self.hidden_making_room(&plan.batch)?;
        // The pass may have evicted kept blocks for its cells.
        self.publish(None);
        let rows = plan.pick_rows();
        let picks = if rows.is_empty() {
            Vec::new()
        } else {
            // Rows a sampler or `min_tokens` reads whole; greedy ones need an id.
            let whole: Vec<bool> = plan
                .parts
                .iter()
                .filter(|part| part.pick_row.is_some())
                .map(|part| {
                    let slot = self.slots[part.seq].as_ref().expect("planned slots are live");
                    slot.sampler.is_some() || slot.generated.len() < slot.req.min_tokens
                })
                .collect();
            let n = rows.len();
            let idx = Tensor::from_vec(rows, n, hidden.device())?;
            picks::fetch(&self.model.logits(&hidden.index_select(&idx, 0)?)?, &whole)?
        };
        let elapsed = t0.elapsed();
        self.stats.passes += 1;
        self.stats.prefill_tokens += prefill;
        self.stats.decode_tokens += decode;
        self.reuse.evaluated_tokens += prefill;
        if prefill == 0 {
            self.stats.decode_time += elapsed;
        }
        on_event(&Event::Pass {
            decode,
            prefill,
            elapsed,
        });
        let mut picks = picks.into_iter();
        for part in plan.parts {
            let seq = part.seq;
            let slot = self.slots[seq].as_mut().expect("planned slots are live");
            slot.cached += part.tokens;
            // Kept once the sequence holds more than the junction, so the
            // cache sees a prefix of a sequence that goes on.
            if let Some(j) = slot.junction.filter(|&j| slot.cached > j) {
                slot.junction = None;
                let (namespace, prefix) = (slot.req.namespace.clone(), slot.tokens[..j].to_vec());
                self.with_retention(|policy, cx| {
                    policy.keep_prefix(cx, seq, &namespace, &prefix);
                    Ok(())
                })?;
            }
            let slot = self.slots[seq].as_mut().expect("planned slots are live");
            if part.pick_row.is_none() {
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
            let (token, logprobs) = match picks.next().expect("one pick per pick row") {
                Pick::Token(token) => (token, None),
                Pick::Row(row) => {
                    // Before `min_tokens`, what would end the request cannot be picked.
                    let held = slot
                        .req
                        .hold_back_end(slot.generated.len(), &row, &self.config.stop_tokens);
                    let row = held.as_deref().unwrap_or(row.as_slice());
                    match slot.sampler.as_mut() {
                        Some(sampler) => (sampler.sample(row), sampler.take_logprobs()),
                        None => (argmax(row), None),
                    }
                }
            };
            slot.first_token.get_or_insert_with(|| slot.joined.elapsed());
            slot.generated.push(token);
            slot.tokens.push(token);
            self.stats.generated_tokens += 1;
            let stop_token = slot.req.ends_on(token, &self.config.stop_tokens)
                && slot.generated.len() > slot.req.min_tokens;
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
            if first && self.store.is_set() {
                // The prompt is evaluated and its first token chosen: the
                // cache holds exactly the prompt, share it (before the request
                // may end and free its cells).
                let (namespace, prompt) = (slot.req.namespace.clone(), slot.req.prompt.clone());
                self.store.write_back(&self.cache, seq, &namespace, &prompt);
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

    /// Runs `batch`, letting the retention policy free what it keeps while
    /// the cache is too full for it (a block index makes room by itself).
    fn hidden_making_room(&mut self, batch: &[BatchToken]) -> Result<Tensor> {
        loop {
            match self.model.hidden(batch, &mut self.cache) {
                Err(ModelError::Cache(CacheError::Full { .. }))
                    if self.with_retention(|policy, cx| policy.make_room(cx))? =>
                {
                    continue
                }
                result => return Ok(result?),
            }
        }
    }

    /// Drops the request in `seq`, whose text could not be decoded, freeing
    /// its cells, and says so.
    fn fail(&mut self, seq: SeqId, error: DecodeError, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let s = self.slots[seq].take().expect("live");
        tracing::warn!(%error, id = s.req.id, "a request's text could not be decoded: dropped");
        self.cache.remove(seq, PosRange::from(0..))?;
        self.with_retention(|policy, cx| {
            policy.release(cx, seq, 0);
            Ok(())
        })?;
        on_event(&Event::Failed { id: s.req.id, error });
        Ok(())
    }

    /// Ends the request in `seq`: its retention policy keeps what it keeps of
    /// its cells and frees the rest.
    fn finish(&mut self, seq: SeqId, reason: FinishReason, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let s = self.slots[seq].take().expect("live");
        let ended = Ended {
            namespace: &s.req.namespace,
            tokens: &s.tokens[..s.cached],
            prompt_len: s.req.prompt.len(),
            shifted: s.shifts > 0,
        };
        if self.retention.keeps_blocks() && !ended.shifted && self.store.is_set() {
            // What the cache keeps is in the store too (its memory tier
            // first), so a block evicted later costs a fetch, not a
            // recompute: the prompt went at its first token, now the rest.
            self.store
                .write_back(&self.cache, seq, ended.namespace, ended.tokens);
        }
        self.with_retention(|policy, cx| policy.finish(cx, seq, ended))?;
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
