//! [`StoreClient`]: the one way a cache's driver (the prefix trie, the
//! batching engine) talks to a [`PrefixStore`].
//!
//! See [`StoreClient`] for the rules it keeps.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::host::{Fetched, Fingerprint, HostKv, HostState, KvLayout, Namespace, PrefixStore, SeqKv};
use crate::{CacheError, Result, Submitted};

/// A [`PrefixStore`] and the deadline of its reads: what the prefix trie and
/// the batching engine hold to restore prompts from a store and write them
/// back. Cheap to clone (the store is shared).
///
/// A driver restores before it evaluates and writes back once it has evaluated:
///
/// - **Restore** ([`StoreClient::restore`]): the keys and values the store holds
///   for the prompt past what the driver holds already, never the prompt's last
///   token (the model must evaluate it to have logits to sample from), with the
///   tokens each tier served ([`Fetched`]). An answer that does not fit (another
///   layout, another range) is an error, never taken.
/// - **Write-back** ([`StoreClient::write_back`]): once the prompt is evaluated
///   and its first token chosen (so the write never delays the first token),
///   the part of the prompt the store does not hold yet, from
///   [`known_prefix`](PrefixStore::known_prefix) aligned down to the store's
///   block size to the prompt's end, read from the cache by the caller and
///   submitted; the answer ([`WriteBack`]) says which tokens went and what the
///   store did with them, so the caller counts it. Whole-layer states (layers
///   that cannot cut their state into token rows) go through
///   [`StoreClient::submit_states`] beside them and come back through
///   [`StoreClient::fetch_states`].
/// - **The model** ([`StoreClient::fingerprint`]): what a store holds belongs
///   to one model; [`StoreClient::seq_state`] makes an imported sequence of
///   it.
///
/// - **The counters** ([`StoreClient::counters`]): one set for every driver,
///   kept by the client. What the client sees itself (reads and their time,
///   answers that do not fit, what the store took of each write) it counts;
///   what only the reader knows it reports ([`StoreClient::record_restored`],
///   [`StoreClient::record_rejected`], [`StoreClient::record_write_failed`]).
///   Clones share them.
///
/// Plain Rust, no tensors, no I/O of its own: every read is bounded by the
/// client's deadline, every write returns at once.
///
/// ```
/// # use std::ops::Range;
/// # use std::sync::Arc;
/// # use std::time::Duration;
/// # use kvcache_api::{DType, Fetched, Fingerprint, HostKv, KvLayout, Namespace, PrefixStore, Submitted};
/// use kvcache_api::{StoreClient, WriteBack};
///
/// # struct Blocks { layout: KvLayout }
/// # impl PrefixStore for Blocks {
/// #     fn fingerprint(&self) -> Fingerprint { Fingerprint([1; 32]) }
/// #     fn layout(&self) -> &KvLayout { &self.layout }
/// #     fn block_tokens(&self) -> usize { 4 }
/// #     // It holds the first block (4 tokens) of every prompt.
/// #     fn known_prefix(&self, _: &Namespace, tokens: &[u32]) -> usize { tokens.len().min(4) }
/// #     fn fetch(&self, _: &Namespace, _: &[u32], _: usize, _: Duration) -> Option<Fetched> { None }
/// #     fn submit(&self, _: &Namespace, _: &[u32], _: HostKv) -> Submitted { Submitted::Queued }
/// # }
/// # let store = Arc::new(Blocks { layout: KvLayout::new(2, 1, 4, DType::F32) });
/// // `store`: a PrefixStore of 4-token blocks holding this prompt's first block.
/// let client = StoreClient::new(store, Duration::from_millis(20));
/// let prompt: Vec<u32> = (1..=10).collect();
/// let layout = *client.layout();
/// // Once the prompt is evaluated and its first token chosen: the rows the
/// // store lacks, read from the cache (here zeros), submitted.
/// let wrote = client.write_back(&Namespace::shared(), &prompt, |rows: Range<usize>| {
///     Ok::<_, kvcache_api::CacheError>(HostKv::zeroed(layout, rows.start, rows.len()))
/// })?;
/// assert_eq!(wrote, WriteBack::Sent { range: 4..10, outcome: Submitted::Queued });
/// assert_eq!(wrote.stored_tokens(), 6);
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Clone)]
pub struct StoreClient {
    store: Arc<dyn PrefixStore>,
    deadline: Duration,
    counters: Arc<Mutex<StoreCounters>>,
}

