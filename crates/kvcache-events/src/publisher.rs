//! [`ZmqPublisher`]: a [`KvEventSink`] that binds a ZMQ XPUB socket and sends
//! each batch as vLLM's `ZmqEventPublisher` does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvcache_api::events::{KvEvent, KvEventSink};

use crate::wire::encode_batch;

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// The endpoint could not be bound (in use, not `tcp://HOST:PORT`, ...).
    #[error("cannot bind the KV events socket to {endpoint}: {reason}")]
    Bind {
        /// The endpoint asked for.
        endpoint: String,
        /// What ZMQ said.
        reason: String,
    },
    /// The sending thread could not start.
    #[error("cannot start the KV events thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// How a [`ZmqPublisher`] publishes.
#[derive(Debug, Clone)]
pub struct ZmqPublisherConfig {
    /// What to bind, `tcp://HOST:PORT` (port 0 picks a free one; see
    /// [`ZmqPublisher::endpoint`]).
    pub endpoint: String,
    /// The first frame of every message (vLLM's `topic`, empty by default).
    pub topic: String,
    /// Batches waiting for the sending thread at most; past that `publish`
    /// drops (vLLM's `max_queue_size` blocks instead).
    pub queue_batches: usize,
    /// Sent in every batch as `data_parallel_rank` (vLLM sends its rank, 0
    /// without data parallelism).
    pub data_parallel_rank: i32,
    /// The sequence number of the first batch (the `AllBlocksCleared` sent at
    /// start); each batch after it takes the next. vLLM starts at 0. The
    /// default is the start time in microseconds since the Unix epoch, so a
    /// restarted publisher's numbers continue above its last run's: Dynamo's
    /// listener drops a batch whose number is not above the last it applied,
    /// and would otherwise ignore a restarted replica (its `AllBlocksCleared`
    /// first) until the numbers passed the old ones. Set 0 for vLLM's.
    pub first_sequence: u64,
    /// How long the sending thread holds the first batch (and what is queued
    /// behind it) for a subscriber to subscribe, after `bind`. What a PUB
    /// socket sends before a subscription has arrived is lost, and a
    /// router's subscriber reconnects to a restarted engine only after the
    /// socket is bound again (Dynamo's within a second or two): sending
    /// `AllBlocksCleared` at once would reach nobody. The batches go out as
    /// soon as the first subscription arrives, or when this has passed
    /// without one. `publish` never waits for it; the queue takes what comes
    /// meanwhile.
    pub startup_wait: Duration,
}

impl ZmqPublisherConfig {
    /// Defaults for `endpoint`: empty topic, 10,000 queued batches, rank 0,
    /// the first sequence number from the clock.
    pub fn new(endpoint: impl Into<String>) -> Self {
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        ZmqPublisherConfig {
            endpoint: endpoint.into(),
            topic: String::new(),
            queue_batches: 10_000,
            data_parallel_rank: 0,
            first_sequence: micros,
            startup_wait: Duration::from_secs(5),
        }
    }
}

/// What the sending thread gets: one batch, its number and its time.
struct Queued {
    sequence: u64,
    ts: f64,
    events: Vec<KvEvent>,
}

/// Counters shared with the sending thread.
#[derive(Debug, Default)]
struct Counters {
    /// Batches `publish` dropped because the queue was full.
    dropped: AtomicU64,
    /// Batches handed to the socket.
    sent: AtomicU64,
}

/// Publishes KV events on a ZMQ socket in vLLM's wire format.
///
/// Each [`publish`](KvEventSink::publish) call is one batch: `[topic,
/// sequence number (8 bytes, big-endian), msgpack KVEventBatch]`, three
/// frames, as vLLM's `ZmqEventPublisher` sends them, one sequence number per
/// batch. The first batch is `AllBlocksCleared`, sent once a subscriber has
/// subscribed (see [`ZmqPublisherConfig::startup_wait`]): a restarted engine
/// holds nothing, and a router that remembers its old blocks forgets them
/// without any replay.
///
/// The socket is libzmq's (the library vLLM publishes with, through pyzmq),
/// an XPUB: a PUB that also reports subscriptions, so the first batch waits
/// for a real one. libzmq keeps each subscriber's connection alive the ZMTP
/// 3.1 way: it answers the heartbeats a subscriber sends (Dynamo's send one
/// every 5 s), so a router never loses the batches sent while it would
/// otherwise be reconnecting.
///
/// Nothing here waits for a subscriber. `publish` timestamps the batch,
/// numbers it and puts it on a bounded queue (`try_send`, under a lock held
/// for nothing else, so numbers follow the queue's order; about 0.1 us).
/// When the queue is full the batch is dropped and counted
/// ([`dropped`](Self::dropped)), and its sequence number stays unused, so a
/// subscriber sees the gap (Dynamo logs it) instead of silently missing
/// blocks. A thread of the publisher's own polls the queue every
/// millisecond, encodes and hands each batch to the socket, which queues it
/// for every subscriber without waiting and drops it for one whose queue
/// holds 1,000 batches already (ZMTP's rule for PUB), so a
/// stalled or vanished subscriber costs neither the engine nor the other
/// subscribers anything.
#[derive(Debug)]
pub struct ZmqPublisher {
    queue: Option<SyncSender<Queued>>,
    /// The next batch's sequence number; held only to number a batch and
    /// `try_send` it, so numbers follow the queue's order.
    next_sequence: Mutex<u64>,
    counters: Arc<Counters>,
    endpoint: String,
    thread: Option<JoinHandle<()>>,
}

