//! The server through a client we did not write: the `async-openai` crate,
//! streamed and not, usage and `cached_tokens`, salts, errors; plus raw HTTP
//! for the malformed requests no client library would send.

mod common;

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::{CreateChatCompletionResponse, CreateChatCompletionStreamResponse};
use async_openai::types::completions::CreateCompletionResponse;
use async_openai::Client;
use common::Server;
use futures_util::StreamExt;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

fn client(server: &Server) -> Client<OpenAIConfig> {
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(server.api_base())
            .with_api_key("unused"),
    )
}

async fn chat(client: &Client<OpenAIConfig>, body: Value) -> CreateChatCompletionResponse {
    client.chat().create_byot(body).await.expect("chat completion")
}

/// The text and final chunk of a streamed chat; checks every chunk's shape.
async fn chat_streamed(
    client: &Client<OpenAIConfig>,
    body: Value,
) -> (String, Vec<CreateChatCompletionStreamResponse>) {
    let mut stream = client
        .chat()
        .create_stream_byot::<_, CreateChatCompletionStreamResponse>(body)
        .await
        .expect("stream");
    let (mut text, mut chunks) = (String::new(), Vec::new());
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("chunk");
        for choice in &chunk.choices {
            text.push_str(choice.delta.content.as_deref().unwrap_or(""));
        }
        chunks.push(chunk);
    }
    (text, chunks)
}

