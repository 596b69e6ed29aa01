//! The edges of HTTP (issue 24, item 7): control tokens stay out of answers
//! and end the turn; 405, 413 and a stalled body answer OpenAI-style JSON;
//! `/v1/models/{id}`; `max_tokens` past the context, a message without
//! content and a too-long completions prompt are 400s naming their field;
//! SIGTERM lets a stream finish.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::Server;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

async fn send(server: &Server, method: reqwest::Method, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut request = reqwest::Client::new().request(method, format!("{}{path}", server.base));
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{status}: not JSON: {text:?}"));
    (status, body)
}

fn assert_error(status: u16, body: &Value, want: u16, param: Option<&str>) {
    assert_eq!(status, want, "{body}");
    assert!(
        body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(body["error"]["type"].is_string(), "{body}");
    if let Some(param) = param {
        assert_eq!(body["error"]["param"], param, "{body}");
    }
}

#[tokio::test]
async fn control_tokens_never_show_and_end_of_turn_tokens_stop() {
    let Some(server) = Server::start(&[]) else { return };
    let t = kvcache_models::ModelFile::open(kvcache_models::paths::model_path().unwrap())
        .unwrap()
        .tokenizer()
        .unwrap();
    let endoftext = t.encode("<|endoftext|>").unwrap();
    let im_start = t.encode("<|im_start|>").unwrap();
    assert_eq!((endoftext.len(), im_start.len()), (1, 1));
    assert!(t.end_of_turn_ids().contains(&endoftext[0]));
    let post = |bias: u32| {
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
               "logit_bias": { bias.to_string(): 100 }})
    };
    // Forced `<|endoftext|>`: an end-of-turn token, the answer stops there.
    let (status, answer) = send(
        &server,
        reqwest::Method::POST,
        "/v1/completions",
        Some(&post(endoftext[0])),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["text"], "");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    // Forced `<|im_start|>`: a control token, never text.
    let (status, answer) = send(
        &server,
        reqwest::Method::POST,
        "/v1/completions",
        Some(&post(im_start[0])),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    let text = answer["choices"][0]["text"].as_str().unwrap();
    assert!(!text.contains("<|"), "{text:?}");
}

#[tokio::test]
async fn errors_of_http_itself_are_openai_json() {
    let Some(server) = Server::start(&[]) else { return };
    use reqwest::Method;
    let (status, body) = send(&server, Method::GET, "/v1/chat/completions", None).await;
    assert_error(status, &body, 405, None);
    let (status, body) = send(&server, Method::DELETE, "/v1/models", None).await;
    assert_error(status, &body, 405, None);
    // 3 MiB: over the 2 MiB limit.
    let huge = json!({"model": MODEL, "prompt": "a".repeat(3 << 20)});
    let (status, body) = send(&server, Method::POST, "/v1/completions", Some(&huge)).await;
    assert_error(status, &body, 413, None);
    let (status, body) = send(&server, Method::GET, &format!("/v1/models/{MODEL}"), None).await;
    assert_eq!(
        (status, &body["id"], &body["object"]),
        (200, &json!(MODEL), &json!("model"))
    );
    let (status, body) = send(&server, Method::GET, "/v1/models/gpt-9", None).await;
    assert_error(status, &body, 404, Some("model"));
    assert_eq!(body["error"]["code"], "model_not_found");
    let (status, body) = send(&server, Method::GET, "/health", None).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")));
}

#[tokio::test]
async fn fields_past_their_limits_are_400_naming_them() {
    let Some(server) = Server::start(&[]) else { return };
    const POST: reqwest::Method = reqwest::Method::POST;
    // The test server's context is 1,024 positions.
    let chat = |messages: Value, max_tokens: u64| json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens});
    let hi = json!([{"role": "user", "content": "Hi"}]);
    let (status, body) = send(
        &server,
        POST,
        "/v1/chat/completions",
        Some(&chat(hi.clone(), 5000)),
    )
    .await;
    assert_error(status, &body, 400, Some("max_tokens"));
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    let (status, body) = send(&server, POST, "/v1/chat/completions", Some(&chat(hi, 3))).await;
    assert_eq!(status, 200, "{body}");
    for role in ["user", "system"] {
        let messages = json!([{"role": role}, {"role": "user", "content": "Hi"}]);
        let (status, body) = send(&server, POST, "/v1/chat/completions", Some(&chat(messages, 3))).await;
        assert_error(status, &body, 400, Some("messages[0].content"));
    }
    let messages = json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": null},
                          {"role": "user", "content": "Hi"}]);
    let (status, body) = send(&server, POST, "/v1/chat/completions", Some(&chat(messages, 3))).await;
    assert_eq!(status, 200, "an assistant turn may be empty: {body}");
    let long = json!({"model": MODEL, "prompt": vec![1u32; 1100], "max_tokens": 1});
    let (status, body) = send(&server, POST, "/v1/completions", Some(&long)).await;
    assert_error(status, &body, 400, Some("prompt"));
    let long = json!({"model": MODEL, "prompt": vec![1u32; 1000], "max_tokens": 30});
    let (status, body) = send(&server, POST, "/v1/completions", Some(&long)).await;
    assert_error(status, &body, 400, Some("max_tokens"));
}

#[test]
fn a_stalled_body_is_timed_out_with_408() {
    let Some(server) = Server::start(&["--body-timeout", "1"]) else {
        return;
    };
    let addr = server.base.strip_prefix("http://").unwrap();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Headers promise 100 bytes; 10 come, then nothing.
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"model\":"
    )
    .unwrap();
    stream.flush().unwrap();
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    let n = stream.read(&mut buf).unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]).to_string();
    let waited = t0.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"error\""), "{answer}");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

#[tokio::test]
async fn sigterm_lets_a_stream_finish() {
    let Some(mut server) = Server::start(&[]) else {
        return;
    };
    let mut response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "Count to fifty."}],
                      "max_tokens": 48, "temperature": 0, "stream": true, "logit_bias": {"2": -100, "0": -100}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.unwrap().expect("a first chunk");
    let mut body = String::from_utf8_lossy(&first).to_string();
    let exit = tokio::task::spawn_blocking(move || {
        let status = server.terminate(Duration::from_secs(60));
        (status, server)
    });
    while let Some(chunk) = response.chunk().await.unwrap() {
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (status, _server) = exit.await.unwrap();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let chunks = body.matches("chat.completion.chunk").count();
    // The role chunk, 48 tokens' text (fewer chunks if some held back), the finish.
    assert!(chunks > 20, "{chunks}: {body}");
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}
