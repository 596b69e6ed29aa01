//! The engine's counters: what its passes did and what prefix reuse and
//! the prefix store saved.

use std::time::Duration;

/// Totals of a run ([`Engine::run`](super::Engine::run)) or of every pass
/// since the engine was made ([`Engine::stats`](super::Engine::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Forward passes.
    pub passes: usize,
    /// Prompt tokens evaluated.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Decode tokens evaluated (generated tokens fed back).
    pub decode_tokens: usize,
    /// Context shifts.
    pub context_shifts: usize,
    /// Wall time of the run ([`Engine::run`](super::Engine::run)), or since
    /// the engine was made ([`Engine::stats`](super::Engine::stats)).
    pub elapsed: Duration,
    /// Time in passes that contained decode tokens only.
    pub decode_time: Duration,
    /// Prompt tokens imported from the prefix store.
    pub restored_tokens: usize,
    /// Prompt tokens exported to the prefix store.
    pub stored_tokens: usize,
    /// Store answers that did not fit or the cache refused to import (the
    /// request evaluated its whole prompt instead), and evaluated prompts
    /// that could not be exported as the store's model (not stored).
    pub store_errors: usize,
    /// Evaluated prompts the store did not take (its writer queue full, or
    /// the input refused): not stored.
    pub store_refused: usize,
}

impl Stats {
    /// Generated tokens per second over the whole run.
    pub fn tokens_per_second(&self) -> f64 {
        self.generated_tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Prefix reuse across requests, counted since the engine was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReuseStats {
    /// Requests that started from another sequence's cells.
    pub hits: usize,
    /// Requests that found nothing to start from.
    pub misses: usize,
    /// Prompt tokens taken from other sequences' cells instead of evaluated.
    pub reused_tokens: usize,
    /// Prompt tokens evaluated.
    pub evaluated_tokens: usize,
    /// Idle sequences dropped to make room (slots or cells) or for age.
    pub evictions: usize,
    /// Requests cancelled before they finished.
    pub cancelled: usize,
    /// Blocks that left the cache's block index: evicted for a pass's cells,
    /// aged out ([`Engine::evict_idle`](super::Engine::evict_idle)), moved by
    /// a context shift, or dropped with prefix reuse.
    pub blocks_evicted: usize,
    /// Requests that waited for a running request to evaluate the prefix
    /// they share instead of evaluating it too (counted once per request).
    pub waited_for_prefix: usize,
    /// Requests that imported part of their prompt from the prefix store.
    pub store_restores: usize,
    /// Prompt tokens imported from the prefix store.
    pub store_restored_tokens: usize,
    /// Time spent asking the prefix store, whether or not it answered: part
    /// of each such request's time to first token.
    pub store_restore_time: Duration,
}

impl Stats {
    /// What was counted since `before`, a copy of these totals taken earlier
    /// ([`Stats::elapsed`] included).
    pub fn since(&self, before: &Stats) -> Stats {
        Stats {
            passes: self.passes - before.passes,
            prefill_tokens: self.prefill_tokens - before.prefill_tokens,
            generated_tokens: self.generated_tokens - before.generated_tokens,
            decode_tokens: self.decode_tokens - before.decode_tokens,
            context_shifts: self.context_shifts - before.context_shifts,
            elapsed: self.elapsed.saturating_sub(before.elapsed),
            decode_time: self.decode_time - before.decode_time,
            restored_tokens: self.restored_tokens - before.restored_tokens,
            stored_tokens: self.stored_tokens - before.stored_tokens,
            store_errors: self.store_errors - before.store_errors,
            store_refused: self.store_refused - before.store_refused,
        }
    }
}
