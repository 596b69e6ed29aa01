//! Benchmark E5 of BENCHMARKS.md (issue 12): multi-turn chat on a
//! sliding-window model. Gemma 3 answers the E5 trace (interleaved
//! conversations in Gemma's turn format, growing past 3 windows) with one of
//! three ways of reusing earlier work:
//!
//! - [`E5Policy::Trie`]: `kvcache_trie::PrefixCache` over
//!   [`GemmaLayer`]s (global layers' rows, window layers' windows), a
//!   snapshot at the end of every prompt, so the next turn resumes there;
//! - [`E5Policy::WindowOnly`]: a cache without memory beyond the window, one
//!   slot per conversation holding its live state: a turn resumes where it
//!   parts from the slot only while the slot has rotated nothing out
//!   (it holds at most a window), or when the prompt extends what it holds;
//!   otherwise the whole prompt is evaluated again;
//! - [`E5Policy::NoReuse`]: every prompt from scratch.
//!
//! Each reports the prompt tokens evaluated against the trace's minimum, the
//! time to first token, and the bytes its caches hold against a full-size
//! cache of the same contexts (every layer keeping every position, as
//! llama.cpp's `--swa-full`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use kvcache_api::{MixedLayer, SnapshotCache};
use kvcache_engine::{EngineError, Result};
use kvcache_models::argmax;
use kvcache_models::gemma::tokenizer::{chat_turn, end_of_reply};
use kvcache_models::gemma::{Gemma, GemmaLayer};
use kvcache_trie::PrefixCache;
use serde::{Deserialize, Serialize};

use crate::bench::median;

/// Where the E5 trace lives in the repository.
pub fn e5_trace_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/e5_trace.json")
}

/// One scripted turn of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E5Turn {
    /// The user's message.
    pub user: String,
    /// The scripted model reply (the history of later turns).
    pub model: String,
}

/// One request of the trace, in arrival order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E5Request {
    /// Index in the trace.
    pub idx: usize,
    /// Conversation id.
    pub conv: usize,
    /// Turn within the conversation, from 1.
    pub turn: usize,
    /// Number of prompt tokens.
    pub prompt_tokens: usize,
    /// Longest prefix shared with any earlier prompt.
    pub best_prefix_with_earlier: usize,
    /// Tokens that must be evaluated at least (`prompt_tokens - best_prefix`, at least 1).
    pub min_prefill: usize,
    /// The prompt's token ids (`<bos>` first).
    pub token_ids: Vec<u32>,
}

/// How the trace was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E5Meta {
    /// What the trace is.
    pub name: String,
    /// The program and seed that wrote it.
    pub generator: String,
    /// The tokenizer of the token ids.
    pub tokenizer: String,
    /// Conversations.
    pub n_conversations: usize,
    /// Turns per conversation.
    pub n_turns: usize,
    /// Tokens to generate greedily per request (then discarded).
    pub n_predict: usize,
    /// The model's window the trace grows past.
    pub window: usize,
    /// Sum of all prompt lengths.
    pub total_prompt_tokens: usize,
    /// Sum of the minimum prefill.
    pub total_min_prefill: usize,
}

/// The whole trace: conversations opened by one instruction, asked round-robin
/// (turn 1 of every conversation, then turn 2, ...). A prompt is the
/// instruction and the user's first message in the first user turn, then
/// every earlier turn with its scripted reply, then the new message and the
/// start of the model's turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E5Trace {
    /// How it was made.
    pub meta: E5Meta,
    /// The instruction opening every conversation.
    pub instruction: String,
    /// `conversations[c][t]`: turn `t` of conversation `c`.
    pub conversations: Vec<Vec<E5Turn>>,
    /// The requests in arrival order.
    pub requests: Vec<E5Request>,
}

