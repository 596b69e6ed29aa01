//! Prefix-trie operation sequences from arbitrary bytes, over fake layer caches.
//!
//! The bytes choose the layers (rewindable KV, recurrent, sliding-window, mixed),
//! a byte budget, whether an in-memory store ([`MemStore`]) stands behind the
//! trie and its block size, and a list of requests and trie calls. A request
//! is `begin_in` one of three namespaces (empty prompts included) followed by
//! engine actions in any order, the well-behaved ones (prefill, chunks,
//! snapshots, recording and evaluating generated tokens) and abusive ones
//! (feeding one layer only, feeding past the known tokens, freeing a layer, an
//! `eval` that evaluates too little, snapshots at any time), ended by `close`
//! or a drop. Between requests: budget changes, `clear`, `lookup`, injected
//! restore and row-append failures, the store going offline, and restarts (a
//! new trie over new layers, the same store).
//!
//! After every step: no panic; the trie's checker passes (`Session::check` while
//! the engine behaves, [`PrefixCache::check`] at rest); every layer holds exactly
//! what evaluating its tokens from scratch gives (so every restore, from
//! snapshots or from the store, is right); the snapshots off the active path fit
//! the budget, and above it every snapshot lies on the active path; a request
//! restores no more than the longest prefix of its prompt seen before in its
//! namespace; every live snapshot is owned by the trie; the store never refuses
//! a write; a rejected `begin` and a `lookup` change nothing; and when a trie is
//! dropped every snapshot has been dropped exactly once.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use kvcache_api::{CacheError, Namespace, SnapshotCache};
use kvcache_trie::fake::{feed_all, Counters, FakeKv, FakeLayer, FakeRecurrent, FakeWindow, MemStore};
use kvcache_trie::{PrefixCache, Session};

use super::input::Input;

/// A layer of the fake model.
pub type Layer = Box<dyn FakeLayer>;

/// Token id fed past the known tokens (never part of a prompt).
const JUNK: u32 = 999;

/// The trie under test.
#[derive(Debug, Clone)]
pub struct Setup {
    /// `k` KV, `r` recurrent, `w` window, per layer.
    pub kinds: String,
    /// Window of the `w` layers.
    pub window: usize,
    /// Byte budget.
    pub budget: usize,
    /// Block size of the store behind the trie; 0 for no store.
    pub store_block: usize,
}

/// Namespace `i` of the three requests run in (0 is the shared one).
fn namespace(i: usize) -> Namespace {
    match i {
        0 => Namespace::shared(),
        1 => Namespace::new("tenant-a").expect("valid"),
        _ => Namespace::new("tenant-b").expect("valid"),
    }
}

/// How a request's prompt is made.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// These tokens.
    Fresh(Vec<u32>),
    /// A stored conversation followed by these tokens.
    Extend(usize, Vec<u32>),
    /// A stored conversation cut at `cut` (modulo its length + 1), then these tokens.
    Branch(usize, usize, Vec<u32>),
    /// A stored conversation again.
    Repeat(usize),
    /// An empty prompt (rejected).
    Empty,
}

/// One engine action inside a request.
#[derive(Debug, Clone)]
pub enum Act {
    /// `Session::prefill` with a correct model.
    Prefill,
    /// `Session::prefill` with a model that evaluates one token too few.
    PrefillShort,
    /// `next_chunk`, then evaluate it.
    Chunk,
    /// Evaluate up to `n` known tokens on every layer, ignoring pending snapshots.
    Feed(usize),
    /// Evaluate up to `n` known tokens on one layer only.
    FeedLayer(usize, usize),
    /// Evaluate a token that is not among the known ones on every layer.
    FeedJunk,
    /// `free` one layer behind the session's back.
    FreeLayer(usize),
    /// `Session::snapshot(user)`.
    Snapshot(bool),
    /// `Session::record(token)`.
    Record(u32),
}

/// One step of a case.
#[derive(Debug, Clone)]
pub enum Op {
    /// A request.
    Request {
        /// The namespace (see [`namespace`]).
        space: usize,
        /// The prompt.
        prompt: Prompt,
        /// What the engine does.
        acts: Vec<Act>,
        /// Drop the session instead of closing it.
        drop: bool,
    },
    /// `set_budget`.
    Budget(usize),
    /// `clear`.
    Clear,
    /// `lookup`.
    Lookup(Vec<u32>),
    /// Make every restore from a snapshot fail (or stop failing).
    FailRestore(bool),
    /// Make every `append_rows` of the KV layers fail (or stop failing).
    FailAppend(bool),
    /// The store answers every fetch with `None` (or answers again).
    StoreOffline(bool),
    /// Drop the trie and start a new one over new layers, the same store.
    Restart,
}

