//! Fake layer caches for tests, benchmarks and engine prototypes.
//!
//! Their state is made of token ids, so what a snapshot holds and what a
//! restore produced can be compared with a from-scratch evaluation:
//!
//! - [`FakeKv`]: a rewindable KV cache whose state is the list of tokens it
//!   holds; snapshots hold the tokens of their range. It reads and appends
//!   host rows in the layout [`FakeKv::layout`] (one head of one `f32`-sized
//!   element: the token id's bits as the key, their complement as the value).
//! - [`FakeRecurrent`]: a non-rewindable recurrent state (a running hash of
//!   every token seen). It cannot rewind its live state and restores only at a
//!   snapshot's exact end offset; it cannot split snapshots. Its whole state
//!   goes to the host and back ([`SnapshotCache::read_state`]): one `[2]`
//!   array of `f32`-sized elements holding the hash's little-endian bytes.
//! - [`FakeWindow`]: a sliding-window (rotating) cache holding the last `W`
//!   tokens. Like a rotating KV cache, it rewinds or stops inside a snapshot
//!   only while nothing has left the window, its snapshots hold the whole
//!   window, merging keeps the child and splitting is refused. Its whole state
//!   on the host is one `[min(offset, W)]` array of `f32`-sized elements: the
//!   window's token ids, oldest first.
//!
//! Their snapshot, restore, merge and split are [`kvcache_api::paging`]'s,
//! as the real caches' are (the fakes only say what a snapshot holds), and
//! they keep the same `kvcache_api::contract`.
//!
//! Every snapshot they create and drop is counted in a shared [`Counters`], so
//! a test can prove that each snapshot was dropped exactly once or is still
//! owned by the trie. [`feed_all`] plays the model: it appends tokens to every
//! layer. [`MemStore`] is an in-memory [`PrefixStore`] (rows and whole states)
//! to put behind a trie.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvcache_api::paging::{Payload, Rewind, RowCache, Rows, RowsSnapshot, State, StateCache, StateSnapshot};
use kvcache_api::{
    CacheError, DType, Fetched, HostArray, HostKv, HostState, KvLayout, LayerRows, LayerRowsMut, MixedLayer,
    Namespace, PrefixStore, Result, Snapshot, SnapshotCache, Submitted,
};

/// Bytes a [`FakeRecurrent`] snapshot reports: a recurrent state has a fixed size.
pub const RECURRENT_STATE_BYTES: usize = 64;

#[derive(Debug, Default)]
struct Inner {
    created: AtomicUsize,
    dropped: AtomicUsize,
    fed: AtomicUsize,
    restored: AtomicUsize,
    appended: AtomicUsize,
    fail_restore: AtomicBool,
    fail_append: AtomicBool,
}

/// Shared counters of the fakes created with it. Cloning shares the counters.
#[derive(Debug, Clone, Default)]
pub struct Counters(Arc<Inner>);

impl Counters {
    /// Fresh counters, all zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Snapshots created so far (by `snapshot`, `merge` and `split`).
    pub fn created(&self) -> usize {
        self.0.created.load(Ordering::Relaxed)
    }

    /// Snapshots dropped so far.
    pub fn dropped(&self) -> usize {
        self.0.dropped.load(Ordering::Relaxed)
    }

    /// Snapshots alive now (`created - dropped`).
    pub fn alive(&self) -> usize {
        self.created() - self.dropped()
    }

    /// Tokens the fake model evaluated, summed over layers (see [`FakeLayer::feed`]).
    pub fn fed_tokens(&self) -> usize {
        self.0.fed.load(Ordering::Relaxed)
    }

    /// Tokens brought back from snapshots by `restore`, summed over layers.
    pub fn restored_tokens(&self) -> usize {
        self.0.restored.load(Ordering::Relaxed)
    }

    /// Tokens appended from host rows by `append_rows`, summed over layers.
    pub fn appended_tokens(&self) -> usize {
        self.0.appended.load(Ordering::Relaxed)
    }

    /// While set, every `restore` from a snapshot fails with a backend error
    /// (to exercise the trie's recovery).
    pub fn set_fail_restore(&self, fail: bool) {
        self.0.fail_restore.store(fail, Ordering::Relaxed);
    }

    /// While set, every [`FakeKv::append_rows`] fails with a backend error,
    /// changing nothing.
    pub fn set_fail_append(&self, fail: bool) {
        self.0.fail_append.store(fail, Ordering::Relaxed);
    }

