//! Gemma 3 on mlx-rs through the prefix trie: window layers on rotating
//! caches, global layers on KV caches (`MixedLayer`s), against a full
//! recompute with the windowed attention computed from scratch.
//!
//! - The mlx model's full recompute equals the candle model's (an independent
//!   implementation) on the same weights: random ones on a tiny Gemma, and the
//!   real file's dequantized to f32.
//! - Every logit row computed through the trie equals the mlx full recompute
//!   of the tokens the caches hold (<= 1e-3 on the real model, f32), over
//!   conversations many windows long: two conversations sharing a prefix,
//!   alternating turn by turn (branch switches), a fork behind the end of a
//!   conversation (inside a cached edge, far behind the window), and a trie
//!   budget small enough that snapshots are evicted and later re-evaluated.
//! - Each continued turn resumes exactly where its previous prompt ended (the
//!   restore point taken there), however far past the window the
//!   conversation is, while the budget keeps the snapshots.
//!
//! The real model (`$KVCACHE_GEMMA`, skipped with a printed reason without it)
//! runs with its window layers narrowed from 512 to 128 positions, so the
//! conversations outgrow 3 windows in a short run (the mask, the caches and the
//! reference all use the same window).
//!
//! Not covered: a context shift (dropping the oldest positions and moving the
//! rest back) has no counterpart in the trie, whose nodes are prefixes from
//! position 0; the candle `LayerGroupCache` covers it (tests/gemma.rs).
//! Nor are quantized weights: `MlxGemma` multiplies the GGUF's weights
//! dequantized to f32 (the quantized runs are candle's, tests/gemma.rs).
//!
//! Time: 116-119 s for `cargo xtask test -p kvcache-engine --test gemma_mlx`
//! on the 2-core Linux machine (mlx on the CPU), nearly all of it the real
//! model (loading it twice, mlx and candle, about 40 s).
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod common;

use candle_core::Device;
use common::testing::Trace;
use kvcache_api::{LayerCache, MixedLayer, SnapshotCache};
use kvcache_models::argmax;
use std::time::Instant;

use kvcache_engine::mlx::MlxGemmaChat;
use kvcache_mlx::layers::{KvCache, RotatingKvCache};
use kvcache_models::gemma::tokenizer::end_of_reply;
use kvcache_models::gemma::{chat_turn, Gemma, GemmaConfig, GemmaFile, GemmaTokenizer};
use kvcache_models::mlx::model::to_host;
use kvcache_models::mlx::{MlxGemma, MlxGemmaLayer};
use kvcache_models::ModelError;
use kvcache_models::{paths, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};
use kvcache_trie::PrefixCache;
use mlx_rs::Array;

/// The bound on |cached - recomputed| logits, f32.
const TOL: f32 = 1e-3;

/// Largest absolute difference between two equally long slices.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Rows `rows` of hidden states `[n, dim]`, `[rows.len(), dim]`.
fn rows_of(hidden: &Array, rows: &[usize]) -> Array {
    let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
    hidden
        .take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0)
        .unwrap()
}

/// A tiny Gemma of 6 layers, every third global (window 8), so window layers
/// sit both below and above a global one.
fn tiny_config() -> GemmaConfig {
    GemmaConfig {
        n_layers: 6,
        global_every: 3,
        ..GemmaConfig::tiny()
    }
}

/// One request's outcome.
#[derive(Debug)]
struct Turn {
    /// Prompt tokens the trie restored.
    cached: usize,
    /// The tokens the caches hold afterwards (prompt and evaluated replies).
    held: Vec<u32>,
}

/// Requests through one trie, each compared with a full recompute.
struct Driver<'m> {
    model: &'m MlxGemma,
    trie: PrefixCache<MlxGemmaLayer>,
    /// Compare positions that are multiples of this, and the last of each chunk.
    stride: usize,
    /// Largest |cached - recomputed| logit so far.
    max_diff: f32,
    /// Logit rows compared.
    rows: usize,
}

