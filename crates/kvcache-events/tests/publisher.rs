//! The publisher on real sockets: a libzmq SUB receives `[topic, sequence,
//! batch]` frames in order, one that sends ZMTP heartbeats (as Dynamo's
//! does) stays connected and misses nothing, and `publish` never waits, with
//! no subscriber or with one that stopped reading.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvcache_api::events::{KvEvent, KvEventSink, Medium};
use kvcache_events::{encode_batch, ZmqPublisher, ZmqPublisherConfig};

fn removed(hash: u64) -> Vec<KvEvent> {
    vec![KvEvent::BlockRemoved {
        block_hashes: vec![hash],
        medium: Medium::Device,
    }]
}

/// The payload less its timestamp (`[`, float64): what identifies a batch.
fn body(payload: &[u8]) -> &[u8] {
    &payload[10..]
}

/// A libzmq SUB on `endpoint` subscribed to `topic`, waiting at most
/// `timeout` for each message.
fn subscriber(endpoint: &str, topic: &[u8], timeout: Duration) -> zmq::Socket {
    let sub = zmq::Context::new().socket(zmq::SUB).unwrap();
    sub.set_rcvtimeo(timeout.as_millis() as i32).unwrap();
    sub.set_linger(0).unwrap();
    sub.set_subscribe(topic).unwrap();
    sub.connect(endpoint).unwrap();
    sub
}

/// The next message's frames, or `None` when none came within the socket's
/// timeout.
fn next(sub: &zmq::Socket) -> Option<Vec<Vec<u8>>> {
    sub.recv_multipart(0).ok()
}

/// A message's sequence number.
fn sequence(message: &[Vec<u8>]) -> u64 {
    u64::from_be_bytes(message[1][..].try_into().unwrap())
}

/// Publishes probes until one reaches `sub` (PUB/SUB: what is sent before
/// the subscription arrives is lost), then drains what is still in flight.
fn probe_until_subscribed(publisher: &ZmqPublisher, sub: &zmq::Socket) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let probe = encode_batch(0.0, &removed(u64::MAX), Some(0));
    loop {
        assert!(Instant::now() < deadline, "no probe arrived");
        publisher.publish(removed(u64::MAX));
        if let Some(m) = next(sub) {
            if body(&m[2]) == body(&probe) {
                break;
            }
        }
    }
    sub.set_rcvtimeo(200).unwrap();
    while next(sub).is_some() {}
}

fn publisher(first_sequence: u64, queue_batches: usize) -> ZmqPublisher {
    let mut config = ZmqPublisherConfig::new("tcp://127.0.0.1:0");
    config.startup_wait = Duration::ZERO;
    config.first_sequence = first_sequence;
    config.queue_batches = queue_batches;
    config.topic = "kv".into();
    ZmqPublisher::bind(config).unwrap()
}

#[test]
fn a_subscriber_gets_three_frames_with_consecutive_sequence_numbers() {
    let publisher = publisher(1_000, 1024);
    let sub = subscriber(publisher.endpoint(), b"kv", Duration::from_millis(100));
    probe_until_subscribed(&publisher, &sub);
    sub.set_rcvtimeo(5_000).unwrap();

    let mut sequences = Vec::new();
    for hash in 0..50 {
        publisher.publish(removed(hash));
    }
    for hash in 0..50 {
        let message = next(&sub).expect("batch within 5 s");
        assert_eq!(message.len(), 3);
        assert_eq!(&message[0][..], b"kv");
        assert_eq!(message[1].len(), 8);
        sequences.push(sequence(&message));
        let payload = &message[2];
        assert_eq!(payload[..2], [0x93, 0xcb]);
        assert_eq!(body(payload), body(&encode_batch(0.0, &removed(hash), Some(0))));
    }
    assert!(sequences[0] > 1_000, "the probes and the first batch came before");
    assert!(
        sequences.windows(2).all(|w| w[1] == w[0] + 1),
        "one number per batch, in order: {sequences:?}"
    );
    assert_eq!(publisher.dropped(), 0);
}

#[test]
fn the_first_batch_clears_everything_and_waits_for_a_subscriber() {
    let mut config = ZmqPublisherConfig::new("tcp://127.0.0.1:0");
    config.first_sequence = 7;
    config.startup_wait = Duration::from_secs(30);
    let publisher = ZmqPublisher::bind(config).unwrap();
    // Published before anyone listens: held behind the first batch.
    publisher.publish(removed(1));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        publisher.sent(),
        0,
        "nothing goes out before a subscriber connects"
    );
    let sub = subscriber(publisher.endpoint(), b"", Duration::from_secs(10));
    let mut got = Vec::new();
    for _ in 0..2 {
        let m = next(&sub).expect("the held batches arrive");
        got.push((sequence(&m), body(&m[2]).to_vec()));
    }
    let cleared = encode_batch(0.0, &[KvEvent::AllBlocksCleared], Some(0));
    let first = encode_batch(0.0, &removed(1), Some(0));
    assert_eq!(got, [(7, body(&cleared).to_vec()), (8, body(&first).to_vec())]);
}

