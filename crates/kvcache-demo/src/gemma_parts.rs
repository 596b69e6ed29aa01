//! The demo's windowed parts on Gemma 3 270M (`--model gemma3`), a model whose
//! layers attend through a sliding window of 512 positions, five in six of them,
//! through a `LayerGroupCache` (window layers keeping a memory beyond the
//! window, global layers everything):
//!
//! - chat past the window: conversations longer than the window, continued
//!   turn after turn from the cache, then a question edited, which resumes
//!   behind the end (where a cache holding only the window recomputes the
//!   whole prompt, llama.cpp's "forcing full prompt re-processing"), its
//!   first logits checked against a full recompute (f32 weights);
//! - a context shift: one sequence generating past its context, both kinds
//!   of layers re-rotating their keys with their own RoPE base.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, IndexOp, Tensor, D};
use kvcache_api::{CausalCache, CausalConfig, Pos, PosRange, SeqId};
use kvcache_causal::LayerGroupCache;
use kvcache_engine::Result;
use kvcache_models::gemma::{Gemma, GemmaFile, GemmaTokenizer};
use kvcache_models::{BatchToken, WeightMode};

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
        chat(&model, &tokenizer, cli)?;
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

/// Conversations past the window: each in its own sequence of one
/// `LayerGroupCache`, turns interleaved, the last question of each edited.
pub fn chat(model: &Gemma, tokenizer: &GemmaTokenizer, cli: &Cli) -> Result<()> {
    let window = model.config().window;
    let memory = window + MEMORY_BEYOND_WINDOW;
    let conversations = QUESTIONS.len();
    let base = CausalConfig::new(conversations, conversations * 2048, PREFILL_CHUNK);
    let mut chat = Chat::new(model, tokenizer, base, memory)?;
    println!(
        "\n== chat past the window: {conversations} conversations, one sequence each of a LayerGroupCache \
         (window layers: window {window}, memory {memory}; global layers: everything) =="
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
    let mut totals = Totals::default();
    let turns = QUESTIONS[0].len() + 1;
    for turn in 0..turns {
        for (c, history) in histories.iter_mut().enumerate() {
            let edit = turn == turns - 1;
            let question = QUESTIONS[c].get(turn).copied().unwrap_or(EDITED[c]);
            if edit {
                // The user rewrites the last question: the conversation goes
                // back to before it.
                history.truncate(chat.turn_starts[c]);
            }
            chat.turn_starts[c] = history.len();
            let mut prompt = history.clone();
            prompt.extend(tokenizer.encode_user_turn(question, false));
            let t = chat.turn(c as SeqId, &prompt, cli.demo.max_new)?;
            totals.add(&t);
            report_turn(tokenizer, c, turn, edit, question, &t, window)?;
            if edit && c == 0 {
                if cli.model.weights == WeightMode::Candle {
                    println!(
                        "      (no check against a full recompute with --weights candle: its kernels round \
                         activations to 8 bits, so a recompute without a cache differs by ~1 in the \
                         logits; kvcache-models' tests/gemma.rs checks that run layer by layer)"
                    );
                } else {
                    verify(model, &prompt, &t.first_logits)?;
                }
            }
            *history = prompt;
            history.extend(&t.reply);
            history.extend(tokenizer.encode_reply_end(""));
        }
    }
    let groups = chat.cache.groups();
    let per_cell: Vec<usize> = groups.iter().map(|g| g.storage_bytes_per_cell()).collect();
    println!("  per conversation, what the cache holds against a full-size cache of the same context (llama.cpp's --swa-full):");
    for c in 0..conversations {
        let kept: Vec<usize> = groups.iter().map(|g| g.positions(c as SeqId).len()).collect();
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
    let reply = tokenizer.decode(&t.reply)?;
    println!("      model: {}", reply.trim().replace('\n', "\n             "));
    report::flush();
    Ok(())
}

/// Compares the first reply token's logits through the cache with a full
/// recompute of `prompt` (windowed attention from scratch, no cache).
fn verify(model: &Gemma, prompt: &[u32], cached: &Tensor) -> Result<()> {
    let t0 = Instant::now();
    let hidden = model.hidden_full(prompt)?;
    let n = prompt.len();
    let full = model.logits(&hidden.i(n - 1..n)?)?.squeeze(0)?;
    let diff = (cached - &full)?.abs()?.max(0)?.to_scalar::<f32>()?;
    println!(
        "      (check: these logits through the cache against a full recompute of the {n} tokens in \
         {:.1} s: max difference {diff:.1e})",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// One sequence generating past a context of `2 * --context` positions:
/// when it is full, half of it (after the prompt) is removed and the later
/// keys re-rotated.
pub fn shift(model: &Gemma, tokenizer: &GemmaTokenizer, cli: &Cli) -> Result<()> {
    let context = 2 * cli.demo.context;
    let generate = context + context / 2;
    let prompt = tokenizer.encode("Once upon a time, in a small town by a river,", true, false);
    if prompt.len() + 2 > context {
        println!("\n== context shift: skipped (the prompt does not fit a context of {context}) ==");
        return Ok(());
    }
    println!(
        "\n== context shift: one sequence with a context of {context} positions generating {generate} tokens =="
    );
    let base = CausalConfig::new(1, context, PREFILL_CHUNK);
    let mut chat = Chat::new(model, tokenizer, base, context)?;
    let keep = prompt.len();
    let drop = (context - keep) / 2;
    let t0 = Instant::now();
    let mut logits = chat.eval(0, &prompt, 0)?;
    let (mut len, mut shifts) = (prompt.len(), 0);
    let mut generated = Vec::with_capacity(generate);
    while generated.len() < generate {
        let next = argmax(&logits)?;
        if next == tokenizer.eos_token_id() {
            break;
        }
        generated.push(next);
        if len == context {
            let removed = PosRange::from(keep as Pos..(keep + drop) as Pos);
            chat.cache.remove(0, removed)?;
            len -= drop;
            shifts += 1;
            println!(
                "  [context shift] removed positions {keep}..{}; later keys re-rotated (RoPE base {} in \
                 the window layers, {} in the global ones)",
                keep + drop,
                model.config().rope_base_window,
                model.config().rope_base_global
            );
        }
        logits = chat.eval(0, &[next], len)?;
        len += 1;
    }
    let seconds = t0.elapsed().as_secs_f64();
    println!(
        "  {} tokens in {seconds:.1} s ({:.1} tokens/s), {shifts} context shifts",
        generated.len(),
        generated.len() as f64 / seconds
    );
    println!(
        "  text: Once upon a time, in a small town by a river,{}",
        tokenizer.decode(&generated)?.replace('\n', "\n        ")
    );
    Ok(())
}

/// One turn's outcome.
struct Turn {
    prompt: usize,
    evaluated: usize,
    /// What a cache holding only the window would have evaluated.
    window_only: usize,
    /// How far behind the cached tokens' end the prompt left them.
    behind: usize,
    reply: Vec<u32>,
    time_to_first_token: Duration,
    /// The logits `[vocab_size]` the first reply token was chosen from.
    first_logits: Tensor,
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

/// Greedy generation over a `LayerGroupCache`, the tokens each sequence holds
/// beside it.
struct Chat<'m> {
    model: &'m Gemma,
    tokenizer: &'m GemmaTokenizer,
    cache: LayerGroupCache,
    held: Vec<Vec<u32>>,
    /// Where each conversation's last user turn starts.
    turn_starts: Vec<usize>,
}

impl<'m> Chat<'m> {
    fn new(
        model: &'m Gemma,
        tokenizer: &'m GemmaTokenizer,
        base: CausalConfig,
        memory: usize,
    ) -> Result<Self> {
        let sequences = base.max_sequences;
        let cache = model.new_cache(&base, memory, model.device())?;
        Ok(Chat {
            model,
            tokenizer,
            cache,
            held: vec![Vec::new(); sequences],
            turn_starts: vec![0; sequences],
        })
    }

    /// Answers `prompt` in sequence `seq`: reuses the longest prefix the
    /// sequence holds (going back behind its end when the prompt leaves
    /// it), evaluates the rest, then generates up to `max_new` tokens.
    fn turn(&mut self, seq: SeqId, prompt: &[u32], max_new: usize) -> Result<Turn> {
        let held = &self.held[seq];
        let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        // At least the prompt's last token is evaluated, for its logits.
        let mut start = common.min(prompt.len() - 1);
        let window = self.model.config().window;
        // A window-only cache keeps the last `window` positions: it continues
        // only at the end of what it holds, or while nothing has left it.
        let window_only = if start == held.len() || held.len() < window {
            prompt.len() - start
        } else {
            prompt.len()
        };
        let behind = held.len() - start;
        if start < held.len() {
            if !self.cache.can_resume(seq, start as Pos) {
                start = 0;
            }
            self.cache.remove(seq, PosRange::from(start as Pos..))?;
        }
        let t0 = Instant::now();
        let mut logits = self.eval(seq, &prompt[start..], start)?;
        let mut next = argmax(&logits)?;
        let time_to_first_token = t0.elapsed();
        let first_logits = logits.clone();
        let mut reply = Vec::new();
        let stop = [self.tokenizer.end_of_turn_id(), self.tokenizer.eos_token_id()];
        while reply.len() < max_new && !stop.contains(&next) {
            reply.push(next);
            logits = self.eval(seq, &[next], prompt.len() + reply.len() - 1)?;
            next = argmax(&logits)?;
        }
        let mut held = prompt.to_vec();
        held.extend(&reply);
        self.held[seq] = held;
        Ok(Turn {
            prompt: prompt.len(),
            evaluated: prompt.len() - start,
            window_only,
            behind,
            reply,
            time_to_first_token,
            first_logits,
        })
    }

    /// Evaluates `tokens` at positions `from..` of `seq`, in passes of at most
    /// [`PREFILL_CHUNK`]; returns the last token's logits `[vocab_size]`.
    fn eval(&mut self, seq: SeqId, tokens: &[u32], from: usize) -> Result<Tensor> {
        let mut last = None;
        for (k, part) in tokens.chunks(PREFILL_CHUNK).enumerate() {
            let at = from + k * PREFILL_CHUNK;
            let batch: Vec<BatchToken> = part
                .iter()
                .enumerate()
                .map(|(i, &token)| BatchToken {
                    seq,
                    pos: (at + i) as Pos,
                    token,
                })
                .collect();
            let hidden = self.model.hidden(&batch, &mut self.cache)?;
            last = Some(hidden.i(part.len() - 1..part.len())?);
        }
        let last = last.expect("at least one token to evaluate");
        Ok(self.model.logits(&last)?.squeeze(0)?)
    }
}

fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits
        .argmax(D::Minus1)?
        .to_dtype(DType::U32)?
        .to_scalar::<u32>()?)
}
