//! Errors as OpenAI sends them: a status and
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::openai::{ErrorBody, ErrorDetail};

/// A request the server refuses, or a failure while serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// Seconds after which a retry may succeed (sent as `Retry-After`).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// Sets the code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 404: the model named is not served here.
    pub fn unknown_model(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::invalid(Some("model"), format!("The model `{model}` does not exist"))
        }
        .with_code("model_not_found")
    }

    /// 503 with `Retry-After`: the queue is full.
    pub fn overloaded(in_flight: usize) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("The server is busy ({in_flight} requests in flight); retry shortly"),
            kind: "server_error",
            param: None,
            code: Some("server_overloaded"),
            retry_after: Some(1),
        }
    }

    /// 500: the engine failed.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 401: no API key, or one the server does not know.
    pub fn unauthorized(message: &str) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            ..ApiError::invalid(None, message)
        }
        .with_code("invalid_api_key")
    }

    /// 413: the body is larger than `limit` bytes.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            ..ApiError::invalid(None, format!("The request body is larger than {limit} bytes"))
        }
        .with_code("request_too_large")
    }

    /// 408: the body did not arrive within `after`.
    pub fn body_timeout(after: std::time::Duration) -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            ..ApiError::invalid(
                None,
                format!(
                    "The request body did not arrive within {:.1} s",
                    after.as_secs_f64()
                ),
            )
        }
        .with_code("request_timeout")
    }

    /// 404 for a path the server does not serve.
    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::invalid(None, format!("No route for {path}"))
        }
    }

    /// Why the request was refused, in a word: the `reason` of its access
    /// line and, for a 4xx, of `kvcache_requests_rejected_total{reason}`.
    pub fn reason(&self) -> &'static str {
        reason_of(self.status)
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: &self.message,
                param: self.param.as_deref(),
                kind: self.kind,
            },
        }
    }
}

/// The reason of a refusal with `status` (see [`ApiError::reason`]): one of
/// [`crate::metrics::REJECT_REASONS`] for a 4xx, `overloaded` for 503 and
/// `server_error` for the other 5xx.
pub fn reason_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_request",
        401 => "unauthorized",
        404 => "not_found",
        405 => "method_not_allowed",
        408 => "timeout",
        413 => "too_large",
        503 => "overloaded",
        500..=599 => "server_error",
        _ => "other",
    }
}

/// The response of an error carries the error itself as an extension: the
/// access log reads its reason and message from there, whoever made it.
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response.extensions_mut().insert(self);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_4xx_has_a_counted_reason() {
        for status in [400u16, 401, 404, 405, 408, 413, 418] {
            let status = StatusCode::from_u16(status).unwrap();
            assert!(
                crate::metrics::REJECT_REASONS.contains(&reason_of(status)),
                "{status}"
            );
        }
        assert_eq!(ApiError::too_large(1).reason(), "too_large");
        assert_eq!(ApiError::overloaded(1).reason(), "overloaded");
        let response = ApiError::unauthorized("no").into_response();
        assert_eq!(
            response.extensions().get::<ApiError>().map(ApiError::reason),
            Some("unauthorized")
        );
    }
}
