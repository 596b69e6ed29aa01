//! [`Session`]: one request's use of the prefix cache, from `begin` to close.

use kvcache_api::{CacheError, Namespace, Result, SnapshotCache};

use super::cache::PrefixCache;

/// What a session's `begin` restored instead of leaving it to evaluate, and
/// from where ([`Session::restored`]): per request, where [`Stats`](crate::Stats)
/// sums over every request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// Prompt tokens the trie gave back: kept in the live caches or paged in
    /// from its snapshots.
    pub trie: usize,
    /// Prompt tokens restored from the store, past those.
    pub store: usize,
    /// `(tier, tokens)` for each tier of the store that served blocks of
    /// them, as the store reported it ([`Fetched::tiers`](kvcache_api::Fetched)).
    pub tiers: Vec<(&'static str, usize)>,
    /// Whole layer states loaded from the store (one per layer that cannot
    /// cut its state into rows).
    pub states: usize,
}

impl Restored {
    /// Prompt tokens restored in all: [`Session::cached`].
    pub fn total(&self) -> usize {
        self.trie + self.store
    }
}

/// One request on a [`PrefixCache`]: the prompt, the tokens it generates, and
/// the live caches the model runs on.
///
/// The engine evaluates the [`remaining`](Self::remaining) prompt tokens
/// (stopping at [`pending_snapshot`](Self::pending_snapshot) offsets to call
/// [`snapshot`](Self::snapshot); [`prefill`](Self::prefill) and
/// [`next_chunk`](Self::next_chunk) do that for it), then
/// [`record`](Self::record)s every generated token and evaluates each one
/// except the last ([`decode`](Self::decode) records and evaluates in one
/// step); closing with more than the last one unevaluated is an error. Closing the session (explicitly, or by dropping it) stores
/// what the caches hold in the trie, and writes the prompt's keys and values
/// through to the store, if the trie has one.
pub struct Session<'a, C: SnapshotCache> {
    cache: &'a mut PrefixCache<C>,
    namespace: Namespace,
    /// The prompt followed by the recorded tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    cached: usize,
    /// What `begin` restored, and from where.
    restored: Restored,
    /// Offsets, ascending, where prefill must stop for a snapshot.
    pending: Vec<usize>,
    closed: bool,
    /// Whether the prompt was written through to the store already.
    stored: bool,
}

impl<'a, C: SnapshotCache> Session<'a, C> {
    pub(super) fn new(
        cache: &'a mut PrefixCache<C>,
        namespace: &Namespace,
        prompt: &[u32],
        restored: Restored,
        pending: Vec<usize>,
    ) -> Self {
        Session {
            cache,
            namespace: namespace.clone(),
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            cached: restored.total(),
            restored,
            pending,
            closed: false,
            stored: false,
        }
    }

    /// The prompt.
    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    /// The namespace the request runs in.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// Prompt tokens restored when the session began (from the trie, then the store).
    pub fn cached(&self) -> usize {
        self.cached
    }

    /// What the session's `begin` restored: tokens from the trie, tokens
    /// from the store and what each of its tiers served, states loaded.
    pub fn restored(&self) -> &Restored {
        &self.restored
    }

    /// Prompt tokens the cache did not restore: the engine evaluates these.
    /// Never empty.
    pub fn remaining(&self) -> &[u32] {
        &self.tokens[self.cached..self.prompt_len]
    }

    /// Tokens recorded with [`record`](Self::record).
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens the live caches hold now (the lowest layer offset).
    pub fn offset(&self) -> usize {
        self.cache.min_offset()
    }

    /// The next offset at which prefill must pause and call
    /// [`snapshot`](Self::snapshot)`(false)`: a branch point inside a cached
    /// edge, or the end of a cached node some layer has no snapshot for.
    /// `None` when prefill can run to the end of the prompt.
    pub fn pending_snapshot(&self) -> Option<usize> {
        let offset = self.offset();
        self.pending.iter().copied().find(|&p| p >= offset)
    }

    /// The live layer caches, for the model to run on.
    pub fn caches_mut(&mut self) -> &mut [C] {
        &mut self.cache.caches
    }

    /// The live layer caches.
    pub fn caches(&self) -> &[C] {
        &self.cache.caches
    }

    /// The next prompt tokens to evaluate in one go, with the caches to run
    /// them on: from the current offset to the next pending snapshot or the end
    /// of the prompt. A pending snapshot at the current offset is taken first.
    /// Empty when the prompt has been evaluated.
    pub fn next_chunk(&mut self) -> Result<(&[u32], &mut [C])> {
        let offset = self.cache.uniform_offset()?;
        if self.pending.contains(&offset) {
            self.snapshot(false)?;
        }
        let end = self
            .pending_snapshot()
            .unwrap_or(self.prompt_len)
            .min(self.prompt_len);
        let start = offset.min(end);
        Ok((&self.tokens[start..end], &mut self.cache.caches))
    }

