//! The engine owns how a request ends (issue 22): a request ended by a stop
//! sequence is finished, not cancelled, so its prefix stays cached for the
//! next request of its tenant (before, the next turn got 0 cached tokens).
//! And its answer (issue 33): a request's own `usage` is what the engine
//! counted for it, however it ended (before, one ended by a stop sequence
//! reported the tokens its first pass evaluated as cached).

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

/// The engine's counters in one read of `/metrics` (one snapshot): prompt
/// tokens cached, prompt tokens evaluated, tokens generated, and the
/// requests running.
async fn counters(server: &Server) -> [f64; 4] {
    let text = reqwest::get(format!("{}/metrics", server.base))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics body");
    [
        "kvcache_prompt_tokens_cached_total",
        "kvcache_prompt_tokens_evaluated_total",
        "kvcache_generated_tokens_total",
        "kvcache_sequences_active",
    ]
    .map(|name| common::metric_value(&text, name))
}

/// The counters once the engine has published the pass that ended the
/// request sent after `before` was read: the first snapshot with no request
/// running and more tokens generated (requests here run one at a time).
async fn counters_after(server: &Server, before: [f64; 4]) -> [f64; 4] {
    for _ in 0..300 {
        let now = counters(server).await;
        if now[2] > before[2] && now[3] == 0.0 {
            return now;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the engine never published the request's end");
}

/// Sends `body` and checks its `usage` against what the engine counted for
/// it: prompt tokens cached and evaluated, tokens generated. Returns the
/// answer.
async fn complete_counted(server: &Server, body: Value, finish_reason: &str) -> Value {
    let before = counters(server).await;
    let answer = complete(server, body).await;
    let after = counters_after(server, before).await;
    let [cached, evaluated, generated] = [0, 1, 2].map(|i| after[i] - before[i]);
    let usage = &answer["usage"];
    let field = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("{answer}")) as f64;
    let prompt = field(&usage["prompt_tokens"]);
    assert_eq!(answer["choices"][0]["finish_reason"], finish_reason, "{answer}");
    assert_eq!(
        field(&usage["prompt_tokens_details"]["cached_tokens"]),
        cached,
        "cached: {answer}"
    );
    assert_eq!(prompt - cached, evaluated, "evaluated: {answer}");
    assert_eq!(
        field(&usage["completion_tokens"]),
        generated,
        "generated: {answer}"
    );
    answer
}

#[tokio::test]
async fn a_requests_own_usage_is_what_the_engine_counted_however_it_ended() {
    let Some(server) = Server::start(&[]) else { return };
    let tokenizer = common::tokenizer();
    let prompt = tokenizer
        .encode("The old lighthouse keeper climbed the stairs every evening and")
        .unwrap();
    let body = |salt: &str, extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                              "cache_salt": salt});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    // The length: nothing cached yet, then the same prompt from its cells.
    let free = complete_counted(&server, body("u", json!({})), "length").await;
    assert_eq!(free["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let again = complete_counted(&server, body("u", json!({"max_tokens": 5})), "length").await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt.len() - 1
    );

    // A stop sequence from the middle of the free answer, without and with
    // a cached prefix.
    let text = free["choices"][0]["text"].as_str().unwrap();
    assert!(text.chars().count() >= 6, "{free}");
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(3).collect();
    for salt in ["fresh", "u"] {
        let stopped = complete_counted(&server, body(salt, json!({"stop": [stop]})), "stop").await;
        assert_eq!(stopped["choices"][0]["text"], text[..text.find(&stop).unwrap()]);
    }

    // A stop token: the end of turn, forced as the first token.
    let eos = tokenizer.eos_token_id();
    let ended = complete_counted(
        &server,
        body("u", json!({"logit_bias": { eos.to_string(): 100 }})),
        "stop",
    )
    .await;
    assert_eq!(ended["usage"]["completion_tokens"], 1);
    assert_eq!(ended["choices"][0]["text"], "");
}
