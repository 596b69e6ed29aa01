//! The demo's parts, each a heading, an engine workload and its printout.

use std::path::Path;

use kvcache_api::CausalCache;
use kvcache_bench::conversation::{self, ConversationPlan, Generate};
use kvcache_bench::replica::{self, ReplicaSetup};
use kvcache_bench::trace::Trace;
use kvcache_bench::workloads::{self, PassMix};
use kvcache_engine::chat::{Chat, Reuse};
use kvcache_engine::engine::{Event, FinishReason};
use kvcache_engine::{EngineError, Result};
use kvcache_models::{paths, ChatTokenizer, Llama};

use crate::cli::Cli;
use crate::report;

/// The prefix-trie chat on candle: conversations in interleaved turns through
/// one live sequence of kvcache-causal's `CandleKv` layer caches.
pub fn chat(model: &Llama, tokenizer: &ChatTokenizer, cli: &Cli) -> Result<()> {
    let mut chat = Chat::new(model, Reuse::Trie, 1 << 30)?;
    conversations(
        "candle layer caches (kvcache-causal's CandleKv)",
        tokenizer,
        cli,
        &mut |prompt, n, eos| chat.generate(prompt, n, eos),
    )?;
    report::trie_stats(&chat.trie_stats().expect("a trie chat"));
    Ok(())
}

/// The chat's conversations through `generate`, whose caches `caches` names.
pub fn conversations(
    caches: &str,
    tokenizer: &ChatTokenizer,
    cli: &Cli,
    generate: &mut Generate<'_>,
) -> Result<()> {
    let questions = cli.questions();
    let plan = ConversationPlan {
        conversations: cli.demo.conversations.min(questions.len()),
        turns: cli.demo.turns,
        max_new: cli.demo.max_new,
    };
    println!(
        "\n== prefix trie: {} conversations x {} turns, interleaved, one live sequence of {caches} ==",
        plan.conversations, plan.turns
    );
    conversation::interleaved(
        tokenizer,
        &questions,
        plan,
        generate,
        &mut report::conversation_turn,
    )?;
    Ok(())
}