    /// Evaluates the rest of the prompt with `eval`, which must run the model
    /// on the given tokens (appending exactly that many to every cache), in as
    /// few calls as the pending snapshots allow, taking those snapshots.
    ///
    /// A call that leaves the caches anywhere else is an
    /// [`InvalidState`](CacheError::InvalidState) error.
    pub fn prefill<E, F>(&mut self, mut eval: F) -> std::result::Result<(), E>
    where
        E: From<CacheError>,
        F: FnMut(&[u32], &mut [C]) -> std::result::Result<(), E>,
    {
        loop {
            let before = self.cache.uniform_offset()?;
            let (tokens, caches) = self.next_chunk()?;
            if tokens.is_empty() {
                return Ok(());
            }
            let expected = before + tokens.len();
            eval(tokens, caches)?;
            let after = self.cache.uniform_offset()?;
            if after != expected {
                return Err(CacheError::InvalidState(format!(
                    "prefill evaluated to offset {after}, expected {expected}"
                ))
                .into());
            }
        }
    }

    /// Records a generated token. Every recorded token but the last one must
    /// be evaluated before the session closes, or [`close`](Self::close)
    /// reports the gap; [`decode`](Self::decode) records and evaluates at once.
    ///
    /// The first one means the prompt has been evaluated: when the caches hold
    /// exactly the prompt, what the store lacks of it is written through now,
    /// so that other engines on the store can reuse it while this one decodes.
    pub fn record(&mut self, token: u32) {
        if !self.stored && self.tokens.len() == self.prompt_len && self.cache.min_offset() == self.prompt_len
        {
            self.cache
                .write_through(&self.namespace, &self.tokens[..self.prompt_len]);
            self.stored = true;
        }
        self.tokens.push(token);
    }

    /// Records the generated `token` and evaluates it in one step: `eval` runs
    /// the model on `[token]` over the live caches (appending exactly one token
    /// to every layer) and its output (the logits to sample the next token
    /// from, say) is returned. The last token of a reply, which is never
    /// evaluated, is [`record`](Self::record)ed instead.
    ///
    /// Errors ([`InvalidState`](CacheError::InvalidState)): the caches do not
    /// stand together at the end of the prompt and the tokens recorded so far
    /// (nothing is recorded then), or `eval` left them anywhere but one token
    /// further (the token stays recorded; closing reports the gap). An error of
    /// `eval` is returned as it is.
    pub fn decode<R, E, F>(&mut self, token: u32, eval: F) -> std::result::Result<R, E>
    where
        E: From<CacheError>,
        F: FnOnce(&[u32], &mut [C]) -> std::result::Result<R, E>,
    {
        let before = self.cache.uniform_offset()?;
        if before != self.tokens.len() {
            return Err(CacheError::InvalidState(format!(
                "decode needs the caches at the end of the {} known tokens, they stand at {before}",
                self.tokens.len()
            ))
            .into());
        }
        self.record(token);
        let out = eval(&[token], &mut self.cache.caches)?;
        let after = self.cache.uniform_offset()?;
        if after != before + 1 {
            return Err(CacheError::InvalidState(format!(
                "decode evaluated to offset {after}, expected {}",
                before + 1
            ))
            .into());
        }
        Ok(out)
    }

    /// Stores the live state at the current offset as a trie node with
    /// snapshots: a branch point when prefill stops at a pending offset
    /// (`user = false`), or an explicit restore point (`user = true`) that is
    /// never merged away automatically and is evicted only after every
    /// ordinary node.
    ///
    /// Errors ([`InvalidState`](CacheError::InvalidState)) when the layers
    /// disagree on the offset, stand behind the trie's active path, or hold
    /// more tokens than the prompt and the recorded tokens.
    pub fn snapshot(&mut self, user: bool) -> Result<()> {
        let offset = self.cache.uniform_offset()?;
        if offset == 0 {
            return Ok(());
        }
        let frontier_end = self.cache.arena.get(self.cache.frontier()).end;
        if offset < frontier_end {
            return Err(CacheError::InvalidState(format!(
                "the caches stand at {offset}, behind the cached path ending at {frontier_end}"
            )));
        }
        if offset > self.tokens.len() {
            return Err(CacheError::InvalidState(format!(
                "the caches hold {offset} tokens but only {} were given or recorded",
                self.tokens.len()
            )));
        }
        let generated = frontier_end >= self.prompt_len;
        let node = self.cache.advance(&self.tokens[frontier_end..offset], generated);
        if user {
            self.cache.mark_user(node);
        }
        self.cache.fill_snapshots(node)?;
        self.pending.retain(|&p| p > offset);
        self.cache.enforce_budget();
        Ok(())
    }

