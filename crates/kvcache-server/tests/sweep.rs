//! A bounded randomized sweep of request bodies (issue 24, proof): a seeded
//! generator starts from valid chat and completions bodies and breaks them:
//! fields of wrong types, huge and negative numbers, long and odd strings,
//! nested junk, missing fields, unknown fields, then sometimes the bytes
//! themselves (invalid UTF-8, cut short, not JSON). Every answer must be a
//! 4xx with an OpenAI-style JSON error or a valid 200 answer, and `/health`
//! must stay ok after every batch. Bounded in count and in time.
//!
//! Beside each batch run slow clients (issue 36): headers dripped a byte at a
//! time (closed after the 1 s `--header-timeout`), bodies dripped past the
//! 1 s `--body-timeout` (408) and bodies dripped within it (answered). None
//! may get a 5xx or hold its connection past its timeout.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::Server;
use serde_json::{json, Map, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";
const REQUESTS: usize = 400;
const BATCH: usize = 50;
const SEED: u64 = 0x5eed_2024;
/// Slow clients beside each batch.
const SLOW_PER_BATCH: usize = 3;

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

/// One slow client of `kind` (0: headers dripped, 1: body dripped past the
/// body timeout, 2: body dripped within it) sending `body` to `path`; the
/// outcome's name, or what was wrong.
fn slow_client(addr: &str, kind: usize, path: &str, body: &[u8]) -> Result<String, String> {
    use std::io::Write;
    use std::time::Duration;
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    let started = Instant::now();
    match kind {
        0 => {
            // A byte every 100 ms: the headers would take seconds.
            for b in head.bytes() {
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
                if started.elapsed() > Duration::from_secs(6) {
                    return Err("headers dripped for 6 s without the server closing".into());
                }
            }
            match common::closed_within(&mut s, Duration::from_secs(5)) {
                Some(_) if started.elapsed() < Duration::from_secs(6) => Ok("slow headers: closed".into()),
                _ => Err(format!("slow headers open after {:?}", started.elapsed())),
            }
        }
        _ => {
            let pause = if kind == 1 { 300 } else { 40 };
            let mut sent = s.write_all(head.as_bytes()).is_ok();
            for chunk in body.chunks(body.len().div_ceil(8).max(1)) {
                std::thread::sleep(Duration::from_millis(pause));
                sent = sent && s.write_all(chunk).is_ok();
            }
            let what = if kind == 1 { "slow body" } else { "dripped body" };
            match common::read_response(&mut s) {
                Ok((status, head, answer)) => {
                    if !(200..500).contains(&status) {
                        return Err(format!("{what}: {head}"));
                    }
                    if (400..500).contains(&status) {
                        let v: Value = serde_json::from_slice(&answer)
                            .map_err(|_| format!("{what}: {status} not JSON"))?;
                        if !v["error"]["message"].is_string() {
                            return Err(format!("{what}: {status} without an OpenAI error"));
                        }
                    }
                    Ok(format!("{what}: {status}"))
                }
                // Closed before an answer: only if the body never all went out.
                Err(e) if !sent => Ok(format!("{what}: closed ({})", e.kind())),
                Err(e) => Err(format!("{what}: no answer: {e}")),
            }
        }
    }
}

#[tokio::test]
async fn random_bodies_get_a_4xx_or_a_valid_answer_and_the_server_stays_healthy() {
    let Some(server) = Server::start(&[
        "--default-max-tokens",
        "4",
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--idle-ttl",
        "1",
    ]) else {
        return;
    };
    let addr = server.base.strip_prefix("http://").unwrap().to_string();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut rng = Rng(SEED);
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let started = Instant::now();
    let mut slow_outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for batch in 0..REQUESTS / BATCH {
        let slow: Vec<_> = (0..SLOW_PER_BATCH)
            .map(|kind| {
                let (path, bytes) = request(&mut rng);
                let addr = addr.clone();
                std::thread::spawn(move || slow_client(&addr, kind, path, &bytes))
            })
            .collect();
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
        for client in slow {
            match client.join().unwrap() {
                Ok(outcome) => *slow_outcomes.entry(outcome).or_default() += 1,
                Err(why) => panic!("batch {batch}: {why}"),
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
    server.wait_metric("kvcache_sequences_active", 0.0).await;
    // Kept prefixes age out (`--idle-ttl 1`): every cell back.
    server.wait_metric("kvcache_cells_in_use", 0.0).await;
    println!(
        "sweep: {REQUESTS} requests (seed {SEED:#x}) in {:.1} s: {outcomes:?}; slow clients: {slow_outcomes:?}; \
         connections timed out in their headers: {}",
        started.elapsed().as_secs_f64(),
        server
            .metric("kvcache_connections_timed_out_total{phase=\"headers\"}")
            .await
    );
    let slow_total: usize = slow_outcomes.values().sum();
    assert_eq!(slow_total, SLOW_PER_BATCH * REQUESTS / BATCH);
    assert_eq!(
        slow_outcomes.get("slow headers: closed"),
        Some(&(REQUESTS / BATCH)),
        "{slow_outcomes:?}"
    );
    let total: usize = outcomes.values().sum();
    assert_eq!(total, REQUESTS);
    // Both kinds of answer occur: the sweep reaches the engine and the checks.
    assert!(outcomes.keys().any(|k| k.starts_with("200")), "{outcomes:?}");
    assert!(outcomes.keys().any(|k| k.starts_with("4xx")), "{outcomes:?}");
}
