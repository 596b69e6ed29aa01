//! No connection held open by a slow client (issue 36, items 1 and 7): slow
//! or stalled headers are closed after `--header-timeout` while `/health`
//! answers, idle connections after `--keep-alive-timeout`, connections past
//! `--max-connections` get a 503 with `Connection: close`, and refused
//! requests leave a keep-alive connection usable.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{closed_within, read_response, Server};

fn addr(server: &Server) -> String {
    server.base.strip_prefix("http://").unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_closed_after_the_header_timeout_while_health_answers() {
    let Some(server) = Server::start(&["--header-timeout", "1", "--keep-alive-timeout", "30"]) else {
        return;
    };
    let addr = addr(&server);
    // Twenty clients that never finish their headers (the issue's probe).
    let mut stalled: Vec<(TcpStream, Instant)> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
            (s, Instant::now())
        })
        .collect();
    // One that drips a byte every 100 ms: activity does not extend its time.
    let dripper = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let started = Instant::now();
            for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "
                .iter()
                .chain([b'a'; 200].iter())
            {
                if s.write_all(&[*b]).is_err() {
                    return Some(started.elapsed());
                }
                std::thread::sleep(Duration::from_millis(100));
                if started.elapsed() > Duration::from_secs(15) {
                    return None;
                }
            }
            None
        })
    };
    // Meanwhile /health answers at once.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let t0 = Instant::now();
    let health = http.get(format!("{}/health", server.base)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Every stalled client is closed after about the header timeout.
    for (s, opened) in &mut stalled {
        let closed = closed_within(s, Duration::from_secs(10));
        assert!(closed.is_some(), "a stalled client is still open after 10 s");
        let after = opened.elapsed();
        assert!(
            after >= Duration::from_millis(900) && after < Duration::from_secs(8),
            "{after:?}"
        );
    }
    let dripped = dripper
        .join()
        .unwrap()
        .expect("the dripping client was never closed");
    assert!(dripped < Duration::from_secs(8), "{dripped:?}");
    // A fresh request afterwards is served.
    assert_eq!(
        http.get(format!("{}/health", server.base))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let timed_out = server
        .metric("kvcache_connections_timed_out_total{phase=\"headers\"}")
        .await;
    assert_eq!(timed_out, 21.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_after_the_keep_alive_timeout() {
    let Some(server) = Server::start(&["--keep-alive-timeout", "1", "--header-timeout", "30"]) else {
        return;
    };
    let addr = addr(&server);
    // Opened, nothing sent.
    let mut silent = TcpStream::connect(&addr).unwrap();
    let closed = closed_within(&mut silent, Duration::from_secs(10)).expect("a silent connection stays open");
    assert!(closed >= Duration::from_millis(900), "{closed:?}");
    // One request answered, then idle: closed a second after the answer.
    let mut used = TcpStream::connect(&addr).unwrap();
    used.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (status, _, _) = read_response(&mut used).unwrap();
    assert_eq!(status, 200);
    let closed = closed_within(&mut used, Duration::from_secs(10)).expect("an idle keep-alive stays open");
    assert!(closed >= Duration::from_millis(900), "{closed:?}");
    assert_eq!(
        server
            .metric("kvcache_connections_timed_out_total{phase=\"idle\"}")
            .await,
        2.0
    );
    // A connection that keeps working is not idle: five requests, 0.5 s apart.
    let mut busy = TcpStream::connect(&addr).unwrap();
    for _ in 0..5 {
        busy.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        assert_eq!(read_response(&mut busy).unwrap().0, 200);
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_get_a_503_and_are_counted() {
    let Some(server) = Server::start(&["--max-connections", "4", "--header-timeout", "30"]) else {
        return;
    };
    let addr = addr(&server);
    // Four open connections hold every slot.
    let mut held: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    // Each is served (the server accepted it), then stays open.
    for s in &mut held {
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(read_response(s).unwrap().0, 200);
    }
    for _ in 0..3 {
        let mut extra = TcpStream::connect(&addr).unwrap();
        extra.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        extra
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let (status, head, body) = read_response(&mut extra).unwrap();
        assert_eq!(status, 503, "{head}");
        assert!(head.contains("connection: close"), "{head}");
        assert!(head.contains("retry-after: 1"), "{head}");
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["code"], "too_many_connections", "{body}");
        assert_eq!(body["error"]["type"], "server_error", "{body}");
        assert!(closed_within(&mut extra, Duration::from_secs(5)).is_some());
    }
    // One slot given back: served again, and the refusals were counted.
    drop(held.pop());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(server.metric("kvcache_connections_refused_total").await, 3.0);
    // The rest closed: only the connection asking is open.
    drop(held);
    server.wait_metric("kvcache_connections_open", 1.0).await;
}

#[test]
fn three_hundred_wrong_keys_on_one_keep_alive_connection_each_get_a_401() {
    let Some(server) = Server::start(&["--api-key", "sk-right"]) else {
        return;
    };
    let mut stream = TcpStream::connect(addr(&server)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = br#"{"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 1}"#;
    for i in 0..300 {
        // The headers first, the body a moment later: the answer must not
        // go out before the body is read, or the connection is left with
        // it unread.
        write!(
            stream,
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-wrong-{i}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        stream.flush().unwrap();
        if i % 3 == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        stream.write_all(body).unwrap();
        let (status, head, answer) =
            read_response(&mut stream).unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(status, 401, "request {i}: {head}");
        assert!(!head.contains("connection: close"), "request {i}: {head}");
        let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(answer["error"]["code"], "invalid_api_key", "request {i}");
    }
    // The same connection then carries a request with the right key.
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: bearer sk-right\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(body).unwrap();
    let (status, head, _) = read_response(&mut stream).unwrap();
    assert_eq!(status, 200, "{head}");
}
