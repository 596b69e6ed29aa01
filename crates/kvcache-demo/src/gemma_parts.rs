//! The demo's windowed parts on Gemma 3 270M (`--model gemma3`), a model whose
//! layers attend through a sliding window of 512 positions, five in six of them,
//! through a `LayerGroupCache` (window layers keeping a memory beyond the
//! window, global layers everything), both run by `kvcache_engine::Engine`
//! as the SmolLM2 parts are:
//!
//! - chat past the window: conversations longer than the window, continued
//!   turn after turn from the cache (the engine's prefix reuse: each
//!   conversation's finished turn stays in its sequence), then a question
//!   edited, which resumes behind the end (where a cache holding only the
//!   window recomputes the whole prompt, llama.cpp's "forcing full prompt
//!   re-processing"), its first token's log-probabilities checked against a
//!   full recompute (f32 weights);
//! - a context shift: one sequence generating past its context, both kinds
//!   of layers re-rotating their keys with their own RoPE base.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{Device, IndexOp};
use kvcache_api::{CausalConfig, Namespace, SeqId};
use kvcache_causal::LayerGroupCache;
use kvcache_engine::engine::{Engine, EngineConfig, Event, FinishReason, Finished, Request};
use kvcache_engine::sampling::{log_softmax, Sampler, SamplingOptions, SamplingParams, TokenLogprobs};
use kvcache_engine::{EngineError, Result};
use kvcache_models::gemma::{Gemma, GemmaFile, GemmaTokenizer};
use kvcache_models::WeightMode;

use crate::cli::{Cli, Part};
use crate::{progress, report};

/// Positions the window layers keep beyond the window: enough to go back
/// a turn (an edited question, a regenerated reply).
const MEMORY_BEYOND_WINDOW: usize = 128;

/// Tokens per forward pass while a prompt is evaluated.
const PREFILL_CHUNK: usize = 256;

/// The long first message of each conversation: it alone is longer than the
/// window (about 800 tokens).
const NOTES: &str = "\
Notes from the town council meeting, read them and answer my questions.

The river rises in the hills to the north of the town and flows south through farmland before it \
reaches the sea. In spring, when the snow melts, the water is high and fast, and the old stone bridge \
in the centre of the town is sometimes closed for a week or two. In summer the river is slow and \
shallow, and children swim near the mill. The town grew up around the bridge because it was the only \
place for many miles where carts could cross the river safely, and the market square still opens \
onto the bridge.

The council met on Tuesday evening in the library. Twelve members attended and two sent apologies. \
The first item was the bridge. An engineer from the county reported that the stone is sound but the \
mortar between the stones has washed out under the second arch. She recommended repairs before the \
next spring flood, at a cost of about forty thousand pounds, and warned that waiting another year \
could double the cost. The council agreed to apply for a county grant to cover half of the cost and \
to pay the rest from the reserve fund.

The second item was the market. Traders have asked to move the Saturday market from the square to \
the riverside meadow during the summer months, because the square is too hot at midday and there is \
no shade. Residents of Mill Lane objected that the meadow floods after heavy rain and that parking \
would block their street. After a long discussion the council voted seven to five to try the meadow \
for June and July only, with a review in August, and asked the traders to arrange parking at the \
school.

The third item was the library itself. Opening hours will be extended to eight in the evening on \
Thursdays from next month, staffed by volunteers. The library will also lend bicycles to residents, \
starting with six bicycles donated by the cycling club. A volunteer will check the bicycles every \
Monday morning.

The fourth item was the school crossing on Station Road. Parents have complained that cars drive \
too fast past the school gates in the morning, and that the crossing warden, who works until half \
past eight, leaves before many children arrive. The police reported two near misses since \
Christmas. The council agreed to ask the county for a twenty miles per hour limit on Station Road \
between the church and the railway bridge, and to pay for a second warden until a quarter past \
nine, for a trial of one school term. Mr Hughes asked whether speed bumps would be cheaper; the \
clerk will find out before the next meeting.

The fifth item was the allotments behind the old mill. All forty plots are taken and eleven people \
are on the waiting list. The owner of the field next to the allotments has offered to rent half of \
it to the town for a small sum, which would make room for twenty more plots. The council agreed to \
accept the offer for five years, on condition that the plot holders build a new fence and share \
the cost of a water tap. The allotment society will organise a working party in April.

Finally, the council thanked Mrs Alder, who retires as town clerk after twenty-two years. A new \
clerk, Mr Osei, starts on the first of next month. The next meeting is on the second Tuesday of next \
month at seven o'clock, in the library.";

