//! [`Shared`]: one cache driven by several threads, one at a time.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use crate::{CacheError, Result};

/// A cache handle that threads can clone and share, each taking exclusive use of
/// the cache in turn.
///
/// Every cache in kvcache-rs is `Send` and has exactly one owner driving it: its
/// methods take `&mut self`. An engine with one scheduler thread needs nothing
/// more (move the cache into that thread and feed it requests over a channel).
/// `Shared` is for engines whose worker threads each run forward passes
/// themselves: it is an `Arc<Mutex<C>>` with the locking rules of a KV cache
/// written into its API.
///
/// # The locking story
///
/// - **Lock once per unit of work, not per call.** A causal cache keeps the
///   pass in progress (the batch's cells, the mask, the selected layer) for the
///   whole model, so `start_forward` and every layer's `set_layer`, `put` and
///   `get` must happen under one [`lock`](Self::lock). That is why `Shared` does
///   not implement [`CausalCache`](crate::CausalCache) itself: locking call by
///   call would let another thread's `start_forward` replace the pass halfway
///   through a model. Edits between passes (`remove`, `copy_prefix`) take the
///   lock briefly.
/// - **A prefix trie serves one request at a time.** A
///   `kvcache_trie::Session` borrows the trie mutably, so the guard lives
///   for the whole request: the trie has one live path by design.
///   For parallel requests, give each worker its own trie.
/// - **Views outlive the lock, their contents do not.** Tensors returned by
///   `get` are reference-counted views: they stay allocated after the guard is
///   dropped, but the next pass may write new keys into the same cells. Finish
///   attention before unlocking, or copy what you keep.
/// - **Several caches: one fixed order.** A thread that locks two `Shared`
///   caches must lock them in an order every thread follows (say, layer-group
///   order), or two threads can deadlock. Prefer one cache that drives the
///   groups as one (`kvcache_causal::LayerGroupCache`).
/// - **A panic poisons the cache.** Operations validate before they change
///   anything, so a panic inside a cache call means a broken invariant, and a
///   panic in engine code while holding the guard (say, in the model's forward
///   pass) can leave a pass half done. Either way every later
///   [`lock`](Self::lock) and [`with`](Self::with) returns
///   [`CacheError::InvalidState`] instead of panicking in turn, until a thread
///   calls [`recover`](Self::recover) with a repair (check the invariants, or
///   reset the cache).
/// - **No fairness, no timeout.** `lock` blocks like [`std::sync::Mutex`];
///   [`try_lock`](Self::try_lock) never blocks, for schedulers that would rather
///   do something else.
///
/// The guard is not `Send`: the thread that locked is the one that unlocks.
///
/// ```
/// use std::thread;
/// use kvcache_api::{CacheError, Shared};
///
/// // Any cache works; a Vec stands in for one here.
/// let cache = Shared::new(Vec::<(usize, u32)>::new());
/// let workers: Vec<_> = (0..4)
///     .map(|worker| {
///         let cache = cache.clone();
///         thread::spawn(move || -> Result<(), CacheError> {
///             for token in 0..100 {
///                 // One lock per unit of work: these two writes stay together.
///                 let mut guard = cache.lock()?;
///                 guard.push((worker, token));
///                 guard.push((worker, token));
///             }
///             Ok(())
///         })
///     })
///     .collect();
/// for w in workers {
///     w.join().unwrap()?;
/// }
/// let log = cache.into_inner().expect("the workers dropped their handles");
/// assert_eq!(log.len(), 800);
/// assert!(log.chunks(2).all(|pair| pair[0] == pair[1]));
/// # Ok::<(), CacheError>(())
/// ```
pub struct Shared<C> {
    inner: Arc<Mutex<C>>,
}

/// Exclusive use of a [`Shared`] cache until dropped; dereferences to the cache.
#[must_use = "the cache is unlocked as soon as the guard is dropped"]
pub struct SharedGuard<'a, C> {
    guard: MutexGuard<'a, C>,
}

fn poisoned() -> CacheError {
    CacheError::InvalidState(
        "the shared cache is poisoned: a thread panicked while holding it \
         (check or reset it through Shared::recover)"
            .into(),
    )
}

impl<C> Shared<C> {
    /// A handle to `cache`; clone it for each thread.
    pub fn new(cache: C) -> Self {
        Shared {
            inner: Arc::new(Mutex::new(cache)),
        }
    }

