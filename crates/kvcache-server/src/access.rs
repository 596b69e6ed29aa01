//! What an operator sees of each request: an `x-request-id` on every
//! response (the client's own when it sent a usable one) and one access log
//! line per request, written when its response body is done (for a stream:
//! when the last event is sent or the client goes away), with the id,
//! method, path, status, token counts, cached tokens, time to first token and
//! duration, and the error's message for a refusal.
//!
//! The line is a `tracing` event of target [`TARGET`] (`RUST_LOG` filters it
//! like any other); 5xx answers are logged at `warn`, the rest at `info`.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};

use crate::openai::Usage;

/// The `tracing` target of the access log.
pub const TARGET: &str = "kvcache_server::access";

/// The request id header, read from requests and set on every response.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client request id echoed back (longer ones are replaced).
const MAX_CLIENT_ID: usize = 128;

/// What a handler learns about a request for its log line; shared between
/// the handler (or the stream it returns) and the middleware.
#[derive(Debug, Clone, Default)]
pub struct AccessRecord(Arc<Mutex<Fields>>);

#[derive(Debug, Default)]
struct Fields {
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    ttft: Option<Duration>,
    finish_reason: Option<&'static str>,
    error: Option<String>,
}

impl AccessRecord {
    fn with<R>(&self, f: impl FnOnce(&mut Fields) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The request's token counts and why it finished.
    pub fn finished(&self, usage: &Usage, finish_reason: &'static str) {
        self.with(|f| {
            f.prompt_tokens = Some(usage.prompt_tokens);
            f.completion_tokens = Some(usage.completion_tokens);
            f.cached_tokens = Some(usage.prompt_tokens_details.cached_tokens);
            f.finish_reason = Some(finish_reason);
        });
    }

    /// The prompt's length, known before the request runs.
    pub fn prompt(&self, tokens: usize) {
        self.with(|f| f.prompt_tokens = Some(tokens));
    }

    /// When the first token came, counted from the request's arrival.
    pub fn first_token(&self, after: Duration) {
        self.with(|f| {
            f.ttft.get_or_insert(after);
        });
    }

    /// Tokens generated so far (for a request cut short).
    pub fn generated(&self, tokens: usize) {
        self.with(|f| f.completion_tokens = Some(tokens));
    }

    /// Why the request was refused or failed.
    pub fn error(&self, message: &str) {
        self.with(|f| f.error = Some(message.to_owned()));
    }
}

/// The id of the request: the client's `x-request-id` when it is 1 to 128
/// characters of `A-Z a-z 0-9 - _ . :`, else a new one (`req-` and hex).
pub fn request_id(client: Option<&HeaderValue>) -> String {
    let usable = |id: &str| {
        (1..=MAX_CLIENT_ID).contains(&id.len())
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
    };
    if let Some(id) = client.and_then(|v| v.to_str().ok()).filter(|id| usable(id)) {
        return id.to_owned();
    }
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    format!("req-{micros:x}{n:06x}")
}

/// The middleware: gives the request its id and an [`AccessRecord`], sets
/// `x-request-id` on the response, and logs the line once the body is done.
pub async fn layer(mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = request_id(request.headers().get(&REQUEST_ID));
    let record = AccessRecord::default();
    request.extensions_mut().insert(record.clone());
    let method = request.method().to_string();
    let path = request.uri().path().to_owned();
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID.clone(), value);
    }
    let line = Line {
        id,
        method,
        path,
        status: response.status(),
        started,
        record,
    };
    // The line goes out when the body is dropped: sent in full, or abandoned
    // by a client that went away.
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, Body::new(Logged { body, _line: line }))
}

/// A response body that carries its access line: the body's frames and size
/// as they are (a JSON answer keeps its `content-length`), the line written
/// when it is dropped.
struct Logged {
    body: Body,
    _line: Line,
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// One request's access log line, written on drop.
struct Line {
    id: String,
    method: String,
    path: String,
    status: StatusCode,
    started: Instant,
    record: AccessRecord,
}

impl Drop for Line {
    fn drop(&mut self) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let duration_ms = ms(self.started.elapsed());
        self.record.with(|f| {
            macro_rules! line {
                ($level:expr) => {
                    tracing::event!(
                        target: TARGET,
                        $level,
                        request_id = %self.id,
                        method = %self.method,
                        path = %self.path,
                        status = self.status.as_u16(),
                        prompt_tokens = f.prompt_tokens,
                        completion_tokens = f.completion_tokens,
                        cached_tokens = f.cached_tokens,
                        ttft_ms = f.ttft.map(ms),
                        duration_ms,
                        finish_reason = f.finish_reason,
                        error = f.error.as_deref(),
                        "request"
                    )
                };
            }
            if self.status.is_server_error() {
                line!(tracing::Level::WARN);
            } else {
                line!(tracing::Level::INFO);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_client_ids_are_kept_and_others_replaced() {
        let keep = HeaderValue::from_static("client-42_a.b:c");
        assert_eq!(request_id(Some(&keep)), "client-42_a.b:c");
        for bad in ["", "has space", "semi;colon", "ünï"] {
            let value = HeaderValue::from_bytes(bad.as_bytes()).unwrap();
            let id = request_id(Some(&value));
            assert!(id.starts_with("req-") && id != bad, "{bad:?} -> {id}");
        }
        let long = HeaderValue::from_str(&"x".repeat(MAX_CLIENT_ID + 1)).unwrap();
        assert!(request_id(Some(&long)).starts_with("req-"));
        let (a, b) = (request_id(None), request_id(None));
        assert_ne!(a, b);
    }
}
