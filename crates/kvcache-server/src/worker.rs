//! The engine thread: one thread owns the model and the causal cache and runs
//! continuous batching over every request in flight.
//!
//! Requests arrive over a channel ([`Worker::submit`]) and join between
//! forward passes; each pass decodes one token for every running request.
//! The engine's events go back over the request's own channel as they come:
//! its reuse counts when it joins, each token's text and log-probabilities
//! (the engine owns the answer's text: stop sequences cut, control tokens
//! left out), its end. The engine decides how a request ends (a stop token,
//! a stop sequence, `max_tokens`) and says why;
//! a request whose receiver is gone (its client disconnected) is cancelled
//! and its cells freed before the next pass. Finished sequences stay in the
//! cache for prefix reuse within their namespace (the cache salt) and age out
//! after the configured idle time, or sooner when their slot or cells are
//! needed.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvcache_api::{CausalCache, CausalConfig, Fingerprint, Namespace, PrefixStore, StorePart, StoreParts};
use kvcache_engine::engine::{Engine, EngineConfig, Event, FinishReason, Request, ReuseStats};
use kvcache_engine::sampling::{Sampler, TokenLogprobs};
use kvcache_engine::{store, EngineError};
use kvcache_events::{ZmqPublisher, ZmqPublisherConfig};
use kvcache_models::loader::{Loaded, LoadedModel};
use kvcache_models::{CellUse, Model, Tokenizer};
use kvcache_store::{StoreConfig, StoreStats, TieredStore};
use tokio::sync::mpsc;

use crate::config::ServerConfig;

/// What a request's channel receives.
#[derive(Debug, Clone, PartialEq)]
pub enum JobEvent {
    /// The request holds a sequence now.
    Started {
        /// Prompt tokens not evaluated: taken from cached cells or imported
        /// from the prefix store.
        cached_tokens: usize,
        /// How long it waited in the engine's queue for a sequence.
        waited: Duration,
    },
    /// A generated token.
    Token {
        /// The text it adds to the answer (see [`Event::Token`]).
        text: String,
        /// Its log-probabilities, when the request asked for them (never for
        /// a token the text leaves out).
        logprobs: Option<TokenLogprobs>,
    },
    /// The request finished on its own (a stop token, a stop sequence or
    /// `max_tokens`).
    Finished {
        /// Why the engine ended it.
        reason: FinishReason,
    },
    /// The engine failed; the message says why.
    Failed(String),
}

/// One generation request for the engine thread.
#[derive(Debug)]
pub struct Job {
    /// Prompt token ids (non-empty, shorter than the context).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// The tenant's namespace: prefixes are reused within it only.
    pub namespace: Namespace,
    /// Texts that end the request (OpenAI's `stop`).
    pub stop: Vec<String>,
    /// Generate past the end-of-turn tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Tokens generated before a stop may end the request (vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// More tokens that end the request (vLLM's `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Picks the tokens.
    pub sampler: Sampler,
    /// Where the tokens go.
    pub events: mpsc::UnboundedSender<JobEvent>,
}

/// The engine's state as last seen after a pass, for `/metrics` and `/health`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Cells held by at least one sequence.
    pub cells_in_use: usize,
    /// Cells the cache has.
    pub cells_total: usize,
    /// Bytes of keys and values the cells in use hold.
    pub bytes_in_use: usize,
    /// Requests holding a sequence.
    pub active: usize,
    /// Requests waiting for a sequence inside the engine.
    pub queued: usize,
    /// Finished sequences kept for reuse.
    pub idle: usize,
    /// Blocks kept for reuse and the cells they keep.
    pub blocks: (usize, usize),
    /// Prefix reuse counters.
    pub reuse: ReuseStats,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Forward passes run.
    pub passes: usize,
}

enum Command {
    Submit(usize, Job),
}

/// A handle on the engine thread; cloning shares it.
#[derive(Debug, Clone)]
pub struct Worker {
    commands: std_mpsc::Sender<CommandBox>,
    next_id: Arc<AtomicUsize>,
    gauges: Arc<Mutex<Gauges>>,
    /// One store per part of the cache (none without a store).
    store: Vec<Arc<TieredStore>>,
    /// True while the engine thread runs; false once it has returned or panicked.
    running: Arc<AtomicBool>,
}

