//! 8-bit snapshots on the E1 trace (SmolLM2-135M-Instruct on mlx, f32 caches):
//! under a trie budget that holds a quarter of the trace's f16 snapshots, the
//! trie over 8-bit layer caches evaluates fewer prompt tokens than over
//! full-precision ones, and its logits stay close to full precision.
//!
//! The model computes in f32, so its full-precision snapshots are f32. The f16
//! row runs them under twice the budget: every f32 snapshot is exactly twice
//! the size of the f16 one, so the trie keeps, evicts and evaluates exactly
//! what it would over f16 snapshots under the budget itself.
//!
//! Prints the table recorded in docs/BENCHMARKS.md ("Quantized snapshots
//! (mlx)"). `KVCACHE_Q8_REQUESTS` limits the requests (default: 20, the
//! first two turns of every conversation; the whole trace takes tens of
//! minutes in a debug build).
//! Without the model it prints one line and passes (unless `CI` is set).
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod common;
mod mlx_support;

use common::testing::Trace;
use kvcache_mlx::layers::{KvCache, SnapshotEncoding};
use kvcache_models::argmax;
use kvcache_models::mlx::model::to_host;
use kvcache_models::mlx::{HostWeights, MlxLlama};
use kvcache_models::{paths, ModelFile};
use kvcache_testkit::models::{model_file, TestModel};
use kvcache_trie::PrefixCache;
use mlx_support::max_abs_diff;

/// Greedy tokens generated per request.
const GENERATE: usize = 4;

/// What one run over the trace gives.
struct Run {
    /// Prompt tokens evaluated, over all requests.
    evaluated: usize,
    /// Per request: the logits of the last prompt position, then of each
    /// generated token but the last (`GENERATE` rows of the vocabulary).
    logits: Vec<Vec<f32>>,
    /// Per request: the greedy tokens.
    tokens: Vec<Vec<u32>>,
    /// Snapshot bytes the trie holds at the end.
    paged_out: usize,
}

/// Runs `requests` of the trace through a trie of one `KvCache` per layer
/// keeping its snapshots as `encoding` says, under `budget` bytes: the loop of
/// `MlxChat` (restore, prefill, greedy decode, close), keeping logits.
fn run(model: &MlxLlama, trace: &Trace, requests: usize, encoding: SnapshotEncoding, budget: usize) -> Run {
    let caches = (0..model.config().n_layers)
        .map(|_| KvCache::new().with_snapshot_encoding(encoding).unwrap())
        .collect();
    let mut trie = PrefixCache::new(caches, budget).unwrap();
    let vocab = model.config().vocab_size;
    let mut out = Run {
        evaluated: 0,
        logits: Vec::new(),
        tokens: Vec::new(),
        paged_out: 0,
    };
    for r in trace.requests.iter().take(requests) {
        let mut session = trie.begin(&r.token_ids).unwrap();
        out.evaluated += r.token_ids.len() - session.cached();
        let mut last = Vec::new();
        session
            .prefill(|chunk, caches| -> kvcache_engine::Result<()> {
                let h = model.hidden_layers(chunk, caches)?;
                let rows = to_host(&model.logits(&h)?)?;
                last = rows[rows.len() - vocab..].to_vec();
                Ok(())
            })
            .unwrap();
        let mut logits = last.clone();
        let mut tokens = vec![argmax(&last)];
        session.record(tokens[0]);
        while tokens.len() < GENERATE {
            let h = model
                .hidden_layers(&[*tokens.last().unwrap()], session.caches_mut())
                .unwrap();
            let row = to_host(&model.logits(&h).unwrap()).unwrap();
            tokens.push(argmax(&row));
            session.record(*tokens.last().unwrap());
            logits.extend(row);
        }
        session.close().unwrap();
        out.logits.push(logits);
        out.tokens.push(tokens);
    }
    trie.check();
    out.paged_out = trie.stats().paged_out_bytes;
    out
}

/// Negative log-likelihood of `token` under `row`'s softmax.
fn nll(row: &[f32], token: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln() - row[token as usize] as f64
}

