//! Every cache type can move to another thread (one owner drives it at a time).
#![cfg(any(target_os = "macos", kvcache_mlx))]

use kvcache_trie::PrefixCache;

fn assert_send<T: Send>() {}

#[test]
fn caches_are_send() {
    assert_send::<kvcache_mlx::layers::KvCache>();
    assert_send::<kvcache_mlx::layers::RotatingKvCache>();
    assert_send::<kvcache_mlx::layers::RecurrentCache>();
    assert_send::<PrefixCache<kvcache_mlx::layers::KvCache>>();
}
