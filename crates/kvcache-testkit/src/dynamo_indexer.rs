//! NVIDIA Dynamo's standalone KV indexer of one's own, for the tests and
//! benchmarks that prove our KV events with a router we did not write.
//!
//! `ai-dynamo-runtime`'s `python -m dynamo.indexer` (ZMQ subscribers fed by
//! vLLM-format KV events, a radix tree per model, HTTP `/query`), run by the
//! wrapper script `dynamo_indexer.py` beside this crate's manifest in the
//! Python virtual environment `cargo xtask test` prepares ([`PYTHON_ENV`]).
//! It listens on a free loopback port, subscribes to the workers' endpoints,
//! and is killed by its process id when dropped; should this process die
//! first, the script exits when its standard input closes, and after its
//! lifetime whatever happens.

use std::ffi::OsString;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The variable naming the Python with `ai-dynamo-runtime`.
pub const PYTHON_ENV: &str = "KVCACHE_DYNAMO_PYTHON";

/// The variable that makes a missing Python a failure instead of a skipped
/// test (`cargo xtask test` sets it to `1`).
pub const REQUIRE_ENV: &str = "KVCACHE_REQUIRE_DYNAMO_PYTHON";

/// The wrapper script the indexer runs under.
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/dynamo_indexer.py");

/// Why the indexer did not start or answer.
#[derive(Debug, thiserror::Error)]
pub enum IndexerError {
    /// The process could not be started, or a connection failed.
    #[error("Dynamo indexer: {0}")]
    Io(#[from] std::io::Error),
    /// It exited, did not come up, or answered something unexpected.
    #[error("Dynamo indexer: {0}")]
    Failed(String),
}

/// What the indexer answers.
pub type Result<T> = std::result::Result<T, IndexerError>;

/// For a test that needs the indexer: the Python with `ai-dynamo-runtime`
/// ([`PYTHON_ENV`]). Without one, panics if [`REQUIRE_ENV`] is `1`, else
/// prints `skipped: ...` (straight to stderr, past the harness's capture) and
/// answers `None`.
pub fn python_or_skip() -> Option<OsString> {
    let python = std::env::var_os(PYTHON_ENV).filter(|p| !p.is_empty());
    if python.is_none() {
        assert!(
            std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
            "{PYTHON_ENV} is unset and {REQUIRE_ENV}=1 (run through `cargo xtask test`)"
        );
        let name = std::thread::current().name().unwrap_or("a test").to_owned();
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {name}: {PYTHON_ENV} unset (`cargo xtask test` prepares it)"
        );
    }
    python
}

/// How to start an indexer.
#[derive(Debug, Clone)]
pub struct IndexerConfig {
    /// The Python with `ai-dynamo-runtime`.
    pub python: OsString,
    /// `(worker id, ZMQ endpoint)` of each worker to subscribe to.
    pub workers: Vec<(u64, String)>,
    /// Tokens per block, as the workers publish them.
    pub block_size: usize,
    /// The model every worker is registered under (queries name it).
    pub model: String,
    /// Where the indexer's output goes.
    pub log: PathBuf,
    /// The process exits by itself after this, whatever happens.
    pub lifetime: Duration,
}

/// A running indexer (see the [module docs](self)).
#[derive(Debug)]
pub struct DynamoIndexer {
    child: Child,
    port: u16,
    block_size: usize,
    model: String,
}

impl Drop for DynamoIndexer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl DynamoIndexer {
    /// Starts the indexer and waits (60 s at most) until it answers
    /// `/health`.
    pub fn start(config: &IndexerConfig) -> Result<DynamoIndexer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let workers: Vec<String> = config.workers.iter().map(|(id, e)| format!("{id}={e}")).collect();
        let child = Command::new(&config.python)
            .arg(SCRIPT)
            .arg(config.lifetime.as_secs().max(1).to_string())
            .args(["--port", &port.to_string()])
            .args(["--block-size", &config.block_size.to_string()])
            .args(["--threads", "1", "--model-name", &config.model])
            .args(["--workers", &workers.join(",")])
            // Closed when this process dies: the script then exits.
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&config.log)?)
            .spawn()?;
        let mut indexer = DynamoIndexer {
            child,
            port,
            block_size: config.block_size,
            model: config.model.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(indexer.request("GET", "/health", None), Ok((200, _))) {
            if let Some(status) = indexer.child.try_wait()? {
                return Err(IndexerError::Failed(format!(
                    "exited ({status}); its log: {}",
                    config.log.display()
                )));
            }
            if Instant::now() > deadline {
                return Err(IndexerError::Failed(format!(
                    "did not come up in 60 s; its log: {}",
                    config.log.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(indexer)
    }

    /// The HTTP port it listens on (loopback).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `(worker, matched blocks)` for a request's token ids (in the
    /// namespace `salt`, if any), workers with none left out, by worker id.
    /// Dynamo answers in tokens: matched blocks times the block size.
    pub fn matches(&self, tokens: &[u32], salt: Option<&str>) -> Result<Vec<(u64, usize)>> {
        let mut body = json!({"token_ids": tokens, "model_name": self.model});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let (status, answer) = self.request("POST", "/query", Some(&body))?;
        if status != 200 {
            return Err(IndexerError::Failed(format!(
                "/query answered {status}: {answer}"
            )));
        }
        let scores = answer["scores"]
            .as_object()
            .ok_or_else(|| IndexerError::Failed(format!("no scores in {answer}")))?;
        let mut found = Vec::new();
        for (worker, ranks) in scores {
            let worker: u64 = worker
                .parse()
                .map_err(|_| IndexerError::Failed(format!("worker id {worker:?} in {answer}")))?;
            let tokens = ranks["0"]
                .as_u64()
                .ok_or_else(|| IndexerError::Failed(format!("no rank 0 in {answer}")))?;
            let blocks = tokens as usize / self.block_size;
            if blocks > 0 {
                found.push((worker, blocks));
            }
        }
        found.sort_unstable();
        Ok(found)
    }

    /// Polls [`matches`](Self::matches) until it answers `expected` (events
    /// arrive asynchronously), panicking with `what` after 15 s.
    pub fn expect(&self, what: &str, tokens: &[u32], salt: Option<&str>, expected: &[(u64, usize)]) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let found = self.matches(tokens, salt).expect("the indexer's /query");
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

    /// One HTTP/1.1 request; the status and the JSON body (`null` when none).
    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Value)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
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
}
