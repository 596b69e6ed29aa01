//! [`PrefixCache`]: the trie, the live caches behind its active path, paging
//! between them, eviction, and the optional [`PrefixStore`] behind it.
//!
//! Invariants between operations (see [`PrefixCache::check`]):
//! - each namespace has its own root; the active path is a root-down chain
//!   from one of them, and exactly its nodes carry `active`;
//! - at rest every layer's offset equals the active path's end;
//! - `paged_out` and `snapshots` equal the sums over the nodes;
//! - the eviction index holds exactly the candidates (not a root, not active,
//!   at least one snapshot), each under its current key;
//! - above the budget, every snapshot lies on the active path.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use kvcache_api::{
    BoxedSnapshot, CacheError, HostKv, HostState, Namespace, PrefixStore, Result, SnapshotCache, StoreClient,
};

use super::arena::{common_prefix, Arena, Cost, EvictKey, Node, NodeId, NONE, ROOT};
use super::events::BlockEvents;
use super::session::{Restored, Session};
use super::stats::Stats;

/// A compressed prefix trie of token sequences shared across conversations,
/// with per-layer snapshots on its nodes, driving one set of live layer caches.
///
/// One root-down path of the trie, the *active path*, is backed by the live
/// caches. [`begin`](Self::begin) finds the longest cached prefix of a prompt,
/// pages the old path's leaf out to snapshots, rewinds (or frees) the live
/// caches to where the paths part, pages the new path in from snapshots, and
/// hands back a [`Session`] saying which tokens remain to be evaluated.
///
/// Snapshot memory is bounded by a byte budget: above it, nodes off the active
/// path are evicted, least recently used first (then deepest, then largest),
/// through an ordered index, so an eviction costs `O(log n)` and not a walk of
/// the trie. A leaf is removed, a node with one child is merged into it, and a
/// branch point with several children loses its snapshots but stays (Ollama's
/// way); so the budget holds except for snapshots on the active path. Explicit
/// user snapshots are evicted only after every other candidate.
///
/// Requests carry a [`Namespace`] ([`begin_in`](Self::begin_in)): each
/// namespace has its own root, so prefixes are never shared across namespaces;
/// switching to another namespace's path rewinds the live caches to 0.
///
/// With a [`PrefixStore`] ([`set_store`](Self::set_store), driven through a
/// [`StoreClient`] as the batching engine's is), a session writes the prompt's
/// keys and values the store lacks into it once the prompt is evaluated (at
/// its first recorded token, or at close), and `begin` restores from the store
/// the run of tokens past what the trie restored, before the engine evaluates
/// the rest ([`Session::restored`] says what came from where). Layers that cannot be cut
/// into token rows (rotating windows, recurrent states) write their whole
/// state at the prompt's end instead, and are restored only from a state
/// stored at exactly where the rows answer ends: across processes such models
/// reuse a prefix that ends where a stored prompt ended (rows for the KV
/// layers, whole states for the others).
///
/// `C` is the layer cache type; `Box<dyn SnapshotCache>` serves models that mix
/// layer kinds. The trie only uses the [`SnapshotCache`] contract.
pub struct PrefixCache<C> {
    pub(super) arena: Arena,
    pub(super) caches: Vec<C>,
    /// Root-down chain of nodes backed by the live caches.
    pub(super) active: Vec<NodeId>,
    /// Eviction candidates, ordered first to last.
    pub(super) index: BTreeSet<EvictKey>,
    /// Logical clock: advanced by every `begin` and every close.
    pub(super) clock: u64,
    pub(super) budget: usize,
    pub(super) paged_out: usize,
    pub(super) snapshots: usize,
    pub(super) over_budget: bool,
    pub(super) counters: Stats,
    /// Every namespace's root; the shared namespace's is [`ROOT`].
    pub(super) roots: BTreeMap<Namespace, NodeId>,
    /// The inverse of `roots`.
    pub(super) root_names: HashMap<NodeId, Namespace>,
    /// The store behind the trie, if any.
    pub(super) store: Option<StoreClient>,
    /// Where the blocks the paths hold are reported, if anywhere.
    pub(super) events: Option<BlockEvents>,
}

/// What a restore from the store brought: the live caches' new offset, and
/// what the store served for it.
struct FromStore {
    /// Prompt tokens the live caches hold now.
    end: usize,
    /// `(tier, tokens)` the store's tiers served, when the restore was taken.
    tiers: Vec<(&'static str, usize)>,
    /// Whole layer states loaded.
    states: usize,
}

/// Why a write-back read no rows: a layer cannot cut its state into rows
/// (nothing is written then), or reading failed.
enum Unread {
    Cannot,
    Failed(CacheError),
}

impl From<CacheError> for Unread {
    fn from(error: CacheError) -> Self {
        Unread::Failed(error)
    }
}

/// The result of walking the trie along a prompt.
pub(super) struct Match {
    /// Fully matched nodes, root first.
    pub path: Vec<NodeId>,
    /// Tokens matched.
    pub matched: usize,
    /// The node whose edge the match ends inside (`start < matched < end`).
    pub partial: Option<NodeId>,
}

impl<C: SnapshotCache> PrefixCache<C> {
    /// A prefix cache over one model's layer caches (one per layer, in layer
    /// order), keeping at most `budget` bytes of snapshots.
    ///
    /// The caches are freed: the trie starts empty. An empty `caches` is an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error.
    pub fn new(mut caches: Vec<C>, budget: usize) -> Result<Self> {
        if caches.is_empty() {
            return Err(CacheError::InvalidArgument(
                "a prefix cache needs at least one layer cache".into(),
            ));
        }
        for cache in &mut caches {
            cache.free();
        }
        let shared = Namespace::shared();
        Ok(PrefixCache {
            roots: BTreeMap::from([(shared.clone(), ROOT)]),
            root_names: HashMap::from([(ROOT, shared)]),
            store: None,
            events: None,
            arena: Arena::new(),
            caches,
            active: vec![ROOT],
            index: BTreeSet::new(),
            clock: 0,
            budget,
            paged_out: 0,
            snapshots: 0,
            over_budget: false,
            counters: Stats::default(),
        })
    }

    /// Prepares the live caches for `prompt` in the shared namespace and
    /// returns the session that evaluates it: [`begin_in`](Self::begin_in)
    /// with [`Namespace::shared`].
    pub fn begin(&mut self, prompt: &[u32]) -> Result<Session<'_, C>> {
        self.begin_in(&Namespace::shared(), prompt)
    }