    fn created_one(&self) {
        self.0.created.fetch_add(1, Ordering::Relaxed);
    }

    fn dropped_one(&self) {
        self.0.dropped.fetch_add(1, Ordering::Relaxed);
    }

    fn check_restore(&self) -> Result<()> {
        if self.0.fail_restore.load(Ordering::Relaxed) {
            Err(CacheError::Backend("injected restore failure".into()))
        } else {
            Ok(())
        }
    }
}

/// A fake layer cache: one the fake model can feed tokens to, and whose state
/// can be compared with a from-scratch evaluation.
pub trait FakeLayer: SnapshotCache {
    /// Evaluates `tokens`: appends them to the live state.
    fn feed(&mut self, tokens: &[u32]);

    /// True when the live state is exactly what evaluating `tokens` from an
    /// empty cache produces.
    fn holds(&self, tokens: &[u32]) -> bool;
}

impl<T: FakeLayer + ?Sized> FakeLayer for Box<T> {
    fn feed(&mut self, tokens: &[u32]) {
        (**self).feed(tokens)
    }
    fn holds(&self, tokens: &[u32]) -> bool {
        (**self).holds(tokens)
    }
}

impl<G: FakeLayer, W: FakeLayer> FakeLayer for MixedLayer<G, W> {
    fn feed(&mut self, tokens: &[u32]) {
        match self {
            MixedLayer::Global(cache) => cache.feed(tokens),
            MixedLayer::Window(cache) => cache.feed(tokens),
        }
    }
    fn holds(&self, tokens: &[u32]) -> bool {
        match self {
            MixedLayer::Global(cache) => cache.holds(tokens),
            MixedLayer::Window(cache) => cache.holds(tokens),
        }
    }
}

/// The fake model: evaluates `tokens` on every layer.
pub fn feed_all<C: FakeLayer>(caches: &mut [C], tokens: &[u32]) {
    for cache in caches {
        cache.feed(tokens);
    }
}

/// Little-endian bytes of `words`, as a host array `[words.len()]` of
/// `f32`-sized elements.
fn words_array(words: &[u32]) -> HostArray {
    HostArray {
        shape: vec![words.len()],
        dtype: DType::F32,
        data: words.iter().flat_map(|w| w.to_le_bytes()).collect(),
    }
}

/// A whole state at `offset` of one array of `words` (see [`words_array`]);
/// `None` at offset 0, where a fake holds nothing.
fn words_state(offset: usize, words: &[u32]) -> Option<HostState> {
    (offset > 0).then(|| HostState {
        offset,
        arrays: vec![words_array(words)],
    })
}

/// The words of a state of one `[len]` array of `f32`-sized elements, `len`
/// given or any; a typed error for anything else.
fn state_words(state: &HostState, len: Option<usize>) -> Result<Vec<u32>> {
    state.check()?;
    let [array] = &state.arrays[..] else {
        return Err(CacheError::ShapeMismatch {
            what: "state (number of arrays)",
            expected: vec![1],
            got: vec![state.arrays.len()],
        });
    };
    if array.dtype != DType::F32 {
        return Err(CacheError::DTypeMismatch {
            what: "state",
            expected: DType::F32.to_string(),
            got: array.dtype.to_string(),
        });
    }
    let n = array.elements();
    if array.shape.len() != 1 || len.is_some_and(|len| len != n) {
        return Err(CacheError::ShapeMismatch {
            what: "state",
            expected: vec![len.unwrap_or(n)],
            got: array.shape.clone(),
        });
    }
    Ok(array
        .data
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("four bytes")))
        .collect())
}

/// One snapshot payload counted in [`Counters`]: created with it, dropped
/// with it.
#[derive(Debug)]
struct Tally(Counters);

impl Tally {
    fn new(counters: &Counters) -> Self {
        counters.created_one();
        Tally(counters.clone())
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.0.dropped_one();
    }
}

/// A rewindable fake KV cache: its state is the list of tokens it holds.
#[derive(Debug)]
pub struct FakeKv {
    tokens: Vec<u32>,
    counters: Counters,
}

/// A [`FakeKv`] snapshot: the [`FakeRows`] of its range.
pub type FakeKvSnapshot = RowsSnapshot<FakeRows>;

