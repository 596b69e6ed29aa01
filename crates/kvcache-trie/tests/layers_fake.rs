//! The fake layer caches keep the SnapshotCache contract (`kvcache_api::contract`)
//! that the real ones keep.

use kvcache_api::contract::{row_cache, state_cache, Subject};
use kvcache_api::paging::Rewind;
use kvcache_api::KvLayout;
use kvcache_trie::fake::{Counters, FakeKv, FakeLayer, FakeRecurrent, FakeWindow};

/// A fake cache kind, with the counters its snapshots count into.
struct Fake<F>(Counters, F);

impl<C: FakeLayer, F: Fn(&Counters) -> C> Subject for Fake<F> {
    type Cache = C;

    fn cache(&self) -> C {
        (self.1)(&self.0)
    }
    fn feed(&self, cache: &mut C, tokens: &[u32]) {
        cache.feed(tokens);
    }
    fn holds(&self, cache: &C, tokens: &[u32]) -> bool {
        cache.holds(tokens)
    }
    fn bytes_per_token(&self) -> usize {
        4
    }
    fn host_layout(&self) -> Option<KvLayout> {
        Some(FakeKv::layout(1))
    }
}

#[test]
fn fake_kv_keeps_the_row_cache_contract() {
    let counters = Counters::new();
    row_cache(&Fake(counters.clone(), FakeKv::new));
    assert_eq!(counters.alive(), 0, "every snapshot was dropped once");
}

#[test]
fn fake_window_keeps_the_state_cache_contract() {
    for window in [4, 16] {
        let counters = Counters::new();
        state_cache(
            &Fake(counters.clone(), move |c: &Counters| FakeWindow::new(c, window)),
            Rewind::Window(window),
        );
        assert_eq!(counters.alive(), 0);
    }
}

#[test]
fn fake_recurrent_keeps_the_state_cache_contract() {
    let counters = Counters::new();
    state_cache(&Fake(counters.clone(), FakeRecurrent::new), Rewind::Never);
    assert_eq!(counters.alive(), 0);
}