/// The first exchange of each conversation, after the notes, written out:
/// an example of the short answers wanted (Gemma 3 270M is a base model,
/// without instruction tuning).
const FIRST_EXCHANGE: [(&str, &str); 2] = [
    (
        "What is wrong with the bridge?",
        "The stone is sound, but the mortar under the second arch has washed out.",
    ),
    (
        "Where will the Saturday market be held in June?",
        "On the riverside meadow, as a trial for June and July.",
    ),
];

/// Each conversation's questions after the first exchange, answered by the
/// model; the last is asked again, edited, as the final turn.
const QUESTIONS: [[&str; 2]; 2] = [
    [
        "How will the repairs be paid for?",
        "How much will the repairs cost?",
    ],
    [
        "Who objected to the meadow, and why?",
        "When will the council review the decision?",
    ],
];

/// The edited question of each conversation's last turn.
const EDITED: [&str; 2] = [
    "When should the repairs be done, and why?",
    "How did the council vote?",
];

/// The windowed parts that `--skip` leaves, on the Gemma file at `path`.
pub fn run(path: &Path, device: &Device, weights: WeightMode, cli: &Cli) -> Result<()> {
    let (model, tokenizer) = load(path, device, weights)?;
    if !cli.skips(Part::Chat) || !cli.skips(Part::Window) {
        chat(&model, &tokenizer, cli, weights)?;
    }
    if !cli.skips(Part::Shift) {
        shift(&model, &tokenizer, cli)?;
    }
    if !cli.skips(Part::Store) || !cli.skips(Part::Batching) {
        println!(
            "\n(the prefix store and continuous batching do not depend on windows: they run on \
             SmolLM2, without --model gemma3)"
        );
    }
    Ok(())
}

fn load(path: &Path, device: &Device, weights: WeightMode) -> Result<(Gemma, GemmaTokenizer)> {
    let t0 = Instant::now();
    let file = GemmaFile::open(path)?;
    let c = file.config()?;
    println!("model: {}", path.display());
    println!(
        "config: {} layers (every {}th global, the others a window of {}), dim {}, {} heads / {} KV \
         heads of {}, vocab {}, RoPE base {} (window layers {})",
        c.n_layers,
        c.global_every,
        c.window,
        c.dim,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.rope_base_global,
        c.rope_base_window
    );
    let (bar, mut on_load) = progress::loading(&format!("loading weights ({weights:?})"));
    let model = file.load(device, weights, &mut on_load);
    bar.finish_and_clear();
    let model = model?;
    let tokenizer = file.tokenizer()?;
    println!(
        "loaded Gemma 3 ({weights:?} weights) and its tokenizer ({} tokens) in {:.2} s",
        tokenizer.vocab_size(),
        t0.elapsed().as_secs_f64()
    );
    Ok((model, tokenizer))
}

/// The engine the Gemma parts run on.
type GemmaEngine<'m> = Engine<'m, LayerGroupCache, Gemma>;

/// Top log-probabilities the edited turn's check compares.
const CHECKED_LOGPROBS: usize = 20;

