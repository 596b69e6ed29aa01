//! The layer-group wrapper routes by layer and unwinds: when one group rejects a
//! call, no group changes.

mod common;

use kvcache_api::{Batch, CacheError, CausalCache, CausalConfig, ForwardMode, PosRange, SlidingWindow};
use kvcache_causal::{CausalKvCache, LayerGroupCache};

use common::{add_shift, filled, grid};

fn put_layers(cache: &mut LayerGroupCache, layers: usize, vals: &[f32]) {
    let device = common::device();
    for layer in 0..layers {
        cache.set_layer(layer);
        let kv = filled(vals, 1, 2, kvcache_api::DType::F32, &device);
        cache.put(&kv, &kv).unwrap();
    }
}

/// Gemma-3-like: layers 0 and 2 slide over 2 positions, layers 1 and 3 see everything.
fn gemma_like(global_shift: bool) -> LayerGroupCache {
    let local = CausalConfig::new(1, 16, 8).with_window(SlidingWindow::new(2));
    let global = CausalConfig::new(1, 16, 8);
    let device = common::device();
    let groups = vec![
        CausalKvCache::new(local, device.clone(), Some(add_shift())).unwrap(),
        CausalKvCache::new(global, device, global_shift.then(add_shift)).unwrap(),
    ];
    LayerGroupCache::new(groups, vec![0, 1, 0, 1]).unwrap()
}