/// Clears the flag it holds when dropped: at the end of the engine thread,
/// however it ends (a panic unwinds through it too).
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
        tracing::error!("the engine thread has ended: /health answers 503, requests fail");
    }
}

/// `Command` behind a newtype so that `Worker` can derive `Debug`.
struct CommandBox(Command);

impl std::fmt::Debug for CommandBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Command")
    }
}

impl Worker {
    /// Starts the engine loop over `loaded` (the loader's model, on the
    /// device and with the weights the caller chose) on a new thread; returns
    /// once the engine is ready. The model's tokenizer ends a request at its
    /// end-of-turn tokens, and the engine turns the tokens into the answers'
    /// text with it.
    pub fn start(loaded: Loaded, config: &ServerConfig) -> kvcache_engine::Result<Worker> {
        let (tx, rx) = std_mpsc::channel::<CommandBox>();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let gauges = Arc::new(Mutex::new(Gauges::default()));
        let thread_gauges = gauges.clone();
        let config = config.clone();
        let running = Arc::new(AtomicBool::new(true));
        let guard = Running(running.clone());
        // The store's entries belong to this model file and weight mode only.
        let fingerprint = if config.store.dir.is_none() && config.store.redis.is_none() {
            None
        } else {
            Some(loaded.fingerprint()?)
        };
        let tokenizer = loaded.tokenizer();
        std::thread::Builder::new()
            .name("kvcache-engine".into())
            .spawn(move || {
                let _running = guard;
                let setup = EngineSetup {
                    config: &config,
                    tokenizer,
                    commands: rx,
                    gauges: &thread_gauges,
                    ready: ready_tx,
                };
                match loaded.model {
                    LoadedModel::Llama { model, .. } => setup.run(model, fingerprint),
                    LoadedModel::Gemma { model, .. } => setup.run(model, fingerprint),
                }
            })
            .map_err(|e| kvcache_engine::EngineError::io("kvcache-engine thread", e))?;
        let store = ready_rx.recv().unwrap_or_else(|_| {
            Err(kvcache_engine::EngineError::InvalidArgument(
                "engine thread died".into(),
            ))
        })?;
        Ok(Worker {
            commands: tx,
            next_id: Arc::new(AtomicUsize::new(0)),
            gauges,
            store,
            running,
        })
    }

