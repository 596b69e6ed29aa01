//! The engine's reads from and writes to a prefix store, and the one set of
//! counters that says how they went.
//!
//! A joining request imports the longest stored run of its prompt past what
//! memory gave it ([`StoreIo::restore`], into [`CausalCache::import_seq`] as
//! the store's model); an evaluated prompt, or a finished sequence kept by
//! block, is written back where the store lacks it ([`StoreIo::write_back`],
//! exported by [`CausalCache::export_seq`]). Both go through the same
//! [`StoreClient`] as the prefix trie's.
//!
//! **Invariant:** every read and every write is counted here and nowhere
//! else; [`Stats`](super::Stats) and [`ReuseStats`](super::ReuseStats) show
//! these counters.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use kvcache_api::{CacheError, CausalCache, Namespace, Pos, SeqId, StoreClient, Submitted, WriteBack};

/// The prefix store's counters, since the engine was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct StoreCounters {
    /// Requests that imported part of their prompt.
    pub(super) restores: usize,
    /// Prompt tokens imported.
    pub(super) restored_tokens: usize,
    /// Time spent restoring, whether or not the store answered.
    pub(super) restore_time: Duration,
    /// Prompt tokens exported.
    pub(super) stored_tokens: usize,
    /// Answers that did not fit or were refused on import, and exports of
    /// another model than the store's.
    pub(super) errors: usize,
    /// Exports the store did not take.
    pub(super) refused: usize,
}

/// The engine's prefix store, if it has one, and its counters.
#[derive(Debug, Default)]
pub(super) struct StoreIo {
    client: Option<StoreClient>,
    counters: StoreCounters,
}

impl StoreIo {
    /// Reads and writes through `client` from now on; the counters go on.
    pub(super) fn set_client(&mut self, client: StoreClient) {
        self.client = Some(client);
    }

    /// The client, if there is a store.
    pub(super) fn client(&self) -> Option<&StoreClient> {
        self.client.as_ref()
    }

    /// Whether there is a store.
    pub(super) fn is_set(&self) -> bool {
        self.client.is_some()
    }

    /// The counters since the engine was made.
    pub(super) fn counters(&self) -> StoreCounters {
        self.counters
    }

    /// Imports the stored run of `prompt` past `from` into `seq`, which holds
    /// exactly its first `from` tokens, leaving at least the last prompt token
    /// to evaluate. Returns the tokens imported and the tiers that served
    /// them; any failure imports nothing.
    pub(super) fn restore<C>(
        &mut self,
        cache: &mut C,
        seq: SeqId,
        namespace: &Namespace,
        prompt: &[u32],
        from: usize,
    ) -> (usize, Vec<(&'static str, usize)>)
    where
        C: CausalCache<Tensor = Tensor>,
    {
        let Some(client) = &self.client else {
            return (0, Vec::new());
        };
        let started = Instant::now();
        let (restored, tiers) = 'read: {
            let fetched = match client.restore(namespace, prompt, from) {
                Ok(Some(fetched)) => fetched,
                Ok(None) => break 'read (0, Vec::new()),
                Err(error) => {
                    tracing::warn!(%error, seq, "prefix store: answer refused, evaluating the whole prompt");
                    self.counters.errors += 1;
                    break 'read (0, Vec::new());
                }
            };
            let state = client.seq_state(fetched.kv);
            match cache.import_seq(seq, &state) {
                Ok(()) => {
                    self.counters.restored_tokens += state.kv.tokens();
                    (state.kv.tokens(), fetched.tiers)
                }
                Err(error) => {
                    tracing::warn!(%error, seq, "prefix store: import refused, evaluating the whole prompt");
                    self.counters.errors += 1;
                    (0, Vec::new())
                }
            }
        };
        self.counters.restore_time += started.elapsed();
        if restored > 0 {
            self.counters.restores += 1;
        }
        (restored, tiers)
    }

    /// Writes back the part of the evaluated `prompt` of `seq` (or any run of
    /// its tokens from position 0) that the store lacks
    /// ([`StoreClient::write_back`]), exported as the store's model.
    pub(super) fn write_back<C>(&mut self, cache: &C, seq: SeqId, namespace: &Namespace, prompt: &[u32])
    where
        C: CausalCache<Tensor = Tensor>,
    {
        let Some(client) = &self.client else { return };
        let wrote = client.write_back(namespace, prompt, |range| {
            let state = cache.export_seq(seq, range.start as Pos..range.end as Pos)?;
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
            Ok(WriteBack::Held) => {}
            Ok(WriteBack::Sent {
                range,
                outcome: Submitted::Queued,
            }) => self.counters.stored_tokens += range.len(),
            Ok(WriteBack::Sent { outcome, .. }) => {
                tracing::debug!(?outcome, seq, "prefix store: prompt not stored");
                self.counters.refused += 1;
            }
            Err(error) => {
                tracing::warn!(%error, seq, "prefix store: export failed, prompt not stored");
                self.counters.errors += 1;
            }
        }
    }
}
