//! The prefix trie shared across conversations, over any layer cache.
//!
//! [`PrefixCache`] keeps a compressed trie of the token sequences it has seen,
//! with per-layer snapshots on its nodes, and one set of live layer caches
//! backing one root-down path (the *active path*). [`PrefixCache::begin`]
//! restores the longest cached prefix of a prompt into the live caches (paging
//! the old path out and the new one in) and returns a [`Session`] that tells
//! the engine what to evaluate. The trie only uses the
//! [`SnapshotCache`](kvcache_api::SnapshotCache) contract, so it runs over any
//! layer cache (mlx-rs ones from `kvcache-mlx`, candle ones from `kvcache-causal`),
//! and over fake caches in tests (`fake`, behind the `test-util` feature).
//!
//! # An engine loop
//!
//! ```
//! use kvcache_api::CacheError;
//! use kvcache_trie::fake::{feed_all, Counters, FakeKv};
//! use kvcache_trie::PrefixCache;
//!
//! // The model's layer caches (here two fake KV layers) and a 1 MiB budget
//! // for paged-out snapshots.
//! let counters = Counters::new();
//! let layers = vec![FakeKv::new(&counters), FakeKv::new(&counters)];
//! let mut cache = PrefixCache::new(layers, 1 << 20)?;
//!
//! let system = [1, 2, 3, 4];
//! for user_turn in [[10, 11], [20, 21], [10, 11]] {
//!     let prompt = [&system[..], &user_turn[..]].concat();
//!     let mut session = cache.begin(&prompt)?;
//!     println!("{} tokens cached, {} to evaluate", session.cached(), session.remaining().len());
//!
//!     // Prefill: the session pauses where it needs a snapshot and takes it.
//!     session.prefill(|tokens, caches| {
//!         feed_all(caches, tokens); // the model's forward pass
//!         Ok::<(), CacheError>(())
//!     })?;
//!
//!     // Decode: record and evaluate each sampled token, then record the last
//!     // one, which is never evaluated (closing with more left unevaluated is
//!     // an error).
//!     let max_tokens = 3;
//!     let mut token = 100; // sampled from the logits of the prefill
//!     for step in 1..max_tokens {
//!         session.decode(token, |tokens, caches| {
//!             feed_all(caches, tokens); // the model's forward pass
//!             Ok::<(), CacheError>(())
//!         })?;
//!         token = 100 + step; // sampled from the logits decode returned
//!     }
//!     session.record(token);
//!     // Closing (or dropping) the session stores what the caches hold.
//!     session.close()?;
//!     cache.check();
//! }
//!
//! let stats = cache.stats();
//! assert_eq!((stats.hits, stats.misses), (2, 1));
//! // The third prompt repeats the first: only its last token is evaluated.
//! assert_eq!(stats.evaluated_tokens, 6 + 2 + 1);
//! # Ok::<(), CacheError>(())
//! ```
//!
//! # Behaviour worth knowing
//! - The last prompt token is always evaluated: an exact repeat of a cached
//!   prompt evaluates one token.
//! - A match that ends inside an edge is restored into it for layers that can
//!   stop inside a snapshot (rewindable KV caches); when every layer gets there
//!   the edge is split at once. Otherwise [`Session::pending_snapshot`] names
//!   the offset where prefill must pause so that [`Session::snapshot`] can make
//!   the branch point, and so does the end of any matched node lacking some
//!   layer's snapshot (such gaps heal on their next use).
//! - A layer that cannot reach an offset (`restore` answers `Ok(false)`) pulls
//!   every layer back to the deepest node boundary they all reach; only a
//!   backend error frees the live caches and falls back to the root.
//! - Paging out snapshots only what a node lacks; a conversation that goes on
//!   from a paged-in leaf grows a child node rather than re-copying the leaf.
//! - Eviction above the byte budget takes the cheapest nodes first: an
//!   ordinary node with one requested child whose whole-state snapshots (a
//!   window, a recurrent state:
//!   [`holds_whole_state`](kvcache_api::SnapshotCache::holds_whole_state)) the
//!   child's supersede, merged into it without losing a path; then nodes
//!   holding only generated tokens that no prompt has matched yet (a reply the
//!   client may never send back: rebuilding one costs at most its own
//!   tokens); then the requested ones. Within each, the least recently used node (a logical
//!   clock), then the deepest, then the largest; never the active path or a
//!   root; user snapshots go only after every ordinary node. A prompt that
//!   matches into a generated node makes it requested. A leaf is
//!   removed, a node with one child merged into it, and a branch point with
//!   several children drops its snapshots but stays in the trie (Ollama's
//!   way): paths through it then page in up to its start, evaluate its edge,
//!   and heal it with a pending snapshot. So the budget holds except for
//!   snapshots on the active path ([`Stats::over_budget`]). An ordered index
//!   makes each eviction `O(log n)`.
//! - Every request runs in a [`Namespace`](kvcache_api::Namespace)
//!   ([`PrefixCache::begin_in`]; [`PrefixCache::begin`] uses the shared one).
//!   Each namespace has its own root, so no prefix is shared across
//!   namespaces; switching to another namespace rewinds the live caches to 0.
//!   A namespace's root is released once nothing hangs from it.
//!
//! # A store behind the trie
//!
//! With a [`PrefixStore`](kvcache_api::PrefixStore) set
//! ([`PrefixCache::set_store`]), prefixes outlive the process:
//!
//! The trie talks to the store through a
//! [`StoreClient`](kvcache_api::StoreClient), the same client the batching
//! engine uses, so both follow one restore rule and one write-back rule:
//!
//! - **Write-back once the prompt is evaluated.** At the session's first
//!   recorded token (or at close, when none was recorded) the live caches
//!   hold exactly the prompt: the trie copies the prompt tokens the store does
//!   not hold (`known_prefix`, aligned down to the store's block) into a
//!   [`HostKv`](kvcache_api::HostKv) with each layer's `read_rows` and submits
//!   it ([`StoreClient::write_back`](kvcache_api::StoreClient::write_back)),
//!   once. Generated tokens are not written. Evictions therefore drop only
//!   what the store already has (or never could).
//! - **Restore on miss.** After the in-memory match, `begin` fetches the run
//!   of the prompt (never its last token) past what the trie restored, within
//!   the store's deadline, and appends it to every layer with `append_rows`;
//!   the restored tokens extend the active path as a node only the live
//!   caches back, as after prefill. If any layer refuses or fails, every layer
//!   is rewound and the tokens are evaluated instead. The session says what
//!   its restore brought, from the trie and from each tier of the store
//!   ([`Session::restored`]).
//! - Layers that cannot be cut into token rows (rotating windows, recurrent
//!   states: `read_rows` answers `false`) give their whole state instead
//!   (`read_state`): the trie submits it with `submit_states`, keyed by the
//!   prompt, beside the other layers' rows. On a miss such a layer loads the
//!   state stored at exactly where the rows answer ends (`fetch_states`,
//!   `load_state`); with none there, nothing is restored from the store. So
//!   such models reuse across processes a prefix ending where a stored prompt
//!   ended (the next turn of a stored conversation), and any prefix within
//!   the process. A layer that can give neither rows nor a state makes the
//!   trie submit nothing.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use kvcache_api::{CacheError, Namespace};
//! use kvcache_trie::fake::{feed_all, Counters, FakeKv, MemStore};
//! use kvcache_trie::PrefixCache;
//!
//! let store = Arc::new(MemStore::new(FakeKv::layout(2), 4));
//! let tenant = Namespace::new("tenant-42")?;
//! let prompt: Vec<u32> = (1..=10).collect();
//! let serve = |prompt: &[u32]| -> Result<usize, CacheError> {
//!     // A new process each time: new layers, an empty trie, the same store.
//!     let counters = Counters::new();
//!     let layers = vec![FakeKv::new(&counters), FakeKv::new(&counters)];
//!     let mut cache = PrefixCache::new(layers, 1 << 20)?;
//!     cache.set_store(store.clone(), Duration::from_millis(20))?;
//!     let mut session = cache.begin_in(&tenant, prompt)?;
//!     let cached = session.cached();
//!     session.prefill(|tokens, caches| {
//!         feed_all(caches, tokens);
//!         Ok::<(), CacheError>(())
//!     })?;
//!     session.close()?; // writes the prompt through to the store
//!     Ok(cached)
//! };
//! assert_eq!(serve(&prompt)?, 0);
//! // The next turn, in another process, restores the first turn's prompt.
//! let next = [&prompt[..], &[11, 12]].concat();
//! assert_eq!(serve(&next)?, 10);
//! # Ok::<(), CacheError>(())
//! ```
//!
//! # Modules
//! - `arena`: nodes in a `Vec` addressed by `u32`, with a free list; each node
//!   holds its edge tokens, `[start, end)`, parent, children sorted by first
//!   token, per-layer snapshots, user flag and last-used stamp.
//! - `cache`: [`PrefixCache`]: namespaces' roots, matching, switching paths
//!   (page out, rewind, page in, align), restoring from and writing to the
//!   store, growing the active path, splitting and merging nodes, eviction
//!   through an ordered index.
//! - `session`: [`Session`], the engine-facing side of one request.
//! - `events`: [`PrefixCache::set_event_sink`]: the full blocks the paths
//!   hold, reported as KV events (stored at a session's close, removed with
//!   an evicted leaf, all cleared with the trie).
//! - `check`: [`PrefixCache::check`], the invariant checker.
//! - `stats`: [`Stats`].
//! - `fake` (feature `test-util`, for tests and benchmarks): fake layer caches
//!   whose state is made of token ids (a KV cache, a recurrent state, a sliding
//!   window), counting every snapshot they make and drop, and `fake::MemStore`,
//!   an in-memory prefix store.

#![deny(missing_docs)]

mod arena;
mod cache;
mod check;
mod events;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
mod session;
mod stats;

pub use cache::PrefixCache;
pub use check::TrieViolation;
pub use session::{Restored, Session};
pub use stats::Stats;
