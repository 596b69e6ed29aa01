//! Metadata does not grow with the number of forward passes.

mod common;

use kvcache_api::{Batch, CausalCache, CausalConfig, DType, ForwardMode, SlidingWindow};
use kvcache_causal::CausalKvCache;

#[test]
fn ten_thousand_sliding_window_decode_steps_keep_metadata_bounded() {
    let device = common::device();
    let config = CausalConfig::new(4, 1 << 20, 8).with_window(SlidingWindow::new(16));
    let mut cache = CausalKvCache::new(config, device.clone(), None).unwrap();
    let kv = common::filled(&[1.0; 4], 1, 2, DType::F32, &device);
    let mut after_warmup = 0;
    for step in 0..10_000 {
        let batch = Batch::from_tokens((0..4).map(|s| (s, step))).unwrap();
        cache.start_forward(&batch, ForwardMode::Compute).unwrap();
        cache.set_layer(0);
        cache.put(&kv, &kv).unwrap();
        if step == 1_000 {
            after_warmup = cache.metadata_bytes();
            cache.check();
        }
    }
    cache.check();
    assert_eq!(
        cache.metadata_bytes(),
        after_warmup,
        "metadata grew between pass 1000 and 10000"
    );
    // Memory 17 per sequence: 4 * 16 + 8 cells, each sequence holding at most 17.
    assert_eq!(cache.num_cells(), 72);
    assert!(cache.used_cells() <= 4 * 17);
}
