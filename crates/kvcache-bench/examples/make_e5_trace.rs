//! Writes the E5 trace (`fixtures/e5_trace.json`): 10 conversations x 8 turns
//! in Gemma 3's turn format, opened by one instruction shorter than the window,
//! growing past 3 windows (turn-8 prompts about 1,700 tokens), tokenized by
//! our Gemma tokenizer. Deterministic: a fixed word list and seed.
//!
//! ```text
//! cargo run --release -p kvcache-bench --example make_e5_trace -- [GEMMA_GGUF] [OUT]
//! ```
//!
//! `GEMMA_GGUF` defaults to `$KVCACHE_GEMMA`, `OUT` to `fixtures/e5_trace.json`.

use std::path::PathBuf;

use kvcache_bench::e5::{e5_trace_path, E5Meta, E5Trace, E5Turn};
use kvcache_models::gemma::{GemmaFile, GEMMA_ENV};

const WORDS: &[&str] = &[
    "about",
    "against",
    "alone",
    "also",
    "always",
    "answer",
    "another",
    "back",
    "because",
    "before",
    "between",
    "block",
    "bright",
    "cache",
    "careful",
    "city",
    "day",
    "early",
    "engine",
    "even",
    "forest",
    "garden",
    "good",
    "great",
    "green",
    "harbor",
    "house",
    "into",
    "know",
    "last",
    "late",
    "life",
    "long",
    "market",
    "memory",
    "model",
    "modern",
    "morning",
    "mountain",
    "never",
    "often",
    "open",
    "people",
    "place",
    "point",
    "quiet",
    "rarely",
    "reason",
    "request",
    "river",
    "road",
    "server",
    "signal",
    "simple",
    "small",
    "sometimes",
    "station",
    "steady",
    "still",
    "system",
    "together",
    "under",
    "water",
    "window",
    "world",
    "years",
    "light",
    "stone",
    "paper",
    "winter",
    "summer",
    "bridge",
    "letter",
    "number",
    "table",
    "valley",
    "question",
    "travel",
    "music",
    "island",
    "friend",
];

const SEED: u64 = 5;
const CONVERSATIONS: usize = 10;
const TURNS: usize = 8;
const N_PREDICT: usize = 8;
const WINDOW: usize = 512;
/// Words of the instruction, of a user message and of a scripted reply.
const INSTRUCTION_WORDS: usize = 220;
const USER_WORDS: usize = 50;
const REPLY_WORDS: usize = 115;

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `words` words in sentences of 6 to 13 words.
    fn text(&mut self, words: usize) -> String {
        let mut out = String::new();
        let mut left_in_sentence = 0;
        for i in 0..words {
            let w = WORDS[self.below(WORDS.len())];
            if left_in_sentence == 0 {
                if i > 0 {
                    out.push_str(". ");
                }
                left_in_sentence = 6 + self.below(8);
                let mut c = w.chars();
                let first = c.next().expect("non-empty word");
                out.extend(first.to_uppercase());
                out.push_str(c.as_str());
            } else {
                out.push(' ');
                out.push_str(w);
            }
            left_in_sentence -= 1;
        }
        out.push('.');
        out
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let gemma = args
        .next()
        .map(PathBuf::from)
        .or_else(|| std::env::var_os(GEMMA_ENV).map(PathBuf::from))
        .ok_or("give the Gemma GGUF's path or set KVCACHE_GEMMA")?;
    let out = args.next().map(PathBuf::from).unwrap_or_else(e5_trace_path);
    let tokenizer = GemmaFile::open(&gemma)?.tokenizer()?;

    let mut rng = Rng(SEED);
    let instruction = format!(
        "You are a careful assistant. Answer every question in the voice of this notebook: {}",
        rng.text(INSTRUCTION_WORDS)
    );
    let conversations: Vec<Vec<E5Turn>> = (0..CONVERSATIONS)
        .map(|_| {
            (0..TURNS)
                .map(|_| E5Turn {
                    user: rng.text(USER_WORDS),
                    model: rng.text(REPLY_WORDS),
                })
                .collect()
        })
        .collect();
    let meta = E5Meta {
        name: "E5 interleaved multi-conversation chat on a sliding-window model".into(),
        generator: format!(
            "cargo run --release -p kvcache-bench --example make_e5_trace (SplitMix64 seed {SEED}, fixed word list)"
        ),
        tokenizer: "Gemma 3 270M GGUF tokenizer (kvcache_models::gemma), <bos> added, special tokens parsed".into(),
        n_conversations: 0,
        n_turns: 0,
        n_predict: N_PREDICT,
        window: WINDOW,
        total_prompt_tokens: 0,
        total_min_prefill: 0,
    };
    let trace = E5Trace::build(meta, &instruction, conversations, |text| {
        tokenizer.encode(text, true, true)
    })?;
    let last: Vec<usize> = trace
        .requests
        .iter()
        .filter(|r| r.turn == TURNS)
        .map(|r| r.prompt_tokens)
        .collect();
    println!(
        "{} requests, {} prompt tokens, minimum prefill {}, turn-{TURNS} prompts {}..{} tokens, instruction {} tokens",
        trace.requests.len(),
        trace.meta.total_prompt_tokens,
        trace.meta.total_min_prefill,
        last.iter().min().unwrap_or(&0),
        last.iter().max().unwrap_or(&0),
        tokenizer.encode(&instruction, false, false).len(),
    );
    std::fs::write(&out, serde_json::to_string(&trace)? + "\n")?;
    println!("wrote {}", out.display());
    Ok(())
}