    /// Waits for exclusive use of the cache.
    ///
    /// An [`InvalidState`](CacheError::InvalidState) error when the cache is
    /// poisoned (see [`recover`](Self::recover)).
    pub fn lock(&self) -> Result<SharedGuard<'_, C>> {
        match self.inner.lock() {
            Ok(guard) => Ok(SharedGuard { guard }),
            Err(_) => Err(poisoned()),
        }
    }

    /// Exclusive use of the cache if no other thread has it: `Ok(None)` when
    /// the cache is busy, an [`InvalidState`](CacheError::InvalidState) error
    /// when it is poisoned. Never blocks.
    ///
    /// ```
    /// use kvcache_api::Shared;
    ///
    /// let cache = Shared::new(0u32);
    /// let held = cache.lock()?;
    /// let other = cache.clone();
    /// let busy = std::thread::spawn(move || other.try_lock().map(|g| g.is_none())).join().unwrap()?;
    /// assert!(busy);
    /// drop(held);
    /// assert!(cache.try_lock()?.is_some());
    /// # Ok::<(), kvcache_api::CacheError>(())
    /// ```
    pub fn try_lock(&self) -> Result<Option<SharedGuard<'_, C>>> {
        match self.inner.try_lock() {
            Ok(guard) => Ok(Some(SharedGuard { guard })),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Poisoned(_)) => Err(poisoned()),
        }
    }

    /// Runs `work` with exclusive use of the cache and returns its result.
    ///
    /// ```
    /// use kvcache_api::Shared;
    ///
    /// let cache = Shared::new(vec![1, 2, 3]);
    /// let len = cache.with(|c| {
    ///     c.push(4);
    ///     c.len()
    /// })?;
    /// assert_eq!(len, 4);
    /// # Ok::<(), kvcache_api::CacheError>(())
    /// ```
    pub fn with<R>(&self, work: impl FnOnce(&mut C) -> R) -> Result<R> {
        let mut guard = self.lock()?;
        Ok(work(&mut guard))
    }

    /// Whether a thread panicked while holding the cache (and no
    /// [`recover`](Self::recover) has succeeded since).
    pub fn is_poisoned(&self) -> bool {
        self.inner.is_poisoned()
    }

    /// Takes the cache whether or not it is poisoned and runs `repair` on it
    /// (check its invariants, end or reset what a panicking thread left half
    /// done). When `repair` succeeds the cache is no longer poisoned; when it
    /// fails it stays poisoned and its error is returned.
    ///
    /// ```
    /// use kvcache_api::{CacheError, Shared};
    ///
    /// let cache = Shared::new(vec![1, 2, 3]);
    /// let worker = cache.clone();
    /// let _ = std::thread::spawn(move || {
    ///     let mut guard = worker.lock().unwrap();
    ///     guard.push(4);
    ///     panic!("the model failed mid-pass");
    /// })
    /// .join();
    /// assert!(matches!(cache.lock(), Err(CacheError::InvalidState(_))));
    ///
    /// // Keep what is known to be good, then carry on.
    /// cache.recover(|c| {
    ///     c.truncate(3);
    ///     Ok(())
    /// })?;
    /// assert_eq!(*cache.lock()?, vec![1, 2, 3]);
    /// # Ok::<(), CacheError>(())
    /// ```
    pub fn recover<R>(&self, repair: impl FnOnce(&mut C) -> Result<R>) -> Result<R> {
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let result = repair(&mut guard)?;
        drop(guard);
        self.inner.clear_poison();
        Ok(result)
    }

    /// Number of handles to this cache, this one included.
    pub fn handles(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// Whether `self` and `other` are handles to the same cache.
    pub fn same_cache(&self, other: &Shared<C>) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The cache back, when this is its last handle; otherwise the handle is
    /// returned. A poisoned cache is handed back too: check
    /// [`is_poisoned`](Self::is_poisoned) first if that matters.
    pub fn into_inner(self) -> std::result::Result<C, Self> {
        match Arc::try_unwrap(self.inner) {
            Ok(mutex) => Ok(mutex.into_inner().unwrap_or_else(|p| p.into_inner())),
            Err(inner) => Err(Shared { inner }),
        }
    }
}

impl<C> Clone for Shared<C> {
    /// Another handle to the same cache.
    fn clone(&self) -> Self {
        Shared {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C> From<C> for Shared<C> {
    fn from(cache: C) -> Self {
        Shared::new(cache)
    }
}

impl<C: Default> Default for Shared<C> {
    fn default() -> Self {
        Shared::new(C::default())
    }
}

impl<C> fmt::Debug for Shared<C> {
    /// Shows the handle count and poisoning, never the cache (that would lock).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("handles", &self.handles())
            .field("poisoned", &self.is_poisoned())
            .finish_non_exhaustive()
    }
}

impl<C> Deref for SharedGuard<'_, C> {
    type Target = C;
    fn deref(&self) -> &C {
        &self.guard
    }
}

impl<C> DerefMut for SharedGuard<'_, C> {
    fn deref_mut(&mut self) -> &mut C {
        &mut self.guard
    }
}

impl<C: fmt::Debug> fmt::Debug for SharedGuard<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.guard, f)
    }
}
