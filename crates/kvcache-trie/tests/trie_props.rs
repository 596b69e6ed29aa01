//! Property tests: random conversations (new, extend, branch, repeat, user
//! snapshots, abandoned requests, budget changes) over fake layers of mixed
//! kinds. After every step the live state must equal a from-scratch evaluation
//! of the tokens the trie says it restored, and the trie's invariants must
//! hold; at the end every snapshot is owned by the trie or dropped exactly once.
//! The KV events the trie reports, replayed as a router would, must name
//! exactly the full blocks its paths hold.

mod trie_support;

use std::collections::HashMap;
use std::sync::Arc;

use kvcache_api::events::{EventLog, KvEvent};
use kvcache_api::Fingerprint;
use proptest::prelude::*;
use trie_support::{cache, request_with, Options};

#[derive(Debug, Clone)]
enum Op {
    /// A fresh prompt.
    New { prompt: Vec<u32>, generated: Vec<u32> },
    /// The next turn of a conversation: its transcript and new tokens; with
    /// `end_snapshot`, an ordinary snapshot at the end of the prompt (an
    /// engine resuming conversations there), so the reply is a node of its own.
    Extend {
        conv: usize,
        extra: Vec<u32>,
        generated: Vec<u32>,
        end_snapshot: bool,
    },
    /// A conversation edited at `cut`, then new tokens.
    Branch {
        conv: usize,
        cut: usize,
        extra: Vec<u32>,
        generated: Vec<u32>,
    },
    /// An earlier prompt again.
    Repeat { conv: usize, generated: Vec<u32> },
    /// The next turn, with a user snapshot at the end of the prompt.
    User { conv: usize, extra: Vec<u32> },
    /// `begin`, evaluate `keep` prompt tokens at most (passing pending
    /// snapshots by), drop the session.
    Abandon {
        conv: usize,
        extra: Vec<u32>,
        keep: usize,
    },
    /// A new budget in bytes.
    Budget(usize),
}

fn tokens(max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    // A small alphabet: conversations collide and branch often.
    prop::collection::vec(0u32..5, 0..max_len)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (tokens(10), tokens(4)).prop_map(|(prompt, generated)| Op::New { prompt, generated }),
        4 => (any::<usize>(), tokens(6), tokens(4))
            .prop_map(|(conv, extra, generated)| Op::Extend { conv, extra, generated, end_snapshot: false }),
        3 => (any::<usize>(), tokens(6), tokens(5))
            .prop_map(|(conv, extra, generated)| Op::Extend { conv, extra, generated, end_snapshot: true }),
        4 => (any::<usize>(), any::<usize>(), tokens(6), tokens(4))
            .prop_map(|(conv, cut, extra, generated)| Op::Branch { conv, cut, extra, generated }),
        2 => (any::<usize>(), tokens(3)).prop_map(|(conv, generated)| Op::Repeat { conv, generated }),
        1 => (any::<usize>(), tokens(4)).prop_map(|(conv, extra)| Op::User { conv, extra }),
        1 => (any::<usize>(), tokens(4), 0usize..8).prop_map(|(conv, extra, keep)| Op::Abandon { conv, extra, keep }),
        1 => prop_oneof![Just(0usize), Just(24), Just(96), Just(400), Just(usize::MAX)].prop_map(Op::Budget),
    ]
}

fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn pick(list: &[Vec<u32>], i: usize) -> Vec<u32> {
    if list.is_empty() {
        Vec::new()
    } else {
        list[i % list.len()].clone()
    }
}

/// Tokens per reported block: small, so that the short random prompts fill
/// several.
const BLOCK: usize = 2;

/// A router's view of one worker: every block reported stored and not
/// removed, by name, with the tokens of its whole path from the root.
#[derive(Default)]
struct RouterView {
    paths: HashMap<u64, Vec<u32>>,
    parents: HashMap<u64, Option<u64>>,
}

impl RouterView {
    /// Applies events in order, asserting what a router relies on: a stored
    /// run's parent is held, names are not stored twice, removed blocks are
    /// held and leave no child behind.
    fn apply(&mut self, events: Vec<KvEvent>) {
        for event in events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..
                } => {
                    assert_eq!(block_size, BLOCK);
                    assert_eq!(token_ids.len(), block_hashes.len() * BLOCK);
                    let mut path = match parent_block_hash {
                        Some(parent) => self
                            .paths
                            .get(&parent)
                            .expect("a stored run's parent is held")
                            .clone(),
                        None => Vec::new(),
                    };
                    let mut parent = parent_block_hash;
                    for (name, block) in block_hashes.into_iter().zip(token_ids.chunks(BLOCK)) {
                        path.extend_from_slice(block);
                        assert!(
                            self.paths.insert(name, path.clone()).is_none(),
                            "block {name} stored twice"
                        );
                        self.parents.insert(name, parent);
                        parent = Some(name);
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for name in &block_hashes {
                        assert!(
                            self.paths.remove(name).is_some(),
                            "removed block {name} was not held"
                        );
                        self.parents.remove(name);
                    }
                    for (child, parent) in &self.parents {
                        assert!(
                            parent.is_none_or(|p| !block_hashes.contains(&p)),
                            "block {child} outlives its removed parent"
                        );
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.paths.clear();
                    self.parents.clear();
                }
            }
        }
    }

    fn holds(&self, path: &[u32]) -> bool {
        self.paths.values().any(|p| p == path)
    }
}