impl<'m> Driver<'m> {
    fn new(model: &'m MlxGemma, budget: usize, stride: usize) -> Self {
        Driver {
            model,
            trie: PrefixCache::new(model.new_caches(16).unwrap(), budget).unwrap(),
            stride,
            max_diff: 0.0,
            rows: 0,
        }
    }

    /// Runs one turn: restores what the trie has, prefills the rest (taking
    /// the branch-point snapshots the trie asks for), keeps a restore point at
    /// the prompt's end, then generates `generate` greedy tokens (evaluating
    /// all but the last). Every chosen row is compared with the full
    /// recompute of the tokens the caches hold at the end.
    fn request(&mut self, prompt: &[u32], generate: usize) -> Turn {
        let model = self.model;
        let mut s = self.trie.begin(prompt).unwrap();
        let cached = s.cached();
        assert!(s.caches().iter().all(|c| c.offset() == cached));
        // (positions, hidden rows [k, dim]) of the cached path.
        let mut got: Vec<(Vec<usize>, Array)> = vec![];
        let mut last = None;
        loop {
            let start = s.offset();
            let (tokens, caches) = s.next_chunk().unwrap();
            if tokens.is_empty() {
                break;
            }
            let n = tokens.len();
            let h = model.hidden_layers(tokens, caches).unwrap();
            let rows: Vec<usize> = (0..n)
                .filter(|&i| (start + i).is_multiple_of(self.stride) || i + 1 == n)
                .collect();
            got.push((rows.iter().map(|i| start + i).collect(), rows_of(&h, &rows)));
            last = Some(rows_of(&h, &[n - 1]));
        }
        assert_eq!(s.offset(), prompt.len());
        s.snapshot(true).unwrap();
        let mut held = prompt.to_vec();
        let mut token = model.next_token(&last.unwrap()).unwrap();
        for i in 0..generate {
            if i + 1 == generate {
                s.record(token);
                break;
            }
            let at = s.offset();
            let h = s
                .decode(token, |t, caches| model.hidden_layers(t, caches))
                .unwrap();
            held.push(token);
            token = model.next_token(&h).unwrap();
            got.push((vec![at], h));
        }
        s.close().unwrap();
        self.trie.check();
        assert_eq!(self.trie.offset(), held.len());
        let full = model.hidden_full(&held).unwrap();
        for (positions, rows) in &got {
            let cached_logits = to_host(&model.logits(rows).unwrap()).unwrap();
            let want = to_host(&model.logits(&rows_of(&full, positions)).unwrap()).unwrap();
            self.max_diff = self.max_diff.max(max_abs_diff(&cached_logits, &want));
            self.rows += positions.len();
        }
        Turn { cached, held }
    }
}

/// A conversation: the user's tokens and the reply the next turn carries
/// (the trace's, not the generated one), per turn.
type Turns = Vec<(Vec<u32>, Vec<u32>)>;

/// What one schedule saw, for the caller's checks.
#[derive(Debug, Default)]
struct Seen {
    /// Per continued turn: (end of the conversation's previous prompt, tokens restored).
    continued: Vec<(usize, usize)>,
    /// Tokens restored by the fork, and where it forked.
    fork: (usize, usize),
    /// The longest conversation, in tokens.
    longest: usize,
}

