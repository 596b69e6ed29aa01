//! How the demo prints what the engine reports.

use std::io::Write;

use kvcache_bench::conversation::ConversationTurn;
use kvcache_bench::replica::TurnLine;
use kvcache_engine::engine::{Event, Stats};
use kvcache_models::ChatTokenizer;
use kvcache_trie::Stats as TrieStats;

/// Flushes stdout, so a line shows while the next one is computed.
pub fn flush() {
    let _ = std::io::stdout().flush();
}

/// Prints an engine's events as they come; replies in full when their
/// request finishes (request `i` asked `questions[i % len]`).
pub fn events<'a>(tokenizer: &'a ChatTokenizer, questions: &'a [String]) -> impl FnMut(&Event) + 'a {
    move |ev: &Event| match ev {
        Event::Joined {
            id,
            seq,
            prompt_tokens,
            ..
        } => {
            println!("  [join] conversation {id} -> sequence {seq} ({prompt_tokens} prompt tokens)");
        }
        Event::Prefilled { id, done, total } => {
            println!("  [prefill] conversation {id}: {done}/{total} prompt tokens");
        }
        Event::ContextShift { id, seq, removed } => {
            println!(
                "  [context shift] conversation {id} (sequence {seq}): removed positions {}..{}, later keys re-rotated",
                removed.start, removed.end
            );
        }
        Event::Finished(f) => {
            let text = tokenizer
                .decode_text(&f.generated)
                .unwrap_or_else(|e| format!("<{e}>"));
            let decode_s = (f.total - f.time_to_first_token).as_secs_f64();
            println!(
                "  [done] conversation {} (sequence {}): {} tokens, first token after {:.0} ms, {:.1} tokens/s after it{}",
                f.id,
                f.seq,
                f.generated.len(),
                f.time_to_first_token.as_secs_f64() * 1e3,
                (f.generated.len().saturating_sub(1)) as f64 / decode_s.max(1e-9),
                if f.context_shifts > 0 { format!(", {} context shifts", f.context_shifts) } else { String::new() }
            );
            println!("      user: {}", questions[f.id % questions.len()]);
            println!(
                "      assistant: {}",
                text.trim().replace('\n', "\n                 ")
            );
            flush();
        }
        Event::Failed { id, error } => {
            println!("  [failed] conversation {id}: {error}");
            flush();
        }
        Event::Token { .. } | Event::Pass { .. } => {}
    }
}

/// One line of an engine run's totals.
pub fn summary(label: &str, s: &Stats) {
    println!(
        "{label}: {} passes, {} prompt tokens + {} generated in {:.2} s: {:.1} generated tokens/s \
         (decode-only passes: {:.1} tokens/s){}",
        s.passes,
        s.prefill_tokens,
        s.generated_tokens,
        s.elapsed.as_secs_f64(),
        s.tokens_per_second(),
        s.decode_tokens as f64 / s.decode_time.as_secs_f64().max(1e-9),
        if s.context_shifts > 0 {
            format!(", {} context shifts", s.context_shifts)
        } else {
            String::new()
        }
    );
}

/// One chat turn: what the trie reused and the exchange.
pub fn conversation_turn(t: &ConversationTurn) {
    let out = &t.outcome;
    println!(
        "  conversation {} turn {}: {} prompt tokens, {} reused from the trie, {} evaluated; \
         first token after {:.0} ms; {} tokens in {:.0} ms",
        t.conversation,
        t.turn,
        out.prompt_tokens,
        out.matched,
        out.evaluated,
        out.time_to_first_token.as_secs_f64() * 1e3,
        out.generated.len(),
        out.total.as_secs_f64() * 1e3
    );
    println!("      user: {}", t.user);
    println!(
        "      assistant: {}",
        t.reply.replace('\n', "\n                 ")
    );
    flush();
}

/// The trie's counters after a chat.
pub fn trie_stats(s: &TrieStats) {
    println!(
        "prefix trie: {} hits, {} misses, {} prompt tokens reused, {} evaluated; {} page-outs, {} page-ins; \
         {} nodes, {} snapshots, {:.1} MB paged out",
        s.hits,
        s.misses,
        s.reused_tokens,
        s.evaluated_tokens,
        s.page_outs,
        s.page_ins,
        s.nodes,
        s.snapshots,
        s.paged_out_bytes as f64 / 1e6
    );
}

/// One turn a replica process answered, with where its prefix came from.
pub fn replica_turn(who: &str, t: &TurnLine) {
    let tiers: Vec<String> = t
        .tiers
        .iter()
        .map(|(tier, n)| format!("{n} from {tier}"))
        .collect();
    println!(
        "  {who}: turn {} of conversation {}: {} prompt tokens, {} restored from the store{}, {} evaluated; first token after {:.0} ms",
        t.turn,
        t.conv,
        t.prompt_tokens,
        t.restored,
        if tiers.is_empty() { String::new() } else { format!(" ({})", tiers.join(", ")) },
        t.evaluated,
        t.ttft_ms
    );
    flush();
}
