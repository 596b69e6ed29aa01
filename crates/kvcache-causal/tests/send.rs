//! Every cache type can move to another thread (one owner drives it at a time).

use kvcache_causal::{CausalKvCache, LayerGroupCache, RopeShift};

fn assert_send<T: Send>() {}

#[test]
fn caches_are_send() {
    assert_send::<CausalKvCache>();
    assert_send::<LayerGroupCache>();
    assert_send::<RopeShift>();
}