/// The prompt of turn `history.len() + 1` of a conversation opened by
/// `instruction` (without `<bos>`, which the tokenizer adds).
pub fn prompt_text(instruction: &str, history: &[E5Turn], user: &str) -> String {
    let first = |u: &str| format!("{instruction}\n\n{u}");
    let mut text = String::new();
    for (t, turn) in history.iter().enumerate() {
        let u = if t == 0 {
            first(&turn.user)
        } else {
            turn.user.clone()
        };
        text.push_str(&chat_turn(&u));
        text.push_str(&end_of_reply(&turn.model));
    }
    let u = if history.is_empty() {
        first(user)
    } else {
        user.to_string()
    };
    text.push_str(&chat_turn(&u));
    text
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl E5Trace {
    /// Reads a trace file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| EngineError::Format(format!("{}: {e}", path.display())))
    }

    /// The trace of `conversations` (all of the same number of turns),
    /// tokenized by `encode` (which adds `<bos>`); `meta`'s counts and totals
    /// are filled in from them.
    pub fn build(
        mut meta: E5Meta,
        instruction: &str,
        conversations: Vec<Vec<E5Turn>>,
        encode: impl Fn(&str) -> Vec<u32>,
    ) -> Result<Self> {
        let turns = conversations.first().map_or(0, Vec::len);
        if turns == 0 || conversations.iter().any(|c| c.len() != turns) {
            return Err(EngineError::InvalidArgument(
                "conversations must be non-empty and of one number of turns".into(),
            ));
        }
        let mut requests = Vec::new();
        for t in 0..turns {
            for (c, conv) in conversations.iter().enumerate() {
                let ids = encode(&prompt_text(instruction, &conv[..t], &conv[t].user));
                requests.push((c, t + 1, ids));
            }
        }
        meta.n_conversations = conversations.len();
        meta.n_turns = turns;
        let mut trace = E5Trace {
            meta,
            instruction: instruction.to_string(),
            conversations,
            requests: Vec::new(),
        };
        trace.set_requests(requests);
        Ok(trace)
    }

    /// Replaces the requests with `prompts` (conversation, turn, token ids) in
    /// arrival order, computing each one's minimum prefill and the totals.
    pub fn set_requests(&mut self, prompts: Vec<(usize, usize, Vec<u32>)>) {
        let mut requests: Vec<E5Request> = Vec::with_capacity(prompts.len());
        for (idx, (conv, turn, ids)) in prompts.into_iter().enumerate() {
            let best = requests
                .iter()
                .map(|r| common_prefix(&r.token_ids, &ids))
                .max()
                .unwrap_or(0);
            requests.push(E5Request {
                idx,
                conv,
                turn,
                prompt_tokens: ids.len(),
                best_prefix_with_earlier: best,
                min_prefill: (ids.len() - best).max(1),
                token_ids: ids,
            });
        }
        self.meta.total_prompt_tokens = requests.iter().map(|r| r.prompt_tokens).sum();
        self.meta.total_min_prefill = requests.iter().map(|r| r.min_prefill).sum();
        self.requests = requests;
    }

    /// The same trace with only its first `conversations` conversations (the
    /// minimum prefill computed again over them).
    pub fn first_conversations(&self, conversations: usize) -> Self {
        let mut trace = self.clone();
        trace.conversations.truncate(conversations);
        trace.meta.n_conversations = trace.conversations.len();
        let prompts = self
            .requests
            .iter()
            .filter(|r| r.conv < conversations)
            .map(|r| (r.conv, r.turn, r.token_ids.clone()))
            .collect();
        trace.set_requests(prompts);
        trace
    }
}

/// How requests reuse earlier work (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum E5Policy {
    /// The prefix trie, a snapshot at every prompt's end.
    Trie,
    /// One slot per conversation, no memory beyond the window.
    WindowOnly,
    /// Every prompt from scratch.
    NoReuse,
}

impl E5Policy {
    /// All three, in the order the report lists them.
    pub const ALL: [E5Policy; 3] = [E5Policy::Trie, E5Policy::WindowOnly, E5Policy::NoReuse];

    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            E5Policy::Trie => "prefix trie",
            E5Policy::WindowOnly => "window-only",
            E5Policy::NoReuse => "no reuse",
        }
    }
}

