//! The trie can move to another thread (one owner drives it at a time).

use kvcache_api::SnapshotCache;
use kvcache_trie::fake::FakeKv;
use kvcache_trie::PrefixCache;

fn assert_send<T: Send>() {}

#[test]
fn caches_are_send() {
    assert_send::<PrefixCache<FakeKv>>();
    assert_send::<PrefixCache<Box<dyn SnapshotCache>>>();
}
