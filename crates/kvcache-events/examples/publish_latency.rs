//! How long `ZmqPublisher::publish` takes with no subscriber, with one that
//! keeps up, and with one that stopped reading: a bad or lost subscriber must
//! not slow the engine that publishes.
//!
//! `cargo run --release -p kvcache-events --example publish_latency [BATCHES]`
//!
//! Each batch is one `BlockStored` of 2 blocks of 16 tokens (what one request's
//! prompt adds), published from one thread, back to back (far faster than the
//! sending thread encodes: the queue overflows and drops) and then paced at
//! 20,000 batches a second (an engine's rate with room to spare); every call
//! is timed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvcache_api::events::{KvEvent, KvEventSink, Medium};
use kvcache_api::Namespace;
use kvcache_events::{ZmqPublisher, ZmqPublisherConfig};

fn batch(i: u64) -> Vec<KvEvent> {
    vec![KvEvent::BlockStored {
        block_hashes: vec![2 * i + 1_000_000, 2 * i + 1_000_001],
        parent_block_hash: Some(2 * i + 999_999),
        token_ids: (0..32)
            .map(|t| (i as u32).wrapping_mul(31).wrapping_add(t))
            .collect(),
        block_size: 16,
        medium: Medium::Device,
        namespace: Namespace::shared(),
    }]
}

/// A SUB that reads everything on a thread of its own; counts messages.
fn fast_subscriber(endpoint: String, stop: Arc<AtomicBool>) -> (Arc<AtomicU64>, std::thread::JoinHandle<()>) {
    let received = Arc::new(AtomicU64::new(0));
    let count = received.clone();
    let thread = std::thread::spawn(move || {
        let sub = zmq::Context::new().socket(zmq::SUB).unwrap();
        sub.set_rcvtimeo(100).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.connect(&endpoint).unwrap();
        while !stop.load(Ordering::Relaxed) {
            if sub.recv_multipart(0).is_ok() {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    (received, thread)
}

/// A ZMTP 3.0 SUB that subscribes to everything and never reads again.
fn stalled_subscriber(endpoint: &str) -> TcpStream {
    let mut stream = TcpStream::connect(endpoint.trim_start_matches("tcp://")).unwrap();
    let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x7f, 3, 0];
    greeting.extend_from_slice(b"NULL");
    greeting.resize(64, 0);
    stream.write_all(&greeting).unwrap();
    let mut theirs = [0u8; 64];
    stream.read_exact(&mut theirs).unwrap();
    let mut ready = vec![0x04, 25, 5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"SUB");
    stream.write_all(&ready).unwrap();
    stream.write_all(&[0x00, 0x01, 0x01]).unwrap();
    stream
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn run(label: &str, batches: u64, subscriber: &str, pace: Option<Duration>) {
    let mut config = ZmqPublisherConfig::new("tcp://127.0.0.1:0");
    config.startup_wait = Duration::ZERO;
    let publisher = ZmqPublisher::bind(config).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut fast = None;
    let mut _stalled = None;
    match subscriber {
        "fast" => fast = Some(fast_subscriber(publisher.endpoint().to_string(), stop.clone())),
        "stalled" => _stalled = Some(stalled_subscriber(publisher.endpoint())),
        _ => {}
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut times = Vec::with_capacity(batches as usize);
    let start = Instant::now();
    for i in 0..batches {
        if let Some(pace) = pace {
            while start.elapsed() < pace * i as u32 {
                std::hint::spin_loop();
            }
        }
        let events = batch(i);
        let t = Instant::now();
        publisher.publish(events);
        times.push(t.elapsed());
    }
    let wall = start.elapsed();
    let deadline = Instant::now() + Duration::from_secs(30);
    while publisher.sent() + publisher.dropped() < batches + 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    let slow = times.iter().filter(|t| **t > Duration::from_micros(100)).count();
    times.sort();
    let received = fast.as_ref().map(|(r, _)| r.load(Ordering::Relaxed));
    println!(
        "{label:<36} {batches:>7} batches in {:>7.1} ms: publish p50 {:>6.0} ns, p99 {:>6.0} ns, \
         p99.9 {:>7.0} ns, max {:>8.1} us ({slow} over 100 us); sent {}, dropped at the queue {}{}",
        wall.as_secs_f64() * 1e3,
        percentile(&times, 0.5).as_nanos(),
        percentile(&times, 0.99).as_nanos(),
        percentile(&times, 0.999).as_nanos(),
        times.last().unwrap().as_nanos() as f64 / 1e3,
        publisher.sent(),
        publisher.dropped(),
        received.map_or(String::new(), |r| format!(", received {r}")),
    );
    stop.store(true, Ordering::Relaxed);
    if let Some((_, thread)) = fast {
        thread.join().unwrap();
    }
}

fn main() {
    let batches = std::env::args()
        .nth(1)
        .map_or(100_000, |n| n.parse().expect("BATCHES is a number"));
    let paced = Some(Duration::from_micros(50));
    for (pace, how) in [(None, "back to back"), (paced, "20k/s")] {
        run(&format!("{how}, no subscriber"), batches, "none", pace);
        run(&format!("{how}, fast subscriber"), batches, "fast", pace);
        run(&format!("{how}, stalled subscriber"), batches, "stalled", pace);
    }
}