/// What a [`StoreClient`] and the drivers reading through it did, since the
/// client was made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// Restores the reader took (at least one token, every layer).
    pub restores: u64,
    /// Prompt tokens those restores gave.
    pub restored_tokens: u64,
    /// Of those, the tokens each of the store's tiers served, by tier name.
    pub tier_tokens: BTreeMap<&'static str, u64>,
    /// Whole layer states loaded by those restores (one per layer that
    /// cannot cut its state into rows).
    pub states_loaded: u64,
    /// Time spent asking the store (rows and states), answered or not.
    pub restore_time: Duration,
    /// Answers that did not fit, or that the reader could not take: the
    /// prompt was evaluated instead.
    pub rejected: u64,
    /// Write-backs the store queued.
    pub writes: u64,
    /// Prompt tokens those write-backs held.
    pub written_tokens: u64,
    /// Whole layer states the store queued.
    pub states_written: u64,
    /// Writes the store did not take (its queue full, or the input
    /// refused): those prompts are not stored.
    pub refused: u64,
    /// Write-backs whose rows could not be read as the store's model.
    pub write_errors: u64,
}

/// What [`StoreClient::write_back`] did.
#[must_use = "a write the store did not take is not stored: count it"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteBack {
    /// The store holds the whole prompt already: nothing was read or submitted.
    Held,
    /// Rows `range` of the prompt were read and submitted; `outcome` is what
    /// the store did with them.
    Sent {
        /// Token offsets submitted: from what the store held (aligned down to
        /// its block size) to the prompt's end.
        range: Range<usize>,
        /// Queued, dropped by a full writer queue, or rejected.
        outcome: Submitted,
    },
}

impl WriteBack {
    /// Tokens the store accepted: the range's length when it was queued, 0
    /// otherwise.
    pub fn stored_tokens(&self) -> usize {
        match self {
            WriteBack::Sent {
                range,
                outcome: Submitted::Queued,
            } => range.len(),
            _ => 0,
        }
    }

    /// Whether rows were submitted and the store did not take them.
    pub fn is_refused(&self) -> bool {
        matches!(self, WriteBack::Sent { outcome, .. } if !outcome.is_queued())
    }
}

impl StoreClient {
    /// A client of `store` whose reads wait at most `deadline`.
    pub fn new(store: Arc<dyn PrefixStore>, deadline: Duration) -> Self {
        StoreClient {
            store,
            deadline,
            counters: Arc::default(),
        }
    }

    /// The counters of every read and write through this client and its
    /// clones.
    pub fn counters(&self) -> StoreCounters {
        self.count(|c| c.clone())
    }

