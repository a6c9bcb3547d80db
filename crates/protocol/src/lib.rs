//! Every wire format of tokenpath, and only here: the OpenAI request/response/SSE types with the
//! `timing` extension, worker messages, and KV transfer framing.
//!
//! One crate owns the bytes so that a format change is one diff, and so every decoder of
//! untrusted input sits in one place with its bounds, typed errors and fuzz target. The modules
//! follow the two directions bytes travel: the server side parses and validates requests
//! ([`chat`], [`completion`], [`params`]) and renders responses, chunks and errors ([`response`],
//! [`stream`], [`error`]); the client side (the bench, talking to *any* OpenAI-compatible server)
//! decodes SSE ([`sse`]) and reads chunks leniently ([`view`]). Requests are strict (unknown
//! fields are a 400, as at OpenAI) because a silently ignored parameter is a wrong benchmark;
//! responses are lenient because other servers add fields we must not choke on. HTTP status codes
//! are not here: [`ErrorKind`] is what the gateway maps to a status. Between tokenpath processes,
//! [`frame`] is the one framing (versioned, bounded, checksummed) and [`cluster`] the messages.

pub mod auth;
pub mod backend;
pub mod chat;
pub mod cluster;
pub mod completion;
pub mod error;
pub mod forward;
pub mod frame;
pub mod params;
pub mod pool;
pub mod response;
pub mod sampling;
pub mod sse;
pub mod stream;
pub mod tokenize;
pub mod view;
mod wire;
pub mod work;

pub use chat::{parse_chat_request, ChatCompletionRequest, ChatMessage, ContentPart, MessageContent, Role};
pub use completion::{parse_completion_request, CompletionRequest, PromptInput};
pub use error::{ApiError, ErrorBody, ErrorDetail, ErrorKind};
pub use params::{
    GenerationParams, GenerationRequest, Limits, Prompt, PromptMessage, StreamOptions,
    COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_STOP_BYTES, MAX_STOP_SEQUENCES,
};
pub use response::{
    chat_completion_id, completion_id, ChatChoice, ChatCompletionResponse, CompletionChoice,
    CompletionResponse, FinishReason, PromptTokensDetails, ResponseMessage, Usage,
};
pub use sse::{SseDecoder, SseEvent, DEFAULT_MAX_EVENT_BYTES};
pub use stream::{
    sse_data, sse_event, ChatChunkChoice, ChatCompletionChunk, ChatStream, CompletionChunk, CompletionStream,
    Delta, SSE_DONE,
};
pub use view::{
    parse_response_body, parse_stream_chunk, parse_stream_parts, parse_stream_value, StreamChunkView,
};

use tokenpath_timeline::{ServerTiming, Stage};

/// Errors decoding or validating wire formats. One enum for the crate; the gateway turns it into
/// an OpenAI error body with [`ProtocolError::api_error`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProtocolError {
    /// A message larger than its bound.
    #[error("{what} is {len} bytes, over the {max}-byte limit")]
    TooLarge {
        /// What was being decoded.
        what: &'static str,
        /// Its declared or actual size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A request the server will not run: malformed JSON, a wrong type, an unknown field, a value
    /// out of range or a feature we do not support. `message` is in OpenAI's wording style and is
    /// sent to the client as is.
    #[error("{message}")]
    InvalidRequest {
        /// The offending request parameter (`temperature`, `messages[1].content`), when known.
        param: Option<String>,
        /// What is wrong, for the client.
        message: String,
    },
    /// A frame between tokenpath processes that breaks the framing rules (magic, version, kind,
    /// length, a control message that does not parse).
    #[error("invalid frame: {message}")]
    InvalidFrame {
        /// What is wrong.
        message: String,
    },
    /// A frame whose payload does not match its checksum: corrupted in flight.
    #[error("frame checksum mismatch: header says {expected:016x}, payload hashes to {actual:016x}")]
    Checksum {
        /// The header's checksum.
        expected: u64,
        /// The payload's.
        actual: u64,
    },
    /// Reading or writing the connection failed.
    #[error("connection error: {message}")]
    Connection {
        /// The I/O error.
        message: String,
    },
    /// A peer that could not prove it holds the cluster secret (or a connection that did not
    /// follow the handshake).
    #[error("unauthenticated: {message}")]
    Unauthenticated {
        /// What failed (never the secret or a MAC).
        message: String,
    },
    /// A backend's queue is full; the client should retry later.
    #[error("the queue is full ({max} requests waiting)")]
    Overloaded {
        /// The queue bound (0 when the backend did not say).
        max: usize,
    },
    /// No worker or upstream engine is up to take the request (none registered yet, all down,
    /// ejected or draining): not a full queue, which this used to be reported as.
    #[error("no worker is up to take the request")]
    NoWorker,
    /// The prompt, or the prompt plus `max_tokens`, does not fit the model's context.
    #[error("{prompt_tokens} prompt tokens + {max_tokens} completion tokens exceed the context of {limit}")]
    ContextOverflow {
        /// Prompt length in tokens (counted up to `limit + 1` when refused while tokenizing).
        prompt_tokens: usize,
        /// Requested completion tokens (0 when none was requested).
        max_tokens: usize,
        /// The model's context length.
        limit: usize,
    },
    /// A backend could not be reached, broke its protocol or refused for its own reasons.
    #[error("unavailable: {message}")]
    Unavailable {
        /// What happened (for logs; a peer's own words are cut by `cluster::peer_message`).
        message: String,
    },
    /// The backend is gone (shut down, restarting or crashed).
    #[error("the backend has stopped")]
    Stopped,
    /// A response (body or stream event) from a server that is not what an OpenAI-compatible
    /// server sends: not JSON, not an object, or a known field with an impossible type.
    #[error("invalid response: {message}")]
    InvalidResponse {
        /// What is wrong.
        message: String,
    },
}

