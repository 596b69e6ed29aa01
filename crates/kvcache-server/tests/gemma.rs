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

#[test]
fn a_prefix_store_is_refused_for_gemma_with_the_reason() {
    let Some(path) = model_file(TestModel::Gemma3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvcache-server"))
        .args(["--host", "127.0.0.1", "--port", "0", "--model"])
        .arg(&path)
        .arg("--store-dir")
        .arg(dir.path())
        .output()
        .expect("run kvcache-server");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("prefix store") && stderr.contains("gemma3"),
        "{stderr}"
    );
}