    /// Prepares the live caches for `prompt` in `namespace` and returns the
    /// session that evaluates it.
    ///
    /// The longest prefix cached in that namespace is restored, but never the
    /// whole prompt: at least the last token is always left to evaluate, so
    /// that the engine has logits to sample from. With a store set, the run of
    /// tokens the store holds past what the trie restored is then fetched
    /// (within the store's deadline) and appended to every layer; if some
    /// layer refuses the rows, the layers are rewound and the request goes on
    /// without them. An empty prompt is an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error that changes nothing.
    ///
    /// A backend error while paging, or layers that cannot be taken back after
    /// a refused store restore, frees the live caches, leaves the trie at the
    /// namespace's root (consistent, with its snapshots kept) and is returned.
    pub fn begin_in(&mut self, namespace: &Namespace, prompt: &[u32]) -> Result<Session<'_, C>> {
        if prompt.is_empty() {
            return Err(CacheError::InvalidArgument(
                "empty prompt: nothing to evaluate".into(),
            ));
        }
        self.clock += 1;
        let root = self.root_for(namespace);
        let mut m = self.find_from(root, prompt);
        let structural = m.matched;
        self.leave_one(&mut m, prompt.len());
        // A prompt asked for these: generated or not, they are requested now.
        for &id in m.path.iter().chain(&m.partial) {
            let node = self.arena.get_mut(id);
            if node.generated {
                node.generated = false;
                let parent = node.parent;
                self.refresh(id);
                self.refresh(parent);
            }
        }
        let partial = m.partial.map(|p| (p, m.matched));
        let cached = match self.switch_to(&m.path, partial) {
            Ok(cached) => cached,
            Err(e) => {
                self.prune_root(root);
                return Err(e);
            }
        };
        let from_trie = cached;
        let FromStore {
            end: cached,
            tiers,
            states,
        } = match self.restore_from_store(namespace, prompt, cached) {
            Ok(restored) => restored,
            Err(e) => {
                self.prune_root(root);
                return Err(e);
            }
        };
        let restored = Restored {
            trie: from_trie,
            store: cached - from_trie,
            tiers,
            states,
        };

        // Where prefill must stop so that the trie can take snapshots the match
        // could not restore: ends of nodes that lack some layer's snapshot, and
        // the branch point inside a partially matched edge (unless a restore
        // from the store went past it: then the trie already branched there).
        let mut pending: Vec<usize> = m
            .path
            .iter()
            .map(|&id| self.arena.get(id))
            .filter(|n| n.end > cached && !n.has_all_snaps(self.caches.len()))
            .map(|n| n.end)
            .collect();
        if let Some((_, at)) = partial {
            if at >= cached && at > from_trie && !pending.contains(&at) {
                pending.push(at);
                pending.sort_unstable();
            }
        }

