//! Gemma 3 served (issue 22): `--model` a Gemma 3 file serves it with
//! continuous batching over its layer-group cache (window layers keeping
//! `--window-memory` positions, global layers everything), Gemma's chat
//! template (a system message opens the first user turn), greedy answers
//! equal to the engine's own run of the same prompt, and a conversation's
//! next turn reusing the cached history (`cached_tokens`).

mod common;

use candle_core::Device;
use common::Server;
use kvcache_api::CausalConfig;
use kvcache_engine::engine::{Engine, EngineConfig, Event, Request};
use kvcache_models::gemma::GemmaFile;
use kvcache_models::tokenizer::{Message, Role};
use kvcache_models::{Tokenizer, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};
use serde_json::{json, Value};

const MODEL: &str = "gemma-3-270m";
const SYSTEM: &str = "You are a terse assistant. Answer in one short sentence.";

async fn chat(server: &Server, messages: &Value, max_tokens: usize) -> Value {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 200);
    response.json().await.expect("JSON body")
}

/// The tokens the engine generates for `prompt` alone, as the server's engine
/// is configured (batch 256, prefill chunks of 128, the same cache shape),
/// and whether the last one ends the turn.
fn engine_answer(prompt: &[u32], max_tokens: usize) -> (Vec<u32>, String) {
    let path = model_file(TestModel::Gemma3).expect("Gemma file");
    let file = GemmaFile::open(&path).unwrap();
    let tokenizer = file.tokenizer().unwrap();
    let model = file.load(&Device::Cpu, WeightMode::F32, &mut |_| {}).unwrap();
    let cache = model
        .new_cache(&CausalConfig::new(16, 1024, 256), 1024, &Device::Cpu)
        .unwrap();
    let mut engine = Engine::new(
        &model,
        cache,
        EngineConfig {
            max_batch: 256,
            prefill_chunk: 128,
            context: Some(1024),
            keep: 4,
            stop_tokens: tokenizer.end_of_turn_ids(),
            block_tokens: None,
        },
    )
    .unwrap();
    engine
        .submit(Request::new(0, prompt.to_vec(), max_tokens))
        .unwrap();
    let mut generated = Vec::new();
    engine
        .run(&mut |event| {
            if let Event::Finished(f) = event {
                generated = f.generated.clone();
            }
        })
        .unwrap();
    let mut shown = generated.clone();
    if shown.last() == Some(&tokenizer.end_of_turn_id()) {
        shown.pop();
    }
    let text = Tokenizer::decode_text(&tokenizer, &shown).unwrap();
    (generated, text)
}