fn tokens(input: &mut Input, max: usize) -> Vec<u32> {
    (0..input.below(max + 1))
        .map(|_| u32::from(input.u8() % 5))
        .collect()
}

fn act(input: &mut Input, layers: usize) -> Act {
    match input.below(24) {
        0..=5 => Act::Prefill,
        6..=8 => Act::Chunk,
        9..=10 => Act::Feed(input.range(1, 4)),
        11..=15 => Act::Record(u32::from(input.u8() % 5)),
        16..=17 => Act::Feed(1),
        18 => Act::Snapshot(input.chance(50)),
        19 => Act::PrefillShort,
        20 => Act::FeedLayer(input.below(layers), input.range(1, 3)),
        21 => Act::FeedJunk,
        22 => Act::FreeLayer(input.below(layers)),
        _ => Act::Snapshot(false),
    }
}

fn op(input: &mut Input, layers: usize) -> Op {
    match input.below(24) {
        0..=15 => {
            let space = input.pick(&[0, 0, 1, 2]);
            let prompt = match input.below(12) {
                0..=2 => Prompt::Fresh(tokens(input, 10)),
                3..=6 => Prompt::Extend(input.u8().into(), tokens(input, 6)),
                7..=8 => Prompt::Branch(input.u8().into(), input.u8().into(), tokens(input, 6)),
                9..=10 => Prompt::Repeat(input.u8().into()),
                _ => Prompt::Empty,
            };
            let acts = (0..input.below(7)).map(|_| act(input, layers)).collect();
            Op::Request {
                space,
                prompt,
                acts,
                drop: input.chance(20),
            }
        }
        16 => Op::Budget(input.pick(&[0, 8, 24, 64, 200, 1000, usize::MAX])),
        17 => Op::Clear,
        18 => Op::Lookup(tokens(input, 12)),
        19 => Op::FailAppend(input.chance(30)),
        20 => Op::StoreOffline(input.chance(30)),
        21 => Op::Restart,
        _ => Op::FailRestore(input.chance(30)),
    }
}

/// Decodes a case from fuzz bytes.
pub fn decode(bytes: &[u8]) -> (Setup, Vec<Op>) {
    let mut input = Input::new(bytes);
    let kinds: String = (0..input.range(1, 3))
        .map(|_| input.pick(&['k', 'k', 'r', 'w']))
        .collect();
    let setup = Setup {
        window: input.range(1, 5),
        budget: input.pick(&[0, 16, 64, 200, 1000, usize::MAX]),
        store_block: input.pick(&[0, 0, 1, 2, 3, 4]),
        kinds,
    };
    let layers = setup.kinds.len();
    let mut ops = Vec::new();
    while !input.is_empty() && ops.len() < 128 {
        ops.push(op(&mut input, layers));
    }
    (setup, ops)
}

/// The fake layers of `setup`, counting into `counters`.
pub fn layers(setup: &Setup, counters: &Counters) -> Vec<Layer> {
    setup
        .kinds
        .chars()
        .map(|k| match k {
            'k' => Box::new(FakeKv::new(counters)) as Layer,
            'r' => Box::new(FakeRecurrent::new(counters)) as Layer,
            _ => Box::new(FakeWindow::new(counters, setup.window)) as Layer,
        })
        .collect()
}

/// Statistics of one run, for reporting.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    /// Requests begun.
    pub requests: usize,
    /// Calls rejected with a typed error.
    pub rejected: usize,
    /// Engine actions performed inside requests.
    pub actions: usize,
    /// Requests that restored tokens from the store.
    pub store_hits: usize,
    /// Branch points evicted (snapshots dropped, node kept).
    pub branch_evictions: usize,
}

/// Asserts every layer holds exactly what evaluating its share of `known` from
/// scratch gives.
fn assert_holds(caches: &[Layer], known: &[u32], what: &str) {
    for (i, c) in caches.iter().enumerate() {
        let off = c.offset();
        assert!(
            off <= known.len(),
            "{what}: layer {i} at {off}, past the {} known tokens",
            known.len()
        );
        assert!(
            c.holds(&known[..off]),
            "{what}: layer {i} does not hold {:?}",
            &known[..off]
        );
    }
}

