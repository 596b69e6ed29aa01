//! Bounded load on loopback: 16 concurrent streaming clients for about a
//! minute, mixing conversations that share a system prompt, two salts,
//! clients that disconnect mid-stream and bad requests. Every greedy answer
//! must equal the same request run alone (on a server with one sequence and
//! no reuse), nothing may be lost or garbled, and afterwards the cells, the
//! gauges and the resident memory are back to their baseline.
//!
//! Beside them, slow clients (issue 36): one that opens connections and
//! drips its headers, one that drips its bodies; each connection must be
//! closed after the 2 s `--header-timeout`, each body answered 408 after the
//! 2 s `--body-timeout`, never a 5xx, while the other clients are served.

mod common;

use std::time::{Duration, Instant};

use common::Server;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";
const CLIENTS: usize = 16;
const REQUESTS_PER_CLIENT: usize = 14;
const TIME_CAP: Duration = Duration::from_secs(60);
const SYSTEM: &str = "You are a concise assistant. Answer every question in one short sentence.";
const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Name a primary color.",
    "How many legs does a spider have?",
    "What do bees make?",
];

/// A streamed answer: its text and finish reason, or what was wrong with it.
async fn stream(http: &reqwest::Client, url: &str, body: &Value) -> Result<(String, String), String> {
    let mut response = http
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if response.status() != 200 {
        return Err(format!("status {}", response.status()));
    }
    let (mut buffer, mut text, mut finish, mut done) = (String::new(), String::new(), None, false);
    while let Some(bytes) = response.chunk().await.map_err(|e| e.to_string())? {
        buffer.push_str(std::str::from_utf8(&bytes).map_err(|e| e.to_string())?);
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            // A comment (the server's keep-alive) carries no data.
            if event.starts_with(':') {
                continue;
            }
            let data = event
                .trim()
                .strip_prefix("data: ")
                .ok_or(format!("not a data event: {event:?}"))?;
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
            let choice = &chunk["choices"][0];
            if let Some(t) = choice["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    match (done, finish) {
        (true, Some(f)) => Ok((text, f)),
        _ => Err(format!("stream ended early after {text:?}")),
    }
}

fn chat_body(messages: &[Value], salt: &str, max_tokens: usize) -> Value {
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
           "stream": true, "cache_salt": salt})
}

/// The greedy requests of the load: 4 conversations x 2 turns x 2 salts, the
/// second turn carrying the first turn's answer (from the reference run).
async fn reference_requests(alone: &Server) -> Vec<(Value, String)> {
    let http = reqwest::Client::new();
    let url = format!("{}/chat/completions", alone.api_base());
    let mut out = Vec::new();
    for salt in ["tenant-a", "tenant-b"] {
        for (i, q) in QUESTIONS.iter().enumerate() {
            let mut messages = vec![
                json!({"role": "system", "content": SYSTEM}),
                json!({"role": "user", "content": q}),
            ];
            let first = chat_body(&messages, salt, 10 + i);
            let (answer, _) = stream(&http, &url, &first).await.expect("reference");
            out.push((first, answer.clone()));
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": "Why?"}));
            let second = chat_body(&messages, salt, 8);
            let (answer2, _) = stream(&http, &url, &second).await.expect("reference");
            out.push((second, answer2));
        }
    }
    out
}

/// Slow connections each slow client opens (bounded by the time cap too).
const SLOW_CONNECTIONS: usize = 8;