/// The rows of a [`FakeKv`] snapshot: the tokens of its range.
#[derive(Debug)]
pub struct FakeRows {
    tokens: Vec<u32>,
    tally: Tally,
}

impl FakeRows {
    fn new(tokens: Vec<u32>, counters: &Counters) -> Self {
        FakeRows {
            tokens,
            tally: Tally::new(counters),
        }
    }

    /// The tokens held.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl Payload for FakeRows {
    fn size_bytes(&self) -> usize {
        self.tokens.len() * std::mem::size_of::<u32>()
    }
}

impl Rows for FakeRows {
    fn tokens(&self) -> usize {
        self.tokens.len()
    }
    fn concat(parent: &Self, child: &Self) -> Result<Self> {
        let tokens = [&parent.tokens[..], &child.tokens[..]].concat();
        Ok(FakeRows::new(tokens, &parent.tally.0))
    }
    fn split(&self, at: usize) -> Result<(Self, Self)> {
        let (upper, lower) = self.tokens.split_at(at);
        let counters = &self.tally.0;
        Ok((
            FakeRows::new(upper.to_vec(), counters),
            FakeRows::new(lower.to_vec(), counters),
        ))
    }
}

impl FakeKv {
    /// An empty cache counting into `counters`.
    pub fn new(counters: &Counters) -> Self {
        FakeKv {
            tokens: Vec::new(),
            counters: counters.clone(),
        }
    }

    /// The tokens the live cache holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The host layout of `layers` fake KV layers: one head of dimension 1 in
    /// `f32`-sized elements, whose little-endian bytes are the token id (keys)
    /// and its bitwise complement (values).
    pub fn layout(layers: usize) -> KvLayout {
        KvLayout::new(layers, 1, 1, DType::F32)
    }

    /// Checks that `layout` is [`FakeKv::layout`] (any layer count).
    fn check_layout(layout: &KvLayout) -> Result<()> {
        Self::layout(layout.layers).expect(layout)
    }
}

impl FakeLayer for FakeKv {
    fn feed(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        self.counters.0.fed.fetch_add(tokens.len(), Ordering::Relaxed);
    }
    fn holds(&self, tokens: &[u32]) -> bool {
        self.tokens == tokens
    }
}

impl RowCache for FakeKv {
    type Rows = FakeRows;

    fn copy_rows(&self, rows: Range<usize>) -> Result<FakeRows> {
        Ok(FakeRows::new(self.tokens[rows].to_vec(), &self.counters))
    }

    fn live_offset(&self) -> usize {
        self.tokens.len()
    }

    fn write_rows(&mut self, at: usize, rows: &FakeRows, take: usize) -> Result<()> {
        self.counters.check_restore()?;
        self.tokens.truncate(at);
        self.tokens.extend_from_slice(&rows.tokens[..take]);
        self.counters.0.restored.fetch_add(take, Ordering::Relaxed);
        Ok(())
    }

    fn clear(&mut self) {
        self.tokens = Vec::new();
    }

    fn truncate(&mut self, to: usize) {
        self.tokens.truncate(to);
    }
}

kvcache_api::snapshot_cache!(rows: FakeKv {
    fn read_rows(&self, rows: Range<usize>, out: LayerRowsMut<'_>) -> Result<bool> {
        Self::check_layout(&out.layout)?;
        if rows.start > rows.end || rows.end > self.tokens.len() {
            return Ok(false);
        }
        if out.tokens != rows.len() {
            return Err(CacheError::InvalidArgument(format!(
                "{} rows read into a layer of {} tokens",
                rows.len(),
                out.tokens
            )));
        }
        for (i, &t) in self.tokens[rows].iter().enumerate() {
            out.keys[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
            out.values[4 * i..4 * i + 4].copy_from_slice(&(!t).to_le_bytes());
        }
        Ok(true)
    }

    fn append_rows(&mut self, src: LayerRows<'_>, rows: Range<usize>) -> Result<bool> {
        Self::check_layout(&src.layout)?;
        if rows.start > rows.end || rows.end > src.tokens {
            return Err(CacheError::InvalidArgument(format!(
                "rows {rows:?} of a layer holding {} tokens",
                src.tokens
            )));
        }
        if self.counters.0.fail_append.load(Ordering::Relaxed) {
            return Err(CacheError::Backend("injected append failure".into()));
        }
        let word = |bytes: &[u8], i: usize| {
            u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("four bytes"))
        };
        let mut tokens = Vec::with_capacity(rows.len());
        for i in rows {
            let (key, value) = (word(src.keys, i), word(src.values, i));
            if value != !key {
                return Err(CacheError::InvalidArgument(format!(
                    "row {i} is no fake KV row (key {key:#x}, value {value:#x})"
                )));
            }
            tokens.push(key);
        }
        self.counters
            .0
            .appended
            .fetch_add(tokens.len(), Ordering::Relaxed);
        self.tokens.extend_from_slice(&tokens);
        Ok(true)
    }
});