/// Two conversations that share `shared` run turn by turn in alternation
/// (each turn switches branches), then a fork of conversation 0 at `fork_at`
/// (behind its end) with `fork` tokens; every turn generates `generate` tokens.
fn run_schedule(
    driver: &mut Driver<'_>,
    shared: &[u32],
    conversations: [&Turns; 2],
    fork_at: usize,
    fork: &[u32],
    generate: usize,
) -> Seen {
    let mut seen = Seen::default();
    let mut history = [shared.to_vec(), shared.to_vec()];
    let mut prompt_end = [0, 0];
    let turns = conversations[0].len().min(conversations[1].len());
    for t in 0..turns {
        for (c, conversation) in conversations.iter().enumerate() {
            let (user, reply) = &conversation[t];
            let mut prompt = history[c].clone();
            prompt.extend(user);
            let turn = driver.request(&prompt, generate);
            assert_eq!(&turn.held[..prompt.len()], &prompt[..]);
            if t > 0 {
                seen.continued.push((prompt_end[c], turn.cached));
            }
            prompt_end[c] = prompt.len();
            history[c] = prompt;
            history[c].extend(reply);
            seen.longest = seen.longest.max(turn.held.len());
        }
    }
    assert!(fork_at < prompt_end[0]);
    let mut prompt = history[0][..fork_at].to_vec();
    prompt.extend(fork);
    seen.fork = (driver.request(&prompt, generate).cached, fork_at);
    seen
}

/// Checks a schedule's outcome under `budget`: every row within [`TOL`];
/// with an unbounded budget every continued turn resumes at its previous
/// prompt's end at least; with a small one the trie evicted and re-evaluated.
fn check_schedule(driver: &Driver<'_>, seen: &Seen, budget: usize, window: usize) {
    let stats = driver.trie.stats();
    println!(
        "budget {budget}: {} rows, max |cached - recompute| {:.2e}, longest {} tokens ({:.1} windows), \
         continued turns (previous prompt end, restored) {:?}, fork {:?}, evictions {}, page-ins {}",
        driver.rows,
        driver.max_diff,
        seen.longest,
        seen.longest as f64 / window as f64,
        seen.continued,
        seen.fork,
        stats.evictions,
        stats.page_ins
    );
    assert!(seen.longest >= 3 * window, "conversations outgrow 3 windows");
    assert!(driver.max_diff <= TOL, "budget {budget}: {}", driver.max_diff);
    assert!(
        seen.fork.0 <= seen.fork.1,
        "the fork restores no more than it shares"
    );
    if budget == usize::MAX {
        assert_eq!(stats.evictions, 0);
        for &(end, cached) in &seen.continued {
            assert!(
                cached >= end,
                "resumed at {cached}, the previous prompt ended at {end}"
            );
        }
    } else {
        assert!(stats.evictions > 0, "budget {budget} evicted nothing");
        assert!(
            seen.continued.iter().any(|&(end, cached)| cached < end),
            "budget {budget}: every turn still resumed at its previous prompt's end"
        );
    }
}

/// Pseudo-random tokens below `vocab` (xorshift).
fn tokens(state: &mut u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (*state % vocab as u64) as u32
        })
        .collect()
}

#[test]
fn tiny_full_recompute_equals_the_candle_model() {
    let config = tiny_config();
    let mlx = MlxGemma::random(config.clone(), 11).unwrap();
    let candle = Gemma::random(config.clone(), 11, &Device::Cpu).unwrap();
    let ids = tokens(&mut 0x9E37_79B9, 5 * config.window, config.vocab_size);
    let want: Vec<f32> = candle
        .forward_full(&ids)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let got = to_host(&mlx.forward_full(&ids).unwrap()).unwrap();
    let diff = max_abs_diff(&got, &want);
    println!("tiny: mlx vs candle full recompute {diff:.2e}");
    assert!(diff <= 1e-4, "{diff}");
    // The window matters here: without it the logits are far apart.
    let unwindowed = mlx
        .with_choices(GemmaConfig {
            window: 1000,
            ..config
        })
        .unwrap();
    let far = max_abs_diff(&to_host(&unwindowed.forward_full(&ids).unwrap()).unwrap(), &want);
    assert!(far > 1e-2, "window or not: {far}");
}

