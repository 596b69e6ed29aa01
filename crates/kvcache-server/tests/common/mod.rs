//! Starting the server binary for a test: on loopback, on a free port, on the
//! real model; stopped by pid when the handle drops.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use kvcache_testkit::models::{model_file, TestModel};

/// The tokenizer of the model the test servers run (SmolLM2's, from its file).
pub fn tokenizer() -> kvcache_models::tokenizer::ChatTokenizer {
    let path = kvcache_models::paths::model_path().expect("model");
    kvcache_models::ModelFile::open(path)
        .unwrap()
        .tokenizer()
        .unwrap()
}

/// A running `kvcache-server` process.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

/// `args` after `--weights f32` (see [`Server::start`]).
fn with_f32<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["--weights", "f32"];
    all.extend_from_slice(args);
    all
}

impl Server {
    /// Starts the server on the test model (SmolLM2) with `args` added, its
    /// weights in f32; `None` (with a printed reason) when there is no model.
    ///
    /// f32 because these tests compare answers text for text across batching
    /// and prefix reuse (the load test against each request alone, logprobs
    /// against the plain answer), which f32 keeps exactly. In the quantized
    /// modes a row's products are the same in any batch, but attention over a
    /// reused prefix sums in another order, and in a near-tie one 8-bit
    /// rounding of an activation can flip a token; the models' tests bound
    /// that (`kvcache-models/tests/equivalence_tiny.rs`). The Gemma tests run
    /// the server's default mode.
    pub fn start(args: &[&str]) -> Option<Server> {
        let model = model_file(TestModel::SmolLM2)?;
        Some(Self::spawn(&model, &with_f32(args), None))
    }

    /// Starts the server on Gemma 3 270M (`$KVCACHE_GEMMA`) with `args`
    /// added; `None` (with a printed reason) when there is no Gemma file.
    pub fn start_gemma(args: &[&str]) -> Option<Server> {
        let model = model_file(TestModel::Gemma3)?;
        Some(Self::spawn(&model, args, None))
    }

    /// [`Server::start`], keeping every line the server writes to stderr
    /// (its log) in the returned list as well as passing it on.
    pub fn start_logged(args: &[&str]) -> Option<(Server, Arc<Mutex<Vec<String>>>)> {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let model = model_file(TestModel::SmolLM2)?;
        Some((Self::spawn(&model, &with_f32(args), Some(lines.clone())), lines))
    }

    fn spawn(model: &std::path::Path, args: &[&str], log: Option<Arc<Mutex<Vec<String>>>>) -> Server {
        // A context of 1024 unless the test sets its own.
        let context: &[&str] = if args.contains(&"--context") {
            &[]
        } else {
            &["--context", "1024"]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvcache-server"))
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(context)
            .arg("--model")
            .arg(model)
            .args(args)
            // Access lines only where the test reads them; warnings always.
            .env("RUST_LOG", if log.is_some() { "info" } else { "warn" })
            .stdout(Stdio::piped())
            .stderr(if log.is_some() {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("start kvcache-server");
        if let (Some(log), Some(stderr)) = (log, child.stderr.take()) {
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    eprintln!("{line}");
                    log.lock().unwrap().push(line);
                }
            });
        }
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(url) = line.strip_prefix("kvcache-server: listening on ") {
                    let _ = tx.send(url.to_string());
                }
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(base) => base,
            Err(_) => {
                let _ = child.kill();
                panic!("kvcache-server did not print its address");
            }
        };
        Server { child, base }
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `base` + `/v1`, for OpenAI clients.
    pub fn api_base(&self) -> String {
        format!("{}/v1", self.base)
    }

    /// The server's resident memory in KiB (`VmRSS` of /proc/PID/status).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    /// Sends SIGTERM to the server's pid (`kill -TERM PID`) and waits up to
    /// `within` for it to exit; its exit status, `None` if it did not.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM failed");
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The value of metric `name` in `GET /metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.base))
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics body");
        metric_value(&text, name)
    }

    /// Waits until metric `name` equals `want` (the engine thread publishes
    /// after its next pass); panics after 30 s.
    pub async fn wait_metric(&self, name: &str, want: f64) {
        for _ in 0..300 {
            if self.metric(name).await == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{name} never reached {want}: {}", self.metric(name).await);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Child::kill sends SIGKILL to exactly this pid.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of the unlabelled metric `name` in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// One HTTP/1.1 answer read off a raw socket: its status, its head (status
/// line and headers, lower-cased) and its body (`content-length` bytes; an
/// answer without one is read to the end of the connection).
pub fn read_response(stream: &mut std::net::TcpStream) -> std::io::Result<(u16, String, Vec<u8>)> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("closed after {:?}", String::from_utf8_lossy(&buf)),
            ));
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    let mut body = Vec::new();
    match length {
        Some(n) => {
            body.resize(n, 0);
            stream.read_exact(&mut body)?;
        }
        None => {
            stream.read_to_end(&mut body)?;
        }
    }
    Ok((status, head, body))
}

/// Whether the server closed `stream` (end of file or reset) within
/// `within`, reading and dropping whatever it sends first; how long it took.
pub fn closed_within(stream: &mut std::net::TcpStream, within: Duration) -> Option<Duration> {
    use std::io::Read;
    let start = std::time::Instant::now();
    let mut sink = [0u8; 1024];
    while start.elapsed() < within {
        let left = within
            .saturating_sub(start.elapsed())
            .max(Duration::from_millis(1));
        stream.set_read_timeout(Some(left)).ok()?;
        match stream.read(&mut sink) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None
            }
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

/// The JSON access lines (target `kvcache_server::access`) in `log`.
pub fn access_lines(log: &Mutex<Vec<String>>) -> Vec<serde_json::Value> {
    log.lock()
        .unwrap()
        .iter()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|v| v["target"] == "kvcache_server::access")
        .collect()
}

/// POSTs `body` as JSON to `path` of `server`: the status and the JSON answer.
pub async fn post(server: &Server, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", server.base))
        .json(body)
        .send()
        .await
        .expect("POST");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON body"))
}

/// A greedy chat request to SmolLM2 asking `question`, at most `max_tokens`
/// tokens, with the fields of `extra` added (or replacing the defaults).
pub fn chat_body(question: &str, max_tokens: u32, extra: serde_json::Value) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    });
    body.as_object_mut()
        .expect("an object")
        .extend(extra.as_object().expect("extra fields as an object").clone());
    body
}