/// Batches the socket queues for one subscriber before it drops for that
/// subscriber (libzmq's send high-water mark, its default).
const SUBSCRIBER_QUEUE: i32 = 1000;

/// How long dropping the publisher lets batches already handed to the
/// socket go out (libzmq's linger); a subscriber that does not take them
/// costs the drop this much at most.
const LINGER: Duration = Duration::from_millis(500);

impl ZmqPublisher {
    /// Binds `config.endpoint` and starts the sending thread; the first batch,
    /// `AllBlocksCleared`, is queued before this returns.
    pub fn bind(config: ZmqPublisherConfig) -> Result<Self, EventsError> {
        let bind_error = |e: zmq::Error| EventsError::Bind {
            endpoint: config.endpoint.clone(),
            reason: e.to_string(),
        };
        let socket = zmq::Context::new().socket(zmq::XPUB).map_err(bind_error)?;
        socket.set_sndhwm(SUBSCRIBER_QUEUE).map_err(bind_error)?;
        socket.set_linger(LINGER.as_millis() as i32).map_err(bind_error)?;
        socket.bind(&config.endpoint).map_err(bind_error)?;
        let endpoint = match socket.get_last_endpoint().map_err(bind_error)? {
            Ok(bound) => bound,
            Err(_) => config.endpoint.clone(),
        };
        let (queue, receiver) = mpsc::sync_channel(config.queue_batches.max(1));
        let counters = Arc::new(Counters::default());
        let sender = Sender {
            socket,
            topic: config.topic.into_bytes(),
            rank: config.data_parallel_rank,
            counters: counters.clone(),
        };
        let startup_wait = config.startup_wait;
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || {
                sender.await_subscription(startup_wait);
                sender.run(receiver);
            })?;
        let publisher = ZmqPublisher {
            queue: Some(queue),
            next_sequence: Mutex::new(config.first_sequence),
            counters,
            endpoint,
            thread: Some(thread),
        };
        publisher.publish(vec![KvEvent::AllBlocksCleared]);
        Ok(publisher)
    }

    /// The bound endpoint, with the port the system chose for port 0.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Batches dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Batches handed to the socket so far (whether or not anyone listened).
    pub fn sent(&self) -> u64 {
        self.counters.sent.load(Ordering::Relaxed)
    }
}

impl KvEventSink for ZmqPublisher {
    fn publish(&self, events: Vec<KvEvent>) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let Some(queue) = &self.queue else { return };
        let mut next = self.next_sequence.lock().unwrap_or_else(|e| e.into_inner());
        let sequence = *next;
        // A dropped batch keeps its number: subscribers see the gap.
        *next = sequence.wrapping_add(1);
        if queue.try_send(Queued { sequence, ts, events }).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ZmqPublisher {
    /// Sends what is queued (giving it half a second to leave, never waiting
    /// longer for subscribers), then stops.
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How often the sending thread looks for batches when it found none: a
/// batch waits at most this long (plus the timer's slack) to be sent.
const POLL: Duration = Duration::from_millis(1);

/// The sending thread's state: it alone touches the socket.
struct Sender {
    socket: zmq::Socket,
    topic: Vec<u8>,
    rank: i32,
    counters: Arc<Counters>,
}

impl Sender {
    /// Waits until a subscription arrives or `wait` has passed. An XPUB
    /// hands each new subscription up as a message (`0x01`, then the
    /// topic) once it is in effect, so what is sent after it reaches that
    /// subscriber.
    fn await_subscription(&self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let millis = left.as_millis().clamp(1, i64::MAX as u128) as i64;
            match self.socket.poll(zmq::POLLIN, millis) {
                Ok(0) => {}
                Ok(_) => {
                    if self.read_subscriptions() > 0 {
                        return;
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "KV events: polling for subscribers failed");
                    return;
                }
            }
        }
    }

    /// Reads the subscription changes the socket has queued (they would
    /// otherwise pile up); returns how many were subscriptions.
    fn read_subscriptions(&self) -> usize {
        let mut subscribed = 0;
        while let Ok(message) = self.socket.recv_bytes(zmq::DONTWAIT) {
            if message.first() == Some(&1) {
                subscribed += 1;
            }
        }
        subscribed
    }

    /// Sends what is queued, in order, until the publisher is dropped. The
    /// queue is polled every [`POLL`] rather than waited on: a thread parked on
    /// it would have to be woken by `publish`, a system call (about 6 us where
    /// a `try_send` alone takes 0.1 us).
    fn run(&self, queue: Receiver<Queued>) {
        loop {
            match queue.try_recv() {
                Ok(batch) => self.send(&batch),
                Err(TryRecvError::Empty) => {
                    self.read_subscriptions();
                    std::thread::sleep(POLL);
                }
                Err(TryRecvError::Disconnected) => return,
            }
        }
    }

    /// Hands one batch to the socket: three frames, never waiting.
    fn send(&self, batch: &Queued) {
        let payload = encode_batch(batch.ts, &batch.events, Some(self.rank));
        let frames: [&[u8]; 3] = [&self.topic, &batch.sequence.to_be_bytes(), &payload];
        if let Err(error) = self.socket.send_multipart(frames, zmq::DONTWAIT) {
            tracing::warn!(%error, "KV events: send failed; batch lost");
        }
        self.counters.sent.fetch_add(1, Ordering::Relaxed);
    }
}
