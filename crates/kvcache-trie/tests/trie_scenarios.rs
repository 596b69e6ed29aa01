//! SCENARIOS.md T1-T3 and edge cases of the prefix trie, over fake caches.

mod trie_support;

use kvcache_api::{CacheError, SnapshotCache};
use kvcache_trie::fake::{feed_all, Counters, FakeKv, FakeLayer, RECURRENT_STATE_BYTES};
use kvcache_trie::PrefixCache;
use trie_support::{assert_holds, cache, request, request_with, Options, Outcome};

const NO_LIMIT: usize = usize::MAX;

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..=b).collect()
}

#[test]
fn t1_match_through_root_children() {
    let (mut c, n) = cache("k", NO_LIMIT);
    request(&mut c, &n, &[1, 2, 3], &[]);
    request(&mut c, &n, &[4, 5, 6], &[]);
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3] [0,3) snaps 1/1 12B\n  [4, 5, 6] [0,3) active\n"
    );
    assert_eq!(c.lookup(&[1, 2, 3, 7]), 3);
    assert_eq!(c.lookup(&[4, 5, 6, 8]), 3);
    assert_eq!(c.lookup(&[7, 8, 9]), 0);

    // The same through begin: a restore of 3 tokens, then 1 to evaluate.
    assert_eq!(request(&mut c, &n, &[1, 2, 3, 7], &[]).cached, 3);
    assert_eq!(request(&mut c, &n, &[4, 5, 6, 8], &[]).cached, 3);
    assert_eq!(request(&mut c, &n, &[7, 8, 9], &[]).cached, 0);
}

#[test]
fn t2_find_split_append() {
    let (mut c, n) = cache("k", NO_LIMIT);
    request(&mut c, &n, &range(1, 5), &[]);
    assert_eq!(c.lookup(&[1, 2, 3, 6, 7]), 3);
    let out = request(&mut c, &n, &[1, 2, 3, 6, 7], &[]);
    assert_eq!((out.cached, out.remaining), (3, vec![6, 7]));
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3] [0,3) snaps 1/1 12B active\n    [4, 5] [3,5) snaps 1/1 8B\n    [6, 7] [3,5) active\n"
    );
    assert_eq!(c.lookup(&range(1, 5)), 5);
    assert_eq!(c.lookup(&[1, 2, 3, 6, 7]), 5);
    assert_eq!(c.lookup(&[1, 2, 3, 9, 9]), 3);
}

#[test]
fn t2_branch_point_snapshot_during_prefill_for_a_recurrent_layer() {
    // A recurrent layer cannot stop inside a cached edge: begin restores
    // nothing and asks for a snapshot at the branch point, 3.
    let (mut c, n) = cache("kr", NO_LIMIT);
    request(&mut c, &n, &range(1, 5), &[]);
    let out = request(&mut c, &n, &[1, 2, 3, 6, 7], &[]);
    assert_eq!((out.cached, out.stops), (0, vec![3]));
    let r = RECURRENT_STATE_BYTES;
    assert_eq!(
        c.dump(),
        format!(
            "root\n  [1, 2, 3] [0,3) snaps 2/2 {}B active\n    [4, 5] [3,5) snaps 2/2 {}B\n    [6, 7] [3,5) active\n",
            12 + r,
            8 + r
        )
    );
    // Both branches now restore from the branch point.
    let out = request(&mut c, &n, &[1, 2, 3, 4, 5, 8], &[]);
    assert_eq!((out.cached, out.stops.len()), (5, 0));
    // A branch inside [6, 7]: restored to 3, a new branch point at 4.
    let out = request(&mut c, &n, &[1, 2, 3, 6, 9], &[]);
    assert_eq!((out.cached, out.stops), (3, vec![4]));
}

