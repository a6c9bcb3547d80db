//! The one place the OpenAI API's HTTP status codes are chosen (invariant 9: the OTLP receiver and
//! the mock engine answer contracts of their own, each in one place too).
//!
//! Library crates return typed errors (`ProtocolError` from every backend → [`ApiError`]); this
//! module maps them to an OpenAI-shaped error body and a status, and attaches `Retry-After` where
//! a retry can succeed. A closed `match` over [`ErrorKind`] means a new kind cannot be forgotten.

use crate::ratelimit::RateLimited;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokenpath_protocol::{ApiError, ErrorKind, ProtocolError};

/// Errors of the gateway itself (start-up and serving), for the binary.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The listen address could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// Address that was asked for.
        addr: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// The HTTP server failed while serving.
    #[error("HTTP server error: {0}")]
    Serve(#[source] std::io::Error),
    /// A configuration that cannot work.
    #[error("invalid gateway configuration: {0}")]
    Config(String),
    /// API keys that cannot be used (the message names the entry, never the key).
    #[error("invalid API keys: {0}")]
    Keys(String),
    /// An API key file that cannot be read or used (the message names the entry, never the key).
    #[error("API key file {path}: {message}")]
    KeyFile {
        /// The file.
        path: String,
        /// What is wrong, and where.
        message: String,
    },
}

/// A rejected request: the OpenAI error, and the status when it is not the kind's usual one.
#[derive(Debug)]
pub(crate) struct Reject {
    pub(crate) api: ApiError,
    status: Option<StatusCode>,
    retry_after_s: u64,
}

impl Reject {
    /// The usual status for the error's kind.
    pub(crate) fn new(api: ApiError) -> Self {
        Reject { api, status: None, retry_after_s: 1 }
    }

    /// 413: the body is larger than the configured limit.
    pub(crate) fn too_large(limit: usize) -> Self {
        let api = ApiError::invalid_request(
            format!("The request body is larger than the server's limit of {limit} bytes."),
            None,
        );
        Reject { api, status: Some(StatusCode::PAYLOAD_TOO_LARGE), retry_after_s: 1 }
    }

    /// 429: over a tenant's rate limit, retry when its bucket says.
    pub(crate) fn rate_limited(r: &RateLimited) -> Self {
        Reject { api: ApiError::rate_limit(r.message()), status: None, retry_after_s: r.retry_after_s.max(1) }
    }

    /// 507: a bounded store (the worker registry) is full.
    pub(crate) fn insufficient_storage(message: String) -> Self {
        Reject {
            api: ApiError::invalid_request(message, None),
            status: Some(StatusCode::INSUFFICIENT_STORAGE),
            retry_after_s: 1,
        }
    }

    /// 404 for a path that does not exist.
    pub(crate) fn no_route(path: &str) -> Self {
        let api = ApiError::invalid_request(format!("Unknown request URL: {path}."), None);
        Reject { api, status: Some(StatusCode::NOT_FOUND), retry_after_s: 1 }
    }

    /// The status this rejection is sent with.
    pub(crate) fn status(&self) -> StatusCode {
        self.status.unwrap_or_else(|| status_of(self.api.kind))
    }

    /// Maps a backend's refusal; `param` names the prompt field (`messages` or `prompt`).
    pub(crate) fn from_backend(e: &ProtocolError, param: &str) -> Self {
        if let ProtocolError::Unavailable { .. } = e {
            tracing::error!("backend error: {e}");
        }
        Reject::new(e.api_error_for(Some(param)))
    }
}

/// The status for each kind of API error.
pub(crate) fn status_of(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::InvalidRequest | ErrorKind::ContextLengthExceeded => StatusCode::BAD_REQUEST,
        ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
        ErrorKind::Permission => StatusCode::FORBIDDEN,
        ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ErrorKind::Conflict => StatusCode::CONFLICT,
        ErrorKind::ModelNotFound => StatusCode::NOT_FOUND,
        ErrorKind::RateLimit => StatusCode::TOO_MANY_REQUESTS,
        ErrorKind::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::ServerError => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = serde_json::to_vec(&self.api.body).unwrap_or_else(|_| b"{\"error\":{}}".to_vec());
        let mut resp = (status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        if matches!(self.api.kind, ErrorKind::Overloaded | ErrorKind::RateLimit) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(self.retry_after_s));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_errors_map_to_openai_statuses() {
        let ctx = ProtocolError::ContextOverflow { prompt_tokens: 10, max_tokens: 5, limit: 12 };
        let r = Reject::from_backend(&ctx, "messages");
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(r.api.body.error.code.as_deref(), Some("context_length_exceeded"));
        let r = Reject::from_backend(&ProtocolError::Overloaded { max: 1 }, "prompt");
        let down = Reject::from_backend(&ProtocolError::Unavailable { message: "x".into() }, "prompt");
        assert_eq!(down.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let stopped = Reject::from_backend(&ProtocolError::Stopped, "prompt");
        assert_eq!(stopped.status(), StatusCode::SERVICE_UNAVAILABLE);
        let bad = Reject::from_backend(
            &ProtocolError::InvalidRequest { param: None, message: "m".into() },
            "prompt",
        );
        assert_eq!(bad.api.body.error.param.as_deref(), Some("prompt"));
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let resp = r.into_response();
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        assert_eq!(Reject::too_large(10).status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(status_of(ErrorKind::ModelNotFound), StatusCode::NOT_FOUND);
        assert_eq!(status_of(ErrorKind::Authentication), StatusCode::UNAUTHORIZED);
        assert_eq!(status_of(ErrorKind::Permission), StatusCode::FORBIDDEN);
        assert_eq!(status_of(ErrorKind::UnsupportedMediaType), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(status_of(ErrorKind::Conflict), StatusCode::CONFLICT);
        assert_eq!(status_of(ErrorKind::RateLimit), StatusCode::TOO_MANY_REQUESTS);
        let limited = RateLimited {
            limit: crate::ratelimit::Limit::InputTokens,
            per_minute: 600,
            retry_after_s: 7,
            too_large: None,
        };
        let resp = Reject::rate_limited(&limited).into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "7");
    }
}
