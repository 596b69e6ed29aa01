//! Our events read by a router we did not write: NVIDIA Dynamo's standalone
//! KV indexer (`ai-dynamo-runtime` from PyPI, `python -m dynamo.indexer`: the
//! ZMQ listener and radix tree of Dynamo's KV router, without etcd or NATS),
//! in the virtual environment `cargo xtask test` prepares (its interpreter in
//! `KVCACHE_DYNAMO_PYTHON`). Outside xtask, without it, the test says it is
//! skipped; under xtask (`KVCACHE_REQUIRE_DYNAMO_PYTHON=1`) a missing one fails.
//!
//! Two replicas ("workers" 1 and 2) publish on two ports; the indexer
//! subscribes to both, and its `/query` for a request's token ids must name
//! the worker that holds the conversation with the right number of blocks,
//! drop blocks that were removed, forget a restarted worker's blocks, and keep
//! a tenant's blocks (cache salt) apart from everyone else's. A prefix trie
//! (`kvcache-trie`, over fake layers) publishing its own blocks is followed
//! the same way, through turns, evictions and a clear.

use std::time::{Duration, Instant};

use std::sync::Arc;

use kvcache_api::events::{block_hash, KvEvent, KvEventSink, Medium};
use kvcache_api::{CacheError, Fingerprint, Namespace};
use kvcache_events::{ZmqPublisher, ZmqPublisherConfig};
use kvcache_testkit::dynamo_indexer::{python_or_skip, DynamoIndexer, IndexerConfig};
use kvcache_trie::fake::{feed_all, Counters, FakeKv};
use kvcache_trie::PrefixCache;
use sha2::{Digest, Sha256};

const BLOCK: usize = 4;
const MODEL: &str = "kvcache-test-model";
/// The indexer process ends by itself after this, whatever happens here.
const LIFETIME_S: u64 = 120;

/// An indexer with `workers` as `(worker id, endpoint)`.
fn indexer(python: std::ffi::OsString, workers: &[(u64, &str)]) -> DynamoIndexer {
    let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "dynamo-indexer-{}-{}.log",
        std::process::id(),
        workers[0].1.rsplit(':').next().unwrap_or("")
    ));
    eprintln!("the Dynamo indexer's log: {}", log.display());
    DynamoIndexer::start(&IndexerConfig {
        python,
        workers: workers.iter().map(|&(id, e)| (id, e.to_string())).collect(),
        block_size: BLOCK,
        model: MODEL.into(),
        log,
        lifetime: Duration::from_secs(LIFETIME_S),
    })
    .expect("start the Dynamo indexer")
}

/// A replica's block chain as the causal cache keys it: SHA-256 over the
/// parent key, the model, the namespace and the block's tokens.
struct Chain {
    namespace: Namespace,
    keys: Vec<[u8; 32]>,
}

impl Chain {
    fn new(namespace: Namespace) -> Chain {
        Chain {
            namespace,
            keys: Vec::new(),
        }
    }

    /// The `BlockStored` event for the next whole blocks of `tokens`.
    fn store(&mut self, tokens: &[u32]) -> KvEvent {
        assert_eq!(tokens.len() % BLOCK, 0);
        let parent = self.keys.last().map(block_hash);
        let mut hashes = Vec::new();
        for block in tokens.chunks(BLOCK) {
            let mut digest = Sha256::new();
            digest.update(self.keys.last().unwrap_or(&[0; 32]));
            digest.update(MODEL.as_bytes());
            digest.update(self.namespace.as_str().as_bytes());
            for token in block {
                digest.update(token.to_le_bytes());
            }
            let key: [u8; 32] = digest.finalize().into();
            hashes.push(block_hash(&key));
            self.keys.push(key);
        }
        KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: BLOCK,
            medium: Medium::Device,
            namespace: self.namespace.clone(),
        }
    }

    /// The `BlockRemoved` event for the chain's last `n` blocks.
    fn evict_last(&mut self, n: usize) -> KvEvent {
        let keys = self.keys.split_off(self.keys.len() - n);
        KvEvent::BlockRemoved {
            block_hashes: keys.iter().map(block_hash).collect(),
            medium: Medium::Device,
        }
    }
}

fn publisher(endpoint: &str) -> ZmqPublisher {
    let mut config = ZmqPublisherConfig::new(endpoint);
    // Hold AllBlocksCleared until the indexer's subscriber is in.
    config.startup_wait = Duration::from_secs(30);
    ZmqPublisher::bind(config).unwrap()
}

