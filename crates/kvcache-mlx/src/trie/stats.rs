//! Counters an engine can export.

/// What the prefix cache has done so far, and what it holds now.
///
/// The first group are monotonic counters; the second a view of the current state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// `begin` calls that restored at least one prompt token.
    pub hits: u64,
    /// `begin` calls that restored nothing (the whole prompt is evaluated).
    pub misses: u64,
    /// Prompt tokens restored instead of evaluated, summed over `begin` calls.
    pub reused_tokens: u64,
    /// Prompt tokens `begin` asked the engine to evaluate, summed over calls.
    pub evaluated_tokens: u64,
    /// Nodes evicted to honour the budget (each one removed, or merged into its child).
    pub evictions: u64,
    /// Parents merged into their only child after an eviction left them with one.
    pub auto_merges: u64,
    /// Leaves paged out when switching paths (snapshots taken of the live state).
    pub page_outs: u64,
    /// Nodes paged in (restored into at least one layer) when switching paths.
    pub page_ins: u64,

    /// Bytes held by all the trie's snapshots now.
    pub paged_out_bytes: usize,
    /// The paged-out byte budget.
    pub budget: usize,
    /// Snapshots the trie owns now.
    pub snapshots: usize,
    /// Trie nodes now, the root included.
    pub nodes: usize,
    /// True when the last eviction pass ended above the budget because only
    /// protected nodes were left (the active path, the root, branch points
    /// with several children).
    pub over_budget: bool,
}