fn tiny_schedule(state: &mut u64, vocab: usize) -> (Vec<u32>, [Turns; 2], Vec<u32>) {
    let shared = tokens(state, 20, vocab);
    let mut conversation = || -> Turns {
        (0..5)
            .map(|_| (tokens(state, 9, vocab), tokens(state, 7, vocab)))
            .collect()
    };
    let conversations = [conversation(), conversation()];
    (shared, conversations, tokens(state, 6, vocab))
}

#[test]
fn tiny_conversations_through_the_trie_equal_recompute() {
    let config = tiny_config();
    let model = MlxGemma::random(config.clone(), 5).unwrap();
    let (shared, conversations, fork) = tiny_schedule(&mut 0x2545_F491, config.vocab_size);
    // Position 43 lies inside the second turn's user tokens of conversation 0.
    for budget in [usize::MAX, 48_000, 12_000, 0] {
        let mut driver = Driver::new(&model, budget, 1);
        let seen = run_schedule(
            &mut driver,
            &shared,
            [&conversations[0], &conversations[1]],
            43,
            &fork,
            3,
        );
        check_schedule(&driver, &seen, budget, config.window);
    }
}

#[test]
fn caches_of_the_wrong_kind_or_window_are_refused_unchanged() {
    let config = tiny_config();
    let model = MlxGemma::random(config.clone(), 5).unwrap();
    let mut caches = model.new_caches(16).unwrap();
    let kinds: Vec<bool> = caches.iter().map(MixedLayer::is_window).collect();
    assert_eq!(kinds, [true, true, false, true, true, false]);
    model.hidden_layers(&[1, 2, 3], &mut caches).unwrap();
    let mut all_global: Vec<MlxGemmaLayer> = (0..6).map(|_| MixedLayer::Global(KvCache::new())).collect();
    let mut narrow = model.new_caches(16).unwrap();
    narrow[0] = MixedLayer::Window(RotatingKvCache::new(4).unwrap());
    for wrong in [&mut all_global, &mut narrow] {
        let err = model.hidden_layers(&[1, 2, 3], wrong).unwrap_err();
        assert!(matches!(err, ModelError::InvalidArgument(_)), "{err:?}");
        assert!(wrong.iter().all(|c| c.offset() == 0 && c.state().is_empty()));
    }
    let err = model.hidden_layers(&[1, 64], &mut caches).unwrap_err();
    assert!(matches!(err, ModelError::InvalidArgument(_)), "{err:?}");
    assert!(caches.iter().all(|c| c.offset() == 3));
}

/// The chat answers interleaved conversations with the greedy tokens of
/// a full recompute, resuming each at its previous prompt's end.
#[test]
fn the_tiny_chat_generates_the_recomputed_tokens() {
    let config = tiny_config();
    let model = MlxGemma::random(config.clone(), 9).unwrap();
    let (shared, conversations, _) = tiny_schedule(&mut 0x1234_5678, config.vocab_size);
    let mut chat = MlxGemmaChat::with_step(&model, usize::MAX, 16).unwrap();
    let mut history = [shared.clone(), shared.clone()];
    let mut prompt_end = [0, 0];
    for t in 0..5 {
        for (c, conversation) in conversations.iter().enumerate() {
            let (user, reply) = &conversation[t];
            history[c].extend(user);
            let out = chat.generate(&history[c], 4, None).unwrap();
            let mut ids = history[c].clone();
            for &got in &out.generated {
                let logits = to_host(&model.forward_full(&ids).unwrap()).unwrap();
                let want = argmax(&logits[(ids.len() - 1) * config.vocab_size..]);
                assert_eq!(got, want, "conversation {c} turn {t}");
                ids.push(got);
            }
            if t > 0 {
                assert_eq!(
                    out.matched, prompt_end[c],
                    "conversation {c} turn {t} resumes at its last prompt"
                );
            }
            prompt_end[c] = history[c].len();
            history[c].extend(reply);
        }
    }
    chat.trie().expect("a trie chat").check();
}

