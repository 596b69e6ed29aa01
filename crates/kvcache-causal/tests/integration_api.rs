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