/// What one request did.
#[derive(Debug, Clone, PartialEq)]
pub struct E5Row {
    /// Index in the trace.
    pub idx: usize,
    /// Conversation id.
    pub conv: usize,
    /// Turn, from 1.
    pub turn: usize,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// The trace's minimum prefill.
    pub min_prefill: usize,
    /// Prompt tokens evaluated.
    pub evaluated: usize,
    /// From receiving the prompt to the first generated token.
    pub time_to_first_token: Duration,
    /// From receiving the prompt to the last generated token.
    pub total: Duration,
    /// The greedy tokens generated (then discarded).
    pub generated: Vec<u32>,
}

/// Bytes the caches held at the end of a run, against a full-size cache of the
/// same contexts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct E5Memory {
    /// Conversations of the run.
    pub conversations: usize,
    /// Bytes of the trie's snapshots (0 for the other policies).
    pub snapshot_bytes: usize,
    /// Bytes of the live caches (every slot's, for the window-only policy).
    pub live_bytes: usize,
    /// Bytes a full-size cache (every layer keeps every position, f32) holds
    /// for every conversation's context at its end (last prompt and reply).
    pub full_size_bytes: usize,
    /// Trie nodes evicted to keep the budget (0 for the other policies).
    pub evictions: u64,
}

impl E5Memory {
    /// Snapshot and live bytes together.
    pub fn held_bytes(&self) -> usize {
        self.snapshot_bytes + self.live_bytes
    }

    /// Held bytes per conversation.
    pub fn per_conversation(&self) -> f64 {
        self.held_bytes() as f64 / self.conversations.max(1) as f64
    }

    /// Full-size bytes per conversation.
    pub fn full_size_per_conversation(&self) -> f64 {
        self.full_size_bytes as f64 / self.conversations.max(1) as f64
    }
}

/// An E5 run with one policy.
#[derive(Debug, Clone, PartialEq)]
pub struct E5Report {
    /// The policy.
    pub policy: E5Policy,
    /// One row per request, in trace order.
    pub rows: Vec<E5Row>,
    /// What the caches held at the end.
    pub memory: E5Memory,
    /// Time spent answering the requests (the sum of the rows' totals).
    pub total: Duration,
}

/// Mean and median, in milliseconds.
fn mean_median(ms: &[f64]) -> (f64, f64) {
    let mean = ms.iter().sum::<f64>() / ms.len().max(1) as f64;
    (mean, median(ms))
}

impl E5Report {
    /// Prompt tokens evaluated.
    pub fn evaluated(&self) -> usize {
        self.rows.iter().map(|r| r.evaluated).sum()
    }

    /// The trace's minimum over the same requests.
    pub fn min_prefill(&self) -> usize {
        self.rows.iter().map(|r| r.min_prefill).sum()
    }

    /// Prompt tokens of the requests.
    pub fn prompt_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.prompt_tokens).sum()
    }

    /// Evaluated over the minimum.
    pub fn ratio(&self) -> f64 {
        self.evaluated() as f64 / self.min_prefill().max(1) as f64
    }

    /// Mean and median time to first token in ms, of turn 1 (`later` false)
    /// or of turns >= 2 (`later` true).
    pub fn ttft_ms(&self, later: bool) -> (f64, f64) {
        let ms: Vec<f64> = self
            .rows
            .iter()
            .filter(|r| (r.turn >= 2) == later)
            .map(|r| r.time_to_first_token.as_secs_f64() * 1e3)
            .collect();
        mean_median(&ms)
    }
}