fn cached(usage: &async_openai::types::chat::CompletionUsage) -> u32 {
    usage
        .prompt_tokens_details
        .as_ref()
        .and_then(|d| d.cached_tokens)
        .expect("usage.prompt_tokens_details.cached_tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streamed_and_not_agree_and_the_next_turn_is_cached() {
    let Some(server) = Server::start(&[]) else { return };
    let client = client(&server);
    let question = json!([
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}
    ]);
    let body = json!({"model": MODEL, "messages": question, "max_tokens": 16, "temperature": 0});
    let first = chat(&client, body.clone()).await;
    let answer = first.choices[0].message.content.clone().expect("content");
    assert!(!answer.is_empty());
    let usage = first.usage.clone().expect("usage");
    assert!(usage.prompt_tokens > 20, "{usage:?}");
    assert!((1..=16).contains(&usage.completion_tokens), "{usage:?}");
    assert_eq!(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
    assert_eq!(cached(&usage), 0, "nothing cached before the first request");
    assert_eq!(first.object, "chat.completion");
    assert_eq!(first.model, MODEL);

    // The same request streamed: the same greedy text, now from the cache.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (text, chunks) = chat_streamed(&client, streamed).await;
    assert_eq!(text, answer);
    assert!(chunks.len() >= 3, "role, text, finish");
    assert_eq!(
        chunks[0].choices[0].delta.role,
        Some(async_openai::types::chat::Role::Assistant)
    );
    let finish = &chunks[chunks.len() - 2];
    assert!(finish.choices[0].finish_reason.is_some());
    let last = chunks.last().unwrap();
    assert!(last.choices.is_empty());
    let stream_usage = last.usage.clone().expect("usage chunk");
    assert_eq!(stream_usage.prompt_tokens, usage.prompt_tokens);
    assert_eq!(stream_usage.completion_tokens, usage.completion_tokens);
    assert_eq!(
        cached(&stream_usage),
        usage.prompt_tokens - 1,
        "all but the last prompt token"
    );

    // The second turn of the conversation starts from the first one's cells.
    let mut turn2 = question.as_array().unwrap().clone();
    turn2.push(json!({"role": "assistant", "content": answer}));
    turn2.push(json!({"role": "user", "content": "And of Italy?"}));
    let second = chat(
        &client,
        json!({"model": MODEL, "messages": turn2, "max_tokens": 8, "temperature": 0}),
    )
    .await;
    let usage2 = second.usage.expect("usage");
    assert!(usage2.prompt_tokens > usage.prompt_tokens + 5);
    assert!(
        cached(&usage2) >= usage.prompt_tokens,
        "turn 2 cached {} of {}, turn 1 prompt {}",
        cached(&usage2),
        usage2.prompt_tokens,
        usage.prompt_tokens
    );
    assert!(server.metric("kvcache_prefix_hits_total").await >= 2.0);
    assert!(server.metric("kvcache_time_to_first_token_seconds_count").await >= 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_take_text_or_token_ids_and_stop_sequences() {
    let Some(server) = Server::start(&[]) else { return };
    let client = client(&server);
    let prompt = "The three primary colors are";
    let by_text: CreateCompletionResponse = client
        .completions()
        .create_byot(json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}))
        .await
        .expect("completion");
    let text = by_text.choices[0].text.clone();
    let usage = by_text.usage.clone().expect("usage");
    assert_eq!(usage.completion_tokens, 12);
    assert_eq!(
        by_text.choices[0].finish_reason,
        Some(async_openai::types::chat::CompletionFinishReason::Length)
    );

    // The same prompt as token ids (what the tokenizer makes of it): the same text.
    let file = kvcache_models::ModelFile::open(kvcache_models::paths::model_path().unwrap()).unwrap();
    let ids = file.tokenizer().unwrap().encode(prompt).unwrap();
    assert_eq!(ids.len() as u32, usage.prompt_tokens);
    let mut stream = client
        .completions()
        .create_stream_byot::<_, CreateCompletionResponse>(
            json!({"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0, "stream": true}),
        )
        .await
        .expect("stream");
    let mut streamed = String::new();
    while let Some(chunk) = stream.next().await {
        streamed.push_str(&chunk.expect("chunk").choices[0].text);
    }
    assert_eq!(streamed, text);

    // A stop sequence in the middle of that text ends it right before.
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(3).collect();
    let expect = &text[..text.find(&stop).unwrap()];
    let stopped: CreateCompletionResponse = client
        .completions()
        .create_byot(
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}),
        )
        .await
        .expect("completion");
    assert_eq!(stopped.choices[0].text, expect);
    assert_eq!(
        stopped.choices[0].finish_reason,
        Some(async_openai::types::chat::CompletionFinishReason::Stop)
    );

    // Seeded sampling repeats itself.
    let sample = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 11});
    let a: CreateCompletionResponse = client.completions().create_byot(sample.clone()).await.unwrap();
    let b: CreateCompletionResponse = client.completions().create_byot(sample).await.unwrap();
    assert_eq!(a.choices[0].text, b.choices[0].text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salts_keep_tenants_apart() {
    let Some(server) = Server::start(&[]) else { return };
    let client = client(&server);
    let body = |salt: &str| {
        json!({"model": MODEL, "max_tokens": 4, "temperature": 0, "cache_salt": salt,
               "messages": [{"role": "user", "content": "Name a color."}]})
    };
    let cached_of = |r: CreateChatCompletionResponse| cached(&r.usage.expect("usage"));
    assert_eq!(cached_of(chat(&client, body("tenant-a")).await), 0);
    assert!(cached_of(chat(&client, body("tenant-a")).await) > 0);
    assert_eq!(
        cached_of(chat(&client, body("tenant-b")).await),
        0,
        "another salt shares nothing"
    );
    assert!(cached_of(chat(&client, body("tenant-b")).await) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_the_server_carries_on() {
    let Some(mut server) = Server::start(&[]) else {
        return;
    };
    let client = client(&server);
    let ok = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});

    // Through the client: an unknown model.
    let mut unknown = ok.clone();
    unknown["model"] = json!("gpt-9");
    match client
        .chat()
        .create_byot::<_, CreateChatCompletionResponse>(unknown)
        .await
    {
        Err(OpenAIError::ApiError(e)) => {
            assert_eq!(e.status_code.as_u16(), 404);
            assert_eq!(e.api_error.code.as_deref(), Some("model_not_found"));
            assert_eq!(e.api_error.param.as_deref(), Some("model"));
        }
        other => panic!("expected a 404, got {other:?}"),
    }

    // Raw HTTP for what a client library would not send.
    let http = reqwest::Client::new();
    let url = format!("{}/chat/completions", server.api_base());
    let long: Vec<u32> = (0..1100).map(|i| 100 + i % 500).collect();
    let cases: Vec<(&str, String, &str, Option<&str>)> = vec![
        ("malformed JSON", "{\"model\": ".into(), "chat", None),
        (
            "wrong type",
            json!({"model": MODEL, "messages": "hi"}).to_string(),
            "chat",
            None,
        ),
        (
            "wrong max_tokens type",
            {
                let mut b = ok.clone();
                b["max_tokens"] = json!("many");
                b.to_string()
            },
            "chat",
            None,
        ),
        (
            "salt too long",
            {
                let mut b = ok.clone();
                b["cache_salt"] = json!("s".repeat(300));
                b.to_string()
            },
            "chat",
            Some("cache_salt"),
        ),
        (
            "salt malformed",
            {
                let mut b = ok.clone();
                b["cache_salt"] = json!("a b\n");
                b.to_string()
            },
            "chat",
            Some("cache_salt"),
        ),
        (
            "temperature out of range",
            {
                let mut b = ok.clone();
                b["temperature"] = json!(7);
                b.to_string()
            },
            "chat",
            Some("temperature"),
        ),
        (
            "prompt longer than the context",
            json!({"model": MODEL, "prompt": long, "max_tokens": 2}).to_string(),
            "completions",
            // The field at fault is the prompt (issue 24, item 7).
            Some("prompt"),
        ),
        (
            "token id outside the vocabulary",
            json!({"model": MODEL, "prompt": [1, 2, 99999999], "max_tokens": 2}).to_string(),
            "completions",
            Some("prompt"),
        ),
    ];
    for (what, body, endpoint, param) in cases {
        let url = if endpoint == "chat" {
            url.clone()
        } else {
            format!("{}/completions", server.api_base())
        };
        let response = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 400, "{what}");
        let error: Value = response.json().await.unwrap();
        let error = &error["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {error}"
        );
        assert_eq!(error["type"], "invalid_request_error", "{what}");
        assert!(
            error.get("param").is_some() && error.get("code").is_some(),
            "{what}: {error}"
        );
        if let Some(param) = param {
            assert_eq!(error["param"], param, "{what}");
        }
    }
    // The server is unharmed: it still answers, and counted the refusals.
    assert!(server.alive());
    let answer = chat(&client, ok).await;
    assert!(answer.usage.is_some());
    // By reason: the eight 400s and the unknown model's 404.
    assert_eq!(
        server
            .metric("kvcache_requests_rejected_total{reason=\"invalid_request\"}")
            .await,
        8.0
    );
    assert_eq!(
        server
            .metric("kvcache_requests_rejected_total{reason=\"not_found\"}")
            .await,
        1.0
    );
    let models: Value = reqwest::get(format!("{}/models", server.api_base()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    let health = reqwest::get(format!("{}/health", server.base)).await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_and_a_disconnect_frees_the_cells() {
    // One sequence, no queue, nothing kept after a request.
    let Some(server) = Server::start(&["--max-sequences", "1", "--max-queue", "0", "--idle-ttl", "0"]) else {
        return;
    };
    let http = reqwest::Client::new();
    let url = format!("{}/completions", server.api_base());
    let long = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": true, "temperature": 0});
    let mut first = http.post(&url).json(&long).send().await.unwrap();
    assert_eq!(first.status().as_u16(), 200);
    // Wait for the first bytes: the request holds the only sequence.
    let chunk = first.chunk().await.unwrap().expect("a first event");
    assert!(chunk.starts_with(b"data: "));
    let busy = http.post(&url).json(&long).send().await.unwrap();
    assert_eq!(busy.status().as_u16(), 503);
    assert_eq!(busy.headers()["retry-after"], "1");
    let error: Value = busy.json().await.unwrap();
    assert_eq!(error["error"]["type"], "server_error");
    assert!(server.metric("kvcache_cells_in_use").await > 0.0);

    // The client goes away mid-stream: the request is cancelled, its cells freed.
    drop(first);
    server.wait_metric("kvcache_requests_cancelled_total", 1.0).await;
    server.wait_metric("kvcache_sequences_active", 0.0).await;
    server.wait_metric("kvcache_cells_in_use", 0.0).await;
    server.wait_metric("kvcache_requests_in_flight", 0.0).await;
    // And the next request is served.
    let ok = http
        .post(&url)
        .json(&json!({"model": MODEL, "prompt": "Hello", "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
}
