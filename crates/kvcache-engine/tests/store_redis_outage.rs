//! A chat whose prefix trie shares a Redis store, on the tiny random
//! model: Redis killed in the middle of a run, the chat keeps answering (by
//! recomputing, the same tokens), counts the errors, and uses Redis again once
//! Redis is back on the same socket.
//!
//! Needs `redis-server` on `PATH`: under `cargo xtask test`
//! (`KVCACHE_REQUIRE_REDIS=1`) a missing one fails the test, elsewhere it is
//! skipped with a line saying so.

use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use kvcache_api::{DType, Fingerprint, KvLayout};
use kvcache_engine::chat::{Chat, Reuse};
use kvcache_models::{Llama, LlamaConfig};
use kvcache_store::{RedisConfig, RedisTier, StoreConfig, TieredStore};
use kvcache_testkit::redis_server::{self, RedisServer};

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| (seed * 31 + i * 7) % 64).collect()
}

#[test]
fn the_engine_answers_through_a_redis_outage_and_uses_redis_again() {
    if !redis_server::available_or_skip() {
        return;
    }
    let model = Llama::random(LlamaConfig::tiny(), 11, &Device::Cpu).unwrap();
    let c = model.config();
    let layout = KvLayout::new(c.n_layers, c.n_kv_heads, c.head_dim, DType::F32);
    let dir = std::env::temp_dir().join(format!("kvcache-outage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut redis = RedisServer::start(&dir, 64 << 20).unwrap();
    // Redis is the only tier: every restore below comes from it.
    let config = StoreConfig::new(Fingerprint([3; 32]), layout).with_block_tokens(8);
    let tier = RedisTier::new(config.context(), RedisConfig::new(redis.url())).unwrap();
    let store = Arc::new(TieredStore::new(config, vec![Box::new(tier)]).unwrap());
    let deadline = Duration::from_millis(500);
    let chat = || Chat::with_store(&model, 1 << 24, store.clone(), deadline).unwrap();
    let alone = |p: &[u32]| {
        Chat::new(&model, Reuse::None, 0)
            .unwrap()
            .generate(p, 3, None)
            .unwrap()
            .generated
    };

    let first = prompt(1, 20);
    let next = [&first[..], &prompt(2, 6)].concat();
    chat().generate(&first, 3, None).unwrap();
    store.flush();
    let turn = chat().generate(&next, 3, None).unwrap();
    assert_eq!((turn.restored, turn.tiers.clone()), (20, vec![("redis", 20)]));
    assert_eq!(turn.generated, alone(&next));

    // Outage: the chat answers every request by evaluating, and the same tokens.
    redis.kill();
    let errors_before = store.stats().tiers[0].errors;
    for seed in 3..6 {
        let p = [&first[..], &prompt(seed, 5)].concat();
        let turn = chat().generate(&p, 3, None).unwrap();
        assert_eq!((turn.restored, turn.evaluated), (0, p.len()));
        assert_eq!(turn.generated, alone(&p));
    }
    store.flush();
    assert!(
        store.stats().tiers[0].errors > errors_before,
        "{:?}",
        store.stats()
    );

    // Back (empty: the chat kept nothing): written and restored again.
    redis.restart().unwrap();
    std::thread::sleep(Duration::from_millis(300)); // past the tier's back-off after errors
    let later = prompt(7, 18);
    chat().generate(&later, 3, None).unwrap();
    store.flush();
    let again = [&later[..], &prompt(8, 4)].concat();
    let turn = chat().generate(&again, 3, None).unwrap();
    assert_eq!((turn.restored, turn.tiers.clone()), (18, vec![("redis", 18)]));
    assert_eq!(turn.generated, alone(&again));
    drop(redis);
    std::fs::remove_dir_all(&dir).unwrap();
}