    /// A handle whose engine thread has already ended (for tests of what the
    /// server answers then).
    #[doc(hidden)]
    pub fn stopped() -> Worker {
        let (tx, _) = std_mpsc::channel::<CommandBox>();
        Worker {
            commands: tx,
            next_id: Arc::default(),
            gauges: Arc::default(),
            store: Vec::new(),
            running: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether the engine thread still runs.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// The prefix store's counters, per tier; `None` without a store.
    pub fn store_stats(&self) -> Option<StoreStats> {
        self.store.iter().map(|s| s.stats()).reduce(|a, b| a.merged(&b))
    }

    /// Waits until every write submitted to the prefix store so far is
    /// written (nothing without a store): a server shutting down calls it
    /// after the requests in flight finish, so their prompts outlive it.
    pub fn flush_store(&self) {
        for store in &self.store {
            store.flush();
        }
    }

    /// Hands `job` to the engine thread; `false` when the thread has stopped.
    pub fn submit(&self, job: Job) -> bool {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.commands.send(CommandBox(Command::Submit(id, job))).is_ok()
    }

    /// The engine's state after its last pass.
    pub fn gauges(&self) -> Gauges {
        *self.gauges.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the engine thread needs besides its model.
struct EngineSetup<'a> {
    config: &'a ServerConfig,
    tokenizer: Arc<dyn Tokenizer>,
    commands: std_mpsc::Receiver<CommandBox>,
    gauges: &'a Mutex<Gauges>,
    ready: std_mpsc::Sender<kvcache_engine::Result<Vec<Arc<TieredStore>>>>,
}

impl EngineSetup<'_> {
    /// Builds the engine over `model` (its prefix store keyed by
    /// `fingerprint`, when there is one) and serves until every
    /// [`Worker`] handle is dropped; tells [`Worker::start`] when it is
    /// ready, or why it could not start.
    fn run<M: Model>(self, mut model: M, fingerprint: Option<Fingerprint>) {
        model.set_attention(self.config.attention);
        let built = build_engine(&model, self.config, self.tokenizer, fingerprint).and_then(|mut engine| {
            let store = open_store(&model, self.config, fingerprint, &mut engine)?;
            Ok((engine, store))
        });
        let engine = match built {
            Ok((engine, store)) => {
                let _ = self.ready.send(Ok(store));
                engine
            }
            Err(e) => {
                let _ = self.ready.send(Err(e));
                return;
            }
        };
        if let Err(error) = serve(engine, self.config, self.commands, self.gauges) {
            tracing::error!(%error, "engine thread stopped");
        }
    }
}

/// The engine over `model`'s cache, with prefix reuse on; the cache of a
/// server with a prefix store carries the model's fingerprint: the store's
/// entries belong to that model and no other.
fn build_engine<'m, M: Model>(
    model: &'m M,
    config: &ServerConfig,
    tokenizer: Arc<dyn Tokenizer>,
    fingerprint: Option<Fingerprint>,
) -> kvcache_engine::Result<Engine<'m, M::Cache, M>> {
    let cache_config = CausalConfig::new(config.max_sequences, config.context, config.max_batch);
    let window_memory = config
        .window_memory
        .unwrap_or_else(|| model.window().map_or(0, |w| w + crate::config::WINDOW_MARGIN));
    let mut cache = model.new_cache(&cache_config, window_memory, model.device())?;
    if let Some(fingerprint) = fingerprint {
        cache.set_fingerprint(fingerprint);
    }
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: config.max_batch,
            prefill_chunk: config.prefill_chunk,
            context: Some(config.context),
            keep: 4,
            stop_tokens: tokenizer.end_of_turn_ids(),
            block_tokens: config.block_tokens,
        },
    )?;
    engine.set_tokenizer(tokenizer);
    engine.set_prefix_reuse(true)?;
    if let Some(endpoint) = &config.kv_events {
        if config.block_tokens.is_none() {
            return Err(kvcache_engine::EngineError::InvalidArgument(
                "--kv-events reports kept blocks: it needs --block-tokens above 0".into(),
            ));
        }
        let publisher = ZmqPublisher::bind(ZmqPublisherConfig::new(endpoint.clone()))
            .map_err(|e| kvcache_engine::EngineError::InvalidArgument(e.to_string()))?;
        tracing::info!(endpoint = publisher.endpoint(), "publishing KV events");
        engine.set_event_sink(Arc::new(publisher));
    }
    Ok(engine)
}

/// How long a joining request waits for the store before evaluating its
/// whole prompt.
const STORE_DEADLINE: Duration = Duration::from_millis(250);

/// Opens the prefix store of the model `fingerprint` names and links `engine`
/// to it (nothing without a fingerprint: no store configured): one store per
/// part of the cache ([`CausalCache::store_parts`]: Gemma 3's global layers
/// and its window layers, each keyed by a fingerprint of its own), over the
/// same tiers. A cache no part of which keeps every position (all layers
/// windowed) refuses the store.
fn open_store<M: Model>(
    model: &M,
    config: &ServerConfig,
    fingerprint: Option<Fingerprint>,
    engine: &mut Engine<'_, M::Cache, M>,
) -> kvcache_engine::Result<Vec<Arc<TieredStore>>> {
    let Some(fingerprint) = fingerprint else {
        return Ok(Vec::new());
    };
    let whole = store::kv_layout(model);
    let mut tiers = Vec::new();
    let mut parts: Vec<(StorePart, Arc<dyn PrefixStore>)> = Vec::new();
    for part in engine.cache().store_parts() {
        let settings = StoreConfig::new(part.fingerprint(fingerprint), part.layout(whole))
            .with_queue_capacity(config.store_queue)
            .with_block_tokens(config.store_block_tokens);
        let store = store::open_with(settings, &config.store)?;
        tiers.push(store.clone());
        parts.push((part, store));
    }
    let parts = StoreParts::new(fingerprint, parts, STORE_DEADLINE).map_err(|why| {
        EngineError::InvalidArgument(format!(
            "a prefix store needs a cache that keeps whole prefixes in some layers; {}'s does not: {why}",
            model.architecture()
        ))
    })?;
    engine.set_store_parts(parts)?;
    Ok(tiers)
}

