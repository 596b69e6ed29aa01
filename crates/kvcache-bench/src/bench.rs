//! Benchmarks E1 and E2 of BENCHMARKS.md: E1 replays the scripted multi-conversation
//! chat trace with three reuse policies; E2 decodes 8 sequences together through
//! one causal cache vs the same 8 one after another.

use std::fmt;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use kvcache_api::{CausalConfig, Pos};
use kvcache_engine::chat::{Chat, Reuse, TurnOutcome};
use kvcache_engine::{EngineError, Result};
use kvcache_models::argmax;
use kvcache_models::{BatchToken, Llama};

use crate::trace::Trace;
use crate::workloads::causal_cache;

/// Short user questions: the demo's default questions and E2's eight sequences.
pub const SAMPLE_QUESTIONS: &[&str] = &[
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain what a cache is in one sentence.",
    "What is 12 times 7?",
    "Name three planets of the solar system.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot.",
];

/// E2's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E2Config {
    /// Tokens each sequence decodes in the timed part.
    pub tokens: usize,
    /// Alternating runs of both modes (medians are reported).
    pub runs: usize,
}

/// E2's results: decode throughput of both modes, per run.
#[derive(Debug, Clone, PartialEq)]
pub struct E2Report {
    /// Sequences.
    pub sequences: usize,
    /// Prompt length of each sequence.
    pub prompt_tokens: Vec<usize>,
    /// Tokens each sequence decodes.
    pub tokens: usize,
    /// Tokens/s with all sequences in each decode pass, per run.
    pub together: Vec<f64>,
    /// Tokens/s decoding the sequences one after another, per run.
    pub sequential: Vec<f64>,
    /// Sequences whose greedy tokens differ between the two modes (batched
    /// matmuls round differently; a near tie can flip a token).
    pub mismatched_sequences: usize,
}

impl E2Report {
    /// Median tokens/s together.
    pub fn together_median(&self) -> f64 {
        median(&self.together)
    }

    /// Median tokens/s one after another.
    pub fn sequential_median(&self) -> f64 {
        median(&self.sequential)
    }

    /// Median of the per-run ratios together / one after another.
    pub fn ratio(&self) -> f64 {
        let r: Vec<f64> = self
            .together
            .iter()
            .zip(&self.sequential)
            .map(|(t, s)| t / s)
            .collect();
        median(&r)
    }
}

impl fmt::Display for E2Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "E2 batched decode: {} sequences x {} decode tokens (prompts of {:?} tokens, prefill not timed), {} runs",
            self.sequences,
            self.tokens,
            self.prompt_tokens,
            self.together.len()
        )?;
        writeln!(
            f,
            "  together:         median {:.1} tokens/s (runs {:?})",
            self.together_median(),
            rounded(&self.together)
        )?;
        writeln!(
            f,
            "  one after another: median {:.1} tokens/s (runs {:?})",
            self.sequential_median(),
            rounded(&self.sequential)
        )?;
        write!(
            f,
            "  speed-up: {:.2}x (median of per-run ratios; target >= 4x); sequences whose tokens differ between modes: {}",
            self.ratio(),
            self.mismatched_sequences
        )
    }
}

fn rounded(v: &[f64]) -> Vec<f64> {
    v.iter().map(|x| (x * 10.0).round() / 10.0).collect()
}

pub(crate) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// Runs E2 with one prompt per sequence, alternating the two modes `runs` times;
/// `log` receives one line per measurement.
pub fn e2_batched_decode(
    model: &Llama,
    prompts: &[Vec<u32>],
    config: &E2Config,
    log: &mut dyn FnMut(&str),
) -> Result<E2Report> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) || config.tokens == 0 || config.runs == 0 {
        return Err(EngineError::InvalidArgument(
            "E2 needs prompts, tokens and runs".into(),
        ));
    }
    let n = prompts.len();
    let mut report = E2Report {
        sequences: n,
        prompt_tokens: prompts.iter().map(Vec::len).collect(),
        tokens: config.tokens,
        together: Vec::new(),
        sequential: Vec::new(),
        mismatched_sequences: 0,
    };
    for run in 0..config.runs {
        let (t, out_t) = decode_run(model, prompts, config.tokens, true)?;
        let tps_t = (n * config.tokens) as f64 / t.as_secs_f64();
        log(&format!(
            "run {}: together          {tps_t:7.1} tokens/s ({:.2} s)",
            run + 1,
            t.as_secs_f64()
        ));
        let (s, out_s) = decode_run(model, prompts, config.tokens, false)?;
        let tps_s = (n * config.tokens) as f64 / s.as_secs_f64();
        log(&format!(
            "run {}: one after another {tps_s:7.1} tokens/s ({:.2} s)",
            run + 1,
            s.as_secs_f64()
        ));
        report.together.push(tps_t);
        report.sequential.push(tps_s);
        report.mismatched_sequences = out_t.iter().zip(&out_s).filter(|(a, b)| a != b).count();
    }
    Ok(report)
}

