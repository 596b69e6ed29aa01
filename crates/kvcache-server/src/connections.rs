//! The server's HTTP/1.1 connections: its own accept loop over hyper, so
//! that no phase of a connection can be held open by a slow client, and a
//! bound on how many are open.
//!
//! - **Headers**: a request's headers must be complete within
//!   `header_timeout` of their first byte, or the connection is closed
//!   (counted in `kvcache_connections_timed_out_total{phase="headers"}`).
//!   Hyper's own `header_read_timeout` stands behind it, set to the header
//!   and idle timeouts together (it counts from the moment the connection is
//!   ready for a request).
//! - **Body**: `routes::guard` reads it within `body_timeout` (a 408 with
//!   `Connection: close`, counted in `kvcache_requests_rejected_total`).
//! - **Idle**: a connection with no request in progress and no byte of the
//!   next one is closed after `keep_alive_timeout` since its last answer
//!   (or since it opened), counted as `phase="idle"`; a zero timeout serves
//!   one request per connection (which waits `header_timeout` for it).
//! - **How many**: at most `max_connections` at once; past it a new
//!   connection gets a 503 in OpenAI's error shape with `Connection: close`
//!   and `Retry-After`, and is closed (counted in
//!   `kvcache_connections_refused_total`). Keep it below the process's
//!   descriptor limit (`ulimit -n`): the server warns at start when it is not.
//!
//! A shutdown (SIGTERM, Ctrl-C) stops accepting, closes idle connections at
//! once, lets every request in progress finish (streams included) and then
//! returns.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower_service::Service;

use crate::body::{BodyEnd, Reported};
use crate::metrics::Metrics;
use crate::openai::{ErrorBody, ErrorDetail};

/// How long each phase of a connection may take, and how many may be open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From the first byte of a request's headers to their end.
    pub header_timeout: Duration,
    /// Idle between requests (and before the first); zero: no keep-alive.
    pub keep_alive_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

/// Refused connections lingering at once to deliver their 503 (beyond, a
/// refused connection is closed at once).
const MAX_REFUSING: usize = 64;

/// Serves `app` on `listener` within `limits` until `shutdown` resolves,
/// then lets the connections' requests in progress finish and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let max = u32::try_from(limits.max_connections)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "max_connections out of range"))?;
    let slots = Arc::new(Semaphore::new(max as usize));
    let refusing = Arc::new(AtomicUsize::new(0));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut last_refusal_log: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of descriptors or memory: wait rather than spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                metrics.connections_accepted.fetch_add(1, Ordering::Relaxed);
                let (app, metrics, stop) = (app.clone(), metrics.clone(), stop_rx.clone());
                tokio::spawn(async move {
                    metrics.connections_open.fetch_add(1, Ordering::Relaxed);
                    connection(stream, app, limits, &metrics, stop).await;
                    metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
                    drop(slot);
                });
            }
            Err(_) => {
                let refused = metrics.connections_refused.fetch_add(1, Ordering::Relaxed) + 1;
                if last_refusal_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    last_refusal_log = Some(Instant::now());
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        refused_total = refused,
                        "a connection past --max-connections was refused"
                    );
                }
                refuse(stream, limits.max_connections, &refusing);
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every slot back: every connection has ended.
    let _ = slots.acquire_many(max).await;
    Ok(())
}

/// The answer of a connection past the limit: OpenAI's error shape, then
/// the connection closes.
fn refusal(max: usize) -> Vec<u8> {
    let message = format!("The server has {max} connections open, its limit; retry shortly");
    let body = ErrorBody {
        error: ErrorDetail {
            code: Some("too_many_connections"),
            message: &message,
            param: None,
            kind: "server_error",
        },
    };
    let body = serde_json::to_string(&body).expect("an error body serializes");
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers `stream` with the refusal and closes it: the answer written, the
/// request read and dropped for up to a second so that closing does not
/// reset the connection before the client reads it. At most
/// [`MAX_REFUSING`] linger at once; past that, closed at once.
fn refuse(mut stream: TcpStream, max: usize, refusing: &Arc<AtomicUsize>) {
    if refusing.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSING {
        refusing.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let refusing = refusing.clone();
    tokio::spawn(async move {
        let answer = async {
            stream.write_all(&refusal(max)).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, io::Error>(())
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
        refusing.fetch_sub(1, Ordering::SeqCst);
    });
}

/// What a connection is doing, as its socket and its requests show it.
#[derive(Debug)]
struct Activity {
    opened: Instant,
    /// Requests whose answer is not fully sent yet.
    busy: AtomicUsize,
    /// Milliseconds after `opened` of the last answer's end.
    idle_since: AtomicU64,
    /// Milliseconds after `opened` of the last byte written.
    last_write: AtomicU64,
    /// Milliseconds after `opened` of the first byte read since the last
    /// answer, when one has been (a request's headers under way).
    first_read: AtomicU64,
    reading: AtomicBool,
    /// Wakes the connection's watch when its deadline moves (a request's
    /// first byte, the end of an answer).
    moved: tokio::sync::Notify,
}

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            busy: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            last_write: AtomicU64::new(0),
            first_read: AtomicU64::new(0),
            reading: AtomicBool::new(false),
            moved: tokio::sync::Notify::new(),
        }
    }

    fn now(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    fn read(&self) {
        if !self.reading.load(Ordering::Relaxed) {
            self.first_read.store(self.now(), Ordering::Relaxed);
            self.reading.store(true, Ordering::Relaxed);
            self.moved.notify_one();
        }
    }

    fn wrote(&self) {
        self.last_write.store(self.now(), Ordering::Relaxed);
    }

    fn answered(&self) {
        self.idle_since.store(self.now(), Ordering::Relaxed);
        self.reading.store(false, Ordering::Relaxed);
        self.busy.fetch_sub(1, Ordering::SeqCst);
        self.moved.notify_one();
    }

    /// What the connection waits for, and the deadline (milliseconds after
    /// `opened`) past which it has waited too long; `None` while a request
    /// is in progress (its body and answer have their own bounds).
    fn deadline(&self, limits: &Limits) -> Option<(Phase, u64)> {
        if self.busy.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let ms = |d: Duration| d.as_millis() as u64;
        if self.reading.load(Ordering::Relaxed) {
            let started = self.first_read.load(Ordering::Relaxed);
            return Some((Phase::Headers, started + ms(limits.header_timeout)));
        }
        let since = self
            .idle_since
            .load(Ordering::Relaxed)
            .max(self.last_write.load(Ordering::Relaxed));
        // Without keep-alive a connection still waits for its one request.
        let idle = match limits.keep_alive_timeout {
            d if d.is_zero() => limits.header_timeout,
            d => d,
        };
        Some((Phase::Idle, since + ms(idle)))
    }
}

/// What a connection without a request in progress waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The rest of a request's headers.
    Headers,
    /// The first byte of the next request.
    Idle,
}

