//! The engine owns how a request ends (issue 22): a request ended by a stop
//! sequence is finished, not cancelled, so its prefix stays cached for the
//! next request of its tenant (before, the next turn got 0 cached tokens).

mod common;

use common::Server;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

async fn complete(server: &Server, body: Value) -> Value {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .json(&body)
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 200);
    response.json().await.expect("JSON body")
}

#[tokio::test]
async fn a_stop_sequence_ends_a_request_and_keeps_its_prefix() {
    let Some(server) = Server::start(&[]) else { return };
    let prompt = common::tokenizer()
        .encode("Once upon a time, in a small village by the sea, there lived")
        .unwrap();
    let free = complete(
        &server,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "cache_salt": "free"}),
    )
    .await;
    let text = free["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.chars().count() >= 6, "{free}");
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(3).collect();
    let expect = &text[..text.find(&stop).unwrap()];

    let stopped = complete(
        &server,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
               "stop": [stop], "cache_salt": "s"}),
    )
    .await;
    assert_eq!(stopped["choices"][0]["text"], expect);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    // The next request of the same tenant extending that prompt starts
    // from its cells; nothing was cancelled.
    let mut next = prompt.clone();
    next.extend_from_slice(&prompt[..3]);
    let again = complete(
        &server,
        json!({"model": MODEL, "prompt": next, "max_tokens": 1, "temperature": 0, "cache_salt": "s"}),
    )
    .await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    assert!(cached >= prompt.len(), "cached {cached}, prompt {}", prompt.len());
    assert_eq!(server.metric("kvcache_requests_cancelled_total").await, 0.0);
}