/// Conversations past the window: each in its own sequence of one
/// `LayerGroupCache` (its own namespace, so that the engine continues it in
/// place and never shares its cells with another), turns interleaved, the
/// last question of each edited.
pub fn chat(model: &Gemma, tokenizer: &GemmaTokenizer, cli: &Cli, weights: WeightMode) -> Result<()> {
    let window = model.config().window;
    let memory = window + MEMORY_BEYOND_WINDOW;
    let conversations = QUESTIONS.len();
    let base = CausalConfig::new(conversations, conversations * 2048, PREFILL_CHUNK);
    let mut chat = Chat::new(model, tokenizer, base, memory)?;
    println!(
        "\n== chat past the window: {conversations} conversations, one sequence each of a LayerGroupCache \
         (window layers: window {window}, memory {memory}; global layers: everything), on the engine =="
    );
    println!(
        "  each conversation opens with notes of {} tokens (the window is {window}) and a first exchange \
         written out, then the model answers {} questions, then the last question edited",
        tokenizer.encode(NOTES, false, false).len(),
        QUESTIONS[0].len()
    );
    // The conversations so far, in Gemma's turn format.
    let mut histories: Vec<Vec<u32>> = FIRST_EXCHANGE
        .iter()
        .map(|(question, answer)| {
            // Built as ids: the messages are plain text, the turn markers the template's.
            let mut ids = tokenizer.encode_user_turn(&format!("{NOTES}\n\n{question}"), true);
            ids.extend(tokenizer.encode_reply_end(answer));
            ids
        })
        .collect();
    // Where each conversation's last user turn starts.
    let mut turn_starts = vec![0; conversations];
    let mut totals = Totals::default();
    let turns = QUESTIONS[0].len() + 1;
    for turn in 0..turns {
        for (c, history) in histories.iter_mut().enumerate() {
            let edit = turn == turns - 1;
            let question = QUESTIONS[c].get(turn).copied().unwrap_or(EDITED[c]);
            if edit {
                // The user rewrites the last question: the conversation goes
                // back to before it.
                history.truncate(turn_starts[c]);
            }
            turn_starts[c] = history.len();
            let mut prompt = history.clone();
            prompt.extend(tokenizer.encode_user_turn(question, false));
            let check = edit && c == 0 && weights != WeightMode::Candle;
            let t = chat.turn(c, &prompt, cli.demo.max_new, check)?;
            totals.add(&t);
            report_turn(tokenizer, c, turn, edit, question, &t, window)?;
            if edit && c == 0 {
                match &t.first_logprobs {
                    _ if !check => println!(
                        "      (no check against a full recompute with --weights candle: its kernels round \
                         activations to 8 bits, so a recompute without a cache differs by ~1 in the \
                         logits; kvcache-models' tests/gemma.rs checks that run layer by layer)"
                    ),
                    Some(first) => verify(model, &prompt, first)?,
                    None => println!("      (no check: the first reply token is a control token, without log-probabilities)"),
                }
            }
            *history = prompt;
            history.extend(&t.reply);
            history.extend(tokenizer.encode_reply_end(""));
        }
    }
    let groups = chat.engine.cache().groups();
    let per_cell: Vec<usize> = groups.iter().map(|g| g.storage_bytes_per_cell()).collect();
    println!("  per conversation, what the cache holds against a full-size cache of the same context (llama.cpp's --swa-full):");
    for (c, &seq) in chat.seqs.iter().enumerate() {
        let kept: Vec<usize> = groups.iter().map(|g| g.positions(seq).len()).collect();
        let held: usize = kept.iter().zip(&per_cell).map(|(k, b)| k * b).sum();
        let full = kept[1] * per_cell.iter().sum::<usize>();
        println!(
            "    conversation {c}: {} positions; window layers keep {}, global layers {}: {:.1} MiB held, \
             {:.1} MiB full-size ({:.2}x)",
            kept[1],
            kept[0],
            kept[1],
            mib(held),
            mib(full),
            full as f64 / held.max(1) as f64
        );
    }
    println!(
        "  prompt tokens: {} in all; evaluated {} with this cache, {} with a cache of the window only, \
         {} without reuse",
        totals.prompt, totals.evaluated, totals.window_only, totals.prompt
    );
    println!(
        "  time to first token: {:.0} ms in all (the edited turns {:.0} ms)",
        totals.ttft.as_secs_f64() * 1e3,
        totals.edit_ttft.as_secs_f64() * 1e3
    );
    Ok(())
}

fn report_turn(
    tokenizer: &GemmaTokenizer,
    conversation: usize,
    turn: usize,
    edit: bool,
    question: &str,
    t: &Turn,
    window: usize,
) -> Result<()> {
    let reused = t.prompt - t.evaluated;
    let label = if edit {
        "edited".to_string()
    } else {
        format!("turn {}", turn + 2)
    };
    println!(
        "  [conversation {conversation}, {label}] prompt {} tokens: {reused} from the cache, {} evaluated \
         (a window-only cache: {}{}), first token after {:.0} ms",
        t.prompt,
        t.evaluated,
        t.window_only,
        if t.window_only > t.evaluated {
            format!(
                ": the prompt parts from the cached tokens {} positions before their end, and that \
                 cache holds nothing before its last {window}",
                t.behind
            )
        } else {
            String::new()
        },
        t.time_to_first_token.as_secs_f64() * 1e3
    );
    println!("      user: {question}");
    let reply = tokenizer.decode_text(&t.reply)?;
    println!("      model: {}", reply.trim().replace('\n', "\n             "));
    if !t.ended_turn {
        println!(
            "      (cut at --max-new {} tokens, before the model ended its turn)",
            t.reply.len()
        );
    }
    report::flush();
    Ok(())
}

