//! Helpers an engine integrating from outside asked for: the cell count through
//! the trait, and the cells a row of the pass may see without reading the mask.

mod common;

use candle_core::Device;
use kvcache_api::{CausalCache, CausalConfig, SlidingWindow};
use kvcache_causal::{CausalKvCache, LayerGroupCache};

/// What generic engine code sees: only the trait.
fn cells_of<C: CausalCache>(cache: &C) -> usize {
    cache.num_cells()
}

#[test]
fn num_cells_through_the_trait() {
    let config = CausalConfig::new(3, 64, 8).with_window(SlidingWindow::new(4));
    let cache = CausalKvCache::new(config.clone(), Device::Cpu, None).unwrap();
    assert_eq!(cells_of(&cache), cache.num_cells());
    assert_eq!(cells_of(&cache), config.num_cells());

    let local = CausalConfig::new(1, 64, 8).with_window(SlidingWindow::new(4));
    let global = CausalConfig::new(1, 64, 8);
    let groups = vec![
        CausalKvCache::new(local.clone(), Device::Cpu, None).unwrap(),
        CausalKvCache::new(global.clone(), Device::Cpu, None).unwrap(),
    ];
    let mut cache = LayerGroupCache::new(groups, vec![0, 1]).unwrap();
    assert_ne!(local.num_cells(), global.num_cells());
    cache.set_layer(0);
    assert_eq!(cells_of(&cache), local.num_cells());
    cache.set_layer(1);
    assert_eq!(cells_of(&cache), global.num_cells());
    // A layer outside every group: the first group's, as `config` answers.
    cache.set_layer(7);
    assert_eq!(cells_of(&cache), local.num_cells());

    // Each layer's visible cells are its group's: a window of 4 hides position 0
    // from position 4 on the local layer only.
    let batch = kvcache_api::Batch::sequence(0, 0, 5).unwrap();
    cache
        .start_forward(&batch, kvcache_api::ForwardMode::Compute)
        .unwrap();
    assert!(cache.visible_cells(0).is_err(), "layer 7 has no group");
    cache.set_layer(0);
    assert_eq!(cache.visible_cells(4).unwrap(), vec![1..5]);
    cache.set_layer(1);
    assert_eq!(cache.visible_cells(4).unwrap(), vec![0..5]);
}

#[test]
fn a_closure_without_annotations_shifts_keys() {
    use kvcache_api::{Batch, ForwardMode, PosRange};
    use kvcache_causal::key_shift;
    let config = CausalConfig::new(1, 16, 8);
    let shift = key_shift(|_layer, keys, shifts| {
        let deltas: Vec<f32> = shifts.iter().map(|&s| s as f32).collect();
        candle_core::Tensor::from_vec(deltas, (shifts.len(), 1, 1), keys.device())
            .and_then(|d| keys.broadcast_add(&d))
            .map_err(kvcache_api::CacheError::backend)
    });
    let mut cache = CausalKvCache::new(config, Device::Cpu, Some(shift)).unwrap();
    cache
        .start_forward(&Batch::sequence(0, 0, 4).unwrap(), ForwardMode::Compute)
        .unwrap();
    cache.set_layer(0);
    let kv = common::filled(
        &[10.0, 11.0, 12.0, 13.0],
        1,
        2,
        kvcache_api::DType::F32,
        &Device::Cpu,
    );
    cache.put(&kv, &kv).unwrap();
    cache.remove(0, PosRange::from(1..2)).unwrap();
    // Positions 2 and 3 moved down by one: their keys went through the closure.
    let moved: Vec<f32> = cache
        .positions(0)
        .iter()
        .map(|&(_, cell)| cache.read_cell(0, cell).unwrap().keys[0])
        .collect();
    assert_eq!(moved, vec![10.0, 11.0, 12.0]);
}

/// `visible_cells` agrees with the dense mask on every row of random passes:
/// windows, chunks, padding, both placements, causality exemptions, removals and
/// copied prefixes, reserve passes.
mod visible_cells {
    use std::ops::Range;

    use candle_core::Device;
    use kvcache_api::{
        Batch, CacheError, CausalCache, CausalConfig, ForwardMode, Placement, PosRange, SlidingWindow,
    };
    use kvcache_causal::CausalKvCache;
    use proptest::prelude::*;