/// Times decoding `tokens` tokens per sequence after an untimed prefill: all
/// sequences together in one cache (one decode pass per step), or one after
/// another, each alone in a fresh cache (so its attention spans only its own
/// cells). Returns the decode time and each sequence's greedy tokens.
fn decode_run(
    model: &Llama,
    prompts: &[Vec<u32>],
    tokens: usize,
    together: bool,
) -> Result<(Duration, Vec<Vec<u32>>)> {
    if together {
        let seqs: Vec<usize> = (0..prompts.len()).collect();
        decode_group(model, prompts, &seqs, tokens)
    } else {
        let mut total = Duration::ZERO;
        let mut outs = Vec::new();
        for p in prompts {
            let (t, mut out) = decode_group(model, std::slice::from_ref(p), &[0], tokens)?;
            total += t;
            outs.push(out.remove(0));
        }
        Ok((total, outs))
    }
}

/// Prefills `prompts` into sequences `0..n` of a fresh cache, then times
/// `tokens` decode passes over all of them.
fn decode_group(
    model: &Llama,
    prompts: &[Vec<u32>],
    seqs: &[usize],
    tokens: usize,
) -> Result<(Duration, Vec<Vec<u32>>)> {
    let n = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let config = CausalConfig::new(n, longest + tokens + 1, longest.max(n));
    let mut cache = causal_cache(model, config)?;
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(n);
    for (seq, p) in prompts.iter().enumerate() {
        let batch = BatchToken::run(seq, 0, p);
        let hidden = model.hidden(&batch, &mut cache)?;
        let logits = model.logits(&hidden.narrow(0, p.len() - 1, 1)?)?;
        out.push(vec![argmax(&logits.squeeze(0)?.to_vec1::<f32>()?)]);
    }
    let t0 = Instant::now();
    for _ in 0..tokens {
        let batch: Vec<BatchToken> = seqs
            .iter()
            .map(|&s| BatchToken {
                seq: s,
                pos: (prompts[s].len() + out[s].len() - 1) as Pos,
                token: *out[s].last().expect("seeded"),
            })
            .collect();
        let logits: Tensor = model.forward(&batch, &mut cache)?;
        for (row, &s) in logits.to_vec2::<f32>()?.iter().zip(seqs) {
            out[s].push(argmax(row));
        }
    }
    Ok((t0.elapsed(), out))
}

/// One request of an E1 run.
#[derive(Debug, Clone, PartialEq)]
pub struct E1Row {
    /// Index in the trace.
    pub idx: usize,
    /// Conversation.
    pub conv: usize,
    /// Turn, from 1.
    pub turn: usize,
    /// The trace's minimum prefill for this request.
    pub min_prefill: usize,
    /// What the chat did.
    pub outcome: TurnOutcome,
}

/// An E1 run with one reuse policy.
#[derive(Debug, Clone, PartialEq)]
pub struct E1Report {
    /// The policy.
    pub reuse: Reuse,
    /// Every request, in trace order.
    pub rows: Vec<E1Row>,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl E1Report {
    /// Prompt tokens in all requests.
    pub fn prompt_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.outcome.prompt_tokens).sum()
    }

    /// Prompt tokens evaluated.
    pub fn evaluated(&self) -> usize {
        self.rows.iter().map(|r| r.outcome.evaluated).sum()
    }

    /// The least any engine must evaluate for these requests.
    pub fn min_prefill(&self) -> usize {
        self.rows.iter().map(|r| r.min_prefill).sum()
    }

    /// Median time to first token over turns >= 2.
    pub fn median_ttft_later_turns(&self) -> Duration {
        let v: Vec<f64> = self
            .rows
            .iter()
            .filter(|r| r.turn >= 2)
            .map(|r| r.outcome.time_to_first_token.as_secs_f64())
            .collect();
        Duration::from_secs_f64(median(&v))
    }
}

impl fmt::Display for E1Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<13} {:>3} requests: {:>6} of {:>6} prompt tokens evaluated ({:.2}x the minimum {}), \
             median TTFT turns>=2 {:>7.1} ms, {:.1} s",
            self.reuse.name(),
            self.rows.len(),
            self.evaluated(),
            self.prompt_tokens(),
            self.evaluated() as f64 / self.min_prefill().max(1) as f64,
            self.min_prefill(),
            self.median_ttft_later_turns().as_secs_f64() * 1e3,
            self.elapsed.as_secs_f64()
        )
    }
}

/// E1's verdict: the prefix trie against no reuse over the same requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct E1Verdict {
    /// No reuse's median time to first token on turns >= 2 over the trie's
    /// (target >= 5).
    pub ttft_speedup: f64,
    /// Prompt tokens the trie evaluated over the trace's minimum (target <= 1.01).
    pub trie_over_minimum: f64,
}

impl E1Verdict {
    /// The verdict from `reports`, when they hold a trie run and a no-reuse run.
    pub fn from_reports(reports: &[E1Report]) -> Option<Self> {
        let trie = reports.iter().find(|r| r.reuse == Reuse::Trie)?;
        let none = reports.iter().find(|r| r.reuse == Reuse::None)?;
        Some(E1Verdict {
            ttft_speedup: none.median_ttft_later_turns().as_secs_f64()
                / trie.median_ttft_later_turns().as_secs_f64().max(1e-9),
            trie_over_minimum: trie.evaluated() as f64 / trie.min_prefill().max(1) as f64,
        })
    }
}