        if cached > 0 {
            self.counters.hits += 1;
        } else {
            self.counters.misses += 1;
        }
        self.counters.reused_tokens += cached as u64;
        self.counters.evaluated_tokens += (prompt.len() - cached) as u64;
        tracing::debug!(
            total = prompt.len(),
            matched = structural,
            from_trie,
            cached,
            left = prompt.len() - cached,
            pending = ?pending,
            "prefix cache {}",
            if cached > 0 { "hit" } else { "miss" }
        );
        self.enforce_budget();
        Ok(Session::new(self, namespace, prompt, restored, pending))
    }

    /// Tokens of `tokens` the trie holds as a path from the shared namespace's
    /// root (a structural match: no paging, no "leave one token" rule).
    pub fn lookup(&self, tokens: &[u32]) -> usize {
        self.lookup_in(&Namespace::shared(), tokens)
    }

    /// Tokens of `tokens` the trie holds as a path from `namespace`'s root.
    pub fn lookup_in(&self, namespace: &Namespace, tokens: &[u32]) -> usize {
        self.roots
            .get(namespace)
            .map_or(0, |&root| self.find_from(root, tokens).matched)
    }

    /// Puts `store` behind the trie: sessions write their prompts' keys and
    /// values through to it when they close, and `begin` restores from it what
    /// the trie lacks, waiting at most `deadline` for each read.
    ///
    /// The store's layout must have as many layers as the trie has caches
    /// ([`LayoutMismatch`](CacheError::LayoutMismatch) otherwise, changing
    /// nothing); the layers themselves check heads, dimensions and dtype when
    /// they read or append rows.
    pub fn set_store(&mut self, store: Arc<dyn PrefixStore>, deadline: Duration) -> Result<()> {
        let layers = store.layout().layers;
        if layers != self.caches.len() {
            return Err(CacheError::LayoutMismatch {
                what: "layers",
                expected: self.caches.len().to_string(),
                got: layers.to_string(),
            });
        }
        self.store = Some(StoreClient::new(store, deadline));
        Ok(())
    }

    /// Takes the store away (the trie keeps working in memory only).
    pub fn remove_store(&mut self) -> Option<Arc<dyn PrefixStore>> {
        self.store.take().map(StoreClient::into_store)
    }

    /// The store behind the trie, if any.
    pub fn store(&self) -> Option<&Arc<dyn PrefixStore>> {
        self.store.as_ref().map(StoreClient::store)
    }

    /// The client the trie reads and writes the store through, if it has one.
    pub fn store_client(&self) -> Option<&StoreClient> {
        self.store.as_ref()
    }

    /// Counters and current state; the store's are its client's
    /// ([`StoreClient::counters`]), since the store was set.
    pub fn stats(&self) -> Stats {
        let store = self.store.as_ref().map(StoreClient::counters).unwrap_or_default();
        Stats {
            store_hits: store.restores,
            store_tokens: store.restored_tokens,
            store_rejected: store.rejected,
            store_tier_tokens: store.tier_tokens,
            store_writes: store.writes,
            store_writes_refused: store.refused,
            store_tokens_written: store.written_tokens,
            store_states_written: store.states_written,
            store_states_loaded: store.states_loaded,
            paged_out_bytes: self.paged_out,
            budget: self.budget,
            snapshots: self.snapshots,
            nodes: self.arena.live,
            over_budget: self.over_budget,
            ..self.counters.clone()
        }
    }

    /// The paged-out byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Changes the budget, evicting at once if the trie is above it.
    pub fn set_budget(&mut self, bytes: usize) {
        self.budget = bytes;
        self.enforce_budget();
    }

    /// The live layer caches.
    pub fn caches(&self) -> &[C] {
        &self.caches
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.caches.len()
    }

    /// Tokens the live caches hold: the end of the active path.
    pub fn offset(&self) -> usize {
        self.min_offset()
    }

    /// Drops every node and snapshot of every namespace and frees the live
    /// caches (and reports `AllBlocksCleared` to the event sink, if one is
    /// set). Counters, the store and the sink stay.
    pub fn clear(&mut self) {
        self.report_cleared();
        for cache in &mut self.caches {
            cache.free();
        }
        self.arena = Arena::new();
        self.active = vec![ROOT];
        let shared = Namespace::shared();
        self.roots = BTreeMap::from([(shared.clone(), ROOT)]);
        self.root_names = HashMap::from([(ROOT, shared)]);
        self.index.clear();
        self.paged_out = 0;
        self.snapshots = 0;
        self.over_budget = false;
    }

    /// The trie as indented text, one node per line: edge tokens, offsets,
    /// snapshots held, and the `user` / `generated` / `active` flags. The shared namespace
    /// comes first (as `root`), then every other one (as `root "name"`).
    pub fn dump(&self) -> String {
        let mut out = String::new();
        let mut stack: Vec<(NodeId, usize)> = self.roots.values().rev().map(|&r| (r, 0)).collect();
        while let Some((id, depth)) = stack.pop() {
            let n = self.arena.get(id);
            let indent = "  ".repeat(depth);
            if id == ROOT {
                let _ = write!(out, "root");
            } else if n.is_root() {
                let name = self.root_names.get(&id).map_or("?", Namespace::as_str);
                let _ = write!(out, "root {name:?}");
            } else if n.tokens.len() <= 12 {
                let _ = write!(out, "{indent}{:?} [{},{})", n.tokens, n.start, n.end);
            } else {
                let _ = write!(out, "{indent}{:?}.. [{},{})", &n.tokens[..8], n.start, n.end);
            }
            if n.n_snaps > 0 {
                let _ = write!(out, " snaps {}/{} {}B", n.n_snaps, self.caches.len(), n.bytes);
            }
            if n.user {
                out.push_str(" user");
            }
            if n.generated {
                out.push_str(" generated");
            }
            if n.active && !n.is_root() {
                out.push_str(" active");
            }
            out.push('\n');
            for &(_, c) in n.children.iter().rev() {
                stack.push((c, depth + 1));
            }
        }
        out
    }

    // ---- matching ----

    /// Walks the trie from `root` along `tokens`.
    pub(super) fn find_from(&self, root: NodeId, tokens: &[u32]) -> Match {
        let mut path = vec![root];
        let mut node = root;
        let mut pos = 0;
        while pos < tokens.len() {
            let Some(child) = self.arena.get(node).child(tokens[pos]) else {
                break;
            };
            let edge = &self.arena.get(child).tokens;
            let common = common_prefix(edge, &tokens[pos..]);
            pos += common;
            if common < edge.len() {
                return Match {
                    path,
                    matched: pos,
                    partial: Some(child),
                };
            }
            path.push(child);
            node = child;
        }
        Match {
            path,
            matched: pos,
            partial: None,
        }
    }

    /// Shortens a match of a whole `len`-token prompt by one token, so that the
    /// last prompt token is evaluated again.
    fn leave_one(&self, m: &mut Match, len: usize) {
        if len == 0 || m.matched < len {
            return;
        }
        let target = len - 1;
        // The node whose edge holds offset `target`.
        let node = match m.partial.take() {
            Some(p) => p,
            None => m
                .path
                .pop()
                .expect("a match of a whole non-empty prompt ends below the root"),
        };
        if self.arena.get(node).start < target {
            m.partial = Some(node);
        }
        m.matched = target;
    }

    // ---- namespaces ----

    /// `namespace`'s root, made (empty, off the active path) if it has none.
    fn root_for(&mut self, namespace: &Namespace) -> NodeId {
        if let Some(&root) = self.roots.get(namespace) {
            return root;
        }
        let root = self.arena.alloc(Node::new(Vec::new(), 0, NONE, self.clock));
        self.roots.insert(namespace.clone(), root);
        self.root_names.insert(root, namespace.clone());
        root
    }

    /// Releases `id` if it is a root of a namespace other than the shared one
    /// that holds nothing and is off the active path (so that namespaces seen
    /// once cost nothing once their prefixes are evicted).
    pub(super) fn prune_root(&mut self, id: NodeId) {
        let n = self.arena.get(id);
        if id == ROOT || !n.live || !n.is_root() || n.active || !n.children.is_empty() {
            return;
        }
        if let Some(name) = self.root_names.remove(&id) {
            self.roots.remove(&name);
        }
        self.arena.release(id);
    }

    // ---- the store ----

    /// Restores from the store the run of `prompt` past `cached` (never its
    /// last token) into every layer, extending the active path with it, and
    /// says how many prompt tokens the live caches now hold and what the store
    /// served for them.
    ///
    /// The rows answer ([`StoreClient::restore`]) ends at some `end`. Every
    /// layer appends the rows `[cached, end)`; a layer that refuses rows (it
    /// cannot cut its state) loads instead the whole state stored for exactly
    /// `prompt[..end]` (written at a prompt end by
    /// [`write_through`](Self::write_through); asked of the store once, at the
    /// first such layer). With none there, the restore is refused.
    ///
    /// Nothing changes when there is no store, it answers nothing past
    /// `cached`, or what it answers does not fit. When some layer refuses
    /// the rows or the state (or fails), every layer is taken back to
    /// `cached` (row layers rewound, state layers given back the state they
    /// had); should that fail too, the live caches are freed, the trie is
    /// left at the root ([`fail`](Self::fail)) and the
    /// [`InvalidState`](CacheError::InvalidState) error is returned, as for a
    /// backend error while paging.
    fn restore_from_store(
        &mut self,
        namespace: &Namespace,
        prompt: &[u32],
        cached: usize,
    ) -> Result<FromStore> {
        let nothing = |end| {
            Ok(FromStore {
                end,
                tiers: Vec::new(),
                states: 0,
            })
        };
        let Some(client) = self.store.clone() else {
            return nothing(cached);
        };
        let fetched = match client.restore(namespace, prompt, cached) {
            Ok(Some(fetched)) => fetched,
            Ok(None) => return nothing(cached),
            Err(error) => {
                tracing::warn!(%error, cached, "prefix cache: ignoring a store answer that does not fit");
                return nothing(cached);
            }
        };
        let kv = fetched.kv;
        let end = kv.end();
        // Rows of the answer, `[cached, end)`. A layer that refuses rows
        // loads the whole state stored at exactly `end`, if there is one: the
        // states are fetched at the first such layer, so a model of row layers
        // only never asks for them.
        let rows = 0..kv.tokens();
        let layers = self.caches.len();
        let mut states: Option<Vec<Option<HostState>>> = None;
        // What the state layers held, to give back on a refusal (a state
        // cannot be rewound); nothing to keep at offset 0.
        let mut before: Vec<Option<HostState>> = vec![None; layers];
        let mut loaded = 0;
        let mut taken = true;
        for i in 0..layers {
            let mut outcome = self.caches[i].append_rows(kv.layer(i), rows.clone());
            if matches!(outcome, Ok(false)) {
                let found =
                    states.get_or_insert_with(|| Self::states_at(&client, namespace, &prompt[..end], layers));
                if let Some(state) = found[i].take() {
                    outcome = if cached == 0 {
                        self.caches[i].load_state(&state)
                    } else {
                        match self.caches[i].read_state() {
                            Ok(Some(held)) if held.offset == cached => {
                                before[i] = Some(held);
                                self.caches[i].load_state(&state)
                            }
                            _ => Ok(false),
                        }
                    };
                    loaded += 1;
                }
            }
            let cache = &self.caches[i];
            match outcome {
                Ok(true) if cache.offset() == end => {}
                Ok(true) => {
                    tracing::warn!(
                        layer = i,
                        offset = cache.offset(),
                        end,
                        "prefix cache: stored rows or state taken to the wrong offset"
                    );
                    taken = false;
                }
                Ok(false) => taken = false,
                Err(error) => {
                    tracing::warn!(%error, layer = i, "prefix cache: taking stored rows or state failed");
                    taken = false;
                }
            }
            if !taken {
                break;
            }
        }
        if !taken {
            client.record_rejected();
            let mut rewound = true;
            for (cache, held) in self.caches.iter_mut().zip(&before) {
                if cache.offset() == cached {
                    continue;
                }
                rewound &= match held {
                    Some(held) => matches!(cache.load_state(held), Ok(true)),
                    None if cached == 0 => {
                        cache.free();
                        true
                    }
                    None => matches!(cache.restore(None, cached), Ok(true)),
                };
            }
            if !rewound {
                return Err(self.fail(CacheError::InvalidState(format!(
                    "could not rewind the layers to {cached} after a refused store restore"
                ))));
            }
            return nothing(cached);
        }
        self.advance(&prompt[cached..end], false);
        client.record_restored(end - cached, &fetched.tiers, loaded);
        Ok(FromStore {
            end,
            tiers: fetched.tiers,
            states: loaded,
        })
    }

    /// The whole states the store holds for exactly `prefix`, by layer (of
    /// `layers`); none where it holds none or answers states that do not fit.
    fn states_at(
        client: &StoreClient,
        namespace: &Namespace,
        prefix: &[u32],
        layers: usize,
    ) -> Vec<Option<HostState>> {
        let mut out = vec![None; layers];
        match client.fetch_states(namespace, prefix) {
            Ok(Some(found)) => {
                for (layer, state) in found {
                    out[layer] = Some(state);
                }
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(%error, end = prefix.len(), "prefix cache: ignoring stored states");
            }
        }
        out
    }

    /// Writes `prompt` (the prompt tokens the live caches hold, from offset 0)
    /// through to the store: the rows the store lacks of the layers that cut
    /// their state into rows ([`StoreClient::write_back`]: from what the store
    /// holds, block-aligned, to the prompt's end), and the whole state at
    /// `prompt.len()` of the layers that cannot
    /// ([`read_state`](SnapshotCache::read_state): rotating windows, recurrent
    /// states), keyed by the prompt. Nothing is written when there is no store
    /// or some layer can do neither (a state layer must stand at exactly
    /// `prompt.len()`).
    pub(super) fn write_through(&mut self, namespace: &Namespace, prompt: &[u32]) {
        let Some(client) = self.store.clone() else {
            return;
        };
        let held = prompt.len();
        if held == 0 || self.caches.iter().any(|c| c.offset() < held) {
            return;
        }
        let layout = *client.layout();
        if layout.layers != self.caches.len() {
            return;
        }
        let mut states = Vec::new();
        for (i, cache) in self.caches.iter().enumerate() {
            match cache.read_state() {
                Ok(Some(state)) if state.offset == held => states.push((i, state)),
                Ok(Some(_)) => return,
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%error, layer = i, "prefix cache: reading a state for the store failed");
                    return;
                }
            }
        }
        let caches = &self.caches;
        let state_layers: Vec<usize> = states.iter().map(|(i, _)| *i).collect();
        let wrote = client.write_back(namespace, prompt, |range| {
            let mut kv = HostKv::zeroed(layout, range.start, range.len());
            for (i, cache) in caches.iter().enumerate() {
                // A state layer: its rows stay zero, the state stands for them.
                if state_layers.contains(&i) {
                    continue;
                }
                if !cache.read_rows(range.clone(), kv.layer_mut(i))? {
                    return Err(Unread::Cannot);
                }
            }
            Ok(kv)
        });
        match wrote {
            Ok(_) => {}
            Err(Unread::Cannot) => return,
            Err(Unread::Failed(error)) => {
                tracing::warn!(%error, "prefix cache: reading rows for the store failed");
                return;
            }
        }
        if !states.is_empty() {
            if let Err(error) = client.submit_states(namespace, prompt, states) {
                tracing::warn!(%error, "prefix cache: states not written to the store");
            }
        }
    }

    // ---- switching paths ----

    /// Makes the live caches hold the longest restorable prefix of `path`
    /// (then of the partially matched edge, if given) and returns its length.
    fn switch_to(&mut self, path: &[NodeId], partial: Option<(NodeId, usize)>) -> Result<usize> {
        // The new path's nodes that are already live.
        let mut common = 0;
        while common < path.len() && self.arena.get(path[common]).active {
            common += 1;
        }
        let partial_live = partial.is_some_and(|(p, _)| self.arena.get(p).active);
        // `common == 0`: the new path belongs to another namespace, whose
        // prefixes share nothing with the live ones.
        let ancestor = match partial {
            Some((_, at)) if partial_live => at,
            _ if common == 0 => 0,
            _ => self.arena.get(path[common - 1]).end,
        };

        // Page out the old leaf unless the new path keeps it whole. Only the
        // leaf: the live state is the leaf's, not an interior node's.
        if self.active.len() > common {
            let leaf = *self.active.last().expect("the active path holds the root");
            if !self.arena.get(leaf).is_root() && self.fill_snapshots(leaf)? {
                self.counters.page_outs += 1;
            }
        }

        // Rewind to where the paths part; caches that cannot are freed and
        // come back from snapshots below.
        for i in 0..self.caches.len() {
            if self.caches[i].offset() > ancestor {
                match self.caches[i].restore(None, ancestor) {
                    Ok(true) => {}
                    Ok(false) => self.caches[i].free(),
                    Err(e) => return Err(self.fail(e)),
                }
            }
        }
        let left = self.active.split_off(common);
        for &id in &left {
            self.set_active(id, false);
        }
        if common == 0 {
            // Another namespace: its root starts the active path, and the old
            // namespace's root goes if nothing hangs from it any more.
            self.set_active(path[0], true);
            self.active.push(path[0]);
            self.prune_root(left[0]);
        }

        // Page in along the whole new path; a cache already past a node skips it.
        let mut error = None;
        for &id in &path[1..] {
            let node = self.arena.get(id);
            if node.n_snaps == 0 {
                continue;
            }
            let mut paged_in = false;
            for (i, cache) in self.caches.iter_mut().enumerate() {
                if cache.offset() >= node.end {
                    continue;
                }
                let Some(snap) = node.snap(i) else { continue };
                match cache.restore(Some(&**snap), node.end) {
                    Ok(restored) => paged_in |= restored,
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
            if error.is_some() {
                break;
            }
            if paged_in {
                self.counters.page_ins += 1;
            }
        }
        if let Some(e) = error {
            return Err(self.fail(e));
        }

        // Into the partially matched edge, for caches that can stop inside a
        // snapshot (a rewindable KV cache can; a recurrent one cannot).
        if let Some((p, at)) = partial {
            let node = self.arena.get(p);
            if self.min_offset() >= node.start {
                for (i, cache) in self.caches.iter_mut().enumerate() {
                    if cache.offset() >= at {
                        continue;
                    }
                    let Some(snap) = node.snap(i) else { break };
                    match cache.restore(Some(&**snap), at) {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(e) => {
                            error = Some(e);
                            break;
                        }
                    }
                }
                if let Some(e) = error {
                    return Err(self.fail(e));
                }
            }
        }

        let reached = self.align(path)?;
        // The kept part of the old path may reach past what every layer could
        // restore (a freed layer came back only part of the way).
        self.truncate_active(reached);
        for &id in &path[self.active.len()..] {
            if self.arena.get(id).end > reached {
                break;
            }
            self.push_active(id);
        }
        if let Some((p, at)) = partial {
            if reached == at {
                // Every layer stands inside the edge: make the branch point now.
                let upper = self.split(p, at);
                self.push_active(upper);
                self.fill_snapshots(upper)?;
            }
        }
        Ok(reached)
    }

    /// Brings every layer to one offset: the lowest one, or lower (a boundary
    /// of `path`) when some layer cannot get there. Returns the offset.
    fn align(&mut self, path: &[NodeId]) -> Result<usize> {
        let mut target = self.min_offset();
        loop {
            let mut aligned = true;
            for i in 0..self.caches.len() {
                if self.caches[i].offset() == target {
                    continue;
                }
                match self.caches[i].restore(None, target) {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(e) => return Err(self.fail(e)),
                }
                if target == 0 {
                    self.caches[i].free();
                    continue;
                }
                if let Ok(k) = path.binary_search_by_key(&target, |&id| self.arena.get(id).end) {
                    if let Some(snap) = self.arena.get(path[k]).snap(i) {
                        match self.caches[i].restore(Some(&**snap), target) {
                            Ok(true) => continue,
                            Ok(false) => {}
                            Err(e) => return Err(self.fail(e)),
                        }
                    }
                }
                aligned = false;
                break;
            }
            if aligned {
                return Ok(target);
            }
            let k = path.partition_point(|&id| self.arena.get(id).end < target);
            target = if k == 0 {
                0
            } else {
                self.arena.get(path[k - 1]).end
            };
        }
    }

    /// After a failed cache operation: frees the live caches and falls back to
    /// the active namespace's root. The trie keeps its nodes and snapshots.
    pub(super) fn fail(&mut self, error: CacheError) -> CacheError {
        tracing::warn!(%error, "prefix cache: cache operation failed, freeing the live caches");
        for cache in &mut self.caches {
            cache.free();
        }
        for id in self.active.split_off(1) {
            self.set_active(id, false);
        }
        self.enforce_budget();
        error
    }

    pub(super) fn min_offset(&self) -> usize {
        self.caches.iter().map(SnapshotCache::offset).min().unwrap_or(0)
    }

    fn set_active(&mut self, id: NodeId, active: bool) {
        self.arena.get_mut(id).active = active;
        self.refresh(id);
    }

    fn push_active(&mut self, id: NodeId) {
        debug_assert_eq!(self.arena.get(id).parent, *self.active.last().expect("root"));
        self.set_active(id, true);
        self.active.push(id);
    }

    // ---- growing the active path ----

    /// Extends the active path from its end along `tokens`, the tokens that
    /// follow it, through existing nodes (splitting an edge where they part)
    /// and then a new or extended leaf, which counts as generated when
    /// `generated` says all of `tokens` were (and the leaf it extends was).
    /// Returns the new end of the path.
    pub(super) fn advance(&mut self, tokens: &[u32], generated: bool) -> NodeId {
        let mut cur = *self.active.last().expect("root");
        let mut pos = 0;
        while pos < tokens.len() {
            let Some(child) = self.arena.get(cur).child(tokens[pos]) else {
                break;
            };
            let node = self.arena.get(child);
            let common = common_prefix(&node.tokens, &tokens[pos..]);
            pos += common;
            if common < node.tokens.len() {
                let at = node.start + common;
                cur = self.split(child, at);
                self.push_active(cur);
                break;
            }
            self.push_active(child);
            cur = child;
        }
        if pos < tokens.len() {
            let rest = &tokens[pos..];
            let node = self.arena.get(cur);
            if !node.is_root() && node.children.is_empty() && !node.user && node.n_snaps == 0 {
                // A leaf only the live caches back: grow its edge in place.
                let node = self.arena.get_mut(cur);
                node.tokens.extend_from_slice(rest);
                node.end += rest.len();
                node.generated &= generated;
                let parent = node.parent;
                self.refresh(parent);
            } else {
                let mut leaf = Node::new(rest.to_vec(), node.end, cur, self.clock);
                leaf.generated = generated;
                let leaf = self.arena.alloc(leaf);
                self.arena.add_child(cur, rest[0], leaf);
                self.refresh(cur);
                self.push_active(leaf);
                cur = leaf;
            }
        }
        cur
    }

    /// Splits node `id`'s edge at offset `at` (`start < at < end`): a new node
    /// takes `[start, at)` and becomes `id`'s parent, `id` keeps `[at, end)`.
    /// Snapshots are split with the caches' `split`. Returns the new node.
    fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let node = self.arena.get_mut(id);
        debug_assert!(node.start < at && at < node.end, "split point outside the edge");
        let (start, parent, stamp, generated) = (node.start, node.parent, node.stamp, node.generated);
        let lower = node.tokens.split_off(at - start);
        let upper_tokens = std::mem::replace(&mut node.tokens, lower);
        node.start = at;
        let (first_upper, first_lower) = (upper_tokens[0], node.tokens[0]);
        let mut upper = Node::new(upper_tokens, start, parent, stamp);
        upper.generated = generated;
        let upper = self.arena.alloc(upper);
        self.arena.get_mut(id).parent = upper;
        self.arena.get_mut(upper).children.push((first_lower, id));
        self.arena.replace_child(parent, first_upper, upper);

        for (i, snap) in self.take_snaps(id).into_iter().enumerate() {
            let Some(snap) = snap else { continue };
            match self.caches[i].split(snap, at) {
                Ok((a, b)) => {
                    self.put_snap(upper, i, a);
                    self.put_snap(id, i, b);
                }
                Err(error) => tracing::warn!(%error, layer = i, "prefix cache: snapshot split failed"),
            }
        }
        self.refresh(id);
        self.refresh(upper);
        upper
    }

    /// Takes snapshots of the live caches for the layers `id` lacks. The
    /// caches must stand at `id`'s end. Returns whether any was taken.
    pub(super) fn fill_snapshots(&mut self, id: NodeId) -> Result<bool> {
        let node = self.arena.get(id);
        let (start, end) = (node.start, node.end);
        if node.has_all_snaps(self.caches.len()) {
            return Ok(false);
        }
        let mut taken = false;
        for i in 0..self.caches.len() {
            if self.arena.get(id).snap(i).is_some() {
                continue;
            }
            debug_assert_eq!(
                self.caches[i].offset(),
                end,
                "snapshot of a node the caches are not at"
            );
            match self.caches[i].snapshot(start) {
                Ok(snap) => {
                    taken |= snap.is_some();
                    self.put_snap(id, i, snap);
                }
                Err(e) => return Err(self.fail(e)),
            }
        }
        self.refresh(id);
        Ok(taken)
    }

    // ---- snapshot bookkeeping ----

    /// Gives `snap` to layer `layer` of node `id` (which has none for it),
    /// keeping the byte and snapshot totals. A snapshot that does not end at
    /// the node's end cannot restore it and is dropped. Does not refresh the
    /// eviction index.
    fn put_snap(&mut self, id: NodeId, layer: usize, snap: Option<BoxedSnapshot>) {
        let Some(snap) = snap else { return };
        let layers = self.caches.len();
        let node = self.arena.get_mut(id);
        if snap.range().end != node.end || snap.range().is_empty() {
            tracing::warn!(
                range = ?snap.range(),
                node = ?(node.start..node.end),
                "prefix cache: dropping a snapshot that does not end at its node"
            );
            return;
        }
        if node.snaps.is_empty() {
            node.snaps.resize_with(layers, || None);
        }
        let bytes = snap.size_bytes();
        let old = node.snaps[layer].replace(snap);
        assert!(old.is_none(), "layer {layer} of node {id} already had a snapshot");
        node.n_snaps += 1;
        node.bytes += bytes;
        self.paged_out += bytes;
        self.snapshots += 1;
    }

    /// Takes all of node `id`'s snapshots out, keeping the totals. Does not
    /// refresh the eviction index.
    fn take_snaps(&mut self, id: NodeId) -> Vec<Option<BoxedSnapshot>> {
        let node = self.arena.get_mut(id);
        self.paged_out -= node.bytes;
        self.snapshots -= node.n_snaps;
        node.bytes = 0;
        node.n_snaps = 0;
        std::mem::take(&mut node.snaps)
    }

    // ---- eviction ----

    /// Puts node `id` in the eviction index under its current key if it is a
    /// candidate, and takes it out otherwise.
    pub(super) fn refresh(&mut self, id: NodeId) {
        let want = self.candidate_key(id);
        let node = self.arena.get(id);
        if node.key != want {
            if let Some(old) = node.key {
                self.index.remove(&old);
            }
            if let Some(new) = want {
                self.index.insert(new);
            }
            self.arena.get_mut(id).key = want;
        }
    }

    /// The eviction key node `id` must be indexed under, or `None` if it is
    /// protected.
    pub(super) fn candidate_key(&self, id: NodeId) -> Option<EvictKey> {
        let node = self.arena.get(id);
        Self::key_of(id, node, self.cost(node))
    }

    /// The eviction key of `node` (slot `id`) at `cost`, or `None` if it is
    /// protected.
    pub(super) fn key_of(id: NodeId, node: &Node, cost: Cost) -> Option<EvictKey> {
        let candidate = !node.is_root() && node.live && !node.active && node.n_snaps > 0;
        candidate.then_some((
            node.user,
            cost,
            node.stamp,
            Reverse(node.end),
            Reverse(node.bytes),
            id,
        ))
    }

    /// What evicting `node` costs (see [`Cost`]).
    fn cost(&self, node: &Node) -> Cost {
        let superseded = match node.children[..] {
            [(_, child)] => {
                !node.user
                    && !self.arena.get(child).generated
                    && (node.snaps.iter().zip(&self.caches))
                        .any(|(snap, cache)| snap.is_some() && cache.holds_whole_state())
            }
            _ => false,
        };
        if superseded {
            Cost::Superseded
        } else if node.generated {
            Cost::Generated
        } else {
            Cost::Requested
        }
    }

    fn unindex(&mut self, id: NodeId) {
        if let Some(key) = self.arena.get_mut(id).key.take() {
            self.index.remove(&key);
        }
    }

    /// Evicts candidates, first to last, until the snapshots fit the budget or
    /// only the active path holds any.
    pub(super) fn enforce_budget(&mut self) {
        let mut over = false;
        while self.paged_out > self.budget {
            let Some((.., id)) = self.index.pop_first() else {
                over = true;
                break;
            };
            self.arena.get_mut(id).key = None;
            self.evict(id);
        }
        if over && !self.over_budget {
            tracing::debug!(
                paged_out = self.paged_out,
                budget = self.budget,
                "prefix cache: over budget, only the active path holds snapshots"
            );
        }
        self.over_budget = over;
    }

    /// Evicts candidate `id`: a leaf is removed (and its parent merged into its
    /// remaining child when it is an ordinary node left with one), a node with
    /// one child is merged into it, and a branch point with several children
    /// drops its snapshots and stays (the paths through it page in up to its
    /// start, and the next request along one heals it: see
    /// [`Session::pending_snapshot`]).
    fn evict(&mut self, id: NodeId) {
        self.counters.evictions += 1;
        match self.arena.get(id).children.len() {
            0 => {
                let parent = self.remove_leaf(id);
                let p = self.arena.get(parent);
                if !p.is_root() && !p.user && !p.active && p.children.len() == 1 {
                    self.counters.auto_merges += 1;
                    self.merge_into_child(parent);
                } else {
                    self.refresh(parent);
                    self.prune_root(parent);
                }
            }
            1 => self.merge_into_child(id),
            _ => {
                self.counters.branch_evictions += 1;
                self.unindex(id);
                self.take_snaps(id);
                self.refresh(id);
            }
        }
    }

    /// Removes leaf `id` with its snapshots; returns its parent.
    fn remove_leaf(&mut self, id: NodeId) -> NodeId {
        self.report_leaf_removed(id);
        self.unindex(id);
        self.take_snaps(id);
        let node = self.arena.release(id);
        debug_assert!(node.children.is_empty() && !node.active);
        self.arena.remove_child(node.parent, node.tokens[0]);
        node.parent
    }

    /// Merges node `id` into its only child: the child's edge grows to start
    /// where `id`'s did, and their snapshots are joined with the caches' `merge`.
    fn merge_into_child(&mut self, id: NodeId) {
        let child = {
            let node = self.arena.get(id);
            debug_assert!(node.children.len() == 1 && !node.active);
            node.children[0].1
        };
        self.unindex(id);
        self.unindex(child);
        let mut upper_snaps = self.take_snaps(id);
        let mut lower_snaps = self.take_snaps(child);
        let upper = self.arena.release(id);
        let first = upper.tokens[0];
        let node = self.arena.get_mut(child);
        let mut tokens = upper.tokens;
        tokens.extend_from_slice(&node.tokens);
        node.tokens = tokens;
        node.start = upper.start;
        node.parent = upper.parent;
        node.stamp = node.stamp.max(upper.stamp);
        node.generated &= upper.generated;
        self.arena.replace_child(upper.parent, first, child);
        self.refresh(upper.parent);

        for i in 0..self.caches.len() {
            let a = upper_snaps.get_mut(i).and_then(Option::take);
            let b = lower_snaps.get_mut(i).and_then(Option::take);
            if a.is_none() && b.is_none() {
                continue;
            }
            match self.caches[i].merge(a, b) {
                Ok(snap) => self.put_snap(child, i, snap),
                Err(error) => tracing::warn!(%error, layer = i, "prefix cache: snapshot merge failed"),
            }
        }
        self.refresh(child);
    }

    /// Marks the end of a session: stamps the active path with a new time.
    pub(super) fn touch_active(&mut self) {
        self.clock += 1;
        for &id in &self.active {
            self.arena.get_mut(id).stamp = self.clock;
        }
    }

    /// Truncates the active path to the nodes ending at or before `offset`.
    pub(super) fn truncate_active(&mut self, offset: usize) {
        let keep = self
            .active
            .partition_point(|&id| self.arena.get(id).end <= offset);
        for id in self.active.split_off(keep.max(1)) {
            self.set_active(id, false);
        }
    }

    pub(super) fn mark_user(&mut self, id: NodeId) {
        if !self.arena.get(id).is_root() {
            self.arena.get_mut(id).user = true;
            self.refresh(id);
        }
    }

    pub(super) fn frontier(&self) -> NodeId {
        *self.active.last().expect("the active path holds the root")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeKv;

    fn node(stamp: u64, end: usize, bytes: usize, user: bool) -> Node {
        let mut n = Node::new(vec![0; end], 0, ROOT, stamp);
        n.n_snaps = 1;
        n.bytes = bytes;
        n.user = user;
        n
    }

    #[test]
    fn eviction_order_cheapest_first_user_last_then_oldest_deepest_largest() {
        let key = |id, n: &Node| {
            let cost = if n.generated {
                Cost::Generated
            } else {
                Cost::Requested
            };
            PrefixCache::<FakeKv>::key_of(id, n, cost).unwrap()
        };
        let generated = |mut n: Node| {
            n.generated = true;
            n
        };
        let mut keys = [
            key(1, &node(5, 10, 100, true)),
            key(2, &node(6, 10, 100, false)),
            key(3, &node(5, 10, 100, false)),
            key(4, &node(5, 20, 100, false)),
            key(5, &node(5, 20, 300, false)),
            key(6, &node(1, 1, 1, true)),
            key(7, &generated(node(9, 4, 10, false))),
            key(8, &generated(node(8, 4, 10, false))),
            PrefixCache::<FakeKv>::key_of(9, &node(9, 4, 10, false), Cost::Superseded).unwrap(),
        ];
        keys.sort();
        let order: Vec<NodeId> = keys.iter().map(|k| k.5).collect();
        // Superseded whole states first; then generated nodes no prompt asked
        // for (the older one first); then the oldest (stamp 5); among them the
        // deepest (end 20), the larger of those first; then stamp 6; user
        // nodes after every ordinary one.
        assert_eq!(order, vec![9, 8, 7, 5, 4, 3, 2, 6, 1]);
    }

    #[test]
    fn protected_nodes_are_not_candidates() {
        let c = |id, n: &Node| PrefixCache::<FakeKv>::key_of(id, n, Cost::Requested);
        let mut n = node(1, 4, 16, false);
        assert!(c(3, &n).is_some());
        let mut root = node(1, 0, 16, false);
        root.parent = NONE;
        assert!(c(ROOT, &root).is_none(), "the shared root");
        assert!(c(9, &root).is_none(), "another namespace's root");
        n.active = true;
        assert!(c(3, &n).is_none(), "on the active path");
        n.active = false;
        n.children = vec![(1, 7), (2, 8)];
        assert!(
            c(3, &n).is_some(),
            "a branch point with several children: its snapshots go, it stays"
        );
        n.children.pop();
        assert!(c(3, &n).is_some(), "one child: merged into it when evicted");
        n.n_snaps = 0;
        assert!(c(3, &n).is_none(), "nothing to free");
    }
}

#[cfg(test)]
mod store_tests {
    use kvcache_api::{LayerRows, LayerRowsMut, Snapshot};

    use super::*;
    use crate::fake::{feed_all, Counters, FakeKv, FakeLayer, FakeRecurrent, MemStore};

    /// How a [`Flaky`] layer takes a whole state.
    #[derive(Clone, Copy)]
    enum Loads {
        /// As the layer it wraps.
        Pass,
        /// Never: `load_state` answers `Ok(false)`.
        Refuse,
        /// As the layer it wraps `n` times, then with a backend error.
        FailAfter(usize),
    }

    /// A fake layer whose `load_state` refuses or fails on demand.
    struct Flaky {
        inner: Box<dyn FakeLayer>,
        loads: Loads,
        /// `load_state` calls so far.
        loaded: usize,
    }

    impl Flaky {
        fn new(inner: Box<dyn FakeLayer>, loads: Loads) -> Self {
            Flaky {
                inner,
                loads,
                loaded: 0,
            }
        }
    }

    impl SnapshotCache for Flaky {
        fn offset(&self) -> usize {
            self.inner.offset()
        }
        fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>> {
            self.inner.snapshot(from)
        }
        fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
            self.inner.restore(snapshot, target)
        }
        fn merge(
            &mut self,
            parent: Option<BoxedSnapshot>,
            child: Option<BoxedSnapshot>,
        ) -> Result<Option<BoxedSnapshot>> {
            self.inner.merge(parent, child)
        }
        fn split(
            &mut self,
            snapshot: BoxedSnapshot,
            at: usize,
        ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
            self.inner.split(snapshot, at)
        }
        fn free(&mut self) {
            self.inner.free()
        }
        fn holds_whole_state(&self) -> bool {
            self.inner.holds_whole_state()
        }
        fn read_rows(&self, rows: std::ops::Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> {
            self.inner.read_rows(rows, out)
        }
        fn append_rows(&mut self, src: LayerRows<'_>, rows: std::ops::Range<usize>) -> Result<bool> {
            self.inner.append_rows(src, rows)
        }
        fn read_state(&self) -> Result<Option<HostState>> {
            self.inner.read_state()
        }
        fn load_state(&mut self, state: &HostState) -> Result<bool> {
            let before = self.loaded;
            self.loaded += 1;
            match self.loads {
                Loads::Pass => self.inner.load_state(state),
                Loads::Refuse => Ok(false),
                Loads::FailAfter(n) if before < n => self.inner.load_state(state),
                Loads::FailAfter(_) => Err(CacheError::Backend("injected load failure".into())),
            }
        }
    }

    impl FakeLayer for Flaky {
        fn feed(&mut self, tokens: &[u32]) {
            self.inner.feed(tokens)
        }
        fn holds(&self, tokens: &[u32]) -> bool {
            self.inner.holds(tokens)
        }
    }

    /// `prompt` through `trie` and closed, nothing generated.
    fn request<C: FakeLayer>(trie: &mut PrefixCache<C>, prompt: &[u32]) -> usize {
        let mut session = trie.begin(prompt).unwrap();
        let cached = session.cached();
        session
            .prefill(|tokens, caches| -> Result<()> {
                feed_all(caches, tokens);
                Ok(())
            })
            .unwrap();
        session.close().unwrap();
        cached
    }

    #[test]
    fn layers_that_cannot_be_taken_back_after_a_refused_restore_fail_the_begin() {
        const DEADLINE: Duration = Duration::from_millis(50);
        let store = Arc::new(MemStore::new(FakeKv::layout(3), 2));
        let long: Vec<u32> = (1..=10).collect();
        let n = Counters::new();
        {
            // A KV layer and two recurrent ones: rows for the first, whole
            // states at the prompt's end for the others.
            let layers: Vec<Box<dyn FakeLayer>> = vec![
                Box::new(FakeKv::new(&n)),
                Box::new(FakeRecurrent::new(&n)),
                Box::new(FakeRecurrent::new(&n)),
            ];
            let mut writer = PrefixCache::new(layers, usize::MAX).unwrap();
            writer.set_store(store.clone(), DEADLINE).unwrap();
            request(&mut writer, &long);
        }

        // The first recurrent layer loads the stored state, the second refuses
        // it; giving the first back the state it held then fails.
        let layers = vec![
            Flaky::new(Box::new(FakeKv::new(&n)), Loads::Pass),
            Flaky::new(Box::new(FakeRecurrent::new(&n)), Loads::FailAfter(1)),
            Flaky::new(Box::new(FakeRecurrent::new(&n)), Loads::Refuse),
        ];
        let mut c = PrefixCache::new(layers, usize::MAX).unwrap();
        c.set_store(store.clone(), DEADLINE).unwrap();
        store.set_offline(true);
        assert_eq!(request(&mut c, &long[..5]), 0);
        store.set_offline(false);
        let prompt = [&long[..], &[70]].concat();
        match c.begin(&prompt) {
            Err(CacheError::InvalidState(message)) => {
                assert!(message.contains("could not rewind the layers to 5"), "{message}")
            }
            Err(other) => panic!("not an InvalidState error: {other}"),
            Ok(session) => panic!(
                "begun at {} although the layers could not be taken back",
                session.cached()
            ),
        }
        assert_eq!(c.stats().store_rejected, 1);
        // The live caches are freed and the trie is consistent.
        assert!(c.caches().iter().all(|cache| cache.offset() == 0));
        c.check();
    }
}
