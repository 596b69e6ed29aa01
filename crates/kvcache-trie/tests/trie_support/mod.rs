//! Shared helpers of the trie tests: a request driver that checks the trie's
//! invariants and the live state after every step.
#![allow(dead_code)]

use kvcache_api::Namespace;
use kvcache_trie::fake::{feed_all, Counters, FakeKv, FakeLayer, FakeRecurrent, FakeWindow};
use kvcache_trie::{PrefixCache, Session};

/// A layer of a fake model.
pub type Layer = Box<dyn FakeLayer>;

/// Layer caches of the given kinds: `'k'` a [`FakeKv`], `'r'` a [`FakeRecurrent`],
/// `'w'` a [`FakeWindow`] of 4 tokens.
pub fn layers(kinds: &str, counters: &Counters) -> Vec<Layer> {
    kinds
        .chars()
        .map(|k| match k {
            'k' => Box::new(FakeKv::new(counters)) as Layer,
            'r' => Box::new(FakeRecurrent::new(counters)) as Layer,
            'w' => Box::new(FakeWindow::new(counters, 4)) as Layer,
            other => panic!("unknown layer kind {other:?}"),
        })
        .collect()
}

/// A prefix cache over fake layers of the given kinds.
pub fn cache(kinds: &str, budget: usize) -> (PrefixCache<Layer>, Counters) {
    let counters = Counters::new();
    let cache = PrefixCache::new(layers(kinds, &counters), budget).unwrap();
    (cache, counters)
}

/// Asserts every layer holds exactly what evaluating `tokens` from scratch gives.
pub fn assert_holds<C: FakeLayer>(caches: &[C], tokens: &[u32]) {
    for (i, c) in caches.iter().enumerate() {
        assert!(
            c.holds(tokens),
            "layer {i} (offset {}) does not hold {tokens:?}",
            c.offset()
        );
    }
}

/// What one request did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Prompt tokens restored by `begin`.
    pub cached: usize,
    /// Prompt tokens evaluated.
    pub remaining: Vec<u32>,
    /// Offsets where prefill stopped for a snapshot.
    pub stops: Vec<usize>,
    /// Tokens the fake model evaluated during the request, summed over layers.
    pub fed: usize,
}

/// Options of [`request_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Take a user snapshot at the end of the prompt.
    pub user_snapshot: bool,
    /// Take an ordinary snapshot at the end of the prompt (as an engine that
    /// resumes conversations there does).
    pub end_snapshot: bool,
    /// Evaluate only this many prompt tokens (ignoring pending snapshots),
    /// then drop the session.
    pub abandon_after: Option<usize>,
}

/// Runs one request: `begin(prompt)`, prefill (stopping for pending
/// snapshots), generation of `generated` (evaluating all but the last), close.
/// Checks the invariants and the live state after every step.
pub fn request<C: FakeLayer>(
    cache: &mut PrefixCache<C>,
    counters: &Counters,
    prompt: &[u32],
    generated: &[u32],
) -> Outcome {
    request_with(cache, counters, prompt, generated, Options::default())
}

/// [`request`] with options.
pub fn request_with<C: FakeLayer>(
    cache: &mut PrefixCache<C>,
    counters: &Counters,
    prompt: &[u32],
    generated: &[u32],
    options: Options,
) -> Outcome {
    request_full(cache, counters, &Namespace::shared(), prompt, generated, options)
}

/// [`request`] in a namespace.
pub fn request_in<C: FakeLayer>(
    cache: &mut PrefixCache<C>,
    counters: &Counters,
    namespace: &Namespace,
    prompt: &[u32],
    generated: &[u32],
) -> Outcome {
    request_full(cache, counters, namespace, prompt, generated, Options::default())
}

/// [`request`] in a namespace, with options.
pub fn request_full<C: FakeLayer>(
    cache: &mut PrefixCache<C>,
    counters: &Counters,
    namespace: &Namespace,
    prompt: &[u32],
    generated: &[u32],
    options: Options,
) -> Outcome {
    let fed_before = counters.fed_tokens();
    let mut s = cache.begin_in(namespace, prompt).unwrap();
    s.check();
    let cached = s.cached();
    let remaining = s.remaining().to_vec();
    assert!(!remaining.is_empty(), "begin left nothing to evaluate");
    assert_eq!(&prompt[cached..], &remaining[..]);
    assert_holds(s.caches(), &prompt[..cached]);
    if let Some(k) = options.abandon_after {
        let end = cached + k.min(remaining.len());
        feed_all(s.caches_mut(), &prompt[cached..end]);
        drop(s);
        cache.check();
        assert_holds(cache.caches(), &prompt[..end]);
        return Outcome {
            cached,
            remaining,
            stops: vec![],
            fed: counters.fed_tokens() - fed_before,
        };
    }
    let stops = prefill(&mut s, prompt);
    if options.user_snapshot || options.end_snapshot {
        s.snapshot(options.user_snapshot).unwrap();
        s.check();
    }
    for (i, &t) in generated.iter().enumerate() {
        s.record(t);
        if i + 1 < generated.len() {
            feed_all(s.caches_mut(), &[t]);
            s.check();
        }
    }
    s.close().unwrap();
    cache.check();
    let mut stored = prompt.to_vec();
    stored.extend_from_slice(&generated[..generated.len().saturating_sub(1)]);
    assert_holds(cache.caches(), &stored);
    Outcome {
        cached,
        remaining,
        stops,
        fed: counters.fed_tokens() - fed_before,
    }
}

/// Evaluates the rest of the prompt chunk by chunk, taking pending snapshots
/// and checking after each step. Returns the offsets it stopped at.
pub fn prefill<C: FakeLayer>(s: &mut Session<'_, C>, prompt: &[u32]) -> Vec<usize> {
    let mut stops = vec![];
    loop {
        let offset = s.offset();
        if s.pending_snapshot() == Some(offset) {
            s.snapshot(false).unwrap();
            s.check();
            stops.push(offset);
        }
        let (tokens, caches) = s.next_chunk().unwrap();
        if tokens.is_empty() {
            break;
        }
        let tokens = tokens.to_vec();
        feed_all(caches, &tokens);
        s.check();
        assert_holds(s.caches(), &prompt[..s.offset()]);
    }
    assert_eq!(s.offset(), prompt.len());
    stops
}