impl fmt::Display for E5Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (m1, d1) = self.ttft_ms(false);
        let (m2, d2) = self.ttft_ms(true);
        let mib = |b: f64| b / (1024.0 * 1024.0);
        writeln!(
            f,
            "{:<12} evaluated {:>6} of {:>6} prompt tokens, minimum {:>6}: {:.3}x",
            self.policy.name(),
            self.evaluated(),
            self.prompt_tokens(),
            self.min_prefill(),
            self.ratio()
        )?;
        writeln!(
            f,
            "             TTFT turn 1 mean {m1:.0} ms median {d1:.0} ms; turns >= 2 mean {m2:.0} ms median {d2:.0} ms; total {:.1} s",
            self.total.as_secs_f64()
        )?;
        write!(
            f,
            "             held {:.1} MiB per conversation ({:.1} MiB snapshots + {:.1} MiB live caches, {} conversations); full-size cache {:.1} MiB per conversation; {} evictions",
            mib(self.memory.per_conversation()),
            mib(self.memory.snapshot_bytes as f64),
            mib(self.memory.live_bytes as f64),
            self.memory.conversations,
            mib(self.memory.full_size_per_conversation()),
            self.memory.evictions
        )
    }
}

/// E5's verdict: the trie against no reuse over the same requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct E5Verdict {
    /// The trie's evaluated tokens over the minimum.
    pub trie_ratio: f64,
    /// Median TTFT of turns >= 2, no reuse over the trie.
    pub ttft_speedup_later_turns: f64,
    /// Mean TTFT of turns >= 2, no reuse over the trie.
    pub ttft_speedup_later_turns_mean: f64,
    /// The trie's held bytes over a full-size cache's.
    pub memory_vs_full_size: f64,
}

impl E5Verdict {
    /// The verdict, when `reports` hold a trie and a no-reuse run.
    pub fn from_reports(reports: &[E5Report]) -> Option<Self> {
        let find = |p: E5Policy| reports.iter().find(|r| r.policy == p);
        let (trie, none) = (find(E5Policy::Trie)?, find(E5Policy::NoReuse)?);
        Some(E5Verdict {
            trie_ratio: trie.ratio(),
            ttft_speedup_later_turns: none.ttft_ms(true).1 / trie.ttft_ms(true).1.max(1e-9),
            ttft_speedup_later_turns_mean: none.ttft_ms(true).0 / trie.ttft_ms(true).0.max(1e-9),
            memory_vs_full_size: trie.memory.held_bytes() as f64 / trie.memory.full_size_bytes.max(1) as f64,
        })
    }
}

impl fmt::Display for E5Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "trie {:.4}x the minimum (target <= 1.01x); median TTFT turns >= 2 {:.1}x faster than no reuse (target >= 5x; {:.1}x by the mean); holds {:.2}x the bytes of a full-size cache",
            self.trie_ratio,
            self.ttft_speedup_later_turns,
            self.ttft_speedup_later_turns_mean,
            self.memory_vs_full_size
        )
    }
}

/// The greedy next token after `tokens` appended to `layers`: only the last
/// row's logits are computed (`[1, vocab_size]`, not `[n, vocab_size]`).
fn next_token(model: &Gemma, tokens: &[u32], layers: &mut [GemmaLayer]) -> Result<u32> {
    let hidden = model.hidden_layers(tokens, layers)?;
    let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
    let logits: Tensor = model.logits(&last)?.squeeze(0)?;
    Ok(argmax(&logits.to_vec1::<f32>()?))
}

/// Bytes the live caches of one sequence hold.
fn held_bytes(layers: &[GemmaLayer]) -> usize {
    layers
        .iter()
        .map(|l| match l {
            MixedLayer::Global(kv) => kv.held_bytes(),
            MixedLayer::Window(w) => w.held_bytes(),
        })
        .sum()
}

