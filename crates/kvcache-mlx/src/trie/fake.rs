//! Fake layer caches for tests, benchmarks and engine prototypes.
//!
//! Their state is made of token ids, so what a snapshot holds and what a
//! restore produced can be compared with a from-scratch evaluation:
//!
//! - [`FakeKv`]: a rewindable KV cache whose state is the list of tokens it
//!   holds; snapshots hold the tokens of their range.
//! - [`FakeRecurrent`]: a non-rewindable recurrent state (a running hash of
//!   every token seen). It cannot rewind its live state and restores only at a
//!   snapshot's exact end offset; it cannot split snapshots.
//! - [`FakeWindow`]: a sliding-window (rotating) cache holding the last `W`
//!   tokens. Like a rotating KV cache, it rewinds or stops inside a snapshot
//!   only while nothing has left the window, its snapshots hold the whole
//!   window, merging keeps the child and splitting is refused.
//!
//! Every snapshot they create and drop is counted in a shared [`Counters`], so
//! a test can prove that each snapshot was dropped exactly once or is still
//! owned by the trie. [`feed_all`] plays the model: it appends tokens to every
//! layer.

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use kvcache_api::{BoxedSnapshot, CacheError, Result, Snapshot, SnapshotCache};

/// Bytes a [`FakeRecurrent`] snapshot reports: a recurrent state has a fixed size.
pub const RECURRENT_STATE_BYTES: usize = 64;

#[derive(Debug, Default)]
struct Inner {
    created: AtomicUsize,
    dropped: AtomicUsize,
    fed: AtomicUsize,
    restored: AtomicUsize,
    fail_restore: AtomicBool,
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