/// An in-memory [`PrefixStore`] for tests and prototypes: blocks of
/// `block_tokens` tokens (the last one of a submission may be shorter), each
/// keyed by its namespace and every token from offset 0 to its end, so a block
/// serves exactly the prompts that begin with the tokens it was written for.
///
/// It honours the contract: `known_prefix` counts whole blocks held from
/// offset 0 (or the whole of the tokens), `fetch` answers from the requested
/// offset to the end of the consecutive blocks held, and `submit` refuses
/// (counting it) a write whose layout differs or whose start is not a multiple
/// of the block size. Whole layer states are kept by namespace and the exact
/// prefix they stand at, and served only for that prefix. It can be switched
/// offline, to answer every fetch with `None` as a store past its deadline
/// would.
#[derive(Debug)]
pub struct MemStore {
    layout: KvLayout,
    block: usize,
    inner: Mutex<MemStoreInner>,
}

/// Whole states by layer, standing at the end of one prefix.
type LayerStates = Vec<(usize, HostState)>;

#[derive(Debug, Default)]
struct MemStoreInner {
    blocks: HashMap<(Namespace, Vec<u32>), HostKv>,
    states: HashMap<(Namespace, Vec<u32>), LayerStates>,
    offline: bool,
    fetches: usize,
    state_fetches: usize,
    submits: usize,
    refused: usize,
}

impl MemStore {
    /// An empty store of `layout` cutting tokens into blocks of `block_tokens`
    /// (at least 1).
    pub fn new(layout: KvLayout, block_tokens: usize) -> Self {
        MemStore {
            layout,
            block: block_tokens.max(1),
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemStoreInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// While set, every fetch answers `None` (a store that misses its deadline).
    pub fn set_offline(&self, offline: bool) {
        self.lock().offline = offline;
    }

    /// Blocks held, over every namespace.
    pub fn blocks(&self) -> usize {
        self.lock().blocks.len()
    }

    /// Prefixes with whole layer states stored, over every namespace.
    pub fn state_prefixes(&self) -> usize {
        self.lock().states.len()
    }

    /// `fetch_states` calls so far.
    pub fn state_fetches(&self) -> usize {
        self.lock().state_fetches
    }

    /// `fetch` calls so far.
    pub fn fetches(&self) -> usize {
        self.lock().fetches
    }

    /// `submit` calls accepted so far.
    pub fn submits(&self) -> usize {
        self.lock().submits
    }

    /// `submit` calls refused so far (wrong layout, unaligned start, too few tokens).
    pub fn refused(&self) -> usize {
        self.lock().refused
    }
}

impl PrefixStore for MemStore {
    /// One unnamed model: all zeros, as a cache's fingerprint is until set.
    fn fingerprint(&self) -> kvcache_api::Fingerprint {
        kvcache_api::Fingerprint([0; 32])
    }

    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn block_tokens(&self) -> usize {
        self.block
    }

    fn known_prefix(&self, namespace: &Namespace, tokens: &[u32]) -> usize {
        let inner = self.lock();
        let held = |end: usize| {
            inner
                .blocks
                .contains_key(&(namespace.clone(), tokens[..end].to_vec()))
        };
        // Whole blocks from offset 0; a short last block only ends the tokens.
        let mut end = 0;
        while end < tokens.len() {
            let next = (end + self.block).min(tokens.len());
            if !held(next) {
                break;
            }
            end = next;
        }
        end
    }

    fn fetch(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        from: usize,
        _deadline: Duration,
    ) -> Option<Fetched> {
        let mut inner = self.lock();
        inner.fetches += 1;
        if inner.offline || from >= tokens.len() {
            return None;
        }
        let mut parts: Vec<&HostKv> = Vec::new();
        let mut start = from / self.block * self.block;
        while start < tokens.len() {
            let full = (start + self.block).min(tokens.len());
            // The longest block held from `start`: a whole one, else a short last one.
            let found = (start + 1..=full)
                .rev()
                .find_map(|end| inner.blocks.get(&(namespace.clone(), tokens[..end].to_vec())));
            let Some(kv) = found else { break };
            parts.push(kv);
            if kv.end() < start + self.block {
                break;
            }
            start = kv.end();
        }
        let end = parts.last().map_or(from, |kv| kv.end());
        if end <= from {
            return None;
        }
        let kv = HostKv::concat(&parts).ok()?.slice(from..end).ok()?;
        let tokens = kv.tokens();
        Some(Fetched {
            kv,
            tiers: vec![("memory", tokens)],
        })
    }

    fn submit(&self, namespace: &Namespace, tokens: &[u32], kv: HostKv) -> Submitted {
        let mut inner = self.lock();
        if self.layout.expect(kv.layout()).is_err()
            || !kv.start().is_multiple_of(self.block)
            || kv.end() > tokens.len()
        {
            inner.refused += 1;
            return Submitted::Rejected;
        }
        inner.submits += 1;
        let mut start = kv.start();
        while start < kv.end() {
            let end = (start + self.block).min(kv.end());
            let block = kv.slice(start..end).expect("within the submission");
            inner
                .blocks
                .insert((namespace.clone(), tokens[..end].to_vec()), block);
            start = end;
        }
        Submitted::Queued
    }

    fn submit_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        mut states: Vec<(usize, HostState)>,
    ) -> Submitted {
        let mut inner = self.lock();
        let fits = states
            .iter()
            .all(|(layer, state)| *layer < self.layout.layers && state.offset == tokens.len());
        if states.is_empty() || !fits {
            inner.refused += 1;
            return Submitted::Rejected;
        }
        states.sort_by_key(|(layer, _)| *layer);
        inner.states.insert((namespace.clone(), tokens.to_vec()), states);
        Submitted::Queued
    }

    fn fetch_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        _deadline: Duration,
    ) -> Option<Vec<(usize, HostState)>> {
        let mut inner = self.lock();
        inner.state_fetches += 1;
        if inner.offline {
            return None;
        }
        inner.states.get(&(namespace.clone(), tokens.to_vec())).cloned()
    }
}

