//! Tenants by default (issue 24, item 3): with API keys configured every
//! `/v1` request needs one (401 OpenAI-style otherwise, `/health` and
//! `/metrics` open), and each key is a namespace of its own: prefixes are
//! shared within a key, never across keys, with or without `cache_salt`.

mod common;

use common::Server;
use kvcache_testkit::models::{model_file, TestModel};
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

async fn post(server: &Server, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .json(body);
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    let response = request.send().await.expect("POST");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON body"))
}

fn cached(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

#[tokio::test]
async fn keys_are_required_and_each_key_is_its_own_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys");
    std::fs::write(&file, "# tenants\nsk-bob bob\n").unwrap();
    let Some(server) = Server::start(&["--api-key", "sk-alice", "--api-keys-file", file.to_str().unwrap()])
    else {
        return;
    };
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let body = |salt: Option<&str>| {
        let mut b = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
        if let Some(salt) = salt {
            b["cache_salt"] = json!(salt);
        }
        b
    };
    for key in [None, Some("sk-mallory"), Some("sk-alic")] {
        let (status, e) = post(&server, key, &body(None)).await;
        assert_eq!(status, 401, "{key:?}: {e}");
        assert_eq!(e["error"]["code"], "invalid_api_key", "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    }
    let models = reqwest::Client::new()
        .get(format!("{}/v1/models", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 401);
    for open in ["/health", "/metrics"] {
        let r = reqwest::get(format!("{}{open}", server.base)).await.unwrap();
        assert_eq!(r.status(), 200, "{open}");
    }
    // Alice, no salt: evaluated, then reused by Alice.
    let (status, first) = post(&server, Some("sk-alice"), &body(None)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(cached(&first), 0);
    let (_, again) = post(&server, Some("sk-alice"), &body(None)).await;
    assert!(cached(&again) > 0, "{again}");
    // Bob, no salt, same prompt: nothing of Alice's.
    let (status, bob) = post(&server, Some("sk-bob"), &body(None)).await;
    assert_eq!(status, 200, "{bob}");
    assert_eq!(cached(&bob), 0, "{bob}");
    // The same salt under two keys: two namespaces.
    let (_, a) = post(&server, Some("sk-alice"), &body(Some("team"))).await;
    assert_eq!(cached(&a), 0, "{a}");
    let (_, b) = post(&server, Some("sk-bob"), &body(Some("team"))).await;
    assert_eq!(cached(&b), 0, "{b}");
    let (_, b2) = post(&server, Some("sk-bob"), &body(Some("team"))).await;
    assert!(cached(&b2) > 0, "{b2}");
    // A bad salt is still the client's error.
    let (status, e) = post(&server, Some("sk-bob"), &body(Some("no spaces"))).await;
    assert_eq!((status, &e["error"]["param"]), (400, &json!("cache_salt")), "{e}");
}

#[tokio::test]
async fn without_keys_no_key_is_asked_for() {
    let Some(server) = Server::start(&[]) else { return };
    let (status, answer) = post(
        &server,
        None,
        &json!({"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
}

/// Runs the server binary with `args` until it exits (or 120 s pass): its
/// exit status and its stderr lines.
fn start_and_wait(args: &[&str]) -> (Option<std::process::ExitStatus>, Vec<String>) {
    use std::io::{BufRead, BufReader};
    let Some(model) = model_file(TestModel::SmolLM2) else {
        return (None, Vec::new());
    };
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvcache-server"))
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--weights",
            "f32",
            "--model",
        ])
        .arg(&model)
        .args(args)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start kvcache-server");
    let stderr = child.stderr.take().unwrap();
    let lines = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            // Child::kill sends SIGKILL to exactly this pid.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    (status, lines.join().unwrap())
}

#[test]
fn a_keys_file_without_keys_or_unreadable_is_refused_at_start() {
    if model_file(TestModel::SmolLM2).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("keys.txt");
    std::fs::write(&empty, "# all keys revoked\n\n   \n# sk-old alice\n").unwrap();
    let missing = dir.path().join("no-such-file");
    for (path, why) in [
        (empty.as_path(), "holds no key"),
        (missing.as_path(), "No such file"),
        // A directory cannot be read as a keys file.
        (dir.path(), "--api-keys-file"),
    ] {
        let (status, lines) = start_and_wait(&["--api-keys-file", path.to_str().unwrap()]);
        let status = status.expect("the server did not exit: it started without keys");
        assert!(!status.success(), "{path:?}: {status:?}");
        let errors: Vec<&String> = lines.iter().filter(|l| l.contains("ERROR")).collect();
        assert_eq!(errors.len(), 1, "{path:?}: {lines:?}");
        assert!(errors[0].contains(why), "{path:?}: {lines:?}");
    }
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let Some(server) = Server::start(&["--api-key", "sk-case"]) else {
        return;
    };
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 1});
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/completions", server.base))
            .header("authorization", format!("{scheme} sk-case"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{scheme}");
    }
    // Another scheme, or none, is still refused.
    for header in ["Basic sk-case", "sk-case", "Bearer"] {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/completions", server.base))
            .header("authorization", header)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 401, "{header}");
    }
}

#[tokio::test]
async fn a_salt_of_the_full_128_bytes_fits_under_a_key() {
    let Some(server) = Server::start(&["--api-key", "sk-one", "--api-key", "sk-two"]) else {
        return;
    };
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(4);
    let body = |salt: &str| json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt});
    let full = "s".repeat(128);
    let (status, first) = post(&server, Some("sk-one"), &body(&full)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(cached(&first), 0);
    // 95 bytes, the case, and 128 again: reused within the salt.
    let (status, mid) = post(&server, Some("sk-one"), &body(&"m".repeat(95))).await;
    assert_eq!((status, cached(&mid)), (200, 0), "{mid}");
    let (_, again) = post(&server, Some("sk-one"), &body(&full)).await;
    assert!(cached(&again) > 0, "{again}");
    // The same salt under another key: nothing shared.
    let (_, other) = post(&server, Some("sk-two"), &body(&full)).await;
    assert_eq!(cached(&other), 0, "{other}");
    // Past 128 bytes: the client's 400, as without a key.
    let (status, e) = post(&server, Some("sk-one"), &body(&"s".repeat(129))).await;
    assert_eq!((status, &e["error"]["param"]), (400, &json!("cache_salt")), "{e}");
}
