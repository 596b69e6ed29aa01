//! A bounded randomized sweep of request bodies (issue 24, proof): a seeded
//! generator starts from valid chat and completions bodies and breaks them:
//! fields of wrong types, huge and negative numbers, long and odd strings,
//! nested junk, missing fields, unknown fields, then sometimes the bytes
//! themselves (invalid UTF-8, cut short, not JSON). Every answer must be a
//! 4xx with an OpenAI-style JSON error or a valid 200 answer, and `/health`
//! must stay ok after every batch. Bounded in count and in time.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::Server;
use serde_json::{json, Map, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";
const REQUESTS: usize = 400;
const BATCH: usize = 50;
const SEED: u64 = 0x5eed_2024;

/// SplitMix64: small, seeded, enough for a sweep.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

fn junk_string(rng: &mut Rng) -> String {
    match rng.below(8) {
        0 => String::new(),
        1 => "x".repeat(rng.pick(&[1000, 20_000, 300_000])),
        2 => "<|im_end|>\n<|im_start|>system\n".into(),
        3 => "日本語 😀 \u{0} \u{1b}[31m \u{fffd} \u{202e}".into(),
        4 => (0..rng.below(40))
            .map(|_| char::from(rng.below(128) as u8))
            .collect(),
        5 => "SmolLM2-135M-Instruct".into(),
        6 => "user".into(),
        _ => format!("{}", rng.next()),
    }
}

fn junk(rng: &mut Rng, depth: usize) -> Value {
    let kinds = if depth >= 3 { 6 } else { 8 };
    match rng.below(kinds) {
        0 => Value::Null,
        1 => json!(rng.chance(50)),
        2 => json!(rng.pick(&[0i64, 1, -1, 2, 5, 21, 100, 101, i64::MAX, i64::MIN, 1 << 40])),
        3 => json!(rng.pick(&[0.5f64, -0.0, 1.5, 2.5, -100.5, 1e308, -1e308, 1e-300])),
        4 => json!(junk_string(rng)),
        5 => json!(u64::MAX),
        6 => Value::Array((0..rng.below(4)).map(|_| junk(rng, depth + 1)).collect()),
        _ => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                m.insert(junk_string(rng).chars().take(16).collect(), junk(rng, depth + 1));
            }
            Value::Object(m)
        }
    }
}

/// A value for `field` that is sometimes right and often not.
fn field_value(rng: &mut Rng, field: &str) -> Value {
    if rng.chance(40) {
        return junk(rng, 0);
    }
    match field {
        "max_tokens" | "max_completion_tokens" => json!(rng.pick(&[0i64, 1, 3, 8, 5000, -1])),
        "temperature" => json!(rng.pick(&[0.0, 0.7, 2.0, 2.1, -1.0])),
        "top_p" => json!(rng.pick(&[0.0, 0.1, 1.0, 1.1])),
        "presence_penalty" | "frequency_penalty" => json!(rng.pick(&[-2.0, 0.0, 1.0, 2.0, 2.5])),
        "logit_bias" => {
            json!({ rng.pick(&["0", "5", "49151", "49152", "-1", "x"]): rng.pick(&[-100.0, 5.0, 100.5]) })
        }
        "logprobs" => rng.pick(&[json!(true), json!(false), json!(2), json!(6)]),
        "top_logprobs" => json!(rng.pick(&[0, 3, 20, 21])),
        "stop" => rng.pick(&[json!("."), json!(["a", "b", "c", "d", "e"]), json!([]), json!("")]),
        "n" | "best_of" => json!(rng.pick(&[1, 2])),
        "stream" | "echo" => json!(rng.chance(50)),
        "stream_options" => json!({"include_usage": rng.chance(50)}),
        "cache_salt" => json!(rng.pick(&["t1", "", "bad salt", "a:b", &"s".repeat(200)])),
        "seed" => json!(rng.pick(&[0i64, 42, -7])),
        "response_format" => json!({"type": rng.pick(&["text", "json_object", "json_schema"])}),
        "tools" => rng.pick(&[
            json!([]),
            json!([{"type": "function", "function": {"name": "f"}}]),
        ]),
        "suffix" => json!(rng.pick(&["", "end"])),
        "model" => json!(rng.pick(&[MODEL, "gpt-4o", ""])),
        "prompt" => rng.pick(&[
            json!("Hello"),
            json!([1, 2, 3]),
            json!([[1, 2], [3]]),
            json!(["a"]),
            json!([]),
            json!([49152]),
            json!([-1]),
            json!(vec![1u32; 1100]),
        ]),
        "messages" => {
            let n = rng.below(4);
            let messages: Vec<Value> = (0..n)
                .map(|_| {
                    let mut m = Map::new();
                    if rng.chance(90) {
                        m.insert(
                            "role".into(),
                            json!(rng.pick(&["user", "system", "assistant", "developer", "tool", "x"])),
                        );
                    }
                    if rng.chance(80) {
                        let content = rng.pick(&[
                            json!("Hi"),
                            json!(null),
                            json!([{"type": "text", "text": "Hi"}]),
                            json!([{"type": "image_url", "image_url": {"url": "x"}}]),
                            json!(5),
                        ]);
                        m.insert("content".into(), content);
                    }
                    Value::Object(m)
                })
                .collect();
            json!(messages)
        }
        _ => junk(rng, 0),
    }
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "stream",
    "stream_options",
    "n",
    "seed",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "cache_salt",
    "response_format",
    "tools",
    "echo",
    "suffix",
    "best_of",
    "user",
    "something_unknown",
];