/// T3 over the given layer kinds.
fn t3(kinds: &str) {
    let (mut c, n) = cache(kinds, NO_LIMIT);
    let layers = kinds.len();
    let a = range(1, 8);
    let out = request(&mut c, &n, &a, &[20, 21]);
    assert_eq!((out.cached, out.remaining.len()), (0, 8));
    assert_eq!(c.stats().misses, 1);
    // The last generated token is never evaluated.
    let mut held = a.clone();
    held.push(20);
    assert_holds(c.caches(), &held);
    assert_eq!(c.offset(), 9);

    let b = vec![1, 2, 3, 4, 5, 10, 11, 12];
    let out = request(&mut c, &n, &b, &[]);
    if kinds.contains('r') || kinds.contains('w') {
        // The recurrent (or wrapped window) layer has no state at 5 yet: evaluate from 0, snapshot at 5.
        assert_eq!((out.cached, out.stops), (0, vec![5]));
        // Repeated: the recurrent layer restores at 5 and still lacks a state at 7.
        let out = request(&mut c, &n, &b, &[]);
        assert_eq!((out.cached, out.stops), (5, vec![7]));
    } else {
        assert_eq!((out.cached, out.remaining), (5, vec![10, 11, 12]));
        assert_eq!(out.fed, 3 * layers);
    }
    // An exact repeat evaluates exactly one token.
    let out = request(&mut c, &n, &b, &[]);
    assert_eq!((out.cached, out.remaining, out.fed), (7, vec![12], layers));

    // Back to A's branch: its state comes back from snapshots.
    let restored = n.restored_tokens();
    let mut next_turn = held.clone();
    next_turn.extend([21, 30]);
    let out = request(&mut c, &n, &next_turn, &[40]);
    assert_eq!((out.cached, out.remaining), (9, vec![21, 30]));
    assert_eq!(out.fed, 2 * layers, "only the two new tokens are evaluated");
    assert!(n.restored_tokens() > restored);
}

#[test]
fn t3_request_lifecycle_kv() {
    t3("k");
    t3("kk");
}

#[test]
fn t3_request_lifecycle_mixed_kv_and_recurrent() {
    t3("kr");
    t3("rkr");
}

#[test]
fn t3_request_lifecycle_with_a_sliding_window_layer() {
    // A 4-token window has wrapped by offset 5: it behaves like a recurrent layer.
    t3("kw");
}

#[test]
fn counters_after_t3() {
    let (mut c, n) = cache("k", NO_LIMIT);
    request(&mut c, &n, &range(1, 8), &[20, 21]);
    request(&mut c, &n, &[1, 2, 3, 4, 5, 10, 11, 12], &[]);
    request(&mut c, &n, &[1, 2, 3, 4, 5, 10, 11, 12], &[]);
    request(&mut c, &n, &[1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 30], &[]);
    let s = c.stats();
    assert_eq!((s.hits, s.misses), (3, 1));
    assert_eq!(s.reused_tokens, 5 + 7 + 9);
    assert_eq!(s.evaluated_tokens, 8 + 3 + 1 + 2);
    assert_eq!(s.evictions, 0);
    assert_eq!(s.nodes, c.dump().lines().count());
    assert_eq!(s.snapshots, n.alive());
    // Paged-out bytes: every node off the active path holds its edge (4 bytes a token).
    let held: usize = c
        .dump()
        .lines()
        .filter_map(|l| l.split(" snaps ").nth(1))
        .map(|rest| rest.split(['B', ' ']).nth(1).unwrap().parse::<usize>().unwrap())
        .sum();
    assert_eq!(s.paged_out_bytes, held);
}

#[test]
fn empty_prompt_is_rejected_and_changes_nothing() {
    let (mut c, n) = cache("kr", NO_LIMIT);
    request(&mut c, &n, &[1, 2, 3], &[4]);
    let before = (c.dump(), c.stats());
    let err = c.begin(&[]).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err:?}");
    c.check();
    assert_eq!((c.dump(), c.stats()), before);
    assert_holds(c.caches(), &[1, 2, 3]);
}

#[test]
fn exact_repeat_evaluates_one_token_every_time() {
    for kinds in ["k", "kr", "r"] {
        let (mut c, n) = cache(kinds, NO_LIMIT);
        let p = range(1, 10);
        request(&mut c, &n, &p, &[]);
        for round in 0..4 {
            let out = request(&mut c, &n, &p, &[]);
            if kinds.contains('r') && round == 0 {
                // The recurrent layer has no state at 9 yet: it is taken on the way.
                assert_eq!((out.cached, out.stops), (0, vec![9]), "{kinds}");
            } else {
                assert_eq!(
                    (out.cached, out.remaining),
                    (9, vec![10]),
                    "{kinds} round {round}"
                );
            }
        }
    }
}

