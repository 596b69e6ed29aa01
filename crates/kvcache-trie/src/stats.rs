//! Counters an engine can export.

use std::collections::BTreeMap;

/// What the prefix cache has done so far, and what it holds now.
///
/// The first group are monotonic counters; the second a view of the current state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// `begin` calls that restored at least one prompt token (from the trie
    /// or the store).
    pub hits: u64,
    /// `begin` calls that restored nothing (the whole prompt is evaluated).
    pub misses: u64,
    /// Prompt tokens restored instead of evaluated (from the trie or the
    /// store), summed over `begin` calls.
    pub reused_tokens: u64,
    /// Prompt tokens `begin` asked the engine to evaluate, summed over calls.
    pub evaluated_tokens: u64,
    /// Nodes evicted to honour the budget: each one removed (a leaf), merged
    /// into its only child, or, for a branch point with several children,
    /// stripped of its snapshots and kept.
    pub evictions: u64,
    /// Of `evictions`, the branch points stripped of their snapshots.
    pub branch_evictions: u64,
    /// Parents merged into their only child after an eviction left them with one.
    pub auto_merges: u64,
    /// Leaves paged out when switching paths (snapshots taken of the live state).
    pub page_outs: u64,
    /// Nodes paged in (restored into at least one layer) when switching paths.
    pub page_ins: u64,
    /// `begin` calls that restored tokens from the store (counted in `hits`).
    ///
    /// This and the other `store_` counters are the store client's
    /// ([`StoreClient::counters`](kvcache_api::StoreClient::counters)), the
    /// one set every driver of the store keeps, since the store was set.
    pub store_hits: u64,
    /// Prompt tokens restored from the store (counted in `reused_tokens`).
    pub store_tokens: u64,
    /// Store answers that did not fit, or that the live caches could not take
    /// (some layer refused the rows or failed, or a layer that cannot cut rows
    /// found no state stored where the rows end): the layers were rewound and
    /// the tokens evaluated.
    pub store_rejected: u64,
    /// Tokens the store's tiers served, by tier name, as the store reported them.
    pub store_tier_tokens: BTreeMap<&'static str, u64>,
    /// Writes submitted to the store when sessions closed (and accepted).
    pub store_writes: u64,
    /// Writes the store did not take (its queue full, or the input refused):
    /// those prompts are not stored.
    pub store_writes_refused: u64,
    /// Prompt tokens those writes held.
    pub store_tokens_written: u64,
    /// Whole layer states written to the store (layers that cannot cut rows,
    /// one per such layer and prompt written through).
    pub store_states_written: u64,
    /// Whole layer states loaded from the store by restores (counted per layer).
    pub store_states_loaded: u64,

    /// Bytes held by all the trie's snapshots now.
    pub paged_out_bytes: usize,
    /// The paged-out byte budget.
    pub budget: usize,
    /// Snapshots the trie owns now.
    pub snapshots: usize,
    /// Trie nodes now, the root included.
    pub nodes: usize,
    /// True when the last eviction pass ended above the budget: then every
    /// snapshot the trie holds lies on the active path (the live request's
    /// branch points and restore points), which is never evicted. Off the
    /// active path the budget always holds.
    pub over_budget: bool,
}