    /// The zero entries of one dense mask row, as maximal ranges of columns.
    fn zeros(row: &[f32]) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for (j, &v) in row.iter().enumerate() {
            if v == 0.0 {
                match out.last_mut() {
                    Some(last) if last.end == j => last.end = j + 1,
                    _ => out.push(j..j + 1),
                }
            }
        }
        out
    }

    /// Every row of the pass in progress, padding included, equals the mask's.
    fn agrees(cache: &CausalKvCache) -> Result<(), TestCaseError> {
        let pass = cache.picture().unwrap().pass.expect("a pass in progress");
        let width = pass.range.len();
        let rows = pass.mask.len().checked_div(width).unwrap_or(0);
        for row in 0..rows {
            let listed = cache.visible_cells(row).unwrap();
            prop_assert_eq!(
                &listed,
                &zeros(&pass.mask[row * width..(row + 1) * width]),
                "row {}",
                row
            );
        }
        let past = cache.visible_cells(rows.max(1)).err();
        if rows > 0 {
            prop_assert!(matches!(past, Some(CacheError::InvalidArgument(_))), "{:?}", past);
        }
        Ok(())
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// `parts` (seq, tokens) appended, optionally shuffled; `exempt` batch
        /// indices for set_causal; `reserve` makes it a reserve pass.
        Pass {
            parts: Vec<(usize, usize)>,
            reverse: bool,
            exempt: Vec<usize>,
            reserve: bool,
        },
        Remove {
            seq: usize,
            start: u8,
            len: Option<u8>,
        },
        Copy {
            src: usize,
            dst: usize,
            len: u8,
        },
    }

    fn config() -> impl Strategy<Value = CausalConfig> {
        (
            1..=3usize,
            8..=20usize,
            1..=6usize,
            prop_oneof![2 => Just(None), 1 => (1..=5usize, 0..=2usize).prop_map(Some)],
            prop_oneof![3 => Just(None), 1 => (1..=4usize).prop_map(Some)],
            any::<bool>(),
            (1..=3usize, 1..=4usize),
        )
            .prop_map(|(seqs, capacity, batch, window, chunk, contiguous, padding)| {
                let mut config = CausalConfig::new(seqs, capacity, batch)
                    .with_placement(if contiguous {
                        Placement::Contiguous
                    } else {
                        Placement::Scattered
                    })
                    .with_padding(padding.0, padding.1);
                if let Some((w, extra)) = window {
                    config = config.with_window(SlidingWindow::with_memory(w, w + extra));
                }
                if let Some(c) = chunk {
                    config = config.with_chunk_size(c);
                }
                config
            })
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (
                prop::collection::vec((0..3usize, 1..=3usize), 1..=3),
                any::<bool>(),
                prop::collection::vec(0..6usize, 0..=2),
                prop::bool::weighted(0.1),
            )
                .prop_map(|(parts, reverse, exempt, reserve)| Op::Pass { parts, reverse, exempt, reserve }),
            1 => (0..3usize, 0..8u8, prop::option::of(1..4u8))
                .prop_map(|(seq, start, len)| Op::Remove { seq, start, len }),
            1 => (0..3usize, 0..3usize, 0..8u8).prop_map(|(src, dst, len)| Op::Copy { src, dst, len }),
        ]
    }

    fn run(config: CausalConfig, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let seqs = config.max_sequences;
        let mut cache = CausalKvCache::new(config, Device::Cpu, None).unwrap();
        prop_assert!(matches!(cache.visible_cells(0), Err(CacheError::InvalidState(_))));
        for op in ops {
            match op {
                Op::Pass {
                    parts,
                    reverse,
                    exempt,
                    reserve,
                } => {
                    let mut tokens = Vec::new();
                    for (seq, n) in parts {
                        let seq = seq % seqs;
                        let next = cache.positions(seq).last().map_or(0, |&(p, _)| p + 1)
                            + tokens.iter().filter(|&&(s, _)| s == seq).count() as i32;
                        tokens.extend((0..n as i32).map(|k| (seq, next + k)));
                    }
                    if reverse {
                        tokens.reverse();
                    }
                    let Ok(batch) = Batch::from_tokens(tokens.iter().copied()) else {
                        continue;
                    };
                    let mode = if reserve {
                        ForwardMode::Reserve
                    } else {
                        ForwardMode::Compute
                    };
                    if cache.start_forward(&batch, mode).is_err() {
                        // Full or too large: free everything and go on.
                        for s in 0..seqs {
                            cache.remove(s, PosRange::from(0..)).unwrap();
                        }
                        continue;
                    }
                    agrees(&cache)?;
                    let exempt: Vec<usize> = exempt.into_iter().filter(|&i| i < tokens.len()).collect();
                    if !exempt.is_empty() && cache.set_causal(&exempt).is_ok() {
                        agrees(&cache)?;
                    }
                }
                Op::Remove { seq, start, len } => {
                    let range = match len {
                        Some(len) => PosRange::from(start as i32..(start + len) as i32),
                        None => PosRange::from(start as i32..),
                    };
                    // Without a shift function closed ranges may be refused.
                    if cache.remove(seq % seqs, range).is_ok() {
                        prop_assert!(matches!(cache.visible_cells(0), Err(CacheError::InvalidState(_))));
                    }
                }
                Op::Copy { src, dst, len } => {
                    let _ = cache.copy_prefix(src % seqs, dst % seqs, len as i32);
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]
        #[test]
        fn listed_cells_are_the_masks_zero_entries(config in config(), ops in prop::collection::vec(op(), 1..25)) {
            run(config, ops)?;
        }
    }

    #[test]
    fn padding_rows_and_reserve_passes_see_nothing() {
        let config = CausalConfig::new(1, 16, 4).with_padding(4, 1);
        let mut cache = CausalKvCache::new(config, Device::Cpu, None).unwrap();
        let batch = Batch::sequence(0, 0, 2).unwrap();
        cache.start_forward(&batch, ForwardMode::Compute).unwrap();
        assert_eq!(cache.visible_cells(1).unwrap(), vec![0..2]);
        assert_eq!(cache.visible_cells(3).unwrap(), Vec::<Range<usize>>::new());
        assert!(matches!(
            cache.visible_cells(4),
            Err(CacheError::InvalidArgument(_))
        ));
        cache.start_forward(&batch, ForwardMode::Reserve).unwrap();
        assert_eq!(cache.visible_cells(0).unwrap(), Vec::<Range<usize>>::new());
    }
}