/// Checks the router's view against the trie: every block it holds is a
/// path the trie holds, and every full block of what the trie still holds of
/// each closed request's tokens is in it.
fn check_view<C: kvcache_api::SnapshotCache>(
    view: &RouterView,
    c: &kvcache_trie::PrefixCache<C>,
    stored: &[Vec<u32>],
) {
    for path in view.paths.values() {
        assert_eq!(
            c.lookup(path),
            path.len(),
            "the router holds {path:?}, the trie does not"
        );
    }
    for s in stored {
        let held = c.lookup(s) / BLOCK * BLOCK;
        for end in (BLOCK..=held).step_by(BLOCK) {
            assert!(
                view.holds(&s[..end]),
                "the trie holds {:?}, the router does not",
                &s[..end]
            );
        }
    }
}

fn run(kinds: &str, budget: usize, ops: Vec<Op>) {
    let (mut c, counters) = cache(kinds, budget);
    let log = Arc::new(EventLog::new());
    c.set_event_sink(log.clone(), BLOCK, Fingerprint([3; 32]))
        .unwrap();
    let mut view = RouterView::default();
    let all_kv = kinds.chars().all(|k| k == 'k');
    // What conversations look like so far (prompt and every generated token).
    let mut transcripts: Vec<Vec<u32>> = Vec::new();
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    // What the live caches held when each request closed.
    let mut stored: Vec<Vec<u32>> = Vec::new();
    let (mut begins, mut prompt_tokens) = (0u64, 0u64);

    for op in ops {
        let (mut prompt, generated, options) = match op {
            Op::Budget(b) => {
                c.set_budget(b);
                c.check();
                view.apply(log.take());
                check_view(&view, &c, &stored);
                let s = c.stats();
                assert!(s.paged_out_bytes <= b || s.over_budget, "{s:?}");
                continue;
            }
            Op::New { prompt, generated } => (prompt, generated, Options::default()),
            Op::Extend {
                conv,
                extra,
                generated,
                end_snapshot,
            } => (
                [pick(&transcripts, conv), extra].concat(),
                generated,
                Options {
                    end_snapshot,
                    ..Options::default()
                },
            ),
            Op::Branch {
                conv,
                cut,
                extra,
                generated,
            } => {
                let t = pick(&transcripts, conv);
                let cut = cut % (t.len() + 1);
                ([&t[..cut], &extra[..]].concat(), generated, Options::default())
            }
            Op::Repeat { conv, generated } => (pick(&prompts, conv), generated, Options::default()),
            Op::User { conv, extra } => (
                [pick(&transcripts, conv), extra].concat(),
                vec![1],
                Options {
                    user_snapshot: true,
                    ..Options::default()
                },
            ),
            Op::Abandon { conv, extra, keep } => (
                [pick(&transcripts, conv), extra].concat(),
                vec![],
                Options {
                    abandon_after: Some(keep),
                    ..Options::default()
                },
            ),
        };
        if prompt.is_empty() {
            prompt.push(0);
        }

        let best = stored
            .iter()
            .map(|s| lcp(s, &prompt))
            .max()
            .unwrap_or(0)
            .min(prompt.len() - 1);
        let evictions = c.stats().evictions;
        let out = request_with(&mut c, &counters, &prompt, &generated, options);
        begins += 1;
        prompt_tokens += prompt.len() as u64;
        assert!(
            out.cached <= best,
            "restored {} tokens, only {best} were ever cached",
            out.cached
        );
        if all_kv && evictions == 0 && c.stats().evictions == 0 {
            assert_eq!(
                out.cached, best,
                "a KV-only trie without evictions restores the longest prefix"
            );
            assert!(
                out.stops.is_empty(),
                "KV-only: no snapshot stops, got {:?}",
                out.stops
            );
        }
        let s = c.stats();
        assert!(s.paged_out_bytes <= s.budget || s.over_budget, "{s:?}");
        assert_eq!(
            counters.created(),
            counters.dropped() + s.snapshots,
            "snapshot accounting"
        );

        if let Some(keep) = options.abandon_after {
            stored.push(prompt[..out.cached + keep.min(out.remaining.len())].to_vec());
        } else {
            let mut held = prompt.clone();
            held.extend_from_slice(&generated[..generated.len().saturating_sub(1)]);
            stored.push(held);
            transcripts.push([&prompt[..], &generated[..]].concat());
            prompts.push(prompt);
        }
        view.apply(log.take());
        check_view(&view, &c, &stored);
    }
    let s = c.stats();
    assert_eq!(s.hits + s.misses, begins);
    assert_eq!(s.reused_tokens + s.evaluated_tokens, prompt_tokens);
    drop(c);
    assert_eq!(
        counters.created(),
        counters.dropped(),
        "every snapshot dropped exactly once"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn random_conversations_kv(ops in prop::collection::vec(op(), 1..40)) {
        run("k", usize::MAX, ops);
    }

    #[test]
    fn random_conversations_two_kv_small_budget(ops in prop::collection::vec(op(), 1..40)) {
        run("kk", 160, ops);
    }

    #[test]
    fn random_conversations_mixed(
        kinds in prop_oneof![Just("r"), Just("kr"), Just("rk"), Just("krk"), Just("w"), Just("kw"), Just("wkr")],
        budget in prop_oneof![Just(0usize), Just(200), Just(usize::MAX)],
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run(kinds, budget, ops);
    }
}