/// Dynamo's subscriber (libzmq) sends a ZMTP PING every 5 s and expects a
/// PONG; a publisher that cannot answer loses it, and every batch sent while
/// it reconnects. Here it pings every 50 ms, for about forty pings, and
/// must get every batch.
#[test]
fn a_subscriber_that_sends_heartbeats_stays_connected_and_misses_nothing() {
    let publisher = publisher(0, 1024);
    let sub = zmq::Context::new().socket(zmq::SUB).unwrap();
    sub.set_heartbeat_ivl(50).unwrap();
    sub.set_heartbeat_timeout(500).unwrap();
    sub.set_reconnect_ivl(10).unwrap();
    sub.set_rcvtimeo(100).unwrap();
    sub.set_linger(0).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.connect(publisher.endpoint()).unwrap();
    probe_until_subscribed(&publisher, &sub);
    sub.set_rcvtimeo(5_000).unwrap();

    let mut sequences = Vec::new();
    for hash in 0..40 {
        publisher.publish(removed(hash));
        let message = next(&sub).expect("every batch arrives");
        assert_eq!(
            body(&message[2]),
            body(&encode_batch(0.0, &removed(hash), Some(0)))
        );
        sequences.push(sequence(&message));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        sequences.windows(2).all(|w| w[1] == w[0] + 1),
        "no batch lost between heartbeats: {sequences:?}"
    );
}

/// Publishes `n` batches of about 4 KiB and returns the slowest call.
fn hammer(publisher: &ZmqPublisher, n: u64) -> Duration {
    let tokens: Vec<u32> = (0..1024).collect();
    let mut slowest = Duration::ZERO;
    for i in 0..n {
        let batch = vec![KvEvent::BlockStored {
            block_hashes: (i * 64..i * 64 + 64).collect(),
            parent_block_hash: None,
            token_ids: tokens.clone(),
            block_size: 16,
            medium: Medium::Device,
            namespace: kvcache_api::Namespace::shared(),
        }];
        let start = Instant::now();
        publisher.publish(batch);
        slowest = slowest.max(start.elapsed());
    }
    slowest
}

#[test]
fn publish_never_waits_without_a_subscriber() {
    let publisher = publisher(0, 64);
    let start = Instant::now();
    let slowest = hammer(&publisher, 20_000);
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
    assert!(
        slowest < Duration::from_millis(200),
        "slowest publish {slowest:?}"
    );
    // A 64-batch queue cannot take 20,000 batches as fast as they come; the
    // rest were dropped, and every batch is either sent or dropped.
    let deadline = Instant::now() + Duration::from_secs(10);
    while publisher.sent() + publisher.dropped() < 20_001 {
        assert!(
            Instant::now() < deadline,
            "sent {} dropped {}",
            publisher.sent(),
            publisher.dropped()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(publisher.sent() + publisher.dropped(), 20_001);
}

/// A ZMTP 3.0 SUB that subscribes to everything and then never reads: its
/// socket buffers fill and the publisher must drop for it.
fn stalled_subscriber(endpoint: &str) -> TcpStream {
    let address = endpoint.trim_start_matches("tcp://");
    let mut stream = TcpStream::connect(address).unwrap();
    let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x7f, 3, 0];
    greeting.extend_from_slice(b"NULL");
    greeting.resize(64, 0);
    stream.write_all(&greeting).unwrap();
    let mut theirs = [0u8; 64];
    stream.read_exact(&mut theirs).unwrap();
    assert_eq!(theirs[0], 0xff, "a ZMTP greeting");
    let mut ready = vec![0x04, 25, 5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"SUB");
    stream.write_all(&ready).unwrap();
    // Subscribe to every topic: a one-byte message, 0x01.
    stream.write_all(&[0x00, 0x01, 0x01]).unwrap();
    stream
}

#[test]
fn a_stalled_subscriber_never_slows_publish() {
    let publisher = publisher(0, 1024);
    let mut stalled = stalled_subscriber(publisher.endpoint());
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    // 50,000 batches of ~4 KiB: ~200 MiB, far beyond what the socket buffers hold.
    let slowest = hammer(&publisher, 50_000);
    assert!(start.elapsed() < Duration::from_secs(60), "{:?}", start.elapsed());
    assert!(
        slowest < Duration::from_millis(200),
        "slowest publish {slowest:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while publisher.sent() + publisher.dropped() < 50_001 {
        assert!(
            Instant::now() < deadline,
            "the sending thread is stuck behind the stalled subscriber"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "stalled subscriber: {} batches sent to the socket, {} dropped at the queue, slowest publish {slowest:?}",
        publisher.sent(),
        publisher.dropped()
    );
    // It was a real subscriber: the socket sent it what its buffers could take.
    stalled
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buffered = 0;
    let mut chunk = vec![0u8; 1 << 16];
    while let Ok(n @ 1..) = stalled.read(&mut chunk) {
        buffered += n;
        if buffered > 1 << 20 {
            break;
        }
    }
    assert!(
        buffered > 64 << 10,
        "only {buffered} bytes reached the subscriber"
    );
    // Dropping the publisher does not wait for the subscriber either.
    let start = Instant::now();
    drop(publisher);
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_batch_dropped_at_the_queue_leaves_a_gap_in_the_numbers() {
    let mut config = ZmqPublisherConfig::new("tcp://127.0.0.1:0");
    config.first_sequence = 7;
    config.queue_batches = 1;
    config.startup_wait = Duration::from_secs(30);
    let publisher = ZmqPublisher::bind(config).unwrap();
    // The queue holds the first batch (AllBlocksCleared) until a subscriber
    // connects: these two are dropped.
    publisher.publish(removed(1));
    publisher.publish(removed(2));
    assert_eq!(publisher.dropped(), 2);
    let sub = subscriber(publisher.endpoint(), b"", Duration::from_secs(10));
    let mut seqs = Vec::new();
    for i in 0..2 {
        if i == 1 {
            publisher.publish(removed(3));
        }
        seqs.push(sequence(&next(&sub).expect("a batch")));
    }
    assert_eq!(seqs, [7, 10], "8 and 9 were dropped");
}
