//! RecurrentCache on real mlx-rs CPU arrays: a state that restores only at the
//! exact end of a snapshot.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;

use kvcache_api::{CacheError, LayerCache, Snapshot, SnapshotCache};
use kvcache_mlx::layers::{KvCache, RecurrentCache, RecurrentSnapshot};
use layers_common::{data_range, error_of, f32s, overlaps, Foreign, Ids, SMALL};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;

/// A conv state `[2, 3, 4]` and an SSM state `[2, 5]` whose elements all
/// carry `tag`.
fn state(tag: f32) -> Vec<Array> {
    let conv: Vec<f32> = (0..24).map(|i| tag * 100.0 + i as f32).collect();
    let ssm: Vec<f32> = (0..10).map(|i| -tag * 100.0 - i as f32).collect();
    vec![
        Array::from_slice(&conv, &[2, 3, 4]),
        Array::from_slice(&ssm, &[2, 5]),
    ]
}

fn tag_of(state: &[Array]) -> f32 {
    let conv = f32s(&state[0]);
    let ssm = f32s(&state[1]);
    let tag = conv[0] / 100.0;
    assert_eq!(conv, f32s(&self::state(tag)[0]));
    assert_eq!(ssm, f32s(&self::state(tag)[1]));
    tag
}

fn recurrent(s: &dyn Snapshot) -> &RecurrentSnapshot {
    s.as_any().downcast_ref::<RecurrentSnapshot>().unwrap()
}

#[test]
fn advance_replaces_the_state() {
    let mut cache = RecurrentCache::new();
    assert!(cache.state().is_empty());
    cache.advance(5, state(1.0)).unwrap();
    cache.advance(1, state(2.0)).unwrap();
    assert_eq!(cache.offset(), 6);
    assert_eq!(tag_of(cache.state()), 2.0);

    let err = cache.advance(0, state(3.0)).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let err = cache.advance(1, Vec::new()).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let err = cache.advance(1, state(3.0)[..1].to_vec()).unwrap_err();
    assert!(matches!(err, CacheError::ShapeMismatch { .. }), "{err}");
    let mut wrong = state(3.0);
    wrong[1] = Array::zeros::<f32>(&[2, 6]).unwrap();
    let err = cache.advance(1, wrong).unwrap_err();
    assert!(
        matches!(err, CacheError::ShapeMismatch { what: "state", .. }),
        "{err}"
    );
    let mut wrong = state(3.0);
    wrong[0] = wrong[0].as_dtype(mlx_rs::Dtype::Float16).unwrap();
    let err = cache.advance(1, wrong).unwrap_err();
    assert!(
        matches!(err, CacheError::DTypeMismatch { what: "state", .. }),
        "{err}"
    );
    assert_eq!(cache.offset(), 6);
    assert_eq!(tag_of(cache.state()), 2.0);
}

#[test]
fn restores_only_at_the_exact_end_of_a_snapshot() {
    let mut cache = RecurrentCache::new();
    assert!(cache.restore(None, 0).unwrap());
    assert!(cache.snapshot(0).unwrap().is_none());
    cache.advance(4, state(1.0)).unwrap();
    let at4 = cache.snapshot(2).unwrap().unwrap();
    assert_eq!(at4.range(), 2..4);
    cache.advance(3, state(2.0)).unwrap();
    let at7 = cache.snapshot(4).unwrap().unwrap();
    assert!(cache.snapshot(7).unwrap().is_none());

    // No rewinding the live state, not even by one token.
    assert!(cache.restore(None, 7).unwrap());
    for target in [1, 4, 6, 8] {
        assert!(!cache.restore(None, target).unwrap(), "live rewind to {target}");
    }
    // A snapshot restores at its end and nowhere else.
    for target in [2, 3, 5] {
        assert!(
            !cache.restore(Some(&*at4), target).unwrap(),
            "snapshot [2, 4) at {target}"
        );
    }
    assert_eq!(cache.offset(), 7);
    assert_eq!(tag_of(cache.state()), 2.0);
    assert!(cache.restore(Some(&*at4), 4).unwrap());
    assert_eq!(cache.offset(), 4);
    assert_eq!(tag_of(cache.state()), 1.0);
    // Whatever the live cache holds, even forwards, or after free.
    assert!(cache.restore(Some(&*at7), 7).unwrap());
    assert_eq!(tag_of(cache.state()), 2.0);
    // Back to the initial state is always possible.
    assert!(cache.restore(None, 0).unwrap());
    assert_eq!(cache.offset(), 0);
    assert!(cache.state().is_empty());
    assert!(cache.restore(Some(&*at4), 4).unwrap());
    assert_eq!(tag_of(cache.state()), 1.0);
    // The cache continues from the restored state.
    cache.advance(1, state(3.0)).unwrap();
    assert_eq!(cache.offset(), 5);
    assert_eq!(tag_of(recurrent(&*at4).arrays()), 1.0);
}

#[test]
fn snapshots_are_compact_copies() {
    // The layer's state is a view of a larger array.
    let big = Array::from_slice(&(0..400).map(|i| i as f32).collect::<Vec<_>>(), &[2, 200]);
    let view = big.try_index((.., 10..15)).unwrap();
    let mut cache = RecurrentCache::new();
    cache.advance(3, vec![view, state(1.0)[0].clone()]).unwrap();
    let snap = cache.snapshot(0).unwrap().unwrap();
    let s = recurrent(&*snap);
    assert_eq!(s.arrays()[0].shape(), &[2, 5]);
    assert_eq!(snap.size_bytes(), (10 + 24) * 4);
    let big_range = data_range(&big);
    for copy in s.arrays() {
        assert!(!overlaps(&big_range, &data_range(copy)));
    }
    let expected: Vec<f32> = [10, 11, 12, 13, 14, 210, 211, 212, 213, 214]
        .map(|i| i as f32)
        .to_vec();
    assert_eq!(f32s(&s.arrays()[0]), expected);
}

#[test]
fn foreign_snapshots_are_invalid_arguments() {
    let mut cache = RecurrentCache::new();
    cache.advance(3, state(1.0)).unwrap();
    let mut kv = KvCache::new();
    let (k, v) = SMALL.kv(&Ids::default().next(3));
    kv.update(&k, &v).unwrap();
    let theirs = kv.snapshot(0).unwrap().unwrap();

    let err = cache.restore(Some(&*theirs), 3).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let err = cache.restore(Some(&Foreign(0..3)), 3).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let err = error_of(cache.split(theirs, 1));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    let mine = cache.snapshot(0).unwrap();
    let err = error_of(cache.merge(Some(Box::new(Foreign(0..0))), mine));
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err}");
    assert_eq!(cache.offset(), 3);
    assert_eq!(tag_of(cache.state()), 1.0);
}

#[test]
fn recurrent_cache_keeps_the_state_cache_contract() {
    kvcache_api::contract::state_cache(&layers_common::MlxRecurrent, kvcache_api::paging::Rewind::Never);
}