/// Runs the requests of `trace` under every policy of `policies`, alternating
/// request by request (request 1 under each policy, then request 2, ...), so
/// that drift on a shared machine hits every policy alike. Each generates
/// `n_predict` tokens greedily per request and discards them; the trie keeps
/// at most `trie_budget` bytes of snapshots (evicting above it). `log` sees
/// each row as it completes. Returns one report per policy, in the order of
/// `policies`.
pub fn run(
    model: &Gemma,
    trace: &E5Trace,
    policies: &[E5Policy],
    n_predict: usize,
    trie_budget: usize,
    device: &Device,
    log: &mut dyn FnMut(E5Policy, &E5Row),
) -> Result<Vec<E5Report>> {
    if n_predict == 0 {
        return Err(EngineError::InvalidArgument("nothing to generate".into()));
    }
    let mut runners = policies
        .iter()
        .map(|&policy| Runner::new(model, policy, trie_budget, trace.meta.n_conversations, device))
        .collect::<Result<Vec<_>>>()?;
    for req in &trace.requests {
        for runner in &mut runners {
            let policy = runner.policy;
            log(policy, runner.answer(model, req, n_predict, device)?);
        }
    }
    Ok(runners.into_iter().map(|r| r.report(model)).collect())
}

/// One policy's live caches and the rows it has answered.
struct Runner {
    policy: E5Policy,
    live: Live,
    rows: Vec<E5Row>,
    /// Each conversation's context at its latest request (prompt and reply).
    context: Vec<usize>,
}

impl Runner {
    fn new(
        model: &Gemma,
        policy: E5Policy,
        trie_budget: usize,
        conversations: usize,
        device: &Device,
    ) -> Result<Self> {
        let live = match policy {
            E5Policy::Trie => Live::Trie(Box::new(PrefixCache::new(
                model.new_layers(device)?,
                trie_budget,
            )?)),
            E5Policy::WindowOnly => Live::Slots(Vec::new()),
            E5Policy::NoReuse => Live::Fresh(model.new_layers(device)?),
        };
        Ok(Runner {
            policy,
            live,
            rows: Vec::new(),
            context: vec![0; conversations],
        })
    }

    /// Answers one request, timed from its arrival.
    fn answer(
        &mut self,
        model: &Gemma,
        req: &E5Request,
        n_predict: usize,
        device: &Device,
    ) -> Result<&E5Row> {
        let t0 = Instant::now();
        let prompt = &req.token_ids;
        let (evaluated, ttft, generated) = match &mut self.live {
            Live::Trie(trie) => trie_turn(model, trie, prompt, n_predict, t0)?,
            Live::Slots(slots) => {
                if slots.len() <= req.conv {
                    slots.resize_with(req.conv + 1, || None);
                }
                let slot = match &mut slots[req.conv] {
                    Some(slot) => slot,
                    empty => empty.insert(Slot {
                        layers: model.new_layers(device)?,
                        tokens: Vec::new(),
                    }),
                };
                slot.turn(model, prompt, n_predict, t0)?
            }
            Live::Fresh(layers) => {
                let mut slot = Slot {
                    layers: std::mem::take(layers),
                    tokens: Vec::new(),
                };
                slot.layers.iter_mut().for_each(|l| l.free());
                let out = slot.turn(model, prompt, n_predict, t0);
                *layers = slot.layers;
                out?
            }
        };
        if let Some(len) = self.context.get_mut(req.conv) {
            *len = prompt.len() + n_predict;
        }
        self.rows.push(E5Row {
            idx: req.idx,
            conv: req.conv,
            turn: req.turn,
            prompt_tokens: prompt.len(),
            min_prefill: req.min_prefill,
            evaluated,
            time_to_first_token: ttft,
            total: t0.elapsed(),
            generated,
        });
        Ok(self.rows.last().expect("a row was just pushed"))
    }

    /// The report: rows, the bytes held now, the time spent answering.
    fn report(self, model: &Gemma) -> E5Report {
        let c = model.config();
        let full_size_per_token = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4;
        let (snapshot_bytes, live_bytes, evictions) = match &self.live {
            Live::Trie(trie) => {
                let stats = trie.stats();
                (stats.paged_out_bytes, held_bytes(trie.caches()), stats.evictions)
            }
            Live::Slots(slots) => (0, slots.iter().flatten().map(|s| held_bytes(&s.layers)).sum(), 0),
            Live::Fresh(layers) => (0, held_bytes(layers), 0),
        };
        E5Report {
            policy: self.policy,
            memory: E5Memory {
                conversations: self.context.iter().filter(|&&n| n > 0).count(),
                snapshot_bytes,
                live_bytes,
                full_size_bytes: self.context.iter().map(|n| n * full_size_per_token).sum(),
                evictions,
            },
            total: self.rows.iter().map(|r| r.total).sum(),
            rows: self.rows,
        }
    }
}