/// The E1 trace in Gemma's turn format: its system prompt (after `<bos>`) as
/// the shared start, conversations 0 and 1 as the two conversations (`turns`
/// turns each), and conversation 2's first user turn as the fork.
fn real_schedule(t: &GemmaTokenizer, turns: usize) -> (Vec<u32>, [Turns; 2], Vec<u32>) {
    let trace = Trace::load(paths::e1_trace_path()).unwrap();
    let shared = t.encode(&format!("{}\n\n", trace.system), true, false);
    let conversation = |c: usize| -> Turns {
        trace.conversations[c][..turns]
            .iter()
            .map(|turn| {
                (
                    t.encode(&chat_turn(&turn.user), false, true),
                    t.encode(&end_of_reply(&turn.assistant), false, true),
                )
            })
            .collect()
    };
    let fork = t.encode(&chat_turn(&trace.conversations[2][0].user), false, true);
    (shared, [conversation(0), conversation(1)], fork)
}

/// The real Gemma 3 270M, f32 weights dequantized from the GGUF: the mlx full
/// recompute equals the candle model's past the real window (512), and with the
/// window narrowed to 128 two conversations sharing the trace's system prompt
/// run through the trie (alternating, a fork, then again under a budget that
/// evicts) with every compared logit row within 1e-3 of the full recompute.
#[test]
fn real_gemma_through_the_trie_equals_recompute() {
    let Some(path) = model_file(TestModel::Gemma3) else {
        return;
    };
    let t0 = Instant::now();
    let file = GemmaFile::open(&path).unwrap();
    let t = file.tokenizer().unwrap();
    let model = MlxGemma::load(&path, &mut |_| {}).unwrap();
    assert_eq!(model.config().window, 512);
    println!("loaded in {:.1?}", t0.elapsed());

    // An independent reference: candle's f32 Gemma, 600 tokens, the real window.
    let (shared, conversations, fork) = real_schedule(&t, 2);
    let mut text = shared.clone();
    for (user, reply) in conversations.iter().flatten() {
        text.extend(user);
        text.extend(reply);
    }
    text.truncate(600);
    assert_eq!(text.len(), 600, "the trace gives 600 tokens");
    let rows: Vec<usize> = (0..600).step_by(37).chain([599]).collect();
    let candle = file.load(&Device::Cpu, WeightMode::F32, &mut |_| {}).unwrap();
    let hidden = candle.hidden_full(&text).unwrap();
    let picked = candle_core::Tensor::new(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), &Device::Cpu)
        .and_then(|idx| hidden.index_select(&idx, 0))
        .unwrap();
    let want: Vec<f32> = candle
        .logits(&picked)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    drop(candle);
    let got = to_host(
        &model
            .logits(&rows_of(&model.hidden_full(&text).unwrap(), &rows))
            .unwrap(),
    )
    .unwrap();
    let diff = max_abs_diff(&got, &want);
    println!(
        "mlx vs candle full recompute, 600 tokens, {} rows: {diff:.2e} ({:.1?})",
        rows.len(),
        t0.elapsed()
    );
    assert!(diff <= TOL, "{diff}");

    let window = 128;
    let narrow = model
        .with_choices(GemmaConfig {
            window,
            ..model.config().clone()
        })
        .unwrap();
    // Inside conversation 0's first user turn, behind the system prompt.
    let fork_at = shared.len() + conversations[0][0].0.len() / 2;
    // 4 MiB: less than one window snapshot of every window layer (15 x 128 x 2 KiB)
    // plus the global rows of a conversation.
    for budget in [usize::MAX, 4 << 20] {
        let mut driver = Driver::new(&narrow, budget, 32);
        let seen = run_schedule(
            &mut driver,
            &shared,
            [&conversations[0], &conversations[1]],
            fork_at,
            &fork,
            4,
        );
        check_schedule(&driver, &seen, budget, window);
        println!("({:.1?})", t0.elapsed());
    }
}