/// Compares the first reply token's log-probabilities through the cache (the
/// chosen token's and its `CHECKED_LOGPROBS` most likely alternatives') with
/// those of a full recompute of `prompt` (windowed attention from scratch,
/// no cache).
fn verify(model: &Gemma, prompt: &[u32], cached: &TokenLogprobs) -> Result<()> {
    let t0 = Instant::now();
    let hidden = model.hidden_full(prompt)?;
    let n = prompt.len();
    let row = model.logits(&hidden.i(n - 1..n)?)?.squeeze(0)?.to_vec1::<f32>()?;
    let full = log_softmax(&row);
    let diff = std::iter::once((cached.token, cached.logprob))
        .chain(cached.top.iter().copied())
        .map(|(token, lp)| (lp - full[token as usize]).abs())
        .fold(0.0f32, f32::max);
    let same = kvcache_models::argmax(&row) == cached.token;
    println!(
        "      (check: the first reply token's log-probabilities (its {} most likely) through the cache against \
         a full recompute of the {n} tokens in {:.1} s: max difference {diff:.1e}, {} token chosen)",
        cached.top.len(),
        t0.elapsed().as_secs_f64(),
        if same { "the same" } else { "another" }
    );
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// One sequence generating past a context of `2 * --context` positions:
/// when it is full, half of it (after the prompt) is removed and the later
/// keys re-rotated. The prompt is the start of a story, not a chat turn (Gemma
/// 3 270M continues text): the story runs on until the end of sequence token
/// or the token limit, with no turn to end.
pub fn shift(model: &Gemma, tokenizer: &GemmaTokenizer, cli: &Cli) -> Result<()> {
    let context = 2 * cli.demo.context;
    let generate = context + context / 2;
    let opening = "Once upon a time, in a small town by a river,";
    let prompt = tokenizer.encode(opening, true, false);
    if prompt.len() + 2 > context {
        println!("\n== context shift: skipped (the prompt does not fit a context of {context}) ==");
        return Ok(());
    }
    println!(
        "\n== context shift: one sequence with a context of {context} positions generating up to {generate} \
         tokens of a story, on the engine =="
    );
    let base = CausalConfig::new(1, context + 1, PREFILL_CHUNK);
    let cache = model.new_cache(&base, context + 1, model.device())?;
    let eos = tokenizer.eos_token_id();
    let mut engine: GemmaEngine<'_> = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: PREFILL_CHUNK,
            prefill_chunk: PREFILL_CHUNK,
            context: Some(context),
            keep: prompt.len(),
            stop_tokens: vec![eos],
            ..EngineConfig::default()
        },
    )?;
    engine.submit(Request::new(0, prompt, generate))?;
    let (window_base, global_base) = (model.config().rope_base_window, model.config().rope_base_global);
    let mut finished = None;
    engine.run(&mut |event| match event {
        Event::ContextShift { removed, .. } => println!(
            "  [context shift] removed positions {}..{}; later keys re-rotated (RoPE base {window_base} in \
             the window layers, {global_base} in the global ones)",
            removed.start, removed.end
        ),
        Event::Finished(f) => finished = Some(f.clone()),
        _ => {}
    })?;
    let f = finished.ok_or_else(|| EngineError::InvalidArgument("the story never finished".into()))?;
    let seconds = f.total.as_secs_f64();
    let story = reply_tokens(&f);
    println!(
        "  {} tokens in {seconds:.1} s ({:.1} tokens/s), {} context shifts",
        story.len(),
        story.len() as f64 / seconds,
        f.context_shifts
    );
    println!(
        "  text: {opening}{}",
        tokenizer.decode_text(story)?.replace('\n', "\n        ")
    );
    println!(
        "  ({})",
        match f.reason {
            FinishReason::StopToken => "the model ended the story with its end-of-sequence token",
            _ => "cut at the token limit: a story has no end of turn to stop at",
        }
    );
    Ok(())
}

/// A finished request's tokens without the stop token that ended it.
fn reply_tokens(f: &Finished) -> &[u32] {
    match f.reason {
        FinishReason::StopToken => &f.generated[..f.generated.len() - 1],
        _ => &f.generated,
    }
}

/// One turn's outcome.
struct Turn {
    prompt: usize,
    evaluated: usize,
    /// What a cache holding only the window would have evaluated.
    window_only: usize,
    /// How far behind the cached tokens' end the prompt left them.
    behind: usize,
    /// The reply, without the token that ended the turn.
    reply: Vec<u32>,
    /// Whether the model ended its turn (else `max_new` cut it).
    ended_turn: bool,
    time_to_first_token: Duration,
    /// The first reply token's log-probabilities, when asked for.
    first_logprobs: Option<TokenLogprobs>,
}