    /// The reader took a restore: `tokens` prompt tokens (served by
    /// `tiers`), `states` of its layers loaded from whole states.
    pub fn record_restored(&self, tokens: usize, tiers: &[(&'static str, usize)], states: usize) {
        self.count(|c| {
            c.restores += 1;
            c.restored_tokens += tokens as u64;
            c.states_loaded += states as u64;
            for &(tier, tokens) in tiers {
                *c.tier_tokens.entry(tier).or_default() += tokens as u64;
            }
        })
    }

    /// The reader could not take an answer ([`restore`](Self::restore)'s
    /// rows, or the states beside them): it evaluates the prompt instead.
    pub fn record_rejected(&self) {
        self.count(|c| c.rejected += 1)
    }

    /// A write-back's rows could not be read as the store's model.
    pub fn record_write_failed(&self) {
        self.count(|c| c.write_errors += 1)
    }

    fn count<T>(&self, f: impl FnOnce(&mut StoreCounters) -> T) -> T {
        f(&mut self.counters.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn PrefixStore> {
        &self.store
    }

    /// The store, giving the client up.
    pub fn into_store(self) -> Arc<dyn PrefixStore> {
        self.store
    }

    /// How long a read may take.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The model whose keys and values the store holds: an imported sequence
    /// carries it ([`seq_state`](Self::seq_state)), and a cache exports into
    /// the store only keys and values of this model.
    pub fn fingerprint(&self) -> Fingerprint {
        self.store.fingerprint()
    }

    /// The layout of everything the store takes and returns.
    pub fn layout(&self) -> &KvLayout {
        self.store.layout()
    }

    /// The store's block size in tokens (at least 1): write-backs start at a
    /// multiple of it.
    pub fn block_tokens(&self) -> usize {
        self.store.block_tokens().max(1)
    }

    /// Keys and values the store holds for `prompt` from offset `from` (the
    /// caller holds `[0, from)`) to some `end`, never the prompt's last token
    /// (`from < end < prompt.len()`), and the tokens each tier served. Waits
    /// at most the client's deadline.
    ///
    /// `Ok(None)` when the store holds nothing past `from` (or cannot say in
    /// time), or `from` leaves nothing to restore. An answer that does not
    /// fit, keys and values of another layout or of another range than
    /// `[from, end)`, is a [`LayoutMismatch`](CacheError::LayoutMismatch) or
    /// [`InvalidState`](CacheError::InvalidState) error naming it; an empty
    /// prompt is an [`InvalidArgument`](CacheError::InvalidArgument) error.
    /// The store is not asked then.
    /// Counts its time, and an answer that does not fit as
    /// [`rejected`](StoreCounters::rejected).
    pub fn restore(&self, namespace: &Namespace, prompt: &[u32], from: usize) -> Result<Option<Fetched>> {
        let started = Instant::now();
        let answer = self.ask(namespace, prompt, from);
        self.count(|c| {
            c.restore_time += started.elapsed();
            c.rejected += u64::from(answer.is_err());
        });
        answer
    }

    fn ask(&self, namespace: &Namespace, prompt: &[u32], from: usize) -> Result<Option<Fetched>> {
        if prompt.is_empty() {
            return Err(CacheError::InvalidArgument(
                "an empty prompt: nothing to restore".into(),
            ));
        }
        let want = prompt.len() - 1;
        if from >= want {
            return Ok(None);
        }
        let Some(fetched) = self.store.fetch(namespace, &prompt[..want], from, self.deadline) else {
            return Ok(None);
        };
        self.layout().expect(fetched.kv.layout())?;
        let range = fetched.kv.range();
        if range.start != from || range.end <= from || range.end > want {
            return Err(CacheError::InvalidState(format!(
                "the store answered tokens {range:?} for a restore of [{from}, at most {want})"
            )));
        }
        Ok(Some(fetched))
    }

    /// An imported sequence of `kv`: keys and values of the store's model
    /// (its [`fingerprint`](Self::fingerprint)), what
    /// [`CausalCache::import_seq`](crate::CausalCache::import_seq) takes.
    pub fn seq_state(&self, kv: HostKv) -> SeqKv {
        SeqKv {
            fingerprint: self.fingerprint(),
            kv,
        }
    }

    /// The whole-layer states stored for exactly `prefix` (each standing at
    /// `prefix.len()`), sorted by layer; `Ok(None)` when none are stored or
    /// the store cannot say within the deadline. An answer that does not fit
    /// (a layer beyond the layout, a layer twice, a state standing elsewhere)
    /// is an [`InvalidState`](CacheError::InvalidState) error naming it.
    pub fn fetch_states(
        &self,
        namespace: &Namespace,
        prefix: &[u32],
    ) -> Result<Option<Vec<(usize, HostState)>>> {
        let started = Instant::now();
        let answer = self.store.fetch_states(namespace, prefix, self.deadline);
        self.count(|c| c.restore_time += started.elapsed());
        let Some(mut states) = answer else {
            return Ok(None);
        };
        states.sort_by_key(|(layer, _)| *layer);
        self.states_fit(prefix, &states).map_err(|why| {
            CacheError::InvalidState(format!("the store answered states that do not fit: {why}"))
        })?;
        Ok(Some(states))
    }

    /// The part of `prompt` the store does not hold yet: from
    /// [`known_prefix`](PrefixStore::known_prefix), aligned down to the
    /// block size, to the prompt's end; `None` when the store holds all of it
    /// (or the prompt is empty). No I/O.
    pub fn unheld(&self, namespace: &Namespace, prompt: &[u32]) -> Option<Range<usize>> {
        self.unheld_from(namespace, prompt, 0)
    }

    /// The part of `prompt` from `first` on (rounded up to the block size)
    /// that the store does not hold yet: from
    /// [`known_from`](PrefixStore::known_from) there, aligned down to the
    /// block size, to the prompt's end; `None` when the store holds all of
    /// it, or nothing is left from `first`. No I/O.
    pub fn unheld_from(&self, namespace: &Namespace, prompt: &[u32], first: usize) -> Option<Range<usize>> {
        let len = prompt.len();
        let block = self.block_tokens();
        let from = first.div_ceil(block) * block;
        if from >= len {
            return None;
        }
        let known = self.store.known_from(namespace, prompt, from).clamp(from, len);
        if known >= len {
            return None;
        }
        Some(known - known % block..len)
    }

    /// Writes back the evaluated `prompt`: the rows the store does not hold
    /// yet ([`unheld`](Self::unheld)), which `rows` reads from the cache
    /// (keys and values of exactly that token range, in the store's layout),
    /// submitted at once. Call it once the prompt is evaluated and its first
    /// token chosen (the cache then holds exactly the prompt).
    ///
    /// Returns what happened: [`WriteBack::Held`] (nothing to write, `rows`
    /// not called) or [`WriteBack::Sent`] with the range and the store's
    /// answer. An error of `rows` is returned as it is; rows of another range
    /// or layout are an [`InvalidArgument`](CacheError::InvalidArgument) or
    /// [`LayoutMismatch`](CacheError::LayoutMismatch) error, and an empty
    /// prompt an `InvalidArgument` error: nothing is submitted then.
    pub fn write_back<E>(
        &self,
        namespace: &Namespace,
        prompt: &[u32],
        rows: impl FnOnce(Range<usize>) -> std::result::Result<HostKv, E>,
    ) -> std::result::Result<WriteBack, E>
    where
        E: From<CacheError>,
    {
        self.write_from(namespace, prompt, 0, rows)
    }

    /// [`write_back`](Self::write_back) of the part of `prompt` from
    /// `first` on ([`unheld_from`](Self::unheld_from)): the tail of a prompt
    /// that a sliding-window part of a cache keeps. [`WriteBack::Held`] when
    /// the store holds it all, or nothing is left from `first` (rounded up
    /// to the block size).
    pub fn write_from<E>(
        &self,
        namespace: &Namespace,
        prompt: &[u32],
        first: usize,
        rows: impl FnOnce(Range<usize>) -> std::result::Result<HostKv, E>,
    ) -> std::result::Result<WriteBack, E>
    where
        E: From<CacheError>,
    {
        if prompt.is_empty() {
            return Err(CacheError::InvalidArgument("an empty prompt: nothing to write back".into()).into());
        }
        let Some(range) = self.unheld_from(namespace, prompt, first) else {
            return Ok(WriteBack::Held);
        };
        let kv = rows(range.clone())?;
        self.layout().expect(kv.layout())?;
        if kv.range() != range {
            return Err(CacheError::InvalidArgument(format!(
                "rows {:?} given for a write-back of {range:?}",
                kv.range()
            ))
            .into());
        }
        let outcome = self.store.submit(namespace, prompt, kv);
        self.count(|c| match outcome.is_queued() {
            true => {
                c.writes += 1;
                c.written_tokens += range.len() as u64;
            }
            false => c.refused += 1,
        });
        Ok(WriteBack::Sent { range, outcome })
    }

    /// Submits whole-layer states standing at exactly `prompt.len()`, one
    /// per layer that cannot cut its state into token rows (see
    /// [`PrefixStore::submit_states`]), and returns what the store did.
    /// No states, a layer beyond the layout or given twice, a state standing
    /// elsewhere or whose arrays do not fit their shapes are an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error: nothing is
    /// submitted.
    pub fn submit_states(
        &self,
        namespace: &Namespace,
        prompt: &[u32],
        states: Vec<(usize, HostState)>,
    ) -> Result<Submitted> {
        if states.is_empty() {
            return Err(CacheError::InvalidArgument("no states to submit".into()));
        }
        self.states_fit(prompt, &states)
            .map_err(|why| CacheError::InvalidArgument(format!("states that do not fit: {why}")))?;
        for (layer, state) in &states {
            state
                .check()
                .map_err(|e| CacheError::InvalidArgument(format!("the state of layer {layer}: {e}")))?;
        }
        let count = states.len() as u64;
        let outcome = self.store.submit_states(namespace, prompt, states);
        self.count(|c| match outcome.is_queued() {
            true => c.states_written += count,
            false => c.refused += 1,
        });
        Ok(outcome)
    }

    /// Why `states` do not all stand at `prefix.len()` on distinct layers of
    /// the layout, if they do not.
    fn states_fit(&self, prefix: &[u32], states: &[(usize, HostState)]) -> std::result::Result<(), String> {
        let layers = self.layout().layers;
        let mut seen = vec![false; layers];
        for (layer, state) in states {
            let layer = *layer;
            if layer >= layers {
                return Err(format!("layer {layer} of a {layers}-layer layout"));
            }
            if std::mem::replace(&mut seen[layer], true) {
                return Err(format!("layer {layer} given twice"));
            }
            if state.offset != prefix.len() {
                return Err(format!(
                    "layer {layer}'s state stands at {}, the prefix ends at {}",
                    state.offset,
                    prefix.len()
                ));
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("fingerprint", &self.store.fingerprint())
            .field("block_tokens", &self.store.block_tokens())
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::{DType, HostArray};

    const LAYOUT: KvLayout = KvLayout {
        layers: 2,
        kv_heads: 1,
        head_dim: 2,
        head_dim_v: 2,
        dtype: DType::F32,
    };

    /// A store that answers what it is told to and records what it is given.
    #[derive(Default)]
    struct Scripted {
        known: usize,
        outcome: Option<Submitted>,
        answer: Option<Fetched>,
        states: Option<Vec<(usize, HostState)>>,
        /// `(tokens asked, from)` of every fetch.
        fetches: Mutex<Vec<(Vec<u32>, usize)>>,
        /// `(tokens, range)` of every submitted run.
        submits: Mutex<Vec<(Vec<u32>, Range<usize>)>>,
        /// Layers of every submitted set of states.
        state_submits: Mutex<Vec<Vec<usize>>>,
    }

    impl PrefixStore for Scripted {
        fn fingerprint(&self) -> Fingerprint {
            Fingerprint([9; 32])
        }
        fn layout(&self) -> &KvLayout {
            &LAYOUT
        }
        fn block_tokens(&self) -> usize {
            4
        }
        fn known_prefix(&self, _: &Namespace, tokens: &[u32]) -> usize {
            self.known.min(tokens.len())
        }
        fn fetch(&self, _: &Namespace, tokens: &[u32], from: usize, _: Duration) -> Option<Fetched> {
            self.fetches.lock().unwrap().push((tokens.to_vec(), from));
            self.answer.clone()
        }
        fn submit(&self, _: &Namespace, tokens: &[u32], kv: HostKv) -> Submitted {
            self.submits.lock().unwrap().push((tokens.to_vec(), kv.range()));
            self.outcome.unwrap_or(Submitted::Queued)
        }
        fn submit_states(&self, _: &Namespace, _: &[u32], states: Vec<(usize, HostState)>) -> Submitted {
            let layers = states.iter().map(|(l, _)| *l).collect();
            self.state_submits.lock().unwrap().push(layers);
            self.outcome.unwrap_or(Submitted::Queued)
        }
        fn fetch_states(&self, _: &Namespace, _: &[u32], _: Duration) -> Option<Vec<(usize, HostState)>> {
            self.states.clone()
        }
    }

    fn scripted(store: Scripted) -> (StoreClient, Arc<Scripted>) {
        let store = Arc::new(store);
        (StoreClient::new(store.clone(), Duration::from_millis(5)), store)
    }

    fn prompt(len: u32) -> Vec<u32> {
        (100..100 + len).collect()
    }

    fn zeros(range: Range<usize>) -> Result<HostKv> {
        Ok(HostKv::zeroed(LAYOUT, range.start, range.len()))
    }

    fn write(client: &StoreClient, tokens: &[u32]) -> (Result<WriteBack>, Vec<Range<usize>>) {
        let mut asked = Vec::new();
        let out = client.write_back(&Namespace::shared(), tokens, |range| {
            asked.push(range.clone());
            zeros(range)
        });
        (out, asked)
    }

    #[test]
    fn a_prompt_the_store_lacks_is_written_whole() {
        let (client, store) = scripted(Scripted::default());
        let p = prompt(10);
        let (out, asked) = write(&client, &p);
        let out = out.unwrap();
        assert_eq!(
            out,
            WriteBack::Sent {
                range: 0..10,
                outcome: Submitted::Queued
            }
        );
        assert_eq!((out.stored_tokens(), out.is_refused()), (10, false));
        assert_eq!(asked, vec![0..10]);
        assert_eq!(*store.submits.lock().unwrap(), vec![(p, 0..10)]);
    }

    #[test]
    fn a_known_part_is_skipped_from_its_last_whole_block() {
        // Known up to 6: the write starts at 4, the block holding 6.
        let (client, store) = scripted(Scripted {
            known: 6,
            ..Scripted::default()
        });
        let p = prompt(11);
        assert_eq!(client.unheld(&Namespace::shared(), &p), Some(4..11));
        let (out, asked) = write(&client, &p);
        assert_eq!(out.unwrap().stored_tokens(), 7);
        assert_eq!(asked, vec![4..11]);
        assert_eq!(store.submits.lock().unwrap()[0].1, 4..11);

        // Known up to a block boundary: from there.
        let (client, _) = scripted(Scripted {
            known: 8,
            ..Scripted::default()
        });
        assert_eq!(client.unheld(&Namespace::shared(), &p), Some(8..11));
    }

    #[test]
    fn a_prompt_the_store_holds_is_not_read_or_written() {
        let (client, store) = scripted(Scripted {
            known: usize::MAX,
            ..Scripted::default()
        });
        let p = prompt(9);
        assert_eq!(client.unheld(&Namespace::shared(), &p), None);
        let (out, asked) = write(&client, &p);
        let out = out.unwrap();
        assert_eq!(out, WriteBack::Held);
        assert_eq!((out.stored_tokens(), out.is_refused()), (0, false));
        assert!(asked.is_empty(), "no rows read");
        assert!(store.submits.lock().unwrap().is_empty());
    }

    #[test]
    fn a_refused_submit_is_reported() {
        for refused in [Submitted::Dropped { queue_len: 3 }, Submitted::Rejected] {
            let (client, store) = scripted(Scripted {
                known: 4,
                outcome: Some(refused),
                ..Scripted::default()
            });
            let (out, _) = write(&client, &prompt(6));
            let out = out.unwrap();
            assert_eq!(
                out,
                WriteBack::Sent {
                    range: 4..6,
                    outcome: refused
                }
            );
            assert_eq!((out.stored_tokens(), out.is_refused()), (0, true));
            assert_eq!(store.submits.lock().unwrap().len(), 1);
        }
    }

    #[test]
    fn rows_that_do_not_fit_are_an_error_and_nothing_is_submitted() {
        let (client, store) = scripted(Scripted {
            known: 4,
            ..Scripted::default()
        });
        let ns = Namespace::shared();
        let p = prompt(10);
        // Another range.
        let out = client.write_back(&ns, &p, |_| zeros(0..10));
        assert!(matches!(out, Err(CacheError::InvalidArgument(_))), "{out:?}");
        // Another layout.
        let wide = KvLayout {
            kv_heads: 2,
            ..LAYOUT
        };
        let out = client.write_back(&ns, &p, |r| {
            Ok::<_, CacheError>(HostKv::zeroed(wide, r.start, r.len()))
        });
        assert!(
            matches!(out, Err(CacheError::LayoutMismatch { what: "kv_heads", .. })),
            "{out:?}"
        );
        // The reader's own error, as it is.
        let out = client.write_back(&ns, &p, |_| Err(CacheError::NotSupported("no rows".into())));
        assert_eq!(out, Err(CacheError::NotSupported("no rows".into())));
        // An empty prompt.
        let out = client.write_back(&ns, &[], zeros);
        assert!(matches!(out, Err(CacheError::InvalidArgument(_))), "{out:?}");
        assert!(store.submits.lock().unwrap().is_empty());
    }

    fn fetched(range: Range<usize>, tiers: Vec<(&'static str, usize)>) -> Fetched {
        Fetched {
            kv: HostKv::zeroed(LAYOUT, range.start, range.len()),
            tiers,
        }
    }

    #[test]
    fn a_restore_never_asks_for_the_last_token_and_says_where_it_came_from() {
        let (client, store) = scripted(Scripted {
            answer: Some(fetched(3..9, vec![("memory", 4), ("disk", 2)])),
            ..Scripted::default()
        });
        let ns = Namespace::shared();
        let p = prompt(10);
        let got = client.restore(&ns, &p, 3).unwrap().unwrap();
        assert_eq!(
            (got.kv.range(), got.tiers),
            (3..9, vec![("memory", 4), ("disk", 2)])
        );
        assert_eq!(*store.fetches.lock().unwrap(), vec![(p[..9].to_vec(), 3)]);
        // Nothing left to restore: the store is not asked.
        assert!(client.restore(&ns, &p, 9).unwrap().is_none());
        assert!(client.restore(&ns, &p[..1], 0).unwrap().is_none());
        assert_eq!(store.fetches.lock().unwrap().len(), 1);
        assert!(matches!(
            client.restore(&ns, &[], 0),
            Err(CacheError::InvalidArgument(_))
        ));
        // The engine's import: the store's model.
        let state = client.seq_state(HostKv::zeroed(LAYOUT, 0, 2));
        assert_eq!(state.fingerprint, Fingerprint([9; 32]));
    }

    #[test]
    fn a_restore_answer_that_does_not_fit_is_an_error() {
        let p = prompt(10);
        let ns = Namespace::shared();
        for (answer, from) in [(3..9, 2), (1..9, 2), (2..10, 2), (0..0, 0)] {
            let (client, _) = scripted(Scripted {
                answer: Some(fetched(answer.clone(), vec![("memory", answer.len())])),
                ..Scripted::default()
            });
            let out = client.restore(&ns, &p, from);
            assert!(
                matches!(out, Err(CacheError::InvalidState(_))),
                "{answer:?}: {out:?}"
            );
        }
        let wide = KvLayout { layers: 3, ..LAYOUT };
        let (client, _) = scripted(Scripted {
            answer: Some(Fetched {
                kv: HostKv::zeroed(wide, 0, 4),
                tiers: vec![],
            }),
            ..Scripted::default()
        });
        assert!(matches!(
            client.restore(&ns, &p, 0),
            Err(CacheError::LayoutMismatch { what: "layers", .. })
        ));
        let (client, _) = scripted(Scripted::default());
        assert!(client.restore(&ns, &p, 0).unwrap().is_none(), "nothing stored");
    }

    fn state(offset: usize) -> HostState {
        HostState {
            offset,
            arrays: vec![HostArray::new(vec![2], DType::F32, vec![0; 8]).unwrap()],
        }
    }

    #[test]
    fn states_are_checked_both_ways() {
        let ns = Namespace::shared();
        let p = prompt(6);
        let (client, store) = scripted(Scripted::default());
        assert_eq!(
            client.submit_states(&ns, &p, vec![(1, state(6))]).unwrap(),
            Submitted::Queued
        );
        let bad = [
            vec![],
            vec![(2, state(6))],
            vec![(1, state(5))],
            vec![(0, state(6)), (0, state(6))],
            vec![(
                0,
                HostState {
                    offset: 6,
                    arrays: vec![HostArray {
                        shape: vec![3],
                        dtype: DType::F32,
                        data: vec![0; 8],
                    }],
                },
            )],
        ];
        for states in bad {
            let out = client.submit_states(&ns, &p, states.clone());
            assert!(
                matches!(out, Err(CacheError::InvalidArgument(_))),
                "{states:?}: {out:?}"
            );
        }
        assert_eq!(*store.state_submits.lock().unwrap(), vec![vec![1]]);

        let (client, _) = scripted(Scripted {
            states: Some(vec![(1, state(6)), (0, state(6))]),
            ..Scripted::default()
        });
        let got = client.fetch_states(&ns, &p).unwrap().unwrap();
        assert_eq!(
            got.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
            vec![0, 1],
            "sorted"
        );
        assert!(matches!(
            client.fetch_states(&ns, &p[..5]),
            Err(CacheError::InvalidState(_))
        ));
        let (client, _) = scripted(Scripted::default());
        assert_eq!(client.fetch_states(&ns, &p).unwrap(), None);
    }
}