#[test]
fn q8_snapshots_evaluate_fewer_tokens_within_the_q8_accuracy() {
    let Some(path) = model_file(TestModel::SmolLM2) else {
        println!("skipped: no model (set KVCACHE_MODEL or run through cargo xtask test)");
        return;
    };
    let file = ModelFile::open(&path).unwrap();
    let weights = HostWeights::load(&file, &mut |_| {}).unwrap();
    let model = MlxLlama::new(&weights).unwrap();
    let trace = Trace::load(paths::e1_trace_path()).unwrap();
    let requests = std::env::var("KVCACHE_Q8_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20)
        .min(trace.requests.len());

    // The trace's snapshots: every conversation's longest context (its last
    // prompt and reply), at f16 per position in every layer.
    let c = model.config();
    let f16_per_position = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2;
    let mut longest = vec![0usize; trace.conversations.len()];
    for r in trace.requests.iter().take(requests) {
        longest[r.conv] = longest[r.conv].max(r.prompt_tokens + GENERATE);
    }
    let trace_f16_bytes: usize = longest.iter().sum::<usize>() * f16_per_position;
    let budget = trace_f16_bytes / 4;

    let f32_run = run(&model, &trace, requests, SnapshotEncoding::Full, budget);
    let f16_run = run(&model, &trace, requests, SnapshotEncoding::Full, 2 * budget);
    let q8_run = run(&model, &trace, requests, SnapshotEncoding::Q8_64, budget);

    let prompt_tokens: usize = trace
        .requests
        .iter()
        .take(requests)
        .map(|r| r.prompt_tokens)
        .sum();
    // Accuracy against full precision, on the rows where both runs saw the
    // same tokens (greedy decoding follows each run's own tokens).
    let (mut max_diff, mut same, mut total, mut nll_full, mut nll_q8, mut scored) =
        (0.0f32, 0usize, 0usize, 0.0f64, 0.0f64, 0usize);
    for i in 0..requests {
        let (a, b) = (&f16_run.tokens[i], &q8_run.tokens[i]);
        total += a.len();
        same += a.iter().zip(b).filter(|(x, y)| x == y).count();
        let agree = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let rows = (agree + 1).min(GENERATE);
        let vocab = c.vocab_size;
        for (row, &token) in a.iter().enumerate().take(rows) {
            let (fa, qa) = (
                &f16_run.logits[i][row * vocab..(row + 1) * vocab],
                &q8_run.logits[i][row * vocab..(row + 1) * vocab],
            );
            max_diff = max_diff.max(max_abs_diff(fa, qa));
            // Score the full-precision run's token under both.
            nll_full += nll(fa, token);
            nll_q8 += nll(qa, token);
            scored += 1;
        }
    }
    let ppl_ratio = ((nll_q8 - nll_full) / scored as f64).exp();
    let agreement = same as f64 / total as f64;

    println!("E1 trace, {requests} requests, {prompt_tokens} prompt tokens; trace f16 snapshots {trace_f16_bytes} bytes, budget {budget} bytes (a quarter)");
    println!("| snapshots | budget (bytes) | prompt tokens evaluated | held at end (bytes) |");
    println!("|---|---|---|---|");
    for (name, b, r) in [
        ("f32", budget, &f32_run),
        ("f16 (f32 under 2x budget)", budget, &f16_run),
        ("8-bit (group 64)", budget, &q8_run),
    ] {
        println!("| {name} | {b} | {} | {} |", r.evaluated, r.paged_out);
    }
    println!(
        "8-bit vs full precision: max |logit diff| {max_diff:.4} over {scored} rows; greedy agreement {same}/{total} ({:.1}%); perplexity ratio of the full run's tokens {ppl_ratio:.5}",
        100.0 * agreement
    );

    // The full-precision runs agree with each other exactly (restores are bit-exact).
    assert_eq!(f16_run.tokens, f32_run.tokens);
    assert!(
        q8_run.evaluated < f16_run.evaluated,
        "8-bit evaluates {} tokens, f16 {}",
        q8_run.evaluated,
        f16_run.evaluated
    );
    assert!(f16_run.evaluated <= f32_run.evaluated);
    assert!(q8_run.paged_out <= budget && f16_run.paged_out <= 2 * budget);
    // The q8_0 target of issue 13: perplexity within 1% of full precision.
    assert!((ppl_ratio - 1.0).abs() < 0.01, "perplexity ratio {ppl_ratio}");
    assert!(agreement >= 0.95, "greedy agreement {agreement}");
}
