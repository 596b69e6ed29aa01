//! Conversations that outlive the server: a server with `--store-dir` writes
//! each evaluated prompt to the disk store; a new server process over the same
//! directory continues the conversation from it, reports the imported prefix
//! as `cached_tokens`, answers as the first server did, and counts the hit per
//! tier in `/metrics`.

mod common;

use common::Server;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

async fn complete(server: &Server, messages: &Value) -> Value {
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0});
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&body)
        .send()
        .await
        .expect("POST /v1/chat/completions");
    assert_eq!(response.status(), 200);
    response.json().await.expect("JSON body")
}

fn usage(response: &Value) -> (u64, u64) {
    let usage = &response["usage"];
    (
        usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("usage.prompt_tokens_details.cached_tokens"),
    )
}

fn text(response: &Value) -> String {
    response["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_continues_the_conversation_from_the_disk_store() {
    let dir = tempfile::tempdir().expect("temporary store directory");
    let store = dir.path().to_str().expect("UTF-8 path");
    let system = "You are a careful assistant for a library. ".repeat(8);
    let mut messages = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "Which shelf holds the atlases?"}
    ]);

    let Some(first) = Server::start(&["--store-dir", store]) else {
        return;
    };
    let turn1 = complete(&first, &messages).await;
    let (prompt1, cached1) = usage(&turn1);
    assert_eq!(cached1, 0, "an empty store holds nothing");
    let turns = messages.as_array_mut().expect("messages");
    turns.push(json!({"role": "assistant", "content": text(&turn1)}));
    turns.push(json!({"role": "user", "content": "And the maps of rivers?"}));
    let turn2 = complete(&first, &messages).await;
    let (prompt2, _) = usage(&turn2);
    assert!(prompt2 > prompt1 + 5);
    // Every write the engine submitted was queued: none dropped or refused.
    // Two per turn: the prompt once its first token is chosen, then the
    // generated part when the request ends (blocks the cache keeps are in the
    // store too). The writer stores them in the background: wait for it.
    assert_eq!(first.metric("kvcache_store_writes_submitted_total").await, 4.0);
    first.wait_metric("kvcache_store_writes_done_total", 4.0).await;
    assert!(
        first.metric("kvcache_store_puts_total{tier=\"disk\"}").await >= 4.0,
        "both turns reach the disk tier"
    );
    assert_eq!(first.metric("kvcache_store_hits_total{tier=\"disk\"}").await, 0.0);
    assert_eq!(first.metric("kvcache_store_writes_dropped_total").await, 0.0);
    assert_eq!(first.metric("kvcache_store_writes_rejected_total").await, 0.0);
    drop(first); // killed by pid: only what the disk holds survives

    let Some(second) = Server::start(&["--store-dir", store]) else {
        return;
    };
    let again = complete(&second, &messages).await;
    // The store holds the first turn's prompt and answer (as the model gave
    // it) and the second turn's prompt: what comes back is the first turn
    // with the part of its answer the second prompt repeats (the second
    // prompt's own entry ends at its last token, which is always evaluated).
    let (again_prompt, again_cached) = usage(&again);
    assert_eq!(again_prompt, prompt2);
    assert!(
        prompt1 < again_cached && again_cached < prompt2,
        "cached {again_cached}: more than the first turn's prompt ({prompt1}), less than the second's ({prompt2})"
    );
    assert_eq!(
        text(&again),
        text(&turn2),
        "greedy answers equal with and without the store"
    );
    assert!(second.metric("kvcache_store_hits_total{tier=\"disk\"}").await >= 1.0);
    // A fresh server: everything cached came from the store, in one restore.
    assert_eq!(second.metric("kvcache_store_restores_total").await, 1.0);
    assert_eq!(
        second.metric("kvcache_store_restored_tokens_total").await,
        again_cached as f64
    );
    assert!(second.metric("kvcache_store_restore_seconds_total").await > 0.0);
    assert_eq!(
        second.metric("kvcache_prompt_tokens_evaluated_total").await,
        (prompt2 - again_cached) as f64
    );
}