/// The store: conversation 0 of the E1 trace answered by one process, which
/// stops, and continued by a second process from the disk store.
pub fn store(setup: &ReplicaSetup<'_>, cli: &Cli) -> Result<()> {
    let dir = match &cli.store.store_dir {
        Some(dir) => dir.clone(),
        None => paths::scratch_dir("store-demo")?,
    };
    println!(
        "\n== prefix store: a conversation continued by another process from the disk store in {} ==",
        dir.display()
    );
    let trace = Trace::load(cli.trace_path())?;
    let result = replica::hand_off(setup, &trace, 0, 3, &dir, &mut |process, line| {
        if process == 2 {
            println!("  process 1 stopped; process 2 starts with an empty trie over the same directory");
        }
        report::replica_turn(&format!("process {process}"), line);
    });
    if cli.store.store_dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

/// Continuous batching of the conversations through a few sequences.
pub fn batching(model: &Llama, tokenizer: &ChatTokenizer, cli: &Cli) -> Result<()> {
    let questions = cli.questions();
    let d = &cli.demo;
    println!(
        "\n== continuous batching: {} conversations through {} sequences of one causal cache ==",
        d.conversations,
        d.slots.min(d.conversations)
    );
    let mut engine = workloads::continuous_batching(
        model,
        tokenizer,
        &questions,
        d.conversations,
        d.slots,
        d.max_new,
        cli.model.kv_type,
    )?;
    let mut print = report::events(tokenizer, &questions);
    let mut mix = PassMix::default();
    let stats = engine.run(&mut |ev| {
        mix.observe(ev);
        print(ev)
    })?;
    println!(
        "  {} decode-only passes of {:.2} sequences on average; {} passes mixed decode steps \
         with a joining prompt",
        mix.decode_passes,
        mix.mean_decode_batch(),
        mix.mixed
    );
    report::summary("continuous batching", &stats);
    Ok(())
}

/// What the sliding window asks when no `--prompt` is given: questions with
/// long answers, so that prompt and answer together pass the window.
const WINDOW_QUESTIONS: [&str; 2] = [
    "Give me three tips for staying focused while studying.",
    "Why is the sky blue?",
];

/// Two sequences attending through a sliding window.
pub fn window(model: &Llama, tokenizer: &ChatTokenizer, cli: &Cli) -> Result<()> {
    let questions = if cli.demo.prompts.is_empty() {
        WINDOW_QUESTIONS.iter().map(|q| q.to_string()).collect()
    } else {
        cli.questions()
    };
    let window = cli.demo.window;
    let mut engine = workloads::sliding_window(
        model,
        tokenizer,
        &questions,
        2,
        window,
        cli.demo.max_new,
        cli.model.kv_type,
    )?;
    let config = engine.cache().config().clone();
    println!(
        "\n== sliding window: {} sequences attending to their last {window} positions, questions with \
         long answers ==",
        config.max_sequences
    );
    println!(
        "  cache of {} cells for {} sequences (each keeps its last {} positions)",
        config.num_cells(),
        config.max_sequences,
        config.effective_memory().unwrap_or(config.capacity)
    );
    let mut print = report::events(tokenizer, &questions);
    let mut finished = Vec::new();
    let stats = engine.run(&mut |ev| {
        if let Event::Finished(f) = ev {
            finished.push(f.clone());
        }
        print(ev)
    })?;
    for f in &finished {
        let (prompt, answer) = (f.prompt_tokens, f.generated.len());
        let positions = prompt + answer;
        println!(
            "  conversation {}: {positions} positions ({prompt} of the prompt, {answer} of the answer{}){}",
            f.id,
            match f.reason {
                FinishReason::StopToken => ", which ended its turn",
                _ => ", cut at --max-new",
            },
            if positions > window {
                format!(
                    ": the first {} of them out of the window by the end",
                    positions - window
                )
            } else {
                ": all within the window".to_string()
            }
        );
    }
    println!(
        "  (SmolLM2 was trained with full attention, so a short window changes what it writes; \
         the cache holds {} cells whatever the length of the replies)",
        engine.cache().num_cells()
    );
    report::summary("sliding window", &stats);
    Ok(())
}

/// What the context shift asks when no `--prompt` is given: a story, whose
/// answer runs past the context and ends at its end of turn.
const STORY: &str = "Tell me a story about a lighthouse keeper who finds a message in a bottle.";

/// One sequence generating past its context.
pub fn shift(model: &Llama, tokenizer: &ChatTokenizer, cli: &Cli) -> Result<()> {
    let question = cli.demo.prompts.first().map_or(STORY, String::as_str);
    let ctx = cli.demo.context;
    let Some(mut engine) = workloads::context_shift(model, tokenizer, question, ctx, cli.model.kv_type)?
    else {
        println!(
            "\n== context shift: skipped (prompt of {} tokens does not fit --context {ctx}) ==",
            tokenizer.encode_user(question)?.len()
        );
        return Ok(());
    };
    println!(
        "\n== context shift: one sequence with a context of {ctx} positions generating up to {} tokens, \
         ending at its end of turn ==",
        ctx + ctx / 2
    );
    let questions = [question.to_string()];
    let mut print = report::events(tokenizer, &questions);
    let mut finished = None;
    let stats = engine.run(&mut |ev| {
        if let Event::Finished(f) = ev {
            finished = Some(f.clone());
        }
        print(ev)
    })?;
    if let Some(f) = finished {
        let why = match (&f.reason, f.context_shifts) {
            (FinishReason::StopToken, 0) => format!(
                "the answer ended at its end of turn before the context of {ctx} filled: no shift; \
                 ask for a longer answer with --prompt, or a smaller --context"
            ),
            (FinishReason::StopToken, _) => "the answer ended at its end of turn".to_string(),
            _ => format!(
                "the answer was cut at {} tokens, before its end of turn",
                f.generated.len()
            ),
        };
        println!("  ({why})");
    }
    report::summary("context shift", &stats);
    Ok(())
}

/// This program's path, for replicas of it.
pub fn current_exe() -> Result<std::path::PathBuf> {
    std::env::current_exe().map_err(|e| EngineError::io(Path::new("current executable"), e))
}