#[test]
fn single_token_prompt() {
    let (mut c, n) = cache("k", NO_LIMIT);
    assert_eq!(request(&mut c, &n, &[7], &[8, 9]).remaining, vec![7]);
    // [7] again: at least one token is evaluated, so nothing is restored.
    let out = request(&mut c, &n, &[7], &[]);
    assert_eq!((out.cached, out.remaining), (0, vec![7]));
    assert_eq!(request(&mut c, &n, &[7, 8, 5], &[]).cached, 2);
}

#[test]
fn prompt_that_is_a_prefix_of_a_cached_one() {
    let (mut c, n) = cache("k", NO_LIMIT);
    request(&mut c, &n, &range(1, 10), &[]);
    request(&mut c, &n, &[50], &[]);
    let out = request(&mut c, &n, &range(1, 6), &[]);
    assert_eq!((out.cached, out.remaining), (5, vec![6]));
    // The long conversation is still whole behind the new branch point.
    let out = request(&mut c, &n, &range(1, 11), &[]);
    assert_eq!((out.cached, out.remaining), (10, vec![11]));
    assert_eq!(c.lookup(&range(1, 10)), 10);
}

#[test]
fn generated_tokens_extend_the_path() {
    let (mut c, n) = cache("k", NO_LIMIT);
    request(&mut c, &n, &[1, 2, 3], &[4, 5, 6]);
    assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6]), 5);
    // The next turn: the transcript so far and a new user token.
    let out = request(&mut c, &n, &[1, 2, 3, 4, 5, 6, 7], &[]);
    assert_eq!((out.cached, out.remaining), (5, vec![6, 7]));
}

#[test]
fn dropped_session_is_closed() {
    let (mut c, n) = cache("k", NO_LIMIT);
    {
        let mut s = c.begin(&[1, 2, 3, 4]).unwrap();
        feed_all(s.caches_mut(), &[1, 2, 3, 4]);
        s.record(9);
    }
    c.check();
    assert_eq!(c.lookup(&[1, 2, 3, 4]), 4);
    let out = request_with(
        &mut c,
        &n,
        &[1, 2, 3, 4, 5],
        &[],
        Options {
            abandon_after: Some(0),
            ..Options::default()
        },
    );
    assert_eq!(out.cached, 4);
    assert_eq!(c.offset(), 4);
}

#[test]
fn prefill_helper_takes_pending_snapshots() {
    let (mut c, n) = cache("kr", NO_LIMIT);
    request(&mut c, &n, &range(1, 6), &[]);
    let mut s = c.begin(&[1, 2, 3, 9]).unwrap();
    assert_eq!((s.cached(), s.pending_snapshot()), (0, Some(3)));
    let mut calls = vec![];
    s.prefill(|tokens, caches| {
        calls.push(tokens.to_vec());
        feed_all(caches, tokens);
        Ok::<(), CacheError>(())
    })
    .unwrap();
    assert_eq!(calls, vec![vec![1, 2, 3], vec![9]]);
    assert_eq!(s.pending_snapshot(), None);
    s.close().unwrap();
    c.check();
    assert!(c.dump().contains("[1, 2, 3] [0,3) snaps 2/2"), "{}", c.dump());
}

#[test]
fn prefill_helper_rejects_an_eval_that_does_not_advance() {
    let (mut c, _n) = cache("k", NO_LIMIT);
    let mut s = c.begin(&[1, 2, 3]).unwrap();
    let err = s.prefill(|_, _| Ok::<(), CacheError>(())).unwrap_err();
    assert!(matches!(err, CacheError::InvalidState(_)), "{err:?}");
    drop(s);
    c.check();
}

#[test]
fn user_snapshot_survives_eviction_pressure() {
    // 1 KV layer: 4 bytes a token. Budget: 64 bytes of snapshots.
    let (mut c, n) = cache("k", 64);
    let system = range(1, 8);
    request_with(
        &mut c,
        &n,
        &system,
        &[],
        Options {
            user_snapshot: true,
            ..Options::default()
        },
    );
    for i in 0..20u32 {
        let prompt: Vec<u32> = (0..6).map(|k| 100 + 10 * i + k).collect();
        request(&mut c, &n, &prompt, &[1]);
        let s = c.stats();
        assert!(s.paged_out_bytes <= 64, "{s:?}");
        assert!(
            c.dump()
                .contains("[1, 2, 3, 4, 5, 6, 7, 8] [0,8) snaps 1/1 32B user"),
            "{}",
            c.dump()
        );
    }
    assert!(c.stats().evictions >= 15);
    // The user restore point still serves its prompt.
    let out = request(&mut c, &n, &[1, 2, 3, 4, 5, 6, 7, 8, 42], &[]);
    assert_eq!(out.cached, 8);
    // Under a budget nothing else can meet, it goes too.
    request(&mut c, &n, &[500], &[]);
    c.set_budget(0);
    c.check();
    assert_eq!(c.lookup(&system), 0);
    assert_eq!(c.stats().paged_out_bytes, 0);
}