#[test]
fn layers_see_their_group_masks() {
    let mut cache = gemma_like(true);
    cache
        .start_forward(&Batch::sequence(0, 0, 4).unwrap(), ForwardMode::Compute)
        .unwrap();
    put_layers(&mut cache, 4, &[1.0, 2.0, 3.0, 4.0]);
    cache.set_layer(2);
    assert_eq!(grid(&cache.get().unwrap().mask), ["0xxx", "00xx", "x00x", "xx00"]);
    assert!(cache.config().window.is_some());
    cache.set_layer(3);
    assert_eq!(grid(&cache.get().unwrap().mask), ["0xxx", "00xx", "000x", "0000"]);
    assert!(cache.config().window.is_none());
    cache
        .start_forward(&Batch::sequence(0, 4, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    put_layers(&mut cache, 4, &[5.0]);
    cache.set_layer(0);
    // The local group dropped positions below 3.
    assert_eq!(cache.groups()[0].used_cells(), 2);
    assert_eq!(cache.groups()[1].used_cells(), 5);
    assert_eq!(
        cache.get().unwrap().mask.dims()[1],
        cache.groups()[0].pass_range().unwrap().len()
    );
    cache.check();
    // Unmapped layers are refused.
    cache.set_layer(9);
    assert!(matches!(cache.get(), Err(CacheError::InvalidArgument(_))));
}

#[test]
fn a_group_that_rejects_a_batch_leaves_every_group_unchanged() {
    let device = common::device();
    let small = CausalConfig::new(1, 4, 4);
    let large = CausalConfig::new(1, 64, 4);
    let groups = vec![
        CausalKvCache::new(large, device.clone(), None).unwrap(),
        CausalKvCache::new(small, device, None).unwrap(),
    ];
    let mut cache = LayerGroupCache::new(groups, vec![0, 1]).unwrap();
    cache
        .start_forward(&Batch::sequence(0, 0, 3).unwrap(), ForwardMode::Compute)
        .unwrap();
    put_layers(&mut cache, 2, &[1.0, 2.0, 3.0]);
    let before = cache.picture().unwrap();
    let err = cache
        .start_forward(&Batch::sequence(0, 3, 2).unwrap(), ForwardMode::Compute)
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::Full {
            cells: 4,
            used: 3,
            batch: 2
        }
    );
    assert_eq!(cache.picture().unwrap(), before);
    cache.check();
}

#[test]
fn a_group_that_rejects_a_removal_leaves_every_group_unchanged() {
    // The global group has no shift function: a shifting removal must fail there
    // and leave the local group's keys unshifted.
    let mut cache = gemma_like(false);
    cache
        .start_forward(&Batch::sequence(0, 0, 4).unwrap(), ForwardMode::Compute)
        .unwrap();
    put_layers(&mut cache, 4, &[1.0, 2.0, 3.0, 4.0]);
    let before = cache.picture().unwrap();
    let err = cache.remove(0, PosRange::from(1..2)).unwrap_err();
    assert!(matches!(err, CacheError::NotSupported(_)));
    assert_eq!(cache.picture().unwrap(), before);
    // Open-ended removals need no shift and reach both groups.
    cache.remove(0, PosRange::from(2..)).unwrap();
    assert_eq!(cache.groups()[0].used_cells(), 2);
    assert_eq!(cache.groups()[1].used_cells(), 2);
    cache.check();
}

#[test]
fn shifting_removals_reach_every_group() {
    let mut cache = gemma_like(true);
    cache
        .start_forward(&Batch::sequence(0, 0, 4).unwrap(), ForwardMode::Compute)
        .unwrap();
    put_layers(&mut cache, 4, &[1.0, 2.0, 3.0, 4.0]);
    cache.remove(0, PosRange::from(1..2)).unwrap();
    for (g, group) in cache.groups().iter().enumerate() {
        let layer = g; // layers 0 and 1 are the first of each group
        let keys: Vec<f32> = group
            .positions(0)
            .iter()
            .map(|&(_, c)| group.read_cell(layer, c).unwrap().keys[0])
            .collect();
        assert_eq!(keys, [1.0, 2.0, 3.0], "group {g}");
        let values: Vec<f32> = group
            .positions(0)
            .iter()
            .map(|&(_, c)| group.read_cell(layer, c).unwrap().values[0])
            .collect();
        assert_eq!(values, [1.0, 3.0, 4.0], "group {g}");
    }
    cache.check();
}

#[test]
fn copy_prefix_resume_and_configuration() {
    let local = CausalConfig::new(2, 16, 8).with_window(SlidingWindow::new(2));
    let global = CausalConfig::new(2, 16, 8);
    let device = common::device();
    let groups = vec![
        CausalKvCache::new(local.clone(), device.clone(), None).unwrap(),
        CausalKvCache::new(global.clone(), device, None).unwrap(),
    ];
    let mut cache = LayerGroupCache::new(groups, vec![0, 1]).unwrap();
    cache
        .start_forward(&Batch::sequence(0, 0, 6).unwrap(), ForwardMode::Compute)
        .unwrap();
    put_layers(&mut cache, 2, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    cache.copy_prefix(0, 1, 6).unwrap();
    assert_eq!(cache.groups()[1].positions(1).len(), 6);
    // The local group keeps positions 3.. only after the next pass; resuming at 6
    // needs 5 (window 2), which both groups hold.
    assert!(cache.can_resume(1, 6));
    let before = cache.picture().unwrap();
    assert!(matches!(
        cache.copy_prefix(0, 2, 1),
        Err(CacheError::SequenceOutOfRange { .. })
    ));
    assert_eq!(cache.picture().unwrap(), before);
    assert!(matches!(
        cache.configure(global.clone()),
        Err(CacheError::NotSupported(_))
    ));
    assert!(cache.configure_groups(vec![global.clone()]).is_err());
    assert_eq!(cache.picture().unwrap(), before);
    cache.configure_groups(vec![local, global]).unwrap();
    assert_eq!(cache.groups()[1].used_cells(), 0);
    cache.check();
    assert!(LayerGroupCache::new(vec![], vec![]).is_err());
}

mod random_schedules {
    //! Random schedules on a two-group cache against one model per group: a call
    //! succeeds only when both models accept it, fails with the first group's error
    //! otherwise, and then leaves both groups unchanged.

    use kvcache_api::{Pos, SeqId};
    use proptest::prelude::*;

    use super::common::reference::{same_error, Reference};
    use super::common::{add_shift, contents, filled, sees};
    use super::*;

    #[derive(Debug, Clone)]
    enum Step {
        Batch(Vec<(usize, usize)>),
        Remove(usize, u8, Option<u8>),
        Copy(usize, usize, u8),
    }

    fn config() -> impl Strategy<Value = CausalConfig> {
        (
            4..=12usize,
            1..=5usize,
            prop::option::of(1..=4usize),
            any::<bool>(),
        )
            .prop_map(|(capacity, batch, window, contiguous)| {
                let mut c = CausalConfig::new(2, capacity, batch);
                if let Some(w) = window {
                    c = c.with_window(SlidingWindow::new(w));
                }
                if contiguous {
                    c = c.with_placement(kvcache_api::Placement::Contiguous);
                }
                c
            })
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => prop::collection::vec((0..2usize, 1..=4usize), 1..=2).prop_map(Step::Batch),
            2 => (0..2usize, any::<u8>(), prop::option::of(0..3u8)).prop_map(|(s, a, l)| Step::Remove(s, a, l)),
            1 => (0..2usize, 0..2usize, any::<u8>()).prop_map(|(s, d, l)| Step::Copy(s, d, l)),
        ]
    }

    fn run(configs: [CausalConfig; 2], steps: Vec<Step>) -> Result<(), TestCaseError> {
        let device = common::device();
        let groups = configs
            .iter()
            .map(|c| CausalKvCache::new(c.clone(), device.clone(), Some(add_shift())).unwrap())
            .collect();
        let mut cache = LayerGroupCache::new(groups, vec![0, 1]).unwrap();
        let mut models = [
            Reference::new(&configs[0], true),
            Reference::new(&configs[1], true),
        ];
        let mut val = 0.0;
        let mut stored = false;
        for step in steps {
            let before = cache.picture().unwrap();
            let expect = |apply: &dyn Fn(&mut Reference) -> Result<(), CacheError>| {
                let mut trial = models.clone();
                for m in trial.iter_mut() {
                    apply(m)?;
                }
                Ok(trial)
            };
            let (got, want, tokens) = match &step {
                Step::Batch(parts) => {
                    let mut tokens: Vec<(SeqId, Pos, f32)> = Vec::new();
                    let mut next = [models[0].next_pos(0), models[0].next_pos(1)];
                    let most = configs[0].max_batch.min(configs[1].max_batch);
                    for &(seq, n) in parts {
                        for _ in 0..n.min(most.saturating_sub(tokens.len())) {
                            val += 1.0;
                            tokens.push((seq, next[seq], val));
                            next[seq] += 1;
                        }
                    }
                    let batch = Batch::from_tokens(tokens.iter().map(|t| (t.0, t.1))).unwrap();
                    let got = cache.start_forward(&batch, ForwardMode::Compute);
                    (got, expect(&|m| m.forward(&tokens)), tokens)
                }
                Step::Remove(seq, a, len) => {
                    let start = Pos::from(*a) % (models[0].next_pos(*seq) + 2);
                    let end = len.map(|l| start + Pos::from(l));
                    let got = cache.remove(*seq, PosRange { start, end });
                    (got, expect(&|m| m.remove(*seq, start, end)), vec![])
                }
                Step::Copy(src, dst, len) => {
                    let len = Pos::from(*len) % (models[0].next_pos(*src) + 2);
                    let got = cache.copy_prefix(*src, *dst, len);
                    (got, expect(&|m| m.copy_prefix(*src, *dst, len)), vec![])
                }
            };
            match (got, want) {
                (Ok(()), Ok(trial)) => models = trial,
                (Err(e), Err(w)) => {
                    prop_assert!(same_error(&e, &w), "{step:?}: got {e:?}, expected {w:?}");
                    prop_assert!(
                        cache.picture().unwrap() == before,
                        "{step:?}: rejected but changed"
                    );
                    continue;
                }
                (got, want) => {
                    prop_assert!(false, "{step:?}: got {got:?}, model says {:?}", want.map(|_| ()))
                }
            }
            cache.check();
            if !tokens.is_empty() {
                let vals: Vec<f32> = tokens.iter().map(|t| t.2).collect();
                let pass: Vec<(SeqId, Pos)> = tokens.iter().map(|t| (t.0, t.1)).collect();
                for (layer, model) in models.iter().enumerate() {
                    cache.set_layer(layer);
                    let signed: Vec<f32> = vals.iter().map(|&v| if layer == 0 { v } else { -v }).collect();
                    let kv = filled(&signed, 1, 2, kvcache_api::DType::F32, &device);
                    cache.put(&kv, &kv).unwrap();
                    let seen = sees(&cache.groups()[layer], &pass);
                    for (i, &(seq, pos)) in pass.iter().enumerate() {
                        prop_assert_eq!(&seen[i], &model.visible(seq, pos, false, layer));
                    }
                }
                stored = true;
            }
            if stored {
                for (g, model) in models.iter().enumerate() {
                    prop_assert_eq!(contents(&cache.groups()[g], g), model.contents(g), "group {}", g);
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        #[test]
        fn groups_move_together(a in config(), b in config(), steps in prop::collection::vec(step(), 1..30)) {
            run([a, b], steps)?;
        }
    }
}
