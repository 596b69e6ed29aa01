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
//! a tenant's blocks (cache salt) apart from everyone else's.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvcache_api::events::{block_hash, KvEvent, KvEventSink, Medium};
use kvcache_api::Namespace;
use kvcache_events::{ZmqPublisher, ZmqPublisherConfig};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const BLOCK: usize = 4;
const MODEL: &str = "kvcache-test-model";
/// The indexer process ends by itself after this, whatever happens here.
const LIFETIME_S: u32 = 120;

/// The indexer process, killed by its id when dropped.
struct Indexer {
    child: Child,
    port: u16,
}

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.1 request to the indexer; the status and the JSON body.
fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> std::io::Result<(u16, Value)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let json = response
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null);
    Ok((status, json))
}

impl Indexer {
    fn start(python: &std::ffi::OsStr, workers: &[(u32, &str)]) -> Indexer {
        let port = free_port();
        let workers: Vec<String> = workers.iter().map(|(id, e)| format!("{id}={e}")).collect();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/dynamo_indexer.py");
        let log =
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("dynamo-indexer-{port}.log"));
        eprintln!("the Dynamo indexer's log: {}", log.display());
        let child = Command::new(python)
            .arg(script)
            .arg(LIFETIME_S.to_string())
            .args(["--port", &port.to_string(), "--block-size", &BLOCK.to_string()])
            .args(["--threads", "1", "--model-name", MODEL])
            .args(["--workers", &workers.join(",")])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start the Dynamo indexer");
        let indexer = Indexer { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(http(port, "GET", "/health", None), Ok((200, _))) {
            assert!(
                Instant::now() < deadline,
                "the Dynamo indexer did not come up in 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        indexer
    }

    /// `worker id -> matched blocks` for a request's tokens (Dynamo answers in
    /// tokens: matched blocks times the block size).
    fn matches(&self, tokens: &[u32], salt: Option<&str>) -> Vec<(u64, usize)> {
        let mut body = json!({"token_ids": tokens, "model_name": MODEL});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let (status, answer) = http(self.port, "POST", "/query", Some(&body)).unwrap();
        assert_eq!(status, 200, "{answer}");
        let mut found: Vec<(u64, usize)> = answer["scores"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(worker, ranks)| {
                let tokens = ranks["0"].as_u64().unwrap() as usize;
                (worker.parse().unwrap(), tokens / BLOCK)
            })
            .filter(|&(_, blocks)| blocks > 0)
            .collect();
        found.sort();
        found
    }

    /// Polls until the matches are `expected` (events arrive asynchronously).
    fn expect(&self, what: &str, tokens: &[u32], salt: Option<&str>, expected: &[(u64, usize)]) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let found = self.matches(tokens, salt);
            if found == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: expected {expected:?}, the indexer says {found:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
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
    let Some(python) = std::env::var_os("KVCACHE_DYNAMO_PYTHON").filter(|p| !p.is_empty()) else {
        assert!(
            std::env::var("KVCACHE_REQUIRE_DYNAMO_PYTHON").as_deref() != Ok("1"),
            "KVCACHE_DYNAMO_PYTHON is unset and KVCACHE_REQUIRE_DYNAMO_PYTHON=1 (run through `cargo xtask test`)"
        );
        let _ = writeln!(
            std::io::stderr(),
            "skipped: dynamo: KVCACHE_DYNAMO_PYTHON unset (`cargo xtask test` prepares it)"
        );
        return;
    };
    let worker1 = publisher("tcp://127.0.0.1:0");
    let worker2 = publisher("tcp://127.0.0.1:0");
    let endpoint1 = worker1.endpoint().to_string();
    let indexer = Indexer::start(&python, &[(1, &endpoint1), (2, worker2.endpoint())]);
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
