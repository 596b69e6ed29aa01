//! `--bench-e1` .. `--bench-e4`: the benchmarks of docs/BENCHMARKS.md, run
//! from the command line with a line per request.

use kvcache_bench::bench::{e1_chat_reuse, e2_batched_decode, E1Row, E1Verdict, E2Config};
use kvcache_bench::replica::ReplicaSetup;
use kvcache_bench::store_bench::{e3_restart, e4_replicas};
use kvcache_bench::trace::Trace;
use kvcache_engine::chat::Reuse;
use kvcache_engine::Result;
use kvcache_models::{paths, ChatTokenizer, Llama};

use crate::cli::Cli;
use crate::progress;
use crate::report::flush;

/// Paged-out snapshots E1's trie keeps in memory.
const E1_TRIE_BUDGET: usize = 4 << 30;

/// Memory E4's Redis may hold.
const E4_REDIS_BYTES: usize = 2 << 30;

/// E1: the chat trace through each policy in turn, then the trie's verdict.
pub fn e1(model: &Llama, cli: &Cli) -> Result<()> {
    let path = cli.trace_path();
    let trace = Trace::load(&path)?;
    let b = &cli.bench;
    let requests = b.e1_requests.min(trace.requests.len());
    println!(
        "\n== E1: {} of {} requests of {} ({} conversations x {} turns, round-robin), {} greedy tokens each ==",
        requests,
        trace.requests.len(),
        path.display(),
        trace.conversations.len(),
        trace.conversations.first().map_or(0, Vec::len),
        b.e1_predict
    );
    let mut reports = Vec::new();
    for &policy in &b.e1_policies {
        let reuse = Reuse::from(policy);
        println!("-- {} --", reuse.name());
        let bar = progress::bar(requests as u64, reuse.name());
        let report = e1_chat_reuse(
            model,
            &trace,
            reuse,
            requests,
            b.e1_predict,
            E1_TRIE_BUDGET,
            &mut |row| {
                progress::above(&bar, || print_e1_row(row));
                bar.inc(1);
            },
        );
        bar.finish_and_clear();
        let report = report?;
        println!("{report}");
        reports.push(report);
    }
    println!(
        "\nE1 summary ({requests} requests, {} tokens generated each):",
        b.e1_predict
    );
    for r in &reports {
        println!("  {r}");
    }
    if let Some(verdict) = E1Verdict::from_reports(&reports) {
        println!("  {verdict}");
    }
    Ok(())
}

fn print_e1_row(row: &E1Row) {
    println!(
        "  request {:2} (conversation {}, turn {}): {:4} prompt tokens, {:4} reused, {:4} evaluated (min {:4}), TTFT {:7.1} ms",
        row.idx,
        row.conv,
        row.turn,
        row.outcome.prompt_tokens,
        row.outcome.matched,
        row.outcome.evaluated,
        row.min_prefill,
        row.outcome.time_to_first_token.as_secs_f64() * 1e3
    );
    flush();
}

/// E2: 8 sequences decoding together against one after another.
pub fn e2(model: &Llama, tokenizer: &ChatTokenizer, cli: &Cli) -> Result<()> {
    let questions = cli.questions();
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| tokenizer.encode_user(&questions[i % questions.len()]))
        .collect::<kvcache_models::Result<_>>()?;
    let cfg = E2Config {
        tokens: cli.bench.e2_tokens,
        runs: cli.bench.e2_runs,
    };
    println!(
        "\n== E2: 8 sequences decoding {} tokens each, together vs one after another ({} alternating runs) ==",
        cfg.tokens, cfg.runs
    );
    let spinner = progress::spinner("E2");
    let report = e2_batched_decode(model, &prompts, &cfg, &mut |line| {
        progress::above(&spinner, || println!("  {line}"));
        flush();
        spinner.inc(1);
    });
    spinner.finish_and_clear();
    println!("{}", report?);
    Ok(())
}

/// E3 and/or E4: replicas of this binary over a shared store.
pub fn store(setup: &ReplicaSetup<'_>, cli: &Cli) -> Result<()> {
    let trace = Trace::load(cli.trace_path())?;
    let b = &cli.bench;
    let spinner = progress::spinner(if b.bench_e3 { "E3" } else { "E4" });
    let mut log = |line: &str| {
        progress::above(&spinner, || println!("  {line}"));
        flush();
        spinner.inc(1);
    };
    let mut run = || -> Result<()> {
        if b.bench_e3 {
            let dir = paths::scratch_dir("e3")?;
            let report = e3_restart(setup, &trace, b.e1_requests, b.e3_restart, &dir, &mut log);
            let _ = std::fs::remove_dir_all(&dir);
            let report = report?;
            progress::above(&spinner, || println!("{report}"));
        }
        if b.bench_e4 {
            spinner.set_prefix("E4");
            let report = e4_replicas(setup, &trace, b.e1_requests, E4_REDIS_BYTES, &mut log)?;
            progress::above(&spinner, || println!("{report}"));
        }
        Ok(())
    };
    let result = run();
    spinner.finish_and_clear();
    result
}