    /// Closes the session: the tokens the caches hold (the prompt and the
    /// generated tokens that were evaluated) become the trie's active path,
    /// and the prompt tokens among them that the store lacks are written
    /// through to it (not the generated ones; nothing when a layer cannot cut
    /// its state into rows, or when the close found the layers misaligned).
    ///
    /// The trie is left consistent in every case. When the layers disagree on
    /// the offset (a failed forward pass) or hold more tokens than were given,
    /// they are rewound (or freed) and an
    /// [`InvalidState`](CacheError::InvalidState) error reports it. So does a
    /// session that recorded tokens but left more than the last one
    /// unevaluated (every recorded token but the last must be fed, see
    /// [`decode`](Self::decode)): the path still ends where the caches do, and
    /// the error names that offset and the tokens known. A session closed
    /// before anything was recorded may stop anywhere in the prompt (an
    /// abandoned request).
    pub fn close(mut self) -> Result<()> {
        self.finish()
    }

    /// Checks the trie's invariants mid-session, panicking on a violation
    /// (see [`PrefixCache::check`]): the layers must stand at one offset, at or
    /// after the active path's end and within the known tokens.
    pub fn check(&self) {
        self.cache.check_structure();
        let offset = self.cache.min_offset();
        for (i, c) in self.cache.caches.iter().enumerate() {
            assert_eq!(
                c.offset(),
                offset,
                "layer {i} at offset {}, others at {offset}",
                c.offset()
            );
        }
        let end = self.cache.arena.get(self.cache.frontier()).end;
        assert!(
            offset >= end,
            "caches at {offset}, behind the active path's end {end}"
        );
        assert!(
            offset <= self.tokens.len(),
            "caches at {offset}, past the {} known tokens",
            self.tokens.len()
        );
    }

    fn finish(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let cache = &mut *self.cache;
        let mut problem = None;
        let mut offset = cache.min_offset();
        let limit = offset.min(self.tokens.len());
        if cache.caches.iter().any(|c| c.offset() != limit) {
            let mut aligned = true;
            for c in &mut cache.caches {
                if c.offset() != limit {
                    aligned &= matches!(c.restore(None, limit), Ok(true));
                }
            }
            let error = CacheError::InvalidState(format!(
                "at close the layers stood at offsets {:?} for {} known tokens",
                cache.caches.iter().map(SnapshotCache::offset).collect::<Vec<_>>(),
                self.tokens.len()
            ));
            if aligned {
                offset = limit;
                problem = Some(error);
            } else {
                problem = Some(cache.fail(error));
                offset = 0;
            }
        }
        let frontier_end = cache.arena.get(cache.frontier()).end;
        if offset < frontier_end {
            cache.truncate_active(offset);
        }
        let frontier_end = cache.arena.get(cache.frontier()).end;
        if offset > frontier_end {
            cache.advance(
                &self.tokens[frontier_end..offset],
                frontier_end >= self.prompt_len,
            );
        }
        if problem.is_none() && !self.stored {
            let held = offset.min(self.prompt_len);
            cache.write_through(&self.namespace, &self.tokens[..held]);
        }
        cache.touch_active();
        cache.report_path(cache.frontier());
        cache.enforce_budget();
        let known = self.tokens.len();
        if problem.is_none() && known > self.prompt_len && offset + 1 < known {
            problem = Some(CacheError::InvalidState(format!(
                "at close the caches hold {offset} tokens, but the prompt and the recorded tokens \
                 are {known}: every recorded token but the last must be evaluated \
                 (offsets {offset}..{} were not); the trie keeps the first {offset}",
                known - 1
            )));
        }
        problem.map_or(Ok(()), Err)
    }
}

impl<C: SnapshotCache> Drop for Session<'_, C> {
    fn drop(&mut self) {
        if let Err(error) = self.finish() {
            tracing::warn!(%error, "prefix cache: closing a dropped session");
        }
    }
}

impl<C: SnapshotCache> std::fmt::Debug for Session<'_, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("namespace", &self.namespace)
            .field("prompt_len", &self.prompt_len)
            .field("cached", &self.cached)
            .field("restored", &self.restored)
            .field("generated", &self.generated().len())
            .field("pending", &self.pending)
            .field("closed", &self.closed)
            .finish()
    }
}