impl fmt::Display for E1Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "trie vs no reuse: median TTFT on turns >= 2 {:.1}x faster (target >= 5x); \
             trie evaluated {:.3}x the minimum (target <= 1.01x)",
            self.ttft_speedup, self.trie_over_minimum
        )
    }
}

/// Runs the first `requests` requests of the E1 trace through a [`Chat`]
/// with `reuse`, each generating `n_predict` tokens greedily (end of sequence
/// ignored) from the trace's token ids; `log` sees each request as it finishes.
pub fn e1_chat_reuse(
    model: &Llama,
    trace: &Trace,
    reuse: Reuse,
    requests: usize,
    n_predict: usize,
    budget_bytes: usize,
    log: &mut dyn FnMut(&E1Row),
) -> Result<E1Report> {
    let start = Instant::now();
    let mut chat = Chat::new(model, reuse, budget_bytes)?;
    let mut rows = Vec::new();
    for r in trace.requests.iter().take(requests) {
        let outcome = chat.generate(&r.token_ids, n_predict, None)?;
        let row = E1Row {
            idx: r.idx,
            conv: r.conv,
            turn: r.turn,
            min_prefill: r.min_prefill,
            outcome,
        };
        log(&row);
        rows.push(row);
    }
    Ok(E1Report {
        reuse,
        rows,
        elapsed: start.elapsed(),
    })
}

/// Runs the first `requests` requests of the E1 trace through one [`Chat`]
/// per policy in `policies`, alternating: each request goes to every chat in
/// turn before the next request, so that the policies' times to first token are
/// taken under the same machine load (a shared machine's load drifts over the
/// tens of minutes a policy takes alone). `log` sees each request of each policy
/// as it finishes. Returns one report per policy, in the order given; each
/// report's `elapsed` is the time spent in that policy's requests.
pub fn e1_chat_reuse_interleaved(
    model: &Llama,
    trace: &Trace,
    policies: &[Reuse],
    requests: usize,
    n_predict: usize,
    budget_bytes: usize,
    log: &mut dyn FnMut(Reuse, &E1Row),
) -> Result<Vec<E1Report>> {
    let mut chats = policies
        .iter()
        .map(|&reuse| Chat::new(model, reuse, budget_bytes))
        .collect::<Result<Vec<_>>>()?;
    let mut reports: Vec<E1Report> = policies
        .iter()
        .map(|&reuse| E1Report {
            reuse,
            rows: Vec::new(),
            elapsed: Duration::ZERO,
        })
        .collect();
    for r in trace.requests.iter().take(requests) {
        for (chat, report) in chats.iter_mut().zip(&mut reports) {
            let start = Instant::now();
            let outcome = chat.generate(&r.token_ids, n_predict, None)?;
            report.elapsed += start.elapsed();
            let row = E1Row {
                idx: r.idx,
                conv: r.conv,
                turn: r.turn,
                min_prefill: r.min_prefill,
                outcome,
            };
            log(report.reuse, &row);
            report.rows.push(row);
        }
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(reuse: Reuse, rows: &[(usize, usize, usize, u64)]) -> E1Report {
        let rows = rows
            .iter()
            .enumerate()
            .map(|(idx, &(turn, evaluated, min_prefill, ttft_ms))| E1Row {
                idx,
                conv: 0,
                turn,
                min_prefill,
                outcome: TurnOutcome {
                    prompt_tokens: 100,
                    matched: 100 - evaluated,
                    restored: 0,
                    tiers: Vec::new(),
                    evaluated,
                    time_to_first_token: Duration::from_millis(ttft_ms),
                    total: Duration::from_millis(ttft_ms),
                    generated: vec![1],
                },
            })
            .collect();
        E1Report {
            reuse,
            rows,
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn the_verdict_compares_the_trie_with_no_reuse() {
        let trie = report(
            Reuse::Trie,
            &[(1, 100, 100, 900), (2, 20, 20, 100), (3, 30, 25, 300)],
        );
        let none = report(
            Reuse::None,
            &[(1, 100, 100, 900), (2, 100, 20, 800), (3, 100, 25, 1000)],
        );
        let single = report(Reuse::SingleEntry, &[(1, 100, 100, 5)]);
        assert_eq!(E1Verdict::from_reports(std::slice::from_ref(&trie)), None);
        assert_eq!(E1Verdict::from_reports(&[single.clone(), none.clone()]), None);
        let v = E1Verdict::from_reports(&[none, single, trie]).unwrap();
        // Medians over turns >= 2: no reuse 900 ms (of 800, 1000), the trie 200 ms (of 100, 300).
        assert!((v.ttft_speedup - 4.5).abs() < 1e-9, "{v:?}");
        assert!((v.trie_over_minimum - 150.0 / 145.0).abs() < 1e-12, "{v:?}");
        assert!(v.to_string().contains("4.5x faster"), "{v}");
    }
}