#[tokio::test]
async fn gemma_is_served_with_its_template_and_reuses_a_conversation() {
    let Some(server) = Server::start_gemma(&[]) else {
        return;
    };
    let models: Value = reqwest::get(format!("{}/v1/models", server.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], MODEL, "{models}");

    let first = json!([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What colour is the sky on a clear day?"},
    ]);
    let answer = chat(&server, &first, 12).await;
    let content = answer["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize;

    // The template: the system text opens the first user turn.
    let path = model_file(TestModel::Gemma3).unwrap();
    let tokenizer = GemmaFile::open(&path).unwrap().tokenizer().unwrap();
    let prompt = tokenizer
        .chat_ids(
            &[
                Message::new(Role::System, SYSTEM),
                Message::new(Role::User, "What colour is the sky on a clear day?"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(prompt_tokens, prompt.len());
    let text = Tokenizer::decode(&tokenizer, &prompt).unwrap();
    assert!(
        text.contains(&format!("<start_of_turn>user\n{SYSTEM}\n\nWhat colour")),
        "{text:?}"
    );
    assert!(text.ends_with("<start_of_turn>model\n"), "{text:?}");

    // The server's greedy answer is the engine's own for the same prompt.
    let (generated, want) = engine_answer(&prompt, 12);
    assert_eq!(content, want, "generated {generated:?}");
    assert!(
        !content.contains("<end_of_turn>") && !content.is_empty(),
        "{content:?}"
    );
    let finish = answer["choices"][0]["finish_reason"].as_str().unwrap();
    let ended = generated.last() == Some(&tokenizer.end_of_turn_id());
    assert_eq!(finish, if ended { "stop" } else { "length" });

    // The next turn starts from the cached history.
    let second = json!([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What colour is the sky on a clear day?"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": "And at sunset?"},
    ]);
    let answer = chat(&server, &second, 4).await;
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    let total = answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(
        cached >= prompt_tokens,
        "cached {cached} of {total}, first prompt {prompt_tokens}"
    );
    assert!(cached < total);
    assert!(server.metric("kvcache_cache_bytes_in_use").await > 0.0);
    assert!(server.metric("kvcache_cells_in_use").await > 0.0);
}

/// A conversation whose history runs past Gemma's window of 512 (a
/// system prompt of about 700 tokens), its first turn and the next turn's
/// messages after `answer`.
fn long_conversation(answer: Option<&str>) -> Value {
    let system = "You are the careful archivist of a large library of old maps. ".repeat(60);
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Which shelf holds the atlases?"}),
    ];
    if let Some(answer) = answer {
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": "And the maps of rivers?"}));
    }
    Value::Array(messages)
}

fn usage(response: &Value) -> (u64, u64) {
    let usage = &response["usage"];
    (
        usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens"),
    )
}

fn content(response: &Value) -> String {
    response["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_owned()
}

/// Waits until every write `server` submitted to its store is done.
async fn writes_done(server: &Server) {
    let submitted = server.metric("kvcache_store_writes_submitted_total").await;
    assert!(submitted > 0.0, "the store was written");
    server
        .wait_metric("kvcache_store_writes_done_total", submitted)
        .await;
    assert_eq!(server.metric("kvcache_store_writes_dropped_total").await, 0.0);
    assert_eq!(server.metric("kvcache_store_writes_rejected_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gemma_server_continues_past_its_window_from_the_disk_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    // f32 weights: a prefix restored or computed gives the same answer.
    let args = ["--weights", "f32", "--store-dir", store];
    let Some(first) = Server::start_gemma(&args) else {
        return;
    };
    let turn1 = chat(&first, &long_conversation(None), 8).await;
    let (prompt1, cached1) = usage(&turn1);
    assert!(prompt1 > 600, "{prompt1} tokens: past the window");
    assert_eq!(cached1, 0);
    let second = long_conversation(Some(&content(&turn1)));
    let turn2 = chat(&first, &second, 8).await;
    let (prompt2, cached2) = usage(&turn2);
    assert!(cached2 >= prompt1, "memory gave the first turn back");
    // Stopped at once (SIGTERM): a server shutting down writes what its
    // requests queued for the store before it exits.
    assert_eq!(first.metric("kvcache_store_writes_dropped_total").await, 0.0);
    let mut first = first;
    let status = first.terminate(std::time::Duration::from_secs(60));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");

    let Some(restarted) = Server::start_gemma(&args) else {
        return;
    };
    let again = chat(&restarted, &second, 8).await;
    let (again_prompt, again_cached) = usage(&again);
    assert_eq!(again_prompt, prompt2);
    // Both parts restored the conversation: the global layers from 0, the
    // window layers the window before where it resumes.
    assert!(
        again_cached >= prompt1 && again_cached < prompt2,
        "cached {again_cached} of {prompt2} (the first turn's prompt {prompt1})"
    );
    assert_eq!(content(&again), content(&turn2), "the same greedy answer");
    assert_eq!(restarted.metric("kvcache_store_restores_total").await, 1.0);
    assert_eq!(
        restarted.metric("kvcache_store_restored_tokens_total").await,
        again_cached as f64
    );
    assert!(restarted.metric("kvcache_store_hits_total{tier=\"disk\"}").await >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gemma_replicas_share_a_conversation_through_redis() {
    use kvcache_testkit::redis_server::{self, RedisServer};
    if !redis_server::available_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start(dir.path(), 256 << 20).unwrap();
    let url = redis.url();
    let args = ["--weights", "f32", "--redis", url.as_str()];
    let (Some(a), Some(b)) = (Server::start_gemma(&args), Server::start_gemma(&args)) else {
        return;
    };
    let turn1 = chat(&a, &long_conversation(None), 8).await;
    let (prompt1, _) = usage(&turn1);
    writes_done(&a).await;
    // The next turn goes to the other replica, which has never seen it.
    let second = long_conversation(Some(&content(&turn1)));
    let on_b = chat(&b, &second, 8).await;
    let (prompt2, cached_b) = usage(&on_b);
    assert!(
        cached_b >= prompt1 && cached_b < prompt2,
        "cached {cached_b} of {prompt2} (the first turn's prompt {prompt1})"
    );
    assert!(b.metric("kvcache_store_hits_total{tier=\"redis\"}").await >= 2.0);
    // The replica that held it in memory answers alike.
    let on_a = chat(&a, &second, 8).await;
    assert_eq!(content(&on_b), content(&on_a));
}