/// The hash a [`FakeRecurrent`] holds after evaluating `tokens` from scratch.
pub fn recurrent_hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(FNV_OFFSET, |h, &t| step(h, t))
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

#[inline]
fn step(h: u64, t: u32) -> u64 {
    (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3)
}

/// A non-rewindable fake recurrent layer: its state is the number of tokens
/// seen and a running hash of them. It rewinds only to its own offset and
/// restores only at a snapshot's exact end.
#[derive(Debug)]
pub struct FakeRecurrent {
    offset: usize,
    hash: u64,
    counters: Counters,
}

/// A [`FakeRecurrent`] snapshot: the [`FakeHash`] at the end of its range.
pub type FakeRecurrentSnapshot = StateSnapshot<FakeHash>;

/// The whole state of a [`FakeRecurrent`]: its running hash.
#[derive(Debug)]
pub struct FakeHash {
    hash: u64,
    _tally: Tally,
}

impl FakeHash {
    /// The running hash (compare with [`recurrent_hash`]).
    pub fn hash(&self) -> u64 {
        self.hash
    }
}

impl Payload for FakeHash {
    fn size_bytes(&self) -> usize {
        RECURRENT_STATE_BYTES
    }
}

impl State for FakeHash {}

impl FakeRecurrent {
    /// An empty state counting into `counters`.
    pub fn new(counters: &Counters) -> Self {
        FakeRecurrent {
            offset: 0,
            hash: FNV_OFFSET,
            counters: counters.clone(),
        }
    }

    /// The running hash (compare with [`recurrent_hash`]).
    pub fn hash(&self) -> u64 {
        self.hash
    }
}

impl FakeLayer for FakeRecurrent {
    fn feed(&mut self, tokens: &[u32]) {
        self.hash = tokens.iter().fold(self.hash, |h, &t| step(h, t));
        self.offset += tokens.len();
        self.counters.0.fed.fetch_add(tokens.len(), Ordering::Relaxed);
    }
    fn holds(&self, tokens: &[u32]) -> bool {
        self.offset == tokens.len() && self.hash == recurrent_hash(tokens)
    }
}

