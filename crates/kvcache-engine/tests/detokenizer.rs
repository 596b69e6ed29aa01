//! The answer's text token by token (issue 33), on the real tokenizers
//! (SmolLM2's, and Gemma 3's when `$KVCACHE_GEMMA` names its file): for
//! random token streams, multi-byte characters split across tokens and
//! control tokens among them, the pieces the detokenizer hands out join to
//! the decoding of the whole stream, and a stop sequence taken from that
//! text, however the tokens split it, is found on the token that completes
//! it and cut there exactly once.
//!
//! `decoding_cost_per_token` (ignored; run it in release, see
//! docs/BENCHMARKS.md) times both: the per-token whole-text decodes the
//! engine and the server used to make, and the detokenizer.

use std::sync::Arc;
use std::time::Instant;

use kvcache_engine::detokenizer::{Detokenizer, Pushed};
use kvcache_models::Tokenizer;
use kvcache_testkit::models::{model_file, TestModel};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn smollm() -> Option<Arc<dyn Tokenizer>> {
    let path = model_file(TestModel::SmolLM2)?;
    let file = kvcache_models::ModelFile::open(path).unwrap();
    Some(Arc::new(file.tokenizer().unwrap()))
}

fn gemma() -> Option<Arc<dyn Tokenizer>> {
    let path = model_file(TestModel::Gemma3)?;
    let file = kvcache_models::gemma::GemmaFile::open(path).unwrap();
    Some(Arc::new(file.tokenizer().unwrap()))
}

/// Text whose characters take two to four bytes, and plain text around them.
const MIXED: &str = "Smile 😀, naïve café: 日本語の文章 🎉 Ωμέγα ✓ 𝄞 ok.\n\n";

/// Where random streams draw their tokens from.
struct Pools {
    /// The tokens of [`MIXED`].
    text: Vec<u32>,
    /// Tokens that are not whole UTF-8: parts of a character.
    partial: Vec<u32>,
    /// Tokens the text leaves out (turn markers, end of sequence).
    control: Vec<u32>,
    /// The characters of [`MIXED`] longer than a byte, as one token per byte.
    split: Vec<Vec<u32>>,
    vocab: u32,
}

impl Pools {
    fn of(tokenizer: &dyn Tokenizer) -> Pools {
        let vocab = tokenizer.vocab_size() as u32;
        let text = tokenizer.encode(MIXED).unwrap();
        let partial: Vec<u32> = (0..vocab)
            .filter(|&id| {
                let bytes = tokenizer.token_bytes(id);
                !bytes.is_empty() && std::str::from_utf8(&bytes).is_err()
            })
            .take(512)
            .collect();
        let mut control = tokenizer.end_of_turn_ids();
        control.extend((0..512.min(vocab)).filter(|&id| {
            tokenizer.decode_text(&[id]).unwrap().is_empty() && !tokenizer.token_bytes(id).is_empty()
        }));
        assert!(partial.len() >= 64, "{} partial tokens", partial.len());
        let mut byte_token = std::collections::HashMap::new();
        for id in 0..vocab {
            if let [b] = tokenizer.token_bytes(id)[..] {
                byte_token.entry(b).or_insert(id);
            }
        }
        let split: Vec<Vec<u32>> = MIXED
            .chars()
            .filter(|c| c.len_utf8() > 1)
            .map(|c| c.to_string().bytes().map(|b| byte_token[&b]).collect())
            .collect();
        Pools {
            text,
            partial,
            control,
            split,
            vocab,
        }
    }

    /// Random streams: runs of the mixed text, parts of characters, control
    /// tokens and any token of the vocabulary.
    fn streams(&self) -> impl Strategy<Value = Vec<u32>> + '_ {
        let draw = (0u8..10, any::<u32>()).prop_map(move |(kind, n)| {
            let n = n as usize;
            match kind {
                0..=3 => self.text[n % self.text.len()],
                4..=6 => self.partial[n % self.partial.len()],
                7 => self.control[n % self.control.len()],
                _ => n as u32 % self.vocab,
            }
        });
        let run = (0..self.text.len(), 1usize..12)
            .prop_map(move |(at, len)| self.text[at..(at + len).min(self.text.len())].to_vec());
        let split = (0..self.split.len()).prop_map(move |i| self.split[i].clone());
        prop::collection::vec(prop_oneof![draw.prop_map(|t| vec![t]), run, split], 0..40)
            .prop_map(|parts| parts.concat())
    }
}