fn offsets(caches: &[Layer]) -> Vec<usize> {
    caches.iter().map(|c| c.offset()).collect()
}

struct Engine {
    /// Prompt and recorded tokens.
    known: Vec<u32>,
    /// A layer was fed a token outside `known`.
    junk: bool,
    /// Every action so far kept the layers aligned and on the known tokens.
    behaved: bool,
}

impl Engine {
    fn act(&mut self, s: &mut Session<'_, Layer>, act: &Act, tally: &mut Tally) {
        tally.actions += 1;
        match *act {
            Act::Prefill | Act::PrefillShort => {
                let short = matches!(act, Act::PrefillShort);
                let result = s.prefill(|tokens, caches| {
                    let n = if short { tokens.len() - 1 } else { tokens.len() };
                    feed_all(caches, &tokens[..n]);
                    Ok::<(), CacheError>(())
                });
                match result {
                    Err(e) => {
                        assert!(matches!(e, CacheError::InvalidState(_)), "prefill: {e:?}");
                        assert!(
                            short || !self.behaved,
                            "prefill failed for a well-behaved engine: {e}"
                        );
                        tally.rejected += 1;
                    }
                    Ok(()) if self.behaved => {
                        assert!(
                            s.offset() >= s.prompt().len(),
                            "prefill stopped at {}",
                            s.offset()
                        );
                    }
                    Ok(()) => {}
                }
            }
            Act::Chunk => match s.next_chunk() {
                Ok((tokens, caches)) => {
                    let tokens = tokens.to_vec();
                    feed_all(caches, &tokens);
                }
                Err(e) => {
                    assert!(matches!(e, CacheError::InvalidState(_)), "next_chunk: {e:?}");
                    assert!(!self.behaved, "next_chunk failed for a well-behaved engine: {e}");
                    tally.rejected += 1;
                }
            },
            Act::Feed(n) => {
                for c in s.caches_mut() {
                    let off = c.offset();
                    if off <= self.known.len() {
                        c.feed(&self.known[off..(off + n).min(self.known.len())]);
                    }
                }
            }
            Act::FeedLayer(layer, n) => {
                let c = &mut s.caches_mut()[layer];
                let off = c.offset().min(self.known.len());
                let end = (off + n).min(self.known.len());
                if c.offset() <= self.known.len() && end > off {
                    c.feed(&self.known[off..end]);
                    self.behaved = false;
                }
            }
            Act::FeedJunk => {
                // Only past the known tokens: a wrong token inside them is
                // something no cache can detect.
                for c in s.caches_mut() {
                    if c.offset() >= self.known.len() {
                        c.feed(&[JUNK]);
                        self.junk = true;
                        self.behaved = false;
                    }
                }
            }
            Act::FreeLayer(layer) => {
                s.caches_mut()[layer].free();
                self.behaved = false;
            }
            Act::Snapshot(user) => {
                if let Err(e) = s.snapshot(user) {
                    assert!(matches!(e, CacheError::InvalidState(_)), "snapshot: {e:?}");
                    assert!(!self.behaved, "snapshot failed for a well-behaved engine: {e}");
                    tally.rejected += 1;
                }
            }
            Act::Record(token) => {
                // Recording after junk would make the junk a known token.
                if !self.junk {
                    s.record(token);
                    self.known.push(token);
                }
            }
        }
        if self.behaved {
            s.check();
        }
        if !self.junk {
            assert_holds(s.caches(), &self.known, &format!("after {act:?}"));
        }
    }
}

fn pick(list: &[Vec<u32>], i: usize) -> Vec<u32> {
    if list.is_empty() {
        Vec::new()
    } else {
        list[i % list.len()].clone()
    }
}

