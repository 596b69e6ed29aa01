//! The engine's reads from and writes to a prefix store.
//!
//! A joining request imports the longest stored run of its prompt past what
//! memory gave it ([`StoreIo::restore`], into [`CausalCache::import_seq`] as
//! the store's model); an evaluated prompt, or a finished sequence kept by
//! block, is written back where the store lacks it ([`StoreIo::write_back`],
//! exported by [`CausalCache::export_seq`]). Both go through the same
//! [`StoreClient`] as the prefix trie's.
//!
//! **Invariant:** every read and every write is counted once, by the client
//! ([`StoreClient::counters`], the one counter set the trie's driver keeps
//! too); [`Stats`](super::Stats) and [`ReuseStats`](super::ReuseStats) show
//! them.

use candle_core::Tensor;
use kvcache_api::{CacheError, CausalCache, Namespace, Pos, SeqId, StoreClient, StoreCounters, StoreParts};

/// The engine's prefix store, if it has one: one store per part of the
/// cache ([`CausalCache::store_parts`]; a single one for a cache stored
/// whole).
#[derive(Debug, Default)]
pub(super) struct StoreIo {
    parts: Option<StoreParts>,
    /// What earlier stores counted (the counters go on across stores).
    earlier: StoreCounters,
}

impl StoreIo {
    /// Reads and writes through `parts` from now on; the counters go on.
    pub(super) fn set_parts(&mut self, parts: StoreParts) {
        if let Some(old) = self.parts.replace(parts) {
            self.earlier = add(&self.earlier, &old.counters());
        }
    }

    /// The client of the store's first part without a window (the only one
    /// of a cache stored whole), if there is a store.
    pub(super) fn client(&self) -> Option<&StoreClient> {
        self.parts.as_ref().map(StoreParts::lead)
    }

    /// The stores, if there are.
    pub(super) fn parts(&self) -> Option<&StoreParts> {
        self.parts.as_ref()
    }

    /// Whether there is a store.
    pub(super) fn is_set(&self) -> bool {
        self.parts.is_some()
    }

    /// The counters since the engine was made.
    pub(super) fn counters(&self) -> StoreCounters {
        match &self.parts {
            Some(parts) => add(&self.earlier, &parts.counters()),
            None => self.earlier.clone(),
        }
    }

    /// Imports the stored run of `prompt` past `from` into `seq`, which holds
    /// exactly its first `from` tokens, leaving at least the last prompt token
    /// to evaluate: every part of the cache up to where all of them can
    /// serve it ([`StoreParts::restore`]). Returns the tokens imported and
    /// the tiers that served them; any failure imports nothing.
    pub(super) fn restore<C>(
        &self,
        cache: &mut C,
        seq: SeqId,
        namespace: &Namespace,
        prompt: &[u32],
        from: usize,
    ) -> (usize, Vec<(&'static str, usize)>)
    where
        C: CausalCache<Tensor = Tensor>,
    {
        let Some(parts) = &self.parts else {
            return (0, Vec::new());
        };
        let fetched = match parts.restore(namespace, prompt, from) {
            Ok(Some(fetched)) => fetched,
            Ok(None) => return (0, Vec::new()),
            Err(error) => {
                tracing::warn!(%error, seq, "prefix store: answer refused, evaluating the whole prompt");
                return (0, Vec::new());
            }
        };
        match cache.import_parts(seq, &fetched.parts) {
            Ok(()) => {
                parts.record_restored(from, &fetched);
                (fetched.end - from, fetched.tiers)
            }
            Err(error) => {
                tracing::warn!(%error, seq, "prefix store: import refused, evaluating the whole prompt");
                parts.record_rejected();
                (0, Vec::new())
            }
        }
    }

    /// Writes back the part of the evaluated `prompt` of `seq` (or any run of
    /// its tokens from position 0) that the store lacks, every part of the
    /// cache ([`StoreParts::write_back`]: a window part its tail), exported
    /// as the part's model.
    pub(super) fn write_back<C>(&self, cache: &C, seq: SeqId, namespace: &Namespace, prompt: &[u32])
    where
        C: CausalCache<Tensor = Tensor>,
    {
        let Some(parts) = &self.parts else { return };
        let held = |part| usize::try_from(cache.part_start(part, seq)).unwrap_or(0);
        let wrote = parts.write_back(namespace, prompt, held, |part, range| {
            let client = parts.parts().nth(part).expect("a part of the store").1;
            let state = cache.export_part(part, seq, range.start as Pos..range.end as Pos)?;
            if state.fingerprint != client.fingerprint() {
                return Err(CacheError::LayoutMismatch {
                    what: "model",
                    expected: client.fingerprint().to_hex(),
                    got: state.fingerprint.to_hex(),
                });
            }
            Ok(state.kv)
        });
        match wrote {
            Ok(wrote) if wrote.iter().any(|w| w.is_refused()) => {
                tracing::debug!(?wrote, seq, "prefix store: prompt not stored");
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, seq, "prefix store: export failed, prompt not stored");
                parts.record_write_failed();
            }
        }
    }
}

/// `a` and `b` counted together.
fn add(a: &StoreCounters, b: &StoreCounters) -> StoreCounters {
    let mut tier_tokens = a.tier_tokens.clone();
    for (tier, tokens) in &b.tier_tokens {
        *tier_tokens.entry(tier).or_default() += tokens;
    }
    StoreCounters {
        restores: a.restores + b.restores,
        restored_tokens: a.restored_tokens + b.restored_tokens,
        tier_tokens,
        states_loaded: a.states_loaded + b.states_loaded,
        restore_time: a.restore_time + b.restore_time,
        rejected: a.rejected + b.rejected,
        writes: a.writes + b.writes,
        written_tokens: a.written_tokens + b.written_tokens,
        states_written: a.states_written + b.states_written,
        refused: a.refused + b.refused,
        write_errors: a.write_errors + b.write_errors,
    }
}