#[test]
fn budget_zero_keeps_only_protected_snapshots() {
    let (mut c, n) = cache("k", 0);
    request(&mut c, &n, &range(1, 6), &[]);
    // The old leaf is paged out and evicted at once: nothing is reused.
    assert_eq!(request(&mut c, &n, &[9, 9], &[]).cached, 0);
    assert_eq!(request(&mut c, &n, &range(1, 6), &[]).cached, 0);
    assert_eq!(c.stats().paged_out_bytes, 0);
    assert!(!c.stats().over_budget);
    // A branch inside the live path: the branch point [1, 2, 3] is on the
    // active path, so its snapshot stays over the budget, reported.
    let out = request(&mut c, &n, &[1, 2, 3, 7], &[]);
    assert_eq!(out.cached, 3);
    let s = c.stats();
    assert_eq!((s.paged_out_bytes, s.over_budget), (12, true));
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3] [0,3) snaps 1/1 12B active\n    [7] [3,4) active\n"
    );
    // Switching away releases it.
    request(&mut c, &n, &[8], &[]);
    let s = c.stats();
    assert_eq!((s.paged_out_bytes, s.over_budget), (0, false));
    assert_eq!(s.snapshots, 0);
    assert_eq!(n.alive(), 0);
}

#[test]
fn eviction_order_oldest_then_deepest() {
    let (mut c, n) = cache("k", NO_LIMIT);
    request(&mut c, &n, &[50], &[]); // oldest: 4 bytes
    request(&mut c, &n, &range(1, 6), &[]);
    request(&mut c, &n, &[51, 52], &[]); // [1..6] is paged out
    request(&mut c, &n, &range(1, 8), &[]); // restores [1..6], adds [7, 8] below it
    request(&mut c, &n, &[60], &[]); // [7, 8] is paged out; [1..6] and [7, 8] share a stamp
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3, 4, 5, 6] [0,6) snaps 1/1 24B\n    [7, 8] [6,8) snaps 1/1 8B\n  [50] [0,1) snaps 1/1 4B\n  \
         [51, 52] [0,2) snaps 1/1 8B\n  [60] [0,1) active\n"
    );
    // 44 bytes. Evict to 36: the oldest, [50] (4 bytes), then [51, 52] (8 bytes).
    c.set_budget(36);
    c.check();
    assert_eq!(c.stats().evictions, 2);
    assert_eq!(c.lookup(&[50]), 0);
    assert_eq!(c.lookup(&[51, 52]), 0);
    // [1..6] and [7, 8] were last used together: the deeper one goes first, and
    // its parent keeps its own snapshot (it has no single child left to merge with).
    c.set_budget(24);
    c.check();
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3, 4, 5, 6] [0,6) snaps 1/1 24B\n  [60] [0,1) active\n"
    );
    assert_eq!(request(&mut c, &n, &range(1, 7), &[]).cached, 6);
}

/// An ordinary snapshot at the end of the prompt, as an engine resuming
/// conversations there takes.
const END_SNAPSHOT: Options = Options {
    user_snapshot: false,
    end_snapshot: true,
    abandon_after: None,
};

/// Two conversations, each with a snapshot at its prompt's end and a reply
/// of two evaluated tokens below it; then a third request, so that the
/// second reply is paged out too.
fn two_conversations_with_replies() -> (PrefixCache<trie_support::Layer>, Counters) {
    let (mut c, n) = cache("k", NO_LIMIT);
    request_with(&mut c, &n, &range(1, 6), &[100, 101, 102], END_SNAPSHOT);
    request_with(&mut c, &n, &range(20, 25), &[200, 201, 202], END_SNAPSHOT);
    request(&mut c, &n, &[30, 31], &[]);
    (c, n)
}

