//! Counters: per tier (hits, misses, errors, corrupt entries removed, evictions,
//! bytes moved) and for the store (writes submitted and dropped, fetch timeouts),
//! kept as atomics and read as plain snapshots.

use std::sync::atomic::{AtomicU64, Ordering};

/// The live counters of one tier. The store counts hits, misses and errors;
/// the tier itself counts what only it sees (corrupt entries, evictions).
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Blocks found.
    pub hits: AtomicU64,
    /// Blocks looked for and not found (corrupt entries included).
    pub misses: AtomicU64,
    /// Failed operations (I/O, connection, timeouts).
    pub errors: AtomicU64,
    /// Damaged entries found, counted as misses and removed.
    pub corrupt: AtomicU64,
    /// Entries removed to stay within the budget.
    pub evictions: AtomicU64,
    /// Blocks written.
    pub puts: AtomicU64,
    /// Bytes of keys and values read.
    pub bytes_read: AtomicU64,
    /// Bytes of keys and values written.
    pub bytes_written: AtomicU64,
}

/// Adds `n` to `counter`.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// Adds one to `counter`.
pub(crate) fn bump(counter: &AtomicU64) {
    add(counter, 1);
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// A snapshot of one tier's counters and usage.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    /// The tier's name (`memory`, `disk`, `redis`).
    pub name: &'static str,
    /// Blocks found.
    pub hits: u64,
    /// Blocks looked for and not found.
    pub misses: u64,
    /// Failed operations.
    pub errors: u64,
    /// Damaged entries found and removed.
    pub corrupt: u64,
    /// Entries evicted to stay within the budget.
    pub evictions: u64,
    /// Blocks written.
    pub puts: u64,
    /// Bytes of keys and values read.
    pub bytes_read: u64,
    /// Bytes of keys and values written.
    pub bytes_written: u64,
    /// Bytes in use, if the tier could say (Redis: `used_memory`).
    pub used_bytes: Option<u64>,
    /// The byte budget, if the tier has one of its own.
    pub budget: Option<u64>,
    /// Entries held, if the tier keeps count.
    pub entries: Option<u64>,
}

impl TierCounters {
    /// A snapshot named `name` with the given usage figures.
    pub fn snapshot(
        &self,
        name: &'static str,
        used_bytes: Option<u64>,
        budget: Option<u64>,
        entries: Option<u64>,
    ) -> TierStats {
        TierStats {
            name,
            hits: load(&self.hits),
            misses: load(&self.misses),
            errors: load(&self.errors),
            corrupt: load(&self.corrupt),
            evictions: load(&self.evictions),
            puts: load(&self.puts),
            bytes_read: load(&self.bytes_read),
            bytes_written: load(&self.bytes_written),
            used_bytes,
            budget,
            entries,
        }
    }
}

/// The live counters of the store itself.
#[derive(Debug, Default)]
pub(crate) struct StoreCounters {
    pub(crate) submitted: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) blocks_written: AtomicU64,
    pub(crate) runs_written: AtomicU64,
    pub(crate) fetches: AtomicU64,
    pub(crate) fetch_timeouts: AtomicU64,
    pub(crate) states_submitted: AtomicU64,
    pub(crate) states_written: AtomicU64,
    pub(crate) state_fetches: AtomicU64,
    pub(crate) state_hits: AtomicU64,
    pub(crate) state_corrupt: AtomicU64,
}

/// A snapshot of the store's counters and of every tier's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// One entry per tier, fastest first.
    pub tiers: Vec<TierStats>,
    /// Writes accepted into the queue.
    pub submitted: u64,
    /// Writes dropped because the queue was full.
    pub dropped: u64,
    /// Writes refused as invalid (wrong layout, unaligned start, too few tokens).
    pub rejected: u64,
    /// Blocks the writer stored in at least one tier.
    pub blocks_written: u64,
    /// Submitted runs the writer is done with (every block tried in every
    /// tier): with `submitted`, whether writes are still pending.
    pub runs_written: u64,
    /// Fetches answered.
    pub fetches: u64,
    /// Fetches (of rows or states) cut short by their deadline.
    pub fetch_timeouts: u64,
    /// State writes accepted into the queue (`submit_states`).
    pub states_submitted: u64,
    /// State entries the writer stored whole (every part) in at least one tier.
    pub states_written: u64,
    /// `fetch_states` calls.
    pub state_fetches: u64,
    /// `fetch_states` calls answered with states.
    pub state_hits: u64,
    /// State entries found whole but damaged (bad length, checksum or
    /// encoding): a miss.
    pub state_corrupt: u64,
}

