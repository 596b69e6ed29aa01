//! Bounded fuzzing of causal-cache operation sequences, inside `cargo xtask test`.
//!
//! The same driver as the cargo-fuzz target `causal_ops` (`fuzz/drivers/causal.rs`):
//! arbitrary bytes become a configuration and a list of calls, valid or not, and
//! after each call the cache must not have panicked, must pass `check()`, must be
//! unchanged when the call was rejected and must have done what an accepted call
//! says. Here the bytes come from a seeded generator (`KVCACHE_FUZZ_CASES` cases,
//! 1000 by default) and from the committed corpus in `fuzz/corpus/causal_ops`. A
//! failure is shrunk to a minimal operation list before it is reported.

#[path = "../../../fuzz/drivers/causal.rs"]
mod causal;
#[path = "../../../fuzz/drivers/input.rs"]
mod input;

use candle_core::{DType, Device, Tensor};
use input::{cases, corpus, run_shrinking, Rng};
use kvcache_api::{Batch, CacheError, CausalCache, CausalConfig, ForwardMode, SlidingWindow};
use kvcache_causal::CausalKvCache;

#[test]
fn random_operation_sequences_never_panic_and_rejections_change_nothing() {
    let n = cases(1000);
    let mut rng = Rng::new(0x00CA_05A1);
    let mut total = causal::Tally::default();
    let mut ops_run = 0;
    for case in 0..n {
        let bytes = rng.bytes(700);
        let (setup, ops) = causal::decode(&bytes);
        ops_run += ops.len();
        let t = run_shrinking(&format!("generated case {case}"), &setup, &ops, causal::run);
        total.accepted += t.accepted;
        total.rejected += t.rejected;
        total.bad_batches += t.bad_batches;
    }
    eprintln!(
        "causal_ops: {n} cases, {ops_run} operations: {} accepted, {} rejected ({} malformed batches)",
        total.accepted, total.rejected, total.bad_batches
    );
    // The generator is meant to reach both outcomes often; if it stops doing so
    // the test no longer tests much.
    assert!(total.accepted > ops_run / 4, "{total:?} of {ops_run}");
    assert!(total.rejected > ops_run / 10, "{total:?} of {ops_run}");
}

#[test]
fn committed_corpus_replays_cleanly() {
    for (name, bytes) in corpus("causal_ops") {
        let (setup, ops) = causal::decode(&bytes);
        run_shrinking(&format!("corpus file {name}"), &setup, &ops, causal::run);
    }
}

/// Found by `causal_ops` (cases 0 and 19 of the generated run): invalid
/// configurations panicked in `CausalKvCache::new` instead of being rejected (it
/// sized storage before validating; fixed).
#[test]
fn invalid_configs_are_rejected_by_new_not_a_panic() {
    let configs = [
        CausalConfig::new(1, 12, 1).with_window(SlidingWindow::new(0)),
        CausalConfig::new(1, 12, 1).with_window(SlidingWindow::with_memory(0, 0)),
        CausalConfig::new(2, 6, 2).with_padding(1, 0),
    ];
    for config in configs {
        assert!(config.validate().is_err());
        let result =
            std::panic::catch_unwind(|| CausalKvCache::new(config.clone(), Device::Cpu, None).map(|_| ()));
        assert!(
            matches!(result, Ok(Err(CacheError::InvalidArgument(_)))),
            "{config:?}: {}",
            if result.is_err() {
                "panicked"
            } else {
                "not InvalidArgument"
            }
        );
    }
}

/// Found by `causal_ops`: a huge layer index panicked in `put` (`layer + 1`
/// overflowed sizing the per-layer storage; `1 << 40` would have aborted on
/// allocation). Fixed: layers past `MAX_LAYERS` are rejected.
#[test]
fn huge_layer_index_is_rejected_not_a_panic() {
    let mut cache = CausalKvCache::new(CausalConfig::new(1, 4, 1), Device::Cpu, None).unwrap();
    cache
        .start_forward(&Batch::sequence(0, 0, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    cache.set_layer(usize::MAX);
    let kv = Tensor::zeros((1, 1, 1), DType::F32, &Device::Cpu).unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cache.put(&kv, &kv)));
    assert!(
        matches!(result, Ok(Err(CacheError::InvalidArgument(_)))),
        "put on layer usize::MAX: {}",
        if result.is_err() {
            "panicked"
        } else {
            "not InvalidArgument"
        }
    );
}
