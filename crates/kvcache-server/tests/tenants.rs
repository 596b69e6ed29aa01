//! Tenants by default (issue 24, item 3): with API keys configured every
//! `/v1` request needs one (401 OpenAI-style otherwise, `/health` and
//! `/metrics` open), and each key is a namespace of its own: prefixes are
//! shared within a key, never across keys, with or without `cache_salt`.

mod common;

use common::Server;
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
