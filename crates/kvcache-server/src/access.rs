//! What an operator sees of each request: an `x-request-id` on every
//! response (the client's own when it sent a usable one; tower-http's
//! request-id layers set and propagate it, see [`crate::routes::router`]) and exactly one
//! access log line per request, however it ends: written when its response
//! body is done (for a stream: when the last event is sent or the client goes
//! away), or, for a client that leaves before the answer is ready, when its
//! handler is dropped (status 499, as nginx logs it). The line has the id,
//! method, path, status, tenant, token counts, cached tokens, time to first
//! token and duration, why the answer finished (`cancelled` when the client
//! left first), and for a refusal its reason and message.
//!
//! Every 4xx is counted here, by reason, in
//! `kvcache_requests_rejected_total{reason}`, whoever answered it (a
//! handler, the key and body guard, axum's 405).
//!
//! The line is a `tracing` event of target [`TARGET`] (`RUST_LOG` filters it
//! like any other); 5xx answers are logged at `warn`, the rest at `info`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use tower_http::request_id::{MakeRequestId, RequestId};

use crate::body::{BodyEnd, Reported};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::Usage;

/// The `tracing` target of the access log.
pub const TARGET: &str = "kvcache_server::access";

/// The request id header, read from requests and set on every response.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client request id echoed back (longer ones are replaced).
const MAX_CLIENT_ID: usize = 128;

/// The status logged for a request whose client went away before its
/// answer was ready (nginx's "client closed request"); never sent.
pub const CLIENT_CLOSED: u16 = 499;

/// The finish reason logged for an answer cut short because its client left.
pub const CANCELLED: &str = "cancelled";

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
    reason: Option<&'static str>,
    tenant: Option<String>,
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

    /// A refusal or failure: its message and its reason in a word
    /// ([`ApiError::reason`]).
    pub fn refused(&self, error: &ApiError) {
        self.with(|f| {
            f.error = Some(error.message.clone());
            f.reason = Some(error.reason());
        });
    }

    /// The tenant the request's API key names (its name in the keys file,
    /// else the key's namespace; never the key).
    pub fn tenant(&self, name: &str) {
        self.with(|f| f.tenant = Some(name.to_owned()));
    }
}

/// Whether a client's request id is kept: 1 to 128 characters of
/// `A-Z a-z 0-9 - _ . :`.
fn usable(id: &HeaderValue) -> bool {
    id.to_str().is_ok_and(|id| {
        (1..=MAX_CLIENT_ID).contains(&id.len())
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
    })
}

/// The id of the request: the client's `x-request-id` when it is
/// usable (1 to 128 characters of `A-Z a-z 0-9 - _ . :`), else a new one
/// (`req-` and hex).
pub fn request_id(client: Option<&HeaderValue>) -> String {
    if let Some(id) = client.filter(|id| usable(id)).and_then(|v| v.to_str().ok()) {
        return id.to_owned();
    }
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    format!("req-{micros:x}{n:06x}")
}

/// Before tower-http's [`SetRequestIdLayer`](tower_http::request_id::SetRequestIdLayer):
/// a client's `x-request-id` that [`request_id`] would not keep is dropped, so
/// that the request gets a new one.
pub async fn drop_unusable_id(mut request: Request) -> Request {
    if request.headers().get(&REQUEST_ID).is_some_and(|id| !usable(id)) {
        request.headers_mut().remove(&REQUEST_ID);
    }
    request
}

/// Makes the id of a request that came without a usable one, for
/// tower-http's [`SetRequestIdLayer`](tower_http::request_id::SetRequestIdLayer).
#[derive(Debug, Clone, Copy, Default)]
pub struct NewRequestId;

impl MakeRequestId for NewRequestId {
    fn make_request_id<B>(&mut self, _request: &axum::http::Request<B>) -> Option<RequestId> {
        HeaderValue::from_str(&request_id(None)).ok().map(RequestId::new)
    }
}

/// The middleware, inside tower-http's request-id layers (the id set on the
/// request, and copied onto the response): gives the request an
/// [`AccessRecord`], counts a 4xx by reason, and logs the line, with the
/// id, once the body is done, or at once if the request is dropped before it
/// has an answer (its client went away).
pub async fn layer(State(metrics): State<Arc<Metrics>>, mut request: Request, next: Next) -> Response {
    let id = match request.extensions().get::<RequestId>() {
        Some(id) => id.header_value().to_str().unwrap_or_default().to_owned(),
        None => request_id(request.headers().get(&REQUEST_ID)),
    };
    let record = AccessRecord::default();
    request.extensions_mut().insert(record.clone());
    // From here on, however the request ends, dropping `line` logs it once.
    let mut line = Line {
        id,
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
        status: None,
        started: Instant::now(),
        record,
        // A HEAD answer has no body to send.
        complete: request.method() == axum::http::Method::HEAD,
    };
    let response = next.run(request).await;
    let status = response.status();
    line.status = Some(status);
    if let Some(error) = response.extensions().get::<ApiError>() {
        line.record.refused(error);
    }
    if status.is_client_error() {
        metrics.reject(crate::error::reason_of(status));
    }
    // The line goes out when the body is dropped: sent in full, or abandoned
    // by a client that went away.
    response.map(|body| Reported::wrap(body, line))
}

/// The line learns from the response body whether it went out in full; it
/// is written when dropped, right after.
impl BodyEnd for Line {
    fn ended(mut self, complete: bool) {
        self.complete |= complete;
    }
}

/// One request's access log line, written on drop.
struct Line {
    id: String,
    method: String,
    path: String,
    /// `None` until the handler has answered.
    status: Option<StatusCode>,
    started: Instant,
    record: AccessRecord,
    /// Whether the whole body went out.
    complete: bool,
}

impl Drop for Line {
    fn drop(&mut self) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let duration_ms = ms(self.started.elapsed());
        // No answer yet, or a body not sent in full: the client went away.
        let disconnected = self.status.is_none() || !self.complete;
        let status = self.status.map_or(CLIENT_CLOSED, |s| s.as_u16());
        self.record.with(|f| {
            let finish_reason = match f.finish_reason {
                Some(reason) => Some(reason),
                // A generation cut short (its prompt known, no error).
                None if disconnected && f.error.is_none() && f.prompt_tokens.is_some() => Some(CANCELLED),
                None => None,
            };
            macro_rules! line {
                ($level:expr) => {
                    tracing::event!(
                        target: TARGET,
                        $level,
                        request_id = %self.id,
                        method = %self.method,
                        path = %self.path,
                        status,
                        tenant = f.tenant.as_deref(),
                        prompt_tokens = f.prompt_tokens,
                        completion_tokens = f.completion_tokens,
                        cached_tokens = f.cached_tokens,
                        ttft_ms = f.ttft.map(ms),
                        duration_ms,
                        finish_reason,
                        disconnected,
                        reason = f.reason,
                        error = f.error.as_deref(),
                        "request"
                    )
                };
            }
            if (500..600).contains(&status) {
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