#[test]
fn generated_replies_are_evicted_before_requested_prompts() {
    let (mut c, n) = two_conversations_with_replies();
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3, 4, 5, 6] [0,6) snaps 1/1 24B\n    [100, 101] [6,8) snaps 1/1 8B generated\n  \
         [20, 21, 22, 23, 24, 25] [0,6) snaps 1/1 24B\n    [200, 201] [6,8) snaps 1/1 8B generated\n  \
         [30, 31] [0,2) active\n"
    );
    // 64 bytes. Evict to 48: least recently used first would take the first
    // conversation whole (its reply, then its prompt); the replies, which no
    // prompt has asked for, go first instead, the older one first.
    c.set_budget(48);
    c.check();
    assert_eq!(c.stats().evictions, 2);
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3, 4, 5, 6] [0,6) snaps 1/1 24B\n  [20, 21, 22, 23, 24, 25] [0,6) snaps 1/1 24B\n  \
         [30, 31] [0,2) active\n"
    );
    // Both conversations' next turns (which do not echo the reply) resume.
    c.set_budget(NO_LIMIT);
    let first = [range(1, 6), vec![7, 8]].concat();
    let second = [range(20, 25), vec![26, 27]].concat();
    assert_eq!(request(&mut c, &n, &first, &[]).cached, 6);
    assert_eq!(request(&mut c, &n, &second, &[]).cached, 6);
}

#[test]
fn a_prompt_through_a_generated_reply_makes_it_requested() {
    let (mut c, n) = two_conversations_with_replies();
    // The first conversation's next turn sends its reply back.
    let echoed = [range(1, 6), vec![100, 101, 9]].concat();
    assert_eq!(request(&mut c, &n, &echoed, &[]).cached, 8);
    // The second's next turn does not, and gets a reply of its own.
    let second = [range(20, 25), vec![26]].concat();
    assert_eq!(
        request_with(&mut c, &n, &second, &[210, 211, 212], END_SNAPSHOT).cached,
        6
    );
    request(&mut c, &n, &[30, 31], &[]);
    let dump = c.dump();
    assert!(
        dump.contains("    [100, 101] [6,8) snaps 1/1 8B\n      [9] [8,9) snaps 1/1 4B\n"),
        "{dump}"
    );
    assert!(
        dump.contains("    [200, 201] [6,8) snaps 1/1 8B generated\n"),
        "{dump}"
    );
    assert!(
        dump.contains("      [210, 211] [7,9) snaps 1/1 8B generated\n"),
        "{dump}"
    );
    // Evicting 9 bytes or more takes both generated replies, the newer one
    // too, before the first conversation's older path (least recently used
    // alone would take the old reply, then the echoed turn's [9]).
    let bytes = c.stats().paged_out_bytes;
    c.set_budget(bytes - 9);
    c.check();
    assert_eq!(c.stats().evictions, 2);
    assert_eq!(c.lookup(&echoed), 9);
    assert_eq!(c.lookup(&[range(20, 25), vec![200, 201]].concat()), 6);
    assert_eq!(c.lookup(&[second.clone(), vec![210, 211]].concat()), 7);
}