/// Waits until the publisher's first batch (AllBlocksCleared) went out, which
/// it does once the indexer has subscribed.
fn wait_subscribed(publisher: &ZmqPublisher) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while publisher.sent() == 0 {
        assert!(
            Instant::now() < deadline,
            "the indexer never subscribed to {}",
            publisher.endpoint()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// Token ids of two chat conversations (SmolLM2's ChatML ids around made-up
// text): 16 tokens of A's first turns, 8 of B's.
const A: [u32; 20] = [
    1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198, 19556, 17, 2, 198, 1, 520,
];
const B: [u32; 12] = [1, 9690, 198, 2683, 359, 253, 1935, 314, 2, 198, 1, 4093];

#[test]
fn dynamos_kv_indexer_routes_by_our_events() {
    let Some(python) = python_or_skip() else { return };
    let worker1 = publisher("tcp://127.0.0.1:0");
    let worker2 = publisher("tcp://127.0.0.1:0");
    let endpoint1 = worker1.endpoint().to_string();
    let indexer = indexer(python, &[(1, &endpoint1), (2, worker2.endpoint())]);
    wait_subscribed(&worker1);
    wait_subscribed(&worker2);

    // Worker 1 served conversation A: its first turn (2 blocks), then the
    // second turn's 2 more, chained on the first.
    let mut a1 = Chain::new(Namespace::shared());
    worker1.publish(vec![a1.store(&A[..8])]);
    worker1.publish(vec![a1.store(&A[8..16])]);
    // Worker 2 served B, which shares A's first block (the same system turn).
    let mut b2 = Chain::new(Namespace::shared());
    worker2.publish(vec![b2.store(&B[..8])]);

    // A's next turn: worker 1 holds all 4 blocks, worker 2 the shared first one.
    indexer.expect("A's next turn", &A, None, &[(1, 4), (2, 1)]);
    // B's next turn: only worker 2, both blocks; worker 1 shares the first.
    indexer.expect("B's next turn", &B, None, &[(1, 1), (2, 2)]);

    // Worker 1 evicts A's last two blocks.
    worker1.publish(vec![a1.evict_last(2)]);
    indexer.expect("A after eviction", &A, None, &[(1, 2), (2, 1)]);

    // A tenant's conversation on worker 2: the same tokens as A, salted.
    let mut t2 = Chain::new(Namespace::new("tenant-x").unwrap());
    worker2.publish(vec![t2.store(&A[..12])]);
    indexer.expect("tenant-x's A", &A, Some("tenant-x"), &[(2, 3)]);
    indexer.expect(
        "A, unsalted, ignores tenant-x's blocks",
        &A,
        None,
        &[(1, 2), (2, 1)],
    );
    indexer.expect("another tenant sees nothing", &A, Some("tenant-y"), &[]);

    // Worker 1 restarts on the same port: its AllBlocksCleared (sent once the
    // indexer's subscriber has reconnected, numbered above the old run's)
    // clears what the indexer held for it.
    drop(worker1);
    let worker1 = publisher(&endpoint1);
    wait_subscribed(&worker1);
    indexer.expect("A after worker 1 restarted", &A, None, &[(2, 1)]);
    indexer.expect("B after worker 1 restarted", &B, None, &[(2, 2)]);
    // And the restarted worker's new blocks are indexed.
    let mut b1 = Chain::new(Namespace::shared());
    worker1.publish(vec![b1.store(&B[..8])]);
    indexer.expect("B served again by worker 1", &B, None, &[(1, 2), (2, 2)]);

    assert_eq!(worker1.dropped() + worker2.dropped(), 0);
    drop(indexer);
}

/// One turn on a prefix trie over fake layers: `prompt` evaluated, then
/// `reply` generated (all but its last token evaluated), the session closed.
fn turn(trie: &mut PrefixCache<FakeKv>, prompt: &[u32], reply: &[u32]) {
    let mut session = trie.begin(prompt).unwrap();
    session
        .prefill(|tokens, caches| {
            feed_all(caches, tokens);
            Ok::<(), CacheError>(())
        })
        .unwrap();
    let (last, evaluated) = reply.split_last().unwrap();
    for &token in evaluated {
        session
            .decode(token, |tokens, caches| {
                feed_all(caches, tokens);
                Ok::<(), CacheError>(())
            })
            .unwrap();
    }
    session.record(*last);
    session.close().unwrap();
    trie.check();
}

#[test]
fn dynamos_kv_indexer_follows_a_prefix_trie() {
    let Some(python) = python_or_skip() else { return };
    let worker = Arc::new(publisher("tcp://127.0.0.1:0"));
    let indexer = indexer(python, &[(1, worker.endpoint())]);
    wait_subscribed(&worker);

    let counters = Counters::new();
    let mut trie =
        PrefixCache::new(vec![FakeKv::new(&counters), FakeKv::new(&counters)], usize::MAX).unwrap();
    trie.set_event_sink(worker.clone(), BLOCK, Fingerprint([5; 32]))
        .unwrap();

    // A's first turn: its 12 prompt tokens and two of three reply tokens are
    // held, 14 tokens: 3 whole blocks.
    turn(&mut trie, &A[..12], &[7, 8, 9]);
    let a1 = [&A[..12], &[7, 8]].concat();
    assert_eq!(trie.lookup(&a1), 14);
    indexer.expect("A's first turn and reply", &a1, None, &[(1, 3)]);
    // A edited after its prompt: all 20 tokens held, 5 blocks.
    turn(&mut trie, &A, &[5]);
    indexer.expect("A whole", &A, None, &[(1, 5)]);
    indexer.expect("A's first reply still held", &a1, None, &[(1, 3)]);
    // B shares A's first 6 tokens: its first block is A's.
    turn(&mut trie, &B, &[6]);
    indexer.expect("B", &B, None, &[(1, 3)]);

    // A budget of nothing evicts every paged-out node; B's path stays live.
    trie.set_budget(0);
    trie.check();
    let held = trie.lookup(&A);
    assert!(held < 12, "A's branch was evicted: {}", trie.dump());
    indexer.expect("A after eviction", &A, None, &[(1, held / BLOCK)]);
    indexer.expect("B after eviction", &B, None, &[(1, 3)]);

    // Clearing the trie clears the router's view of it.
    trie.clear();
    indexer.expect("B after clear", &B, None, &[]);
    assert_eq!(worker.dropped(), 0);
    drop(indexer);
}