impl StateCache for FakeRecurrent {
    type State = FakeHash;

    fn capture(&self) -> Result<Option<FakeHash>> {
        Ok(Some(FakeHash {
            hash: self.hash,
            _tally: Tally::new(&self.counters),
        }))
    }

    fn live_offset(&self) -> usize {
        self.offset
    }

    fn load(&mut self, snap: &FakeRecurrentSnapshot, target: usize) -> Result<()> {
        self.counters.check_restore()?;
        self.offset = target;
        self.hash = snap.hash;
        let tokens = snap.range().len();
        self.counters.0.restored.fetch_add(tokens, Ordering::Relaxed);
        Ok(())
    }

    fn clear(&mut self) {
        self.offset = 0;
        self.hash = FNV_OFFSET;
    }
}

kvcache_api::snapshot_cache!(state: FakeRecurrent {
    /// The hash as one `[2]` array (low word first); `None` at offset 0.
    fn read_state(&self) -> Result<Option<HostState>> {
        Ok(words_state(self.offset, &[self.hash as u32, (self.hash >> 32) as u32]))
    }

    fn load_state(&mut self, state: &HostState) -> Result<bool> {
        let words = state_words(state, Some(2))?;
        self.hash = u64::from(words[0]) | (u64::from(words[1]) << 32);
        self.offset = state.offset;
        Ok(true)
    }
});

/// A fake sliding-window cache: the last `window` tokens and the offset.
#[derive(Debug)]
pub struct FakeWindow {
    window: usize,
    offset: usize,
    /// The last `min(offset, window)` tokens.
    held: Vec<u32>,
    counters: Counters,
}

/// A [`FakeWindow`] snapshot: the [`FakeHeld`] window at the end of its range.
pub type FakeWindowSnapshot = StateSnapshot<FakeHeld>;

/// The whole state of a [`FakeWindow`]: the tokens in its window.
#[derive(Debug)]
pub struct FakeHeld {
    held: Vec<u32>,
    _tally: Tally,
}

impl FakeHeld {
    /// The tokens in the window, oldest first.
    pub fn held(&self) -> &[u32] {
        &self.held
    }
}

impl Payload for FakeHeld {
    fn size_bytes(&self) -> usize {
        self.held.len() * std::mem::size_of::<u32>()
    }
}

impl State for FakeHeld {}

impl FakeWindow {
    /// An empty cache keeping the last `window` tokens (at least 1).
    pub fn new(counters: &Counters, window: usize) -> Self {
        FakeWindow {
            window: window.max(1),
            offset: 0,
            held: Vec::new(),
            counters: counters.clone(),
        }
    }

    /// The tokens in the window.
    pub fn held(&self) -> &[u32] {
        &self.held
    }
}

impl FakeLayer for FakeWindow {
    fn feed(&mut self, tokens: &[u32]) {
        self.held.extend_from_slice(tokens);
        let excess = self.held.len().saturating_sub(self.window);
        self.held.drain(..excess);
        self.offset += tokens.len();
        self.counters.0.fed.fetch_add(tokens.len(), Ordering::Relaxed);
    }
    fn holds(&self, tokens: &[u32]) -> bool {
        self.offset == tokens.len() && self.held == tokens[tokens.len().saturating_sub(self.window)..]
    }
}

impl StateCache for FakeWindow {
    type State = FakeHeld;

    fn capture(&self) -> Result<Option<FakeHeld>> {
        Ok(Some(FakeHeld {
            held: self.held.clone(),
            _tally: Tally::new(&self.counters),
        }))
    }

    fn live_offset(&self) -> usize {
        self.offset
    }

    fn load(&mut self, snap: &FakeWindowSnapshot, target: usize) -> Result<()> {
        self.counters.check_restore()?;
        self.held.clone_from(&snap.held);
        self.held.truncate(target);
        self.offset = target;
        let tokens = target.min(self.window);
        self.counters.0.restored.fetch_add(tokens, Ordering::Relaxed);
        Ok(())
    }

    fn clear(&mut self) {
        self.offset = 0;
        self.held = Vec::new();
    }

    fn rewind(&self) -> Rewind {
        Rewind::Window(self.window)
    }

    fn truncate(&mut self, to: usize) {
        self.held.truncate(to);
        self.offset = to;
    }
}