    /// While set, every `restore` from a snapshot fails with a backend error
    /// (to exercise the trie's recovery).
    pub fn set_fail_restore(&self, fail: bool) {
        self.0.fail_restore.store(fail, Ordering::Relaxed);
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

/// The fake model: evaluates `tokens` on every layer.
pub fn feed_all<C: FakeLayer>(caches: &mut [C], tokens: &[u32]) {
    for cache in caches {
        cache.feed(tokens);
    }
}

fn foreign() -> CacheError {
    CacheError::InvalidArgument("snapshot made by another kind of cache".into())
}

/// A rewindable fake KV cache: its state is the list of tokens it holds.
#[derive(Debug)]
pub struct FakeKv {
    tokens: Vec<u32>,
    counters: Counters,
}

/// A [`FakeKv`] snapshot: the tokens of `[from, from + tokens.len())`.
#[derive(Debug)]
pub struct FakeKvSnapshot {
    from: usize,
    tokens: Vec<u32>,
    counters: Counters,
}

impl FakeKvSnapshot {
    fn new(from: usize, tokens: Vec<u32>, counters: &Counters) -> Box<Self> {
        counters.created_one();
        Box::new(FakeKvSnapshot {
            from,
            tokens,
            counters: counters.clone(),
        })
    }

    /// The tokens this snapshot holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl Drop for FakeKvSnapshot {
    fn drop(&mut self) {
        self.counters.dropped_one();
    }
}

impl Snapshot for FakeKvSnapshot {
    fn range(&self) -> Range<usize> {
        self.from..self.from + self.tokens.len()
    }
    fn size_bytes(&self) -> usize {
        self.tokens.len() * std::mem::size_of::<u32>()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
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

    fn own(snapshot: BoxedSnapshot) -> Result<Box<FakeKvSnapshot>> {
        snapshot
            .into_any()
            .downcast::<FakeKvSnapshot>()
            .map_err(|_| foreign())
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

impl SnapshotCache for FakeKv {
    fn offset(&self) -> usize {
        self.tokens.len()
    }

    fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>> {
        if from >= self.tokens.len() {
            return Ok(None);
        }
        Ok(Some(FakeKvSnapshot::new(
            from,
            self.tokens[from..].to_vec(),
            &self.counters,
        )))
    }

    fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
        let Some(snapshot) = snapshot else {
            if target > self.tokens.len() {
                return Ok(false);
            }
            self.tokens.truncate(target);
            return Ok(true);
        };
        let snap = snapshot
            .as_any()
            .downcast_ref::<FakeKvSnapshot>()
            .ok_or_else(foreign)?;
        let range = snap.range();
        if target > range.end || self.tokens.len() < range.start {
            return Ok(false);
        }
        self.counters.check_restore()?;
        self.tokens.truncate(range.start);
        let take = target.saturating_sub(range.start);
        self.tokens.extend_from_slice(&snap.tokens[..take]);
        self.tokens.truncate(target);
        self.counters.0.restored.fetch_add(take, Ordering::Relaxed);
        Ok(true)
    }

    fn merge(
        &mut self,
        parent: Option<BoxedSnapshot>,
        child: Option<BoxedSnapshot>,
    ) -> Result<Option<BoxedSnapshot>> {
        let (Some(parent), Some(child)) = (parent, child) else {
            return Ok(None);
        };
        let (parent, child) = (Self::own(parent)?, Self::own(child)?);
        if parent.range().end != child.range().start {
            return Err(CacheError::InvalidArgument(format!(
                "snapshots {:?} and {:?} are not consecutive",
                parent.range(),
                child.range()
            )));
        }
        let mut tokens = Vec::with_capacity(parent.tokens.len() + child.tokens.len());
        tokens.extend_from_slice(&parent.tokens);
        tokens.extend_from_slice(&child.tokens);
        Ok(Some(FakeKvSnapshot::new(parent.from, tokens, &self.counters)))
    }

    fn split(
        &mut self,
        snapshot: BoxedSnapshot,
        at: usize,
    ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
        let snap = Self::own(snapshot)?;
        let range = snap.range();
        if at <= range.start {
            return Ok((None, Some(snap)));
        }
        if at >= range.end {
            return Ok((Some(snap), None));
        }
        let k = at - range.start;
        let parent = FakeKvSnapshot::new(range.start, snap.tokens[..k].to_vec(), &self.counters);
        let child = FakeKvSnapshot::new(at, snap.tokens[k..].to_vec(), &self.counters);
        Ok((Some(parent), Some(child)))
    }

    fn free(&mut self) {
        self.tokens = Vec::new();
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

/// A [`FakeRecurrent`] snapshot: the whole state at the end of its range.
#[derive(Debug)]
pub struct FakeRecurrentSnapshot {
    from: usize,
    to: usize,
    hash: u64,
    counters: Counters,
}

impl FakeRecurrentSnapshot {
    fn new(from: usize, to: usize, hash: u64, counters: &Counters) -> Box<Self> {
        counters.created_one();
        Box::new(FakeRecurrentSnapshot {
            from,
            to,
            hash,
            counters: counters.clone(),
        })
    }
}

impl Drop for FakeRecurrentSnapshot {
    fn drop(&mut self) {
        self.counters.dropped_one();
    }
}

impl Snapshot for FakeRecurrentSnapshot {
    fn range(&self) -> Range<usize> {
        self.from..self.to
    }
    fn size_bytes(&self) -> usize {
        RECURRENT_STATE_BYTES
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

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

impl SnapshotCache for FakeRecurrent {
    fn offset(&self) -> usize {
        self.offset
    }

    fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>> {
        if from >= self.offset {
            return Ok(None);
        }
        Ok(Some(FakeRecurrentSnapshot::new(
            from,
            self.offset,
            self.hash,
            &self.counters,
        )))
    }

    fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
        let Some(snapshot) = snapshot else {
            if target == 0 {
                self.free();
                return Ok(true);
            }
            return Ok(target == self.offset);
        };
        let snap = snapshot
            .as_any()
            .downcast_ref::<FakeRecurrentSnapshot>()
            .ok_or_else(foreign)?;
        if target != snap.to {
            return Ok(false);
        }
        self.counters.check_restore()?;
        self.offset = snap.to;
        self.hash = snap.hash;
        self.counters
            .0
            .restored
            .fetch_add(snap.to - snap.from, Ordering::Relaxed);
        Ok(true)
    }

    fn merge(
        &mut self,
        parent: Option<BoxedSnapshot>,
        child: Option<BoxedSnapshot>,
    ) -> Result<Option<BoxedSnapshot>> {
        let (Some(parent), Some(child)) = (parent, child) else {
            return Ok(None);
        };
        let parent = parent
            .into_any()
            .downcast::<FakeRecurrentSnapshot>()
            .map_err(|_| foreign())?;
        let child = child
            .into_any()
            .downcast::<FakeRecurrentSnapshot>()
            .map_err(|_| foreign())?;
        // The child's state supersedes the parent's; only its range grows.
        Ok(Some(FakeRecurrentSnapshot::new(
            parent.from,
            child.to,
            child.hash,
            &self.counters,
        )))
    }

    fn split(
        &mut self,
        snapshot: BoxedSnapshot,
        _at: usize,
    ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
        Ok((None, Some(snapshot)))
    }

    fn free(&mut self) {
        self.offset = 0;
        self.hash = FNV_OFFSET;
    }
}

/// A fake sliding-window cache: the last `window` tokens and the offset.
#[derive(Debug)]
pub struct FakeWindow {
    window: usize,
    offset: usize,
    /// The last `min(offset, window)` tokens.
    held: Vec<u32>,
    counters: Counters,
}

/// A [`FakeWindow`] snapshot: the whole window at the end of its range.
#[derive(Debug)]
pub struct FakeWindowSnapshot {
    from: usize,
    to: usize,
    held: Vec<u32>,
    counters: Counters,
}

impl FakeWindowSnapshot {
    fn new(from: usize, to: usize, held: Vec<u32>, counters: &Counters) -> Box<Self> {
        counters.created_one();
        Box::new(FakeWindowSnapshot {
            from,
            to,
            held,
            counters: counters.clone(),
        })
    }
}

impl Drop for FakeWindowSnapshot {
    fn drop(&mut self) {
        self.counters.dropped_one();
    }
}

impl Snapshot for FakeWindowSnapshot {
    fn range(&self) -> Range<usize> {
        self.from..self.to
    }
    fn size_bytes(&self) -> usize {
        self.held.len() * std::mem::size_of::<u32>()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

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

impl SnapshotCache for FakeWindow {
    fn offset(&self) -> usize {
        self.offset
    }

    fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>> {
        if from >= self.offset {
            return Ok(None);
        }
        Ok(Some(FakeWindowSnapshot::new(
            from,
            self.offset,
            self.held.clone(),
            &self.counters,
        )))
    }

    fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
        let Some(snapshot) = snapshot else {
            if target >= self.offset {
                return Ok(target == self.offset);
            }
            // Once tokens have left the window, rewinding would leave it short.
            if self.offset > self.window {
                return Ok(false);
            }
            self.held.truncate(target);
            self.offset = target;
            return Ok(true);
        };
        let snap = snapshot
            .as_any()
            .downcast_ref::<FakeWindowSnapshot>()
            .ok_or_else(foreign)?;
        if target > snap.to || (target < snap.to && snap.to > self.window) {
            return Ok(false);
        }
        self.counters.check_restore()?;
        self.held.clone_from(&snap.held);
        self.held.truncate(target);
        self.offset = target;
        self.counters
            .0
            .restored
            .fetch_add(target.min(self.window), Ordering::Relaxed);
        Ok(true)
    }

    fn merge(
        &mut self,
        parent: Option<BoxedSnapshot>,
        child: Option<BoxedSnapshot>,
    ) -> Result<Option<BoxedSnapshot>> {
        // The child's window supersedes the parent's.
        drop(parent);
        Ok(child)
    }

    fn split(
        &mut self,
        snapshot: BoxedSnapshot,
        _at: usize,
    ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
        Ok((None, Some(snapshot)))
    }

    fn free(&mut self) {
        self.offset = 0;
        self.held = Vec::new();
    }
}

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
        let merged = w.merge(Some(early), Some(late)).unwrap().unwrap();
        assert_eq!(merged.range(), 4..5);
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
