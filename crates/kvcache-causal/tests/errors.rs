//! Every rejected call returns a typed error and leaves the whole cache state
//! (metadata, pass, mask, stored tensors) exactly as it was.

mod common;

use candle_core::{DType as CandleDType, Tensor};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, ForwardMode, KeyShift, Pos, PosRange, Result,
    SlidingWindow,
};
use kvcache_causal::CausalKvCache;

use common::{add_shift, filled, rejected};

/// A cache with two layers, sequence 0 at positions 0..4 and sequence 1 sharing its
/// first two, mid-pass.
fn cache_with(shift: Option<Box<dyn KeyShift<Tensor>>>) -> CausalKvCache {
    let config = CausalConfig::new(2, 4, 4);
    let mut cache = CausalKvCache::new(config, common::device(), shift).unwrap();
    cache
        .start_forward(&Batch::sequence(0, 0, 4).unwrap(), ForwardMode::Compute)
        .unwrap();
    for layer in 0..2 {
        cache.set_layer(layer);
        let kv = kv(&[1.0, 2.0, 3.0, 4.0]);
        cache.put(&kv, &kv).unwrap();
    }
    cache.copy_prefix(0, 1, 2).unwrap();
    cache
        .start_forward(&Batch::sequence(1, 2, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    for layer in 0..2 {
        cache.set_layer(layer);
        let kv = kv(&[5.0]);
        cache.put(&kv, &kv).unwrap();
    }
    cache.check();
    cache
}

fn kv(vals: &[f32]) -> Tensor {
    filled(vals, 2, 4, DType::F32, &common::device())
}

#[test]
fn bad_batches() {
    let mut cache = cache_with(None);
    let big = Batch::sequence(0, 10, 5).unwrap();
    rejected(
        &mut cache,
        |c| c.start_forward(&big, ForwardMode::Compute),
        |e| matches!(e, CacheError::InvalidBatch(_)),
    );
    rejected(
        &mut cache,
        |c| c.start_forward(&big, ForwardMode::Reserve),
        |e| matches!(e, CacheError::InvalidBatch(_)),
    );
    let stranger = Batch::sequence(2, 0, 1).unwrap();
    rejected(
        &mut cache,
        |c| c.start_forward(&stranger, ForwardMode::Compute),
        |e| {
            *e == CacheError::SequenceOutOfRange {
                seq: 2,
                max_sequences: 2,
            }
        },
    );
    let last = Batch::new(vec![Pos::MAX], vec![1]).unwrap();
    rejected(
        &mut cache,
        |c| c.start_forward(&last, ForwardMode::Compute),
        |e| matches!(e, CacheError::InvalidBatch(_)),
    );
    let again = Batch::from_tokens([(1, 3), (1, 1)]).unwrap();
    rejected(
        &mut cache,
        |c| c.start_forward(&again, ForwardMode::Compute),
        |e| matches!(e, CacheError::InvalidBatch(_)),
    );
    // 8 cells, 5 used: a batch of 4 does not fit.
    let full = Batch::sequence(0, 4, 4).unwrap();
    rejected(
        &mut cache,
        |c| c.start_forward(&full, ForwardMode::Compute),
        |e| {
            *e == CacheError::Full {
                cells: 8,
                used: 5,
                batch: 4,
            }
        },
    );
    assert!(CacheError::Full {
        cells: 8,
        used: 5,
        batch: 4
    }
    .to_string()
    .contains("8 cells, 5 in use"));
}

#[test]
fn bad_puts_and_gets() {
    let mut cache = cache_with(None);
    cache.set_layer(0);
    let wrong_batch = kv(&[1.0, 2.0]);
    rejected(
        &mut cache,
        |c| c.put(&wrong_batch, &wrong_batch),
        |e| matches!(e, CacheError::ShapeMismatch { what: "keys", .. }),
    );
    let heads = filled(&[1.0], 3, 4, DType::F32, &common::device());
    rejected(
        &mut cache,
        |c| c.put(&heads, &heads),
        |e| matches!(e, CacheError::ShapeMismatch { what: "keys", .. }),
    );
    let dim_v = filled(&[1.0], 2, 5, DType::F32, &common::device());
    rejected(
        &mut cache,
        |c| c.put(&kv(&[1.0]), &dim_v),
        |e| matches!(e, CacheError::ShapeMismatch { what: "values", .. }),
    );
    let rank2 = Tensor::zeros((1, 8), CandleDType::F32, &common::device()).unwrap();
    rejected(
        &mut cache,
        |c| c.put(&rank2, &rank2),
        |e| matches!(e, CacheError::ShapeMismatch { .. }),
    );
    let half = filled(&[1.0], 2, 4, DType::F16, &common::device());
    rejected(
        &mut cache,
        |c| c.put(&half, &half),
        |e| matches!(e, CacheError::DTypeMismatch { what: "keys", .. }),
    );
    // A layer that was never written has nothing to get.
    cache.set_layer(7);
    rejected(
        &mut cache,
        |c| c.get().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.get_paged().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    // After a metadata change the pass is over.
    cache.set_layer(0);
    cache.remove(1, PosRange::from(3..)).unwrap();
    rejected(
        &mut cache,
        |c| c.get().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.get_paged().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.put(&kv(&[1.0]), &kv(&[1.0])),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.set_causal(&[0]),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
}

#[test]
fn first_calls_out_of_order() {
    let mut cache = CausalKvCache::new(CausalConfig::new(1, 8, 8), common::device(), None).unwrap();
    rejected(
        &mut cache,
        |c| c.get().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.get_paged().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.put(&kv(&[1.0]), &kv(&[1.0])),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    cache
        .start_forward(&Batch::sequence(0, 0, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    rejected(
        &mut cache,
        |c| c.get().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.get_paged().map(|_| ()),
        |e| matches!(e, CacheError::InvalidState(_)),
    );
    rejected(
        &mut cache,
        |c| c.set_causal(&[1]),
        |e| matches!(e, CacheError::InvalidArgument(_)),
    );
}

#[test]
fn bad_removals_and_copies() {
    let mut cache = cache_with(Some(add_shift()));
    rejected(
        &mut cache,
        |c| c.remove(2, PosRange::from(0..)),
        |e| matches!(e, CacheError::SequenceOutOfRange { .. }),
    );
    rejected(
        &mut cache,
        |c| c.remove(0, PosRange { start: -1, end: None }),
        |e| matches!(e, CacheError::InvalidArgument(_)),
    );
    rejected(
        &mut cache,
        |c| {
            c.remove(
                0,
                PosRange {
                    start: 3,
                    end: Some(1),
                },
            )
        },
        |e| matches!(e, CacheError::InvalidArgument(_)),
    );
    // Sequence 0's positions 0 and 1 are shared with sequence 1.
    rejected(
        &mut cache,
        |c| c.remove(0, PosRange::from(0..1)),
        |e| *e == CacheError::SharedCellShift { seq: 0, pos: 1 },
    );
    rejected(
        &mut cache,
        |c| c.copy_prefix(0, 2, 1),
        |e| matches!(e, CacheError::SequenceOutOfRange { seq: 2, .. }),
    );
    rejected(
        &mut cache,
        |c| c.copy_prefix(3, 0, 1),
        |e| matches!(e, CacheError::SequenceOutOfRange { seq: 3, .. }),
    );
    rejected(
        &mut cache,
        |c| c.copy_prefix(0, 1, -2),
        |e| matches!(e, CacheError::InvalidArgument(_)),
    );
    let mut plain = cache_with(None);
    rejected(
        &mut plain,
        |c| c.remove(0, PosRange::from(2..3)),
        |e| matches!(e, CacheError::NotSupported(_)),
    );
}

#[test]
fn failing_shift_functions_change_nothing() {
    // Fails for layer 1 only: layer 0's keys, computed first, must not be written.
    let fails_on_layer_1 = |layer: usize, keys: &Tensor, shifts: &[Pos]| -> Result<Tensor> {
        if layer == 1 {
            return Err(CacheError::Backend("shift kernel failed".into()));
        }
        let deltas: Vec<f32> = shifts.iter().map(|&s| s as f32).collect();
        let d = Tensor::from_vec(deltas, (shifts.len(), 1, 1), keys.device()).unwrap();
        Ok(keys.broadcast_add(&d).unwrap())
    };
    let mut cache = cache_with(Some(Box::new(fails_on_layer_1)));
    cache.copy_prefix(1, 1, 0).unwrap();
    rejected(
        &mut cache,
        |c| c.remove(0, PosRange::from(0..1)),
        |e| matches!(e, CacheError::Backend(_)),
    );
    let wrong_shape =
        |_: usize, keys: &Tensor, _: &[Pos]| -> Result<Tensor> { Ok(keys.narrow(0, 0, 1).unwrap()) };
    let mut cache = cache_with(Some(Box::new(wrong_shape)));
    cache.copy_prefix(1, 1, 0).unwrap();
    rejected(
        &mut cache,
        |c| c.remove(0, PosRange::from(0..1)),
        |e| matches!(e, CacheError::ShapeMismatch { .. }),
    );
    // A shift returning its input unchanged (an identity shift) is accepted.
    let identity = |_: usize, keys: &Tensor, _: &[Pos]| -> Result<Tensor> { Ok(keys.clone()) };
    let mut cache = cache_with(Some(Box::new(identity)));
    cache.copy_prefix(1, 1, 0).unwrap();
    cache.remove(0, PosRange::from(0..1)).unwrap();
    cache.check();
    assert_eq!(cache.read_cell(0, cache.positions(0)[0].1).unwrap().keys[0], 2.0);
}

#[test]
fn bad_configurations_change_nothing() {
    let mut cache = cache_with(None);
    let bad = CausalConfig::new(1, 8, 8).with_window(SlidingWindow::with_memory(4, 2));
    rejected(
        &mut cache,
        |c| c.configure(bad),
        |e| matches!(e, CacheError::InvalidArgument(_)),
    );
    assert!(CausalKvCache::new(CausalConfig::new(0, 8, 8), common::device(), None).is_err());
    cache.configure(CausalConfig::new(1, 8, 8)).unwrap();
    assert_eq!(cache.used_cells(), 0);
    assert_eq!(cache.storage_bytes(), 0);
    cache.check();
}

#[test]
fn reserve_passes_leave_metadata_and_data_untouched() {
    let mut cache = cache_with(None);
    let before = cache.picture().unwrap();
    let batch = Batch::from_tokens([(0, 4), (1, 3), (0, 5)]).unwrap();
    cache.start_forward(&batch, ForwardMode::Reserve).unwrap();
    cache.set_layer(0);
    cache.put(&kv(&[9.0; 3]), &kv(&[9.0; 3])).unwrap();
    let view = cache.get().unwrap();
    assert_eq!(view.keys.dims(), &[8, 2, 4]);
    assert_eq!(view.mask.dims(), &[3, 8]);
    assert!(common::host(&view.mask).iter().all(|&v| v == f32::NEG_INFINITY));
    let after = cache.picture().unwrap();
    assert_eq!(after.cells, before.cells);
    assert_eq!(after.layers, before.layers);
    cache.check();
}

#[test]
fn clones_are_deep_and_views_alias_storage() {
    let mut cache = cache_with(None);
    let copy = cache.try_clone().unwrap();
    assert_eq!(copy.picture().unwrap(), cache.picture().unwrap());
    cache
        .start_forward(&Batch::sequence(0, 4, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    cache.set_layer(0);
    let view_before = cache.get().unwrap();
    cache.put(&kv(&[42.0]), &kv(&[42.0])).unwrap();
    // The view taken before `put` sees the new token: views alias the cache.
    let cell = cache.pass_cells()[0] as usize;
    let range = cache.pass_range().unwrap();
    let seen = common::host(&view_before.keys.narrow(0, cell - range.start, 1).unwrap());
    assert!(seen.iter().all(|&x| x == 42.0));
    // The deep copy is untouched.
    assert_ne!(copy.picture().unwrap(), cache.picture().unwrap());
    assert_eq!(copy.read_cell(0, cell).unwrap().keys[0], 0.0);
    copy.check();
}

#[test]
fn a_copy_and_its_original_never_write_into_each_others_mask() {
    let mut cache = cache_with(None);
    let mut copy = cache.try_clone().unwrap();
    let mask = |c: &CausalKvCache| common::host(&c.get().unwrap().mask);
    let (copy_mask, cache_mask) = (mask(&copy), mask(&cache));
    assert_eq!(copy_mask, cache_mask);
    // Passes of a different shape on each side rewrite their masks in place.
    cache
        .start_forward(&Batch::sequence(0, 4, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    assert_ne!(mask(&cache), cache_mask);
    assert_eq!(mask(&copy), copy_mask);
    let moved_on = mask(&cache);
    copy.start_forward(
        &Batch::from_tokens([(0, 4), (1, 3)]).unwrap(),
        ForwardMode::Compute,
    )
    .unwrap();
    assert_eq!(mask(&cache), moved_on);
    assert_eq!(mask(&copy).len(), 2 * copy.pass_range().unwrap().len());
    copy.check();
    cache.check();
}

#[test]
fn copying_into_an_existing_cache_makes_an_independent_equal_copy() {
    let source = cache_with(None);
    let mut target = CausalKvCache::new(CausalConfig::new(2, 4, 4), common::device(), None).unwrap();
    // Give the target a history of its own, with storage and a mask buffer.
    target
        .start_forward(&Batch::sequence(1, 0, 3).unwrap(), ForwardMode::Compute)
        .unwrap();
    target.set_layer(0);
    target.put(&kv(&[7.0; 3]), &kv(&[7.0; 3])).unwrap();
    target.try_clone_from(&source).unwrap();
    assert_eq!(target.picture().unwrap(), source.picture().unwrap());
    target.check();
    // Both now evolve alike, and neither sees the other's writes.
    let mut twin = source.try_clone().unwrap();
    for cache in [&mut target, &mut twin] {
        cache
            .start_forward(&Batch::sequence(0, 4, 1).unwrap(), ForwardMode::Compute)
            .unwrap();
        cache.set_layer(1);
        cache.put(&kv(&[5.0]), &kv(&[5.0])).unwrap();
    }
    assert_eq!(target.picture().unwrap(), twin.picture().unwrap());
    assert_ne!(target.picture().unwrap(), source.picture().unwrap());
    target.check();
    // A different configuration is copied too.
    let mut other = CausalKvCache::new(CausalConfig::new(1, 8, 2), common::device(), None).unwrap();
    other.try_clone_from(&source).unwrap();
    assert_eq!(other.picture().unwrap(), source.picture().unwrap());
    assert_eq!(other.config(), source.config());
}

#[test]
fn caches_can_move_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CausalKvCache>();
    send_sync::<kvcache_causal::LayerGroupCache>();
    send_sync::<kvcache_causal::RopeShift>();
}