/// Serves one connection until it closes, times out or is shut down.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: Limits,
    metrics: &Metrics,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: activity.clone(),
    });
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            activity.busy.fetch_add(1, Ordering::SeqCst);
            // Dropped with the answer's body (sent, or the client gone), or
            // with this future if the client leaves before the answer.
            let answering = Answering(activity.clone());
            let mut app = app.clone();
            async move {
                let response = match app.call(request.map(Body::new)).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(response.map(|body| Reported::wrap(body, answering)))
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // Hyper's clock starts when the connection is ready for a request:
        // idle time and headers together. Ours are finer (below); this one
        // stands behind them.
        .header_read_timeout(limits.header_timeout + limits.keep_alive_timeout)
        .keep_alive(!limits.keep_alive_timeout.is_zero());
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    if *stop.borrow() {
        return;
    }
    let mut shutting_down = false;
    loop {
        let deadline = activity.deadline(&limits);
        // While a request runs there is no deadline: its end wakes us.
        let wake = match deadline {
            Some((_, at)) => activity.opened + Duration::from_millis(at),
            None => Instant::now() + Duration::from_secs(3600),
        };
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    if error.is_timeout() {
                        metrics.header_timeouts.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::debug!(%error, "connection ended");
                }
                return;
            }
            changed = stop.changed(), if !shutting_down => {
                shutting_down = true;
                if changed.is_err() || matches!(activity.deadline(&limits), Some((Phase::Idle, _))) {
                    // Nothing in progress: close now.
                    return;
                }
                // Finish the request in progress, then close.
                conn.as_mut().graceful_shutdown();
            }
            () = activity.moved.notified() => {}
            () = tokio::time::sleep_until(wake.into()) => {
                if let Some((phase, at)) = activity.deadline(&limits) {
                    if activity.now() >= at {
                        match phase {
                            Phase::Headers => metrics.header_timeouts.fetch_add(1, Ordering::Relaxed),
                            Phase::Idle => metrics.idle_closed.fetch_add(1, Ordering::Relaxed),
                        };
                        tracing::debug!(?phase, "connection timed out");
                        return;
                    }
                }
            }
        }
    }
}

/// Ends a request's part in its connection's activity when its answer's body
/// is over, or when dropped before there is one.
struct Answering(Arc<Activity>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.answered();
    }
}

impl BodyEnd for Answering {
    fn ended(self, _complete: bool) {}
}

/// A socket that notes when bytes come and go.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The process's soft limit on open descriptors (`ulimit -n`), where the
/// system says (Linux: `/proc/self/limits`).
pub fn descriptor_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_connection_waits_for_its_next_request_and_a_started_one_for_its_headers() {
        let limits = Limits {
            header_timeout: Duration::from_secs(2),
            keep_alive_timeout: Duration::from_secs(5),
            max_connections: 1,
        };
        let a = Activity::new();
        assert_eq!(a.deadline(&limits), Some((Phase::Idle, 5000)));
        a.read();
        let (phase, at) = a.deadline(&limits).unwrap();
        assert_eq!(phase, Phase::Headers);
        assert!((2000..2100).contains(&at), "{at}");
        a.busy.fetch_add(1, Ordering::SeqCst);
        assert_eq!(a.deadline(&limits), None);
        a.answered();
        assert_eq!(a.deadline(&limits).map(|d| d.0), Some(Phase::Idle));
        // No keep-alive: the first request is still waited for.
        let once = Limits {
            keep_alive_timeout: Duration::ZERO,
            ..limits
        };
        assert_eq!(Activity::new().deadline(&once), Some((Phase::Idle, 2000)));
    }

    #[test]
    fn the_refusal_is_a_complete_http_answer() {
        let text = String::from_utf8(refusal(8)).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.contains("connection: close") && head.contains("retry-after: 1"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "too_many_connections");
    }
}