#[test]
fn a_superseded_window_is_merged_away_before_any_reply_goes() {
    // A KV layer (4 bytes a token) and a window of 4 tokens (16 bytes).
    let (mut c, n) = cache("kw", NO_LIMIT);
    request_with(&mut c, &n, &range(1, 6), &[100, 101, 102], END_SNAPSHOT);
    request_with(&mut c, &n, &range(20, 25), &[200, 201, 202], END_SNAPSHOT);
    // Pressure takes the first reply before the first conversation goes on...
    let bytes = c.stats().paged_out_bytes;
    c.set_budget(bytes - 1);
    c.check();
    assert_eq!(c.lookup(&[range(1, 6), vec![100, 101]].concat()), 6);
    c.set_budget(NO_LIMIT);
    // ...so its prompt end is left with one requested child when it does.
    let second_turn = [range(1, 6), vec![7, 8]].concat();
    assert_eq!(
        request_with(&mut c, &n, &second_turn, &[110, 111, 112], END_SNAPSHOT).cached,
        6
    );
    request(&mut c, &n, &[30, 31], &[]);
    assert_eq!(
        c.dump(),
        "root\n  [1, 2, 3, 4, 5, 6] [0,6) snaps 2/2 40B\n    [7, 8] [6,8) snaps 2/2 24B\n      \
         [110, 111] [8,10) snaps 2/2 24B generated\n  [20, 21, 22, 23, 24, 25] [0,6) snaps 2/2 40B\n    \
         [200, 201] [6,8) snaps 2/2 24B generated\n  [30, 31] [0,2) active\n"
    );
    // Its window at offset 6 is superseded by the one at 8: merging the node
    // into its child frees it without losing a path, before any reply goes.
    let bytes = c.stats().paged_out_bytes;
    c.set_budget(bytes - 1);
    c.check();
    assert_eq!(c.stats().evictions, 2);
    assert_eq!(c.stats().paged_out_bytes, bytes - 16);
    assert!(
        c.dump().starts_with(
            "root\n  [1, 2, 3, 4, 5, 6, 7, 8] [0,8) snaps 2/2 48B\n    [110, 111] [8,10) snaps 2/2 24B generated\n"
        ),
        "{}",
        c.dump()
    );
    assert_eq!(c.lookup(&[range(20, 25), vec![200, 201]].concat()), 8);
    // The third turn resumes where the second's prompt ended.
    let third_turn = [second_turn, vec![9]].concat();
    assert_eq!(request(&mut c, &n, &third_turn, &[]).cached, 8);
}

#[test]
fn leaf_eviction_merges_an_ordinary_parent_but_not_a_user_one() {
    for user in [false, true] {
        let (mut c, n) = cache("k", NO_LIMIT);
        let options = Options {
            user_snapshot: user,
            ..Options::default()
        };
        request_with(&mut c, &n, &[1, 2, 3], &[], options);
        request(&mut c, &n, &[9], &[]);
        request(&mut c, &n, &[1, 2, 3, 4, 5], &[]);
        request(&mut c, &n, &[1, 2, 3, 6, 7], &[]);
        request(&mut c, &n, &[9, 10], &[]);
        request(&mut c, &n, &[1, 2, 3, 4, 5, 8], &[]);
        request(&mut c, &n, &[9, 10, 11], &[]);
        // [6, 7] is the oldest leaf: evicting it leaves [1, 2, 3] with one child.
        let bytes = c.stats().paged_out_bytes;
        c.set_budget(bytes - 1);
        c.check();
        let dump = c.dump();
        if user {
            assert!(
                dump.starts_with("root\n  [1, 2, 3] [0,3) snaps 1/1 12B user\n    [4, 5] [3,5)"),
                "{dump}"
            );
            assert_eq!(c.stats().auto_merges, 0);
        } else {
            assert!(
                dump.starts_with("root\n  [1, 2, 3, 4, 5] [0,5) snaps 1/1 20B\n    [8] [5,6)"),
                "{dump}"
            );
            assert_eq!(c.stats().auto_merges, 1);
        }
        assert_eq!(c.stats().evictions, 1);
        assert_eq!(c.lookup(&[1, 2, 3, 6, 7]), 3);
        assert_eq!(request(&mut c, &n, &[1, 2, 3, 4, 5, 8, 0], &[]).cached, 6);
    }
}

#[test]
fn restore_failure_frees_everything_and_falls_back_to_the_root() {
    let (mut c, n) = cache("kr", NO_LIMIT);
    request(&mut c, &n, &range(1, 5), &[]);
    request(&mut c, &n, &[7, 8], &[]);
    let nodes = c.stats().nodes;
    n.set_fail_restore(true);
    let err = c.begin(&range(1, 6)).unwrap_err();
    assert!(matches!(err, CacheError::Backend(_)), "{err:?}");
    c.check();
    assert_eq!(c.offset(), 0);
    assert!(c.caches().iter().all(|l| l.offset() == 0));
    // The trie and its snapshots are kept.
    assert_eq!(c.stats().nodes, nodes);
    assert_eq!(c.stats().snapshots, n.alive());
    n.set_fail_restore(false);
    assert_eq!(request(&mut c, &n, &range(1, 6), &[]).cached, 5);
    assert_eq!(request(&mut c, &n, &[7, 8, 9], &[]).cached, 2);
}

