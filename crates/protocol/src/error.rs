//! The OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, and the
//! [`ErrorKind`] the gateway maps to an HTTP status.
//!
//! Statuses are deliberately absent (invariant: the gateway alone chooses them); each
//! constructor returns an [`ApiError`] = kind + body so the gateway's mapping is one `match` over
//! a closed enum and can never disagree with the body's `type`. The body also deserializes
//! leniently (a numeric `code`, as older vLLM sends, becomes a string) so the bench can read
//! error bodies and in-stream error events from any server.

use crate::wire::lenient_code;
use serde::{Deserialize, Serialize};

/// What went wrong, for the gateway's status mapping (suggested statuses in brackets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Malformed, out-of-range or unsupported request (400).
    InvalidRequest,
    /// Prompt plus `max_tokens` exceed the model's context (400).
    ContextLengthExceeded,
    /// Missing or wrong API key (401).
    Authentication,
    /// A valid credential that may not do this (a tenant key on an admin route), or a request
    /// from where it may not come (a foreign `Origin` or `Host`) (403).
    Permission,
    /// A body that is not `application/json` where JSON is required (415).
    UnsupportedMediaType,
    /// A change that contradicts the current state (re-registering a worker with another role)
    /// (409).
    Conflict,
    /// Unknown model (404).
    ModelNotFound,
    /// Client over its rate limit (429).
    RateLimit,
    /// No capacity right now; retry later (503).
    Overloaded,
    /// A bug or a failed worker (500).
    ServerError,
}

/// The inner error object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// For humans.
    #[serde(default)]
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, ...).
    #[serde(rename = "type", default)]
    pub kind: String,
    /// The request parameter at fault.
    #[serde(default)]
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, ...).
    #[serde(default, deserialize_with = "lenient_code")]
    pub code: Option<String>,
}

/// `{"error": {...}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// An error response: what the gateway needs to pick a status, and what it sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// For the status code.
    pub kind: ErrorKind,
    /// The JSON body (also usable as an in-stream SSE error event).
    pub body: ErrorBody,
}

impl ApiError {
    fn new(kind: ErrorKind, type_: &str, message: String, param: Option<String>, code: Option<&str>) -> Self {
        ApiError {
            kind,
            body: ErrorBody {
                error: ErrorDetail { message, kind: type_.to_owned(), param, code: code.map(str::to_owned) },
            },
        }
    }

    /// `invalid_request_error`.
    pub fn invalid_request(message: impl Into<String>, param: Option<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, "invalid_request_error", message.into(), param, None)
    }

    /// OpenAI's context-length error: `invalid_request_error` with code `context_length_exceeded`.
    /// `param` is `messages` (chat) or `prompt` (completions).
    pub fn context_length_exceeded(
        param: &str,
        max_context: u64,
        prompt_tokens: u64,
        max_tokens: u64,
    ) -> Self {
        let what = if param == "prompt" { "prompt" } else { "messages" };
        Self::new(
            ErrorKind::ContextLengthExceeded,
            "invalid_request_error",
            format!(
                "This model's maximum context length is {max_context} tokens. However, you requested {} tokens \
                 ({prompt_tokens} in the {what}, {max_tokens} in the completion). Please reduce the length of \
                 the {what} or completion.",
                prompt_tokens.saturating_add(max_tokens)
            ),
            Some(param.to_owned()),
            Some("context_length_exceeded"),
        )
    }

    /// `authentication_error`, code `invalid_api_key`. Never echo the key back in `message`.
    pub fn authentication(message: impl Into<String>) -> Self {
        Self::new(
            ErrorKind::Authentication,
            "authentication_error",
            message.into(),
            None,
            Some("invalid_api_key"),
        )
    }

    /// `permission_error`: authenticated but not allowed.
    pub fn permission(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Permission, "permission_error", message.into(), None, None)
    }

    /// `invalid_request_error`, code `unsupported_media_type`.
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(
            ErrorKind::UnsupportedMediaType,
            "invalid_request_error",
            message.into(),
            None,
            Some("unsupported_media_type"),
        )
    }

    /// `invalid_request_error`, code `conflict`.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, "invalid_request_error", message.into(), None, Some("conflict"))
    }

    /// OpenAI's unknown-model error: `invalid_request_error`, code `model_not_found`.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            ErrorKind::ModelNotFound,
            "invalid_request_error",
            format!("The model `{model}` does not exist or you do not have access to it."),
            Some("model".to_owned()),
            Some("model_not_found"),
        )
    }

    /// `rate_limit_error`, code `rate_limit_exceeded`.
    pub fn rate_limit(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RateLimit, "rate_limit_error", message.into(), None, Some("rate_limit_exceeded"))
    }

    /// `server_overloaded`: no capacity now, the client should retry with backoff.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Overloaded, "server_overloaded", message.into(), None, None)
    }

    /// `server_error`.
    pub fn server_error(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::ServerError, "server_error", message.into(), None, None)
    }
}

impl From<crate::ProtocolError> for ApiError {
    fn from(e: crate::ProtocolError) -> Self {
        e.api_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_have_openai_shape() {
        let e = ApiError::invalid_request("bad", Some("top_p".into()));
        assert_eq!(
            serde_json::to_value(&e.body).unwrap(),
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": null}})
        );
        let cases = [
            (
                ApiError::authentication("no key"),
                ErrorKind::Authentication,
                "authentication_error",
                Some("invalid_api_key"),
            ),
            (
                ApiError::model_not_found("gpt-x"),
                ErrorKind::ModelNotFound,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            (
                ApiError::rate_limit("slow down"),
                ErrorKind::RateLimit,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
            ),
            (ApiError::overloaded("busy"), ErrorKind::Overloaded, "server_overloaded", None),
            (ApiError::server_error("oops"), ErrorKind::ServerError, "server_error", None),
            (
                ApiError::context_length_exceeded("messages", 8192, 8000, 1000),
                ErrorKind::ContextLengthExceeded,
                "invalid_request_error",
                Some("context_length_exceeded"),
            ),
        ];
        for (e, kind, type_, code) in cases {
            assert_eq!(e.kind, kind);
            assert_eq!(e.body.error.kind, type_);
            assert_eq!(e.body.error.code.as_deref(), code);
            let back: ErrorBody = serde_json::from_str(&serde_json::to_string(&e.body).unwrap()).unwrap();
            assert_eq!(back, e.body);
        }
        let ctx = ApiError::context_length_exceeded("messages", 8192, 8000, 1000);
        assert!(ctx.body.error.message.contains("you requested 9000 tokens (8000 in the messages, 1000"));
        assert!(ApiError::model_not_found("gpt-x").body.error.message.contains("`gpt-x` does not exist"));
    }

    #[test]
    fn foreign_error_bodies_parse_leniently() {
        let vllm =
            r#"{"error":{"object":"error","message":"m","type":"BadRequestError","param":null,"code":400}}"#;
        let b: ErrorBody = serde_json::from_str(vllm).unwrap();
        assert_eq!(b.error.code.as_deref(), Some("400"));
        assert_eq!(b.error.kind, "BadRequestError");
    }
}