/// Runs one begun request: the engine's actions, then close or drop. Returns
/// the tokens the session knew (prompt and recorded).
fn drive(
    mut session: Session<'_, Layer>,
    prompt: &[u32],
    acts: &[Act],
    drop: bool,
    tally: &mut Tally,
) -> Vec<u32> {
    let cached = session.cached();
    assert!(cached < prompt.len(), "begin restored the whole prompt");
    assert_eq!(session.remaining(), &prompt[cached..]);
    session.check();
    assert_holds(session.caches(), &prompt[..cached], "after begin");
    let mut engine = Engine {
        known: prompt.to_vec(),
        junk: false,
        behaved: true,
    };
    for a in acts {
        engine.act(&mut session, a, tally);
    }
    // Every recorded token but the last must be evaluated: close reports a
    // session left further behind (and still leaves the trie consistent).
    let recorded = engine.known.len() > prompt.len();
    let behind = recorded && session.offset() + 1 < engine.known.len();
    if drop {
        std::mem::drop(session);
    } else if let Err(e) = session.close() {
        assert!(matches!(e, CacheError::InvalidState(_)), "close: {e:?}");
        assert!(
            !engine.behaved || behind,
            "close failed for a well-behaved engine: {e}"
        );
        tally.rejected += 1;
    }
    engine.known
}

/// A trie over new layers of `setup`, with `store` behind it.
fn new_trie(
    setup: &Setup,
    counters: &Counters,
    budget: usize,
    store: Option<&Arc<MemStore>>,
) -> PrefixCache<Layer> {
    let mut cache = PrefixCache::new(layers(setup, counters), budget).expect("layers given");
    if let Some(store) = store {
        cache
            .set_store(store.clone(), Duration::from_millis(10))
            .expect("the store has one layer per cache");
    }
    cache
}

/// Length of the common prefix of `a` and `b`.
fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Runs a decoded case, panicking on any violation.
pub fn run(setup: &Setup, ops: &[Op]) -> Tally {
    let mut tally = Tally::default();
    let counters = Counters::new();
    let store = (setup.store_block > 0).then(|| {
        Arc::new(MemStore::new(
            FakeKv::layout(setup.kinds.len()),
            setup.store_block,
        ))
    });
    let mut budget = setup.budget;
    let mut cache = new_trie(setup, &counters, budget, store.as_ref());
    // Transcripts of earlier requests, with their namespaces, and what the
    // live caches hold at rest.
    let mut conversations: Vec<Vec<u32>> = Vec::new();
    let mut seen: Vec<(usize, Vec<u32>)> = Vec::new();
    let mut resting: Vec<u32> = Vec::new();
    let (mut begun, mut prompt_tokens) = (0u64, 0u64);
    // Counters of the tries dropped by restarts.
    let (mut hits, mut misses, mut reused, mut evaluated) = (0u64, 0u64, 0u64, 0u64);
    for op in ops {
        match op {
            Op::Request {
                space,
                prompt,
                acts,
                drop,
            } => {
                let prompt = match prompt {
                    Prompt::Fresh(t) => t.clone(),
                    Prompt::Extend(c, extra) => [pick(&conversations, *c), extra.clone()].concat(),
                    Prompt::Branch(c, cut, extra) => {
                        let t = pick(&conversations, *c);
                        [&t[..cut % (t.len() + 1)], &extra[..]].concat()
                    }
                    Prompt::Repeat(c) => pick(&conversations, *c),
                    Prompt::Empty => Vec::new(),
                };
                // No request restores more than its namespace has seen.
                let bound = seen
                    .iter()
                    .filter(|(s, _)| s == space)
                    .map(|(_, t)| common(t, &prompt))
                    .max()
                    .unwrap_or(0);
                let before = (cache.dump(), cache.stats(), offsets(cache.caches()));
                tally.requests += 1;
                let known = match cache.begin_in(&namespace(*space), &prompt) {
                    Ok(session) => {
                        begun += 1;
                        prompt_tokens += prompt.len() as u64;
                        assert!(
                            session.cached() <= bound,
                            "restored {} tokens, only {bound} seen in namespace {space}",
                            session.cached()
                        );
                        Ok(drive(session, &prompt, acts, *drop, &mut tally))
                    }
                    Err(e) => Err(e),
                };
                let known = match known {
                    Ok(known) => known,
                    Err(e) => {
                        tally.rejected += 1;
                        if prompt.is_empty() {
                            assert!(matches!(e, CacheError::InvalidArgument(_)), "empty prompt: {e:?}");
                            let after = (cache.dump(), cache.stats(), offsets(cache.caches()));
                            assert_eq!(after, before, "a rejected begin changed the trie");
                        } else {
                            // An injected restore failure: the trie falls back to the root.
                            assert!(matches!(e, CacheError::Backend(_)), "begin: {e:?}");
                            assert_eq!(cache.offset(), 0, "after a failed begin");
                        }
                        resting.truncate(cache.offset());
                        check_at_rest(&cache, &counters, &resting, store.as_deref());
                        continue;
                    }
                };
                resting = known.clone();
                seen.push((*space, known.clone()));
                conversations.push(known);
                assert!(cache.offset() <= resting.len());
                resting.truncate(cache.offset());
            }
            Op::Budget(b) => {
                budget = *b;
                cache.set_budget(*b);
            }
            Op::Clear => {
                cache.clear();
                assert_eq!(cache.stats().snapshots, 0);
                assert_eq!(counters.alive(), 0, "snapshots alive after clear");
                resting.clear();
            }
            Op::Lookup(t) => {
                let before = (cache.dump(), cache.stats());
                let n = cache.lookup(t);
                assert!(n <= t.len());
                assert_eq!((cache.dump(), cache.stats()), before, "lookup changed the trie");
            }
            Op::FailRestore(fail) => counters.set_fail_restore(*fail),
            Op::FailAppend(fail) => counters.set_fail_append(*fail),
            Op::StoreOffline(offline) => {
                if let Some(store) = &store {
                    store.set_offline(*offline);
                }
            }
            Op::Restart => {
                let s = cache.stats();
                tally.store_hits += s.store_hits as usize;
                tally.branch_evictions += s.branch_evictions as usize;
                (hits, misses) = (hits + s.hits, misses + s.misses);
                (reused, evaluated) = (reused + s.reused_tokens, evaluated + s.evaluated_tokens);
                std::mem::drop(cache);
                assert_eq!(counters.alive(), 0, "snapshots leaked by a restarted trie");
                cache = new_trie(setup, &counters, budget, store.as_ref());
                resting.clear();
            }
        }
        check_at_rest(&cache, &counters, &resting, store.as_deref());
    }
    let s = cache.stats();
    tally.store_hits += s.store_hits as usize;
    tally.branch_evictions += s.branch_evictions as usize;
    assert_eq!(hits + misses + s.hits + s.misses, begun, "hits + misses");
    assert_eq!(
        reused + evaluated + s.reused_tokens + s.evaluated_tokens,
        prompt_tokens,
        "reused + evaluated"
    );
    std::mem::drop(cache);
    assert_eq!(counters.alive(), 0, "snapshots leaked after the trie was dropped");
    tally
}

