//! Bounded fuzzing of prefix-trie operation sequences over fake layer caches,
//! inside `cargo xtask test`.
//!
//! The same driver as the cargo-fuzz target `trie_ops` (`fuzz/drivers/trie.rs`):
//! arbitrary bytes become layers, a budget, an optional in-memory store and
//! requests in three namespaces in which the engine behaves or misbehaves (one
//! layer fed, junk past the known tokens, a layer freed, a short evaluation,
//! snapshots at any time, sessions dropped), with restarts that keep the store.
//! After every step the trie's checker passes, every layer holds exactly what
//! its tokens give, the budget holds except for the active path, no request
//! restores what its namespace never saw, no snapshot leaks, and a rejected
//! `begin` changes nothing. Here the bytes come from a seeded generator (`KVCACHE_FUZZ_CASES` cases, 2000 by default) and from the committed
//! corpus in `fuzz/corpus/trie_ops`; failures are shrunk before they are reported.

#[path = "../../../fuzz/drivers/input.rs"]
mod input;
#[path = "../../../fuzz/drivers/trie.rs"]
mod trie;

use input::{cases, corpus, run_shrinking, Rng};

#[test]
fn random_trie_operation_sequences_keep_every_invariant() {
    let n = cases(2000);
    let mut rng = Rng::new(0x7A1E);
    let mut total = trie::Tally::default();
    let mut ops_run = 0;
    for case in 0..n {
        let bytes = rng.bytes(600);
        let (setup, ops) = trie::decode(&bytes);
        ops_run += ops.len();
        let t = run_shrinking(&format!("generated case {case}"), &setup, &ops, trie::run);
        total.requests += t.requests;
        total.rejected += t.rejected;
        total.actions += t.actions;
        total.store_hits += t.store_hits;
        total.branch_evictions += t.branch_evictions;
    }
    eprintln!(
        "trie_ops: {n} cases, {ops_run} operations: {} requests, {} engine actions, {} rejected calls, \
         {} store restores, {} branch points evicted",
        total.requests, total.actions, total.rejected, total.store_hits, total.branch_evictions
    );
    assert!(total.requests > ops_run / 2, "{total:?} of {ops_run}");
    assert!(total.rejected > 0, "{total:?}");
    assert!(total.store_hits > 0, "no case restored from the store: {total:?}");
}

#[test]
fn committed_corpus_replays_cleanly() {
    for (name, bytes) in corpus("trie_ops") {
        let (setup, ops) = trie::decode(&bytes);
        run_shrinking(&format!("corpus file {name}"), &setup, &ops, trie::run);
    }
}
