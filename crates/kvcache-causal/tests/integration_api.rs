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