/// A slow client beside the load: `headers` drips a request's headers a byte
/// every 200 ms, else the headers go at once and the body drips 10 bytes
/// every 500 ms. Each connection must be closed (headers) or answered 408
/// (body) within 2 to 8 s; the outcomes, or what was wrong.
fn slow_client(addr: &str, headers: bool, started: Instant) -> Result<usize, String> {
    use std::io::Write;
    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    let mut done = 0;
    while done < SLOW_CONNECTIONS && started.elapsed() < TIME_CAP {
        let mut s = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
        let opened = Instant::now();
        if headers {
            for b in head.bytes() {
                if s.write_all(&[b]).is_err() || opened.elapsed() > Duration::from_secs(8) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            common::closed_within(&mut s, Duration::from_secs(8))
                .ok_or("dripped headers: still open after 8 s")?;
        } else {
            s.write_all(head.as_bytes()).map_err(|e| e.to_string())?;
            for chunk in body.as_bytes().chunks(10) {
                if s.write_all(chunk).is_err() || opened.elapsed() > Duration::from_secs(8) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
            let (status, head, _) =
                common::read_response(&mut s).map_err(|e| format!("dripped body: {e}"))?;
            if status != 408 {
                return Err(format!("dripped body answered {head}"));
            }
        }
        let took = opened.elapsed();
        if !(Duration::from_millis(1900)..Duration::from_secs(8)).contains(&took) {
            return Err(format!("a slow connection ended after {took:?}"));
        }
        done += 1;
    }
    Ok(done)
}

#[derive(Debug, Default)]
struct Tally {
    answered: usize,
    disconnected: usize,
    refused: usize,
    wrong: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_streaming_clients_for_a_minute() {
    // The references: each request alone, no batching, no reuse.
    let Some(alone) = Server::start(&["--max-sequences", "1", "--idle-ttl", "0"]) else {
        return;
    };
    let references = std::sync::Arc::new(reference_requests(&alone).await);
    drop(alone);

    let Some(server) = Server::start(&[
        "--max-sequences",
        "12",
        "--idle-ttl",
        "2",
        "--header-timeout",
        "2",
        "--body-timeout",
        "2",
    ]) else {
        return;
    };
    let http = reqwest::Client::new();
    let url = format!("{}/chat/completions", server.api_base());
    // Warm up (first passes allocate the cache's tensors), then the baseline.
    for (body, _) in references.iter().take(2) {
        stream(&http, &url, body).await.expect("warm-up");
    }
    server.wait_metric("kvcache_cells_in_use", 0.0).await;
    let baseline_rss = server.rss_kib();

    let started = Instant::now();
    let addr = server.base.strip_prefix("http://").unwrap().to_string();
    let slow: Vec<_> = [true, false]
        .into_iter()
        .map(|headers| {
            let addr = addr.clone();
            std::thread::spawn(move || slow_client(&addr, headers, started))
        })
        .collect();
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (http, url, references) = (http.clone(), url.clone(), references.clone());
        clients.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            for i in 0..REQUESTS_PER_CLIENT {
                if started.elapsed() > TIME_CAP {
                    break;
                }
                match (client + i) % 7 {
                    // Disconnect after the first events of a long answer.
                    3 => {
                        let (body, _) = &references[(client * 3 + i) % references.len()];
                        let mut body = body.clone();
                        body["max_tokens"] = json!(400);
                        let mut response = http.post(&url).json(&body).send().await.unwrap();
                        assert_eq!(response.status(), 200);
                        let first = response.chunk().await.unwrap();
                        assert!(first.is_some_and(|b| b.starts_with(b"data: ")));
                        drop(response);
                        tally.disconnected += 1;
                    }
                    // A bad request: malformed, or an unknown model.
                    5 => {
                        let response = if client % 2 == 0 {
                            http.post(&url)
                                .body("{\"model\": [")
                                .header("content-type", "application/json")
                                .send()
                                .await
                        } else {
                            http.post(&url)
                                .json(&json!({"model": "other", "messages": []}))
                                .send()
                                .await
                        }
                        .unwrap();
                        let status = response.status().as_u16();
                        let body: Value = response.json().await.unwrap();
                        if !(status == 400 || status == 404) || body["error"]["message"].as_str().is_none() {
                            tally.wrong.push(format!("bad request answered {status}: {body}"));
                        }
                        tally.refused += 1;
                    }
                    _ => {
                        let (body, expect) = &references[(client * 5 + i * 3) % references.len()];
                        match stream(&http, &url, body).await {
                            Ok((text, _)) if text == *expect => tally.answered += 1,
                            Ok((text, _)) => tally.wrong.push(format!("{text:?} != alone {expect:?}")),
                            Err(e) => tally.wrong.push(e),
                        }
                    }
                }
            }
            tally
        }));
    }
    let mut total = Tally::default();
    for client in clients {
        let t = client.await.expect("client task");
        total.answered += t.answered;
        total.disconnected += t.disconnected;
        total.refused += t.refused;
        total.wrong.extend(t.wrong);
    }
    let slow: Vec<Result<usize, String>> = slow.into_iter().map(|t| t.join().unwrap()).collect();
    let elapsed = started.elapsed();
    eprintln!(
        "load: {} answered, {} disconnected, {} refused in {:.1} s; slow clients: {slow:?} \
         (dripped headers closed, dripped bodies answered 408)",
        total.answered,
        total.disconnected,
        total.refused,
        elapsed.as_secs_f64()
    );
    for outcome in &slow {
        assert!(outcome.as_ref().is_ok_and(|&n| n > 0), "{slow:?}");
    }
    assert!(
        total.wrong.is_empty(),
        "{} wrong: {:#?}",
        total.wrong.len(),
        total.wrong
    );
    assert!(total.answered >= CLIENTS, "{total:?}");
    assert!(total.disconnected > 0 && total.refused > 0, "{total:?}");

    // Back to the baseline once idle sequences age out.
    server.wait_metric("kvcache_sequences_active", 0.0).await;
    server.wait_metric("kvcache_requests_in_flight", 0.0).await;
    server.wait_metric("kvcache_queue_depth", 0.0).await;
    server.wait_metric("kvcache_sequences_idle", 0.0).await;
    server.wait_metric("kvcache_cells_in_use", 0.0).await;
    assert_eq!(
        server.metric("kvcache_requests_cancelled_total").await,
        total.disconnected as f64
    );
    assert!(server.metric("kvcache_prefix_hits_total").await > 0.0);
    let rss = server.rss_kib();
    eprintln!("load: resident memory {baseline_rss} KiB before, {rss} KiB after");
    assert!(
        rss <= baseline_rss + baseline_rss / 5 + 64 * 1024,
        "resident memory grew from {baseline_rss} KiB to {rss} KiB"
    );
}