#[test]
fn close_recovers_when_layers_disagree() {
    let (mut c, n) = cache("kk", NO_LIMIT);
    let mut s = c.begin(&[1, 2, 3]).unwrap();
    feed_all(s.caches_mut(), &[1, 2, 3]);
    // A forward pass that failed after writing the first layer only.
    s.caches_mut()[0].feed(&[4]);
    let err = s.close().unwrap_err();
    assert!(matches!(err, CacheError::InvalidState(_)), "{err:?}");
    c.check();
    assert_holds(c.caches(), &[1, 2, 3]);
    assert_eq!(request(&mut c, &n, &[1, 2, 3, 4], &[]).cached, 3);
}

#[test]
fn snapshot_rejects_caches_behind_the_active_path() {
    let (mut c, n) = cache("k", NO_LIMIT);
    request(&mut c, &n, &range(1, 6), &[]);
    let mut s = c.begin(&range(1, 8)).unwrap();
    assert_eq!(s.cached(), 6);
    for l in s.caches_mut() {
        assert!(l.restore(None, 2).unwrap());
    }
    let err = s.snapshot(true).unwrap_err();
    assert!(matches!(err, CacheError::InvalidState(_)), "{err:?}");
    // Closing accepts the rewound caches: they hold a prefix of the path.
    s.close().unwrap();
    c.check();
    assert_eq!(c.offset(), 2);
}

#[test]
fn snapshot_accounting_every_snapshot_owned_or_dropped_once() {
    let (mut c, n) = cache("krk", 200);
    let prompts: Vec<Vec<u32>> = vec![
        range(1, 12),
        vec![1, 2, 3, 4, 9, 9, 9],
        range(1, 14),
        vec![5, 5, 5],
        vec![1, 2, 3, 4, 9, 9, 8],
        vec![1, 2, 7],
        range(1, 12),
    ];
    for p in &prompts {
        request(&mut c, &n, p, &[30, 31, 32]);
        assert_eq!(n.created(), n.dropped() + c.stats().snapshots);
    }
    assert!(n.created() > 0 && c.stats().evictions > 0);
    drop(c);
    assert_eq!(n.created(), n.dropped());
}

#[test]
fn new_rejects_no_layers_and_frees_the_caches() {
    let counters = Counters::new();
    assert!(PrefixCache::<FakeKv>::new(vec![], 0).is_err());
    let mut kv = FakeKv::new(&counters);
    kv.feed(&[1, 2, 3]);
    let c = PrefixCache::new(vec![kv], 0).unwrap();
    c.check();
    assert_eq!(c.offset(), 0);
}

#[test]
fn plain_layer_type_and_box_dyn_snapshot_cache() {
    // A single concrete layer type.
    let counters = Counters::new();
    let mut c = PrefixCache::new(vec![FakeKv::new(&counters), FakeKv::new(&counters)], NO_LIMIT).unwrap();
    let out: Outcome = request(&mut c, &counters, &[1, 2, 3], &[4]);
    assert_eq!(out.cached, 0);
    // The last generated token (4) was never evaluated.
    assert_eq!(request(&mut c, &counters, &[1, 2, 3, 4, 5], &[]).cached, 3);
    // Box<dyn SnapshotCache>: the trie needs nothing more than the contract.
    let layers: Vec<Box<dyn SnapshotCache>> = vec![Box::new(FakeKv::new(&counters))];
    let mut c = PrefixCache::new(layers, NO_LIMIT).unwrap();
    let s = c.begin(&[1, 2]).unwrap();
    assert_eq!(s.remaining(), &[1, 2]);
    drop(s);
    c.check();
}

#[test]
fn clear_drops_every_snapshot_and_keeps_counters() {
    let (mut c, n) = cache("kr", NO_LIMIT);
    request(&mut c, &n, &range(1, 6), &[7]);
    request(&mut c, &n, &[1, 2, 3, 9], &[]);
    assert!(n.alive() > 0);
    c.clear();
    c.check();
    assert_eq!(n.alive(), 0);
    let s = c.stats();
    assert_eq!(
        (s.nodes, s.snapshots, s.paged_out_bytes, s.hits + s.misses),
        (1, 0, 0, 2)
    );
    assert_eq!(request(&mut c, &n, &range(1, 6), &[]).cached, 0);
}