/// Bytes of the snapshots on nodes off the active path, read from the dump
/// (`... snaps 1/2 24B [user] [active]`).
fn off_path_bytes(dump: &str) -> usize {
    dump.lines()
        .filter(|line| !line.ends_with(" active"))
        .filter_map(|line| line.split(" snaps ").nth(1))
        .filter_map(|rest| rest.split(' ').nth(1))
        .map(|bytes| {
            bytes
                .trim_end_matches('B')
                .parse::<usize>()
                .expect("a byte count")
        })
        .sum()
}

fn check_at_rest(cache: &PrefixCache<Layer>, counters: &Counters, resting: &[u32], store: Option<&MemStore>) {
    cache.check();
    let s = cache.stats();
    // The budget holds except for the active path: off it, snapshots always
    // fit; above it, every snapshot is on it.
    let off = off_path_bytes(&cache.dump());
    assert!(
        off <= s.budget,
        "{off} paged-out bytes off the active path over the {} budget",
        s.budget
    );
    assert!(
        s.paged_out_bytes <= s.budget || off == 0,
        "{} paged-out bytes over the {} budget, {off} of them off the active path",
        s.paged_out_bytes,
        s.budget
    );
    assert_eq!(s.over_budget, s.paged_out_bytes > s.budget, "over_budget");
    assert_eq!(
        counters.alive(),
        s.snapshots,
        "live snapshots the trie does not own"
    );
    if let Some(store) = store {
        assert_eq!(store.refused(), 0, "the trie submitted a write the store refused");
    }
    assert_holds(cache.caches(), resting, "at rest");
}

/// Decodes and runs fuzz bytes (the cargo-fuzz entry point).
pub fn fuzz(bytes: &[u8]) -> Tally {
    let (setup, ops) = decode(bytes);
    run(&setup, &ops)
}