/// The live state of a policy between requests.
enum Live {
    Trie(Box<PrefixCache<GemmaLayer>>),
    /// Window-only: each conversation's slot.
    Slots(Vec<Option<Slot>>),
    /// No reuse: one set of caches, freed for every request.
    Fresh(Vec<GemmaLayer>),
}

/// Prompt tokens evaluated, time to first token, tokens generated.
type Turned = (usize, Duration, Vec<u32>);

/// One sequence's live caches and the tokens they hold.
struct Slot {
    layers: Vec<GemmaLayer>,
    tokens: Vec<u32>,
}

impl Slot {
    /// Answers `prompt` on this slot as a cache without memory beyond the
    /// window can: it resumes where the prompt parts from what the slot holds
    /// while the slot has rotated nothing out (it holds at most a window) or
    /// when the prompt extends all of it, else evaluates the whole prompt.
    /// Returns what [`trie_turn`] does.
    fn turn(&mut self, model: &Gemma, prompt: &[u32], n_predict: usize, t0: Instant) -> Result<Turned> {
        let held = self.tokens.len();
        let parts = common_prefix(&self.tokens, prompt).min(prompt.len() - 1);
        let resume = if held <= model.config().window || parts == held {
            parts
        } else {
            0
        };
        for layer in &mut self.layers {
            if !layer.restore(None, resume)? {
                return Err(EngineError::Cache(kvcache_api::CacheError::InvalidState(
                    format!("a slot holding {held} tokens could not rewind to {resume}"),
                )));
            }
        }
        self.tokens.truncate(resume);
        let mut token = next_token(model, &prompt[resume..], &mut self.layers)?;
        self.tokens.extend_from_slice(&prompt[resume..]);
        let ttft = t0.elapsed();
        let mut generated = vec![token];
        for _ in 1..n_predict {
            self.tokens.push(token);
            token = next_token(model, &[token], &mut self.layers)?;
            generated.push(token);
        }
        Ok((prompt.len() - resume, ttft, generated))
    }
}

/// One request through the trie: evaluate what it did not restore, choose
/// the first token, snapshot the prompt's end (where the conversation's next
/// turn parts from this reply), then generate. Returns the prompt tokens
/// evaluated, the time to first token and the tokens generated.
fn trie_turn(
    model: &Gemma,
    trie: &mut PrefixCache<GemmaLayer>,
    prompt: &[u32],
    n_predict: usize,
    t0: Instant,
) -> Result<Turned> {
    let mut session = trie.begin(prompt)?;
    let evaluated = session.remaining().len();
    // Prefill may stop at pending snapshots: only its last chunk's last row
    // needs logits.
    let mut last = None;
    session.prefill(|tokens, caches| -> Result<()> {
        let hidden = model.hidden_layers(tokens, caches)?;
        last = Some(hidden.narrow(0, hidden.dim(0)? - 1, 1)?);
        Ok(())
    })?;
    let last = last.ok_or_else(|| EngineError::InvalidArgument("nothing evaluated".into()))?;
    let mut token = argmax(&model.logits(&last)?.squeeze(0)?.to_vec1::<f32>()?);
    let ttft = t0.elapsed();
    // The restore point is bookkeeping the first token does not wait for.
    session.snapshot(false)?;
    let mut generated = vec![token];
    for _ in 1..n_predict {
        token = session.decode(token, |t, caches| next_token(model, t, caches))?;
        generated.push(token);
    }
    session.record(token);
    session.close()?;
    Ok((evaluated, ttft, generated))
}