#[derive(Default)]
struct Totals {
    prompt: usize,
    evaluated: usize,
    window_only: usize,
    ttft: Duration,
    edit_ttft: Duration,
}

impl Totals {
    fn add(&mut self, t: &Turn) {
        self.prompt += t.prompt;
        self.evaluated += t.evaluated;
        self.window_only += t.window_only;
        self.ttft += t.time_to_first_token;
        if t.behind > 0 {
            self.edit_ttft += t.time_to_first_token;
        }
    }
}

/// The conversations on the engine, with prefix reuse: a conversation's
/// finished turn stays in its sequence, and its next turn (or an edit of
/// its last question) starts from the longest prefix the sequence can
/// resume from.
struct Chat<'m> {
    engine: GemmaEngine<'m>,
    /// The model's window.
    window: usize,
    /// Each conversation's namespace.
    namespaces: Vec<Namespace>,
    /// The tokens each conversation's sequence holds.
    held: Vec<Vec<u32>>,
    /// The sequence each conversation's last turn ran in.
    seqs: Vec<SeqId>,
    /// Requests submitted so far (their ids).
    requests: usize,
}

impl<'m> Chat<'m> {
    fn new(model: &'m Gemma, tokenizer: &GemmaTokenizer, base: CausalConfig, memory: usize) -> Result<Self> {
        let conversations = base.max_sequences;
        let cache = model.new_cache(&base, memory, model.device())?;
        let mut engine = Engine::new(
            model,
            cache,
            EngineConfig {
                max_batch: PREFILL_CHUNK,
                prefill_chunk: PREFILL_CHUNK,
                stop_tokens: vec![tokenizer.end_of_turn_id(), tokenizer.eos_token_id()],
                ..EngineConfig::default()
            },
        )?;
        engine.set_prefix_reuse(true)?;
        let namespaces = (0..conversations)
            .map(|c| Namespace::new(&format!("conversation-{c}")))
            .collect::<kvcache_api::Result<Vec<_>>>()?;
        Ok(Chat {
            engine,
            window: model.config().window,
            namespaces,
            held: vec![Vec::new(); conversations],
            seqs: vec![0; conversations],
            requests: 0,
        })
    }

    /// Answers `prompt` in conversation `c` with up to `max_new` greedy
    /// tokens, asking for the first token's log-probabilities when `logprobs`.
    fn turn(&mut self, c: usize, prompt: &[u32], max_new: usize, logprobs: bool) -> Result<Turn> {
        let window = self.window;
        let held = &self.held[c];
        // What the conversation's sequence shares with the prompt; at least
        // the prompt's last token is evaluated, for its logits.
        let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let start = common.min(prompt.len() - 1);
        // A window-only cache keeps the last `window` positions: it continues
        // only at the end of what it holds, or while nothing has left it.
        let window_only = if start == held.len() || held.len() < window {
            prompt.len() - start
        } else {
            prompt.len()
        };
        let behind = held.len() - start;
        let id = self.requests;
        self.requests += 1;
        let request = Request {
            namespace: self.namespaces[c].clone(),
            ..Request::new(id, prompt.to_vec(), max_new)
        };
        let sampler = if logprobs {
            let options = SamplingOptions {
                logprobs: Some(CHECKED_LOGPROBS),
                ..SamplingOptions::default()
            };
            Some(Sampler::with_options(SamplingParams::greedy(), options)?)
        } else {
            None
        };
        self.engine.submit_sampled(request, sampler)?;
        let (mut finished, mut first_logprobs) = (None, None);
        self.engine.run(&mut |event| match event {
            Event::Token { logprobs, .. } if first_logprobs.is_none() => {
                first_logprobs = Some(logprobs.clone())
            }
            Event::Finished(f) => finished = Some(f.clone()),
            _ => {}
        })?;
        let f = finished.ok_or_else(|| EngineError::InvalidArgument(format!("turn {id} never finished")))?;
        // The sequence holds the prompt and every generated token but the last.
        let mut now_held = prompt.to_vec();
        now_held.extend_from_slice(&f.generated[..f.generated.len() - 1]);
        self.held[c] = now_held;
        self.seqs[c] = f.seq;
        Ok(Turn {
            prompt: prompt.len(),
            evaluated: prompt.len() - f.reused,
            window_only,
            behind,
            reply: reply_tokens(&f).to_vec(),
            ended_turn: f.reason == FinishReason::StopToken,
            time_to_first_token: f.time_to_first_token,
            first_logprobs: first_logprobs.flatten(),
        })
    }
}