/// One request: the path and the body's bytes.
fn request(rng: &mut Rng) -> (&'static str, Vec<u8>) {
    let chat = rng.chance(50);
    let mut body = if chat {
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    } else {
        json!({"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    };
    let object = body.as_object_mut().unwrap();
    for _ in 0..1 + rng.below(3) {
        let field = rng.pick(FIELDS);
        if rng.chance(20) {
            object.remove(field);
        } else {
            object.insert(field.to_string(), field_value(rng, field));
        }
    }
    let mut bytes = serde_json::to_vec(&body).unwrap();
    match rng.below(10) {
        0 => {
            // Invalid UTF-8 inside the text.
            let at = rng.below(bytes.len());
            bytes.splice(at..at, [0xff, 0xfe, 0xc3]);
        }
        1 => bytes.truncate(rng.below(bytes.len())),
        2 => {
            bytes = rng
                .pick(&[&b""[..], b"null", b"[]", b"{", b"1e999", b"\"x\""])
                .to_vec()
        }
        3 => {
            // A number too large for any type, written out.
            let text = String::from_utf8(bytes).unwrap();
            bytes = text
                .replacen("\"max_tokens\":3", "\"max_tokens\":1e999", 1)
                .into_bytes();
        }
        _ => {}
    }
    (
        if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        },
        bytes,
    )
}

/// Whether `(status, body)` is an acceptable answer; the outcome's name.
fn judge(status: u16, content_type: &str, body: &[u8]) -> Result<&'static str, String> {
    let text = String::from_utf8_lossy(body);
    if (400..500).contains(&status) {
        let v: Value = serde_json::from_slice(body).map_err(|_| format!("{status} not JSON: {text}"))?;
        let e = &v["error"];
        if !(e["message"].is_string() && e["type"].is_string()) {
            return Err(format!("{status} without an OpenAI error: {text}"));
        }
        return Ok("4xx");
    }
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    if content_type.starts_with("text/event-stream") {
        let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        if data.last() != Some(&"[DONE]") {
            return Err(format!("stream without [DONE]: {text}"));
        }
        for d in &data[..data.len() - 1] {
            let v: Value = serde_json::from_str(d).map_err(|_| format!("bad event {d}"))?;
            if v.get("error").is_some() || !v["choices"].is_array() {
                return Err(format!("bad event {d}"));
            }
        }
        return Ok("200 stream");
    }
    let v: Value = serde_json::from_slice(body).map_err(|_| format!("200 not JSON: {text}"))?;
    let choice = &v["choices"][0];
    let text_ok = choice["text"].is_string() || choice["message"]["content"].is_string();
    let finish_ok = matches!(choice["finish_reason"].as_str(), Some("stop" | "length"));
    if !(text_ok && finish_ok && v["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 0)) {
        return Err(format!("200 not a valid answer: {text}"));
    }
    Ok("200")
}

#[tokio::test]
async fn random_bodies_get_a_4xx_or_a_valid_answer_and_the_server_stays_healthy() {
    let Some(server) = Server::start(&["--default-max-tokens", "4"]) else {
        return;
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut rng = Rng(SEED);
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let started = Instant::now();
    for batch in 0..REQUESTS / BATCH {
        for i in 0..BATCH {
            let (path, bytes) = request(&mut rng);
            let response = client
                .post(format!("{}{path}", server.base))
                .header("content-type", "application/json")
                .body(bytes.clone())
                .send()
                .await
                .unwrap_or_else(|e| panic!("request {}: {e}", batch * BATCH + i));
            let status = response.status().as_u16();
            let content_type = response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let body = response.bytes().await.expect("body");
            match judge(status, &content_type, &body) {
                Ok(kind) => *outcomes.entry(format!("{kind} ({status})")).or_default() += 1,
                Err(why) => panic!(
                    "request {} to {path} with {:?}: {why}",
                    batch * BATCH + i,
                    String::from_utf8_lossy(&bytes[..bytes.len().min(500)])
                ),
            }
        }
        let health: Value = reqwest::get(format!("{}/health", server.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(health["status"], "ok", "after batch {batch}: {health}");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the sweep ran past 60 s"
        );
    }
    // Nothing left running or holding cells once the sweep is done.
    server.wait_metric("kvcache_requests_in_flight", 0.0).await;
    println!(
        "sweep: {REQUESTS} requests (seed {SEED:#x}) in {:.1} s: {outcomes:?}",
        started.elapsed().as_secs_f64()
    );
    let total: usize = outcomes.values().sum();
    assert_eq!(total, REQUESTS);
    // Both kinds of answer occur: the sweep reaches the engine and the checks.
    assert!(outcomes.keys().any(|k| k.starts_with("200")), "{outcomes:?}");
    assert!(outcomes.keys().any(|k| k.starts_with("4xx")), "{outcomes:?}");
}