/// The pieces `tokens` hand out, one per token and the end's last.
fn pieces(tokenizer: &Arc<dyn Tokenizer>, stops: Vec<String>, tokens: &[u32]) -> (Vec<Pushed>, String) {
    let mut text = Detokenizer::new(tokenizer.clone(), stops);
    let pushed = tokens.iter().map(|&t| text.push(t).unwrap()).collect();
    (pushed, text.finish().unwrap())
}

fn check_tokenizer(tokenizer: Arc<dyn Tokenizer>) {
    let pools = Pools::of(&*tokenizer);
    let mut runner = TestRunner::new(Config {
        cases: 96,
        ..Config::default()
    });
    runner
        .run(
            &(pools.streams(), any::<prop::sample::Index>(), 1usize..5),
            |(tokens, at, len)| {
                let whole = tokenizer.decode_text(&tokens).unwrap();
                let (pushed, rest) = pieces(&tokenizer, Vec::new(), &tokens);
                let joined: String = pushed.iter().map(|p| p.text.as_str()).collect::<String>() + &rest;
                prop_assert_eq!(&joined, &whole);
                prop_assert!(pushed.iter().all(|p| p.stop.is_none()));

                // A stop sequence from the text: cut once, on the token completing it.
                let chars: Vec<char> = whole.chars().collect();
                if chars.is_empty() {
                    return Ok(());
                }
                let from = at.index(chars.len());
                let stop: String = chars[from..(from + len).min(chars.len())].iter().collect();
                if stop.contains('\u{fffd}') {
                    return Ok(());
                }
                let (pushed, rest) = pieces(&tokenizer, vec![stop.clone()], &tokens);
                let stops: Vec<usize> = (0..pushed.len()).filter(|&i| pushed[i].stop.is_some()).collect();
                prop_assert_eq!(stops.len(), 1, "stop {:?} in {:?}", stop, whole);
                let k = stops[0];
                prop_assert_eq!(pushed[k].stop, Some(0));
                prop_assert!(pushed[k + 1..].iter().all(|p| *p == Pushed::default()));
                prop_assert_eq!(rest, "");
                let joined: String = pushed.iter().map(|p| p.text.as_str()).collect();
                prop_assert_eq!(joined.as_str(), &whole[..whole.find(&stop).unwrap()]);
                let before = tokenizer.decode_text(&tokens[..k]).unwrap();
                let through = tokenizer.decode_text(&tokens[..=k]).unwrap();
                prop_assert!(
                    !before.contains(&stop) && through.contains(&stop),
                    "stop {:?} at token {}",
                    stop,
                    k
                );
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn pieces_join_to_the_whole_decoding_and_stops_are_cut_once_on_smollm2() {
    let Some(tokenizer) = smollm() else { return };
    check_tokenizer(tokenizer);
}

#[test]
fn pieces_join_to_the_whole_decoding_and_stops_are_cut_once_on_gemma() {
    let Some(tokenizer) = gemma() else { return };
    check_tokenizer(tokenizer);
}

#[test]
fn a_split_character_waits_for_its_last_byte_and_the_text_before_it_does_not() {
    let Some(tokenizer) = smollm() else { return };
    let tokens = tokenizer.encode("ok 😀").unwrap();
    let partial = |id: u32| std::str::from_utf8(&tokenizer.token_bytes(id)).is_err();
    let split = tokens.iter().filter(|&&id| partial(id)).count();
    assert!(split >= 2, "😀 is split over {split} tokens: {tokens:?}");
    let (pushed, rest) = pieces(&tokenizer, Vec::new(), &tokens);
    let texts: Vec<&str> = pushed.iter().map(|p| p.text.as_str()).collect();
    // Everything before the character goes out before its last byte comes
    // (the space too, though its token starts the character); the
    // character goes out whole with its last byte.
    assert_eq!(texts[..tokens.len() - 1].concat(), "ok ", "{texts:?}");
    assert_eq!(texts[tokens.len() - 1], "😀");
    assert_eq!(rest, "");
    // Cut short, the end writes the incomplete character as a whole decoding does.
    let (pushed, rest) = pieces(&tokenizer, Vec::new(), &tokens[..tokens.len() - 1]);
    let joined = pushed.iter().map(|p| p.text.as_str()).collect::<String>() + &rest;
    assert_eq!(
        joined,
        tokenizer.decode_text(&tokens[..tokens.len() - 1]).unwrap()
    );
    assert!(joined.ends_with('\u{fffd}'), "{joined:?}");
}

/// Decoding cost per token of a 1,000-token answer with a stop sequence set
/// (one that never matches, so every token is decoded and searched): the
/// whole-text decodes of before issue 33 (the engine's stop match and the
/// server's text, each decoding all generated tokens on every token) against
/// the detokenizer, in blocks of 100 tokens.
#[test]
#[ignore = "a timing: cargo test --release -p kvcache-engine --test detokenizer -- --ignored --nocapture"]
fn decoding_cost_per_token() {
    let Some(tokenizer) = smollm() else { return };
    let story = "Once upon a time, in a small village by the sea, there lived an old fisherman \
                 who told the children stories about the storms he had seen — 日本語 😀 — and \
                 the fish that got away. ";
    let mut answer = Vec::new();
    while answer.len() < 1000 {
        answer.extend(tokenizer.encode(story).unwrap());
    }
    answer.truncate(1000);
    let stop = "THE END".to_string();
    let block = 100;
    let mut old = vec![0.0f64; answer.len() / block];
    let mut new = vec![0.0f64; answer.len() / block];
    let rounds = 5;
    for _ in 0..rounds {
        // Before: each token decoded the whole answer twice (the engine's
        // stop match, the server's text) and searched the new part.
        let mut scanned = 0;
        for n in 1..=answer.len() {
            let started = Instant::now();
            let engine_text = tokenizer.decode_text(&answer[..n]).unwrap();
            let from = scanned.min(engine_text.len()).saturating_sub(stop.len() - 1);
            let from = (0..=from)
                .rev()
                .find(|&i| engine_text.is_char_boundary(i))
                .unwrap();
            assert!(!engine_text[from..].contains(&stop));
            scanned = engine_text.len();
            let server_text = tokenizer.decode_text(&answer[..n]).unwrap();
            std::hint::black_box(&server_text);
            old[(n - 1) / block] += started.elapsed().as_secs_f64();
        }
        // After: one detokenizer, a window of a few tokens per token.
        let mut text = Detokenizer::new(tokenizer.clone(), vec![stop.clone()]);
        for (i, &token) in answer.iter().enumerate() {
            let started = Instant::now();
            let pushed = text.push(token).unwrap();
            assert_eq!(pushed.stop, None);
            std::hint::black_box(&pushed);
            new[i / block] += started.elapsed().as_secs_f64();
        }
    }
    let per_token = |total: f64| total / (rounds * block) as f64 * 1e6;
    println!("tokens      before µs/token   after µs/token");
    for (i, (o, n)) in old.iter().zip(&new).enumerate() {
        println!(
            "{:>4}-{:<4}  {:>15.1}  {:>15.2}",
            i * block + 1,
            (i + 1) * block,
            per_token(*o),
            per_token(*n)
        );
    }
    let sum = |v: &[f64]| v.iter().sum::<f64>() / rounds as f64 * 1e3;
    println!(
        "whole answer: before {:.1} ms, after {:.2} ms",
        sum(&old),
        sum(&new)
    );
}
