//! Bounded fuzzing of batch construction, inside `cargo xtask test`.
//!
//! The same driver as the cargo-fuzz target `batch` (`fuzz/drivers/batch.rs`):
//! arbitrary position and sequence lists given to every `Batch` constructor must
//! be accepted exactly when they follow the documented rules, rejected with
//! `InvalidBatch` otherwise, and read back unchanged. Bytes come from a seeded
//! generator (`KVCACHE_FUZZ_CASES` cases, 2000 by default) and from the committed
//! corpus in `fuzz/corpus/batch`.

#[path = "../../../fuzz/drivers/batch.rs"]
mod batch;
#[path = "../../../fuzz/drivers/input.rs"]
mod input;

use input::{cases, corpus, run_shrinking, Rng};

#[test]
fn arbitrary_lists_build_batches_exactly_by_the_rules() {
    let n = cases(2000);
    let mut rng = Rng::new(0xBA7C);
    let mut total = batch::Tally::default();
    for case in 0..n {
        let bytes = rng.bytes(300);
        let calls = batch::decode(&bytes);
        let t = run_shrinking(&format!("generated case {case}"), &(), &calls, batch::run);
        total.accepted += t.accepted;
        total.rejected += t.rejected;
    }
    eprintln!(
        "batch: {n} cases: {} batches built, {} rejected",
        total.accepted, total.rejected
    );
    assert!(total.accepted > 0 && total.rejected > 0, "{total:?}");
}

#[test]
fn committed_corpus_replays_cleanly() {
    for (name, bytes) in corpus("batch") {
        run_shrinking(
            &format!("corpus file {name}"),
            &(),
            &batch::decode(&bytes),
            batch::run,
        );
    }
}
