//! Gemma 3's per-layer forward on candle (`MixedLayer<CandleKv, CandleWindow>`
//! caches, what `kvcache_trie::PrefixCache` drives): caches that do not fit
//! are refused and left unchanged. The real model through the trie on the E5
//! trace and E5's three policies are tested with the benchmark, in
//! kvcache-bench's `tests/e5.rs`.

use candle_core::Device;
use kvcache_models::gemma::{Gemma, GemmaConfig};

#[test]
fn the_per_layer_forward_refuses_caches_that_do_not_fit() {
    let model = Gemma::random(GemmaConfig::tiny(), 3, &Device::Cpu).unwrap();
    let mut layers = model.new_layers(&Device::Cpu).unwrap();
    model.hidden_layers(&[1, 2, 3], &mut layers).unwrap();
    // Kinds swapped, too few layers, a token outside the vocabulary: errors
    // that leave every cache where it was.
    layers.reverse();
    assert!(model.hidden_layers(&[4], &mut layers).is_err());
    layers.reverse();
    assert!(model.hidden_layers(&[4], &mut layers[..1]).is_err());
    assert!(model.hidden_layers(&[64], &mut layers).is_err());
    assert!(layers.iter().all(|l| kvcache_api::SnapshotCache::offset(l) == 3));
}