kvcache_api::snapshot_cache!(state: FakeWindow {
    /// The window's tokens as one `[min(offset, W)]` array; `None` at offset 0.
    fn read_state(&self) -> Result<Option<HostState>> {
        Ok(words_state(self.offset, &self.held))
    }

    fn load_state(&mut self, state: &HostState) -> Result<bool> {
        let held = state_words(state, Some(state.offset.min(self.window)))?;
        self.held = held;
        self.offset = state.offset;
        Ok(true)
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_snapshot_restore_merge_split() {
        let counters = Counters::new();
        let mut kv = FakeKv::new(&counters);
        kv.feed(&[1, 2, 3, 4, 5]);
        let snap = kv.snapshot(2).unwrap().unwrap();
        assert_eq!(snap.range(), 2..5);
        assert_eq!(snap.size_bytes(), 12);
        assert!(kv.restore(None, 1).unwrap());
        assert_eq!(kv.tokens(), &[1]);
        // The snapshot starts after the live offset: unreachable, unchanged.
        assert!(!kv.restore(Some(&*snap), 5).unwrap());
        assert_eq!(kv.tokens(), &[1]);
        kv.feed(&[2]);
        assert!(kv.restore(Some(&*snap), 4).unwrap());
        assert_eq!(kv.tokens(), &[1, 2, 3, 4]);
        let (a, b) = kv.split(snap, 3).unwrap();
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!((a.range(), b.range()), (2..3, 3..5));
        let merged = kv.merge(Some(a), Some(b)).unwrap().unwrap();
        assert_eq!(merged.range(), 2..5);
        drop(merged);
        assert_eq!((counters.created(), counters.dropped()), (4, 4));
    }

    #[test]
    fn window_rewinds_only_before_tokens_leave_it() {
        let counters = Counters::new();
        let mut w = FakeWindow::new(&counters, 3);
        w.feed(&[1, 2]);
        let early = w.snapshot(0).unwrap().unwrap();
        assert!(w.restore(None, 1).unwrap());
        assert!(w.holds(&[1]));
        w.feed(&[2, 3, 4, 5]);
        assert!(w.holds(&[1, 2, 3, 4, 5]));
        assert_eq!(w.held(), &[3, 4, 5]);
        let late = w.snapshot(4).unwrap().unwrap();
        assert_eq!((late.range(), late.size_bytes()), (4..5, 12));
        assert!(!w.restore(None, 4).unwrap());
        assert!(!w.restore(Some(&*late), 4).unwrap());
        assert!(w.restore(Some(&*early), 1).unwrap());
        assert!(w.holds(&[1]));
        assert!(w.restore(Some(&*late), 5).unwrap());
        assert!(w.holds(&[1, 2, 3, 4, 5]));
        // Merging keeps the child's window, over both ranges; the parent
        // must end where the child starts.
        assert!(w.merge(Some(early), Some(late)).is_err());
        let mut w = FakeWindow::new(&counters, 3);
        w.feed(&[1, 2]);
        let parent = w.snapshot(0).unwrap();
        w.feed(&[3, 4, 5]);
        let child = w.snapshot(2).unwrap();
        let merged = w.merge(parent, child).unwrap().unwrap();
        assert_eq!(merged.range(), 0..5);
        assert!(w.restore(None, 0).unwrap());
        assert!(w.restore(Some(&*merged), 5).unwrap());
        assert!(w.holds(&[1, 2, 3, 4, 5]));
        drop(merged);
        assert_eq!(counters.alive(), 0);
    }

    #[test]
    fn recurrent_restores_only_at_snapshot_end() {
        let counters = Counters::new();
        let mut r = FakeRecurrent::new(&counters);
        r.feed(&[1, 2, 3]);
        let snap = r.snapshot(1).unwrap().unwrap();
        assert!(!r.restore(None, 2).unwrap());
        r.feed(&[4]);
        assert!(!r.restore(Some(&*snap), 2).unwrap());
        assert!(r.holds(&[1, 2, 3, 4]));
        assert!(r.restore(Some(&*snap), 3).unwrap());
        assert!(r.holds(&[1, 2, 3]));
        let (p, c) = r.split(snap, 2).unwrap();
        assert!(p.is_none() && c.is_some());
        drop(c);
        assert_eq!(counters.alive(), 0);
    }
}