impl ProtocolError {
    /// An [`ProtocolError::InvalidRequest`] about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ProtocolError::InvalidRequest { param: Some(param.into()), message: message.into() }
    }

    /// The OpenAI error this becomes on the wire. `param` names the request field a refusal
    /// without its own parameter is about (the prompt field: `messages` or `prompt`). A refusal
    /// by the backend becomes the matching error kind; every other variant is a problem with
    /// bytes the peer sent (`invalid_request_error`).
    pub fn api_error_for(&self, param: Option<&str>) -> ApiError {
        match self {
            ProtocolError::InvalidRequest { param: own, message } => {
                ApiError::invalid_request(message.clone(), own.clone().or_else(|| param.map(str::to_owned)))
            }
            ProtocolError::ContextOverflow { prompt_tokens, max_tokens, limit } => {
                ApiError::context_length_exceeded(
                    param.unwrap_or("messages"),
                    *limit as u64,
                    *prompt_tokens as u64,
                    *max_tokens as u64,
                )
            }
            ProtocolError::Overloaded { .. } => {
                ApiError::overloaded("The server is overloaded; please retry after a short wait.")
            }
            ProtocolError::Stopped => ApiError::overloaded("The server is shutting down or restarting."),
            ProtocolError::NoWorker => ApiError::overloaded(
                "No worker is available to serve this request; please retry after a short wait.",
            ),
            ProtocolError::Unavailable { .. } => {
                ApiError::server_error("The server had an error while processing your request.")
            }
            other => ApiError::invalid_request(other.to_string(), None),
        }
    }

    /// [`ProtocolError::api_error_for`] without a prompt field.
    pub fn api_error(&self) -> ApiError {
        self.api_error_for(None)
    }
}

/// The JSON key of the timing extension in responses and in the last SSE chunk.
pub const TIMING_FIELD: &str = "timing";

/// Renders a W3C `Server-Timing` header value (`queue;dur=12.1, prefill;dur=240.5`), stages in path
/// order, so browsers' dev tools display the server timeline of a non-streamed response.
pub fn server_timing_header(timing: &ServerTiming) -> String {
    Stage::ALL
        .iter()
        .filter_map(|s| timing.stage_ms(*s).map(|ms| format!("{};dur={ms:.1}", s.name())))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timing_header_is_in_path_order_and_skips_absent_stages() {
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Prefill, 240.54);
        t.stages_ms.insert(Stage::Queue, 12.1);
        t.stages_ms.insert(Stage::Decode, 1000.0);
        assert_eq!(server_timing_header(&t), "queue;dur=12.1, prefill;dur=240.5, decode;dur=1000.0");
        assert_eq!(server_timing_header(&ServerTiming::default()), "");
    }

    #[test]
    fn protocol_errors_become_invalid_request_errors_with_their_param() {
        let e = ProtocolError::invalid("temperature", "bad");
        let api = e.api_error();
        assert_eq!(api.kind, ErrorKind::InvalidRequest);
        assert_eq!(api.body.error.param.as_deref(), Some("temperature"));
        assert_eq!(api.body.error.message, "bad");
        let big = ProtocolError::TooLarge { what: "SSE event", len: 9, max: 8 };
        assert!(big.api_error().body.error.message.contains("8-byte limit"));
        assert_eq!(big.api_error().body.error.param, None);
    }
}