/// The engine loop: runs until every [`Worker`] handle is dropped.
fn serve<M: Model>(
    mut engine: Engine<'_, M::Cache, M>,
    config: &ServerConfig,
    commands: std_mpsc::Receiver<CommandBox>,
    gauges: &Mutex<Gauges>,
) -> kvcache_engine::Result<()> {
    let mut jobs: std::collections::HashMap<usize, mpsc::UnboundedSender<JobEvent>> = Default::default();
    let mut last_sweep = Instant::now();
    loop {
        // Wait for work when there is none; otherwise take what has arrived.
        let first = if jobs.is_empty() {
            match commands.recv_timeout(Duration::from_millis(250)) {
                Ok(c) => Some(c),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            }
        } else {
            None
        };
        for CommandBox(command) in first.into_iter().chain(commands.try_iter()) {
            let Command::Submit(id, job) = command;
            let request = Request {
                id,
                prompt: job.prompt,
                max_new_tokens: job.max_tokens,
                namespace: job.namespace,
                stop: job.stop,
                ignore_eos: job.ignore_eos,
                min_tokens: job.min_tokens,
                stop_token_ids: job.stop_token_ids,
            };
            match engine.submit_sampled(request, Some(job.sampler)) {
                Ok(()) => {
                    jobs.insert(id, job.events);
                }
                Err(e) => {
                    let _ = job.events.send(JobEvent::Failed(e.to_string()));
                }
            }
        }
        // Clients that went away: cancel, freeing their cells.
        let gone: Vec<usize> = jobs
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            engine.cancel(id)?;
            jobs.remove(&id);
        }
        // Each event goes to its request as it comes; a request whose
        // receiver is gone is cancelled after the pass.
        let mut closed = Vec::new();
        let result = engine.step(&mut |event| {
            let (id, message) = match event {
                Event::Joined {
                    id,
                    waited,
                    reused,
                    restored,
                    ..
                } => (
                    *id,
                    JobEvent::Started {
                        cached_tokens: reused + restored,
                        waited: *waited,
                    },
                ),
                Event::Token {
                    id, text, logprobs, ..
                } => (
                    *id,
                    JobEvent::Token {
                        text: text.clone(),
                        logprobs: logprobs.clone(),
                    },
                ),
                Event::Finished(f) => {
                    if let Some(tx) = jobs.remove(&f.id) {
                        let _ = tx.send(JobEvent::Finished {
                            reason: f.reason.clone(),
                        });
                    }
                    return;
                }
                Event::Failed { id, error } => {
                    if let Some(tx) = jobs.remove(id) {
                        let _ = tx.send(JobEvent::Failed(error.to_string()));
                    }
                    return;
                }
                Event::Prefilled { .. } | Event::ContextShift { .. } | Event::Pass { .. } => return,
            };
            if let Some(tx) = jobs.get(&id) {
                if tx.send(message).is_err() {
                    closed.push(id);
                }
            }
        });
        if let Err(error) = result {
            // A failed pass leaves the requests in it in an unknown state:
            // fail them all and start over with an empty engine state.
            tracing::error!(%error, "forward pass failed");
            for (id, tx) in jobs.drain() {
                let _ = tx.send(JobEvent::Failed(error.to_string()));
                engine.cancel(id)?;
            }
        }
        for id in closed {
            if jobs.remove(&id).is_some() {
                engine.cancel(id)?;
            }
        }
        if last_sweep.elapsed() >= Duration::from_millis(100) {
            engine.evict_idle(config.idle_ttl)?;
            last_sweep = Instant::now();
        }
        let mut g = gauges.lock().unwrap_or_else(PoisonError::into_inner);
        *g = Gauges {
            cells_in_use: engine.cache().cells_in_use(),
            cells_total: engine.cache().cells_total(),
            bytes_in_use: engine.cache().bytes_in_use(),
            active: engine.active(),
            queued: engine.queued(),
            idle: engine.idle_sequences(),
            blocks: engine.indexed_blocks(),
            reuse: engine.reuse_stats(),
            generated_tokens: engine.stats().generated_tokens,
            passes: engine.stats().passes,
        };
    }
}