impl StoreCounters {
    pub(crate) fn snapshot(&self, tiers: Vec<TierStats>) -> StoreStats {
        StoreStats {
            tiers,
            submitted: load(&self.submitted),
            dropped: load(&self.dropped),
            rejected: load(&self.rejected),
            blocks_written: load(&self.blocks_written),
            runs_written: load(&self.runs_written),
            fetches: load(&self.fetches),
            fetch_timeouts: load(&self.fetch_timeouts),
            states_submitted: load(&self.states_submitted),
            states_written: load(&self.states_written),
            state_fetches: load(&self.state_fetches),
            state_hits: load(&self.state_hits),
            state_corrupt: load(&self.state_corrupt),
        }
    }
}

impl StoreStats {
    /// `self` and `other` counted together (the stores of a cache's parts
    /// seen as one): every count summed, tiers matched by name (a tier only
    /// one has is kept as it is); sizes, budgets and entries summed where
    /// both know them.
    pub fn merged(mut self, other: &StoreStats) -> StoreStats {
        for tier in &other.tiers {
            match self.tiers.iter_mut().find(|t| t.name == tier.name) {
                Some(mine) => mine.add(tier),
                None => self.tiers.push(tier.clone()),
            }
        }
        self.submitted += other.submitted;
        self.dropped += other.dropped;
        self.rejected += other.rejected;
        self.blocks_written += other.blocks_written;
        self.runs_written += other.runs_written;
        self.fetches += other.fetches;
        self.fetch_timeouts += other.fetch_timeouts;
        self.states_submitted += other.states_submitted;
        self.states_written += other.states_written;
        self.state_fetches += other.state_fetches;
        self.state_hits += other.state_hits;
        self.state_corrupt += other.state_corrupt;
        self
    }
}

impl TierStats {
    /// Adds `other`'s counts (the same tier of another store).
    fn add(&mut self, other: &TierStats) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.errors += other.errors;
        self.corrupt += other.corrupt;
        self.evictions += other.evictions;
        self.puts += other.puts;
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
        let sum = |a: Option<u64>, b: Option<u64>| a.zip(b).map(|(a, b)| a + b);
        self.used_bytes = sum(self.used_bytes, other.used_bytes);
        self.budget = sum(self.budget, other.budget);
        self.entries = sum(self.entries, other.entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(name: &'static str, hits: u64, used: Option<u64>) -> TierStats {
        TierStats {
            name,
            hits,
            used_bytes: used,
            ..TierStats::default()
        }
    }

    #[test]
    fn merged_stats_add_counts_and_match_tiers_by_name() {
        let a = StoreStats {
            tiers: vec![tier("memory", 3, Some(10)), tier("disk", 1, Some(5))],
            submitted: 4,
            runs_written: 4,
            ..StoreStats::default()
        };
        let b = StoreStats {
            tiers: vec![tier("memory", 2, Some(7)), tier("redis", 6, None)],
            submitted: 2,
            runs_written: 1,
            ..StoreStats::default()
        };
        let m = a.merged(&b);
        assert_eq!((m.submitted, m.runs_written), (6, 5));
        assert_eq!(m.tiers.len(), 3);
        assert_eq!(
            (m.tiers[0].name, m.tiers[0].hits, m.tiers[0].used_bytes),
            ("memory", 5, Some(17))
        );
        assert_eq!(
            (m.tiers[1].name, m.tiers[1].hits, m.tiers[1].used_bytes),
            ("disk", 1, Some(5))
        );
        assert_eq!((m.tiers[2].name, m.tiers[2].hits), ("redis", 6));
    }
}
