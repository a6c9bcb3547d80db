//! Requests the gateway forwards to an HTTP upstream (vLLM, SGLang, llama.cpp, any OpenAI
//! server) instead of running them: the client's body is kept whole — fields tokenpath does not
//! know (`min_tokens`, `include_metrics`, `nvext`, `tools`, SGLang's extras) go to the engine
//! that does — while the fields the gateway itself acts on are validated exactly as for its own
//! engine, so a bad `max_tokens` is a 400 from us and every tenant limit sees the same numbers.
//!
//! [`parse_forwarded`] picks those fields out ([`CORE_FIELDS`]) into a body the strict parsers
//! take: each message's role, text and name (non-text content parts and tool calls are left to
//! the upstream, and not counted), `stream_options.include_usage`. The original body travels on
//! in [`Forwarded`].

use crate::params::{GenerationRequest, Limits};
use crate::{ChatCompletionRequest, CompletionRequest, ProtocolError};
use serde_json::{Map, Value};

/// The two OpenAI generation endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiEndpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl ApiEndpoint {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            ApiEndpoint::Chat => "/v1/chat/completions",
            ApiEndpoint::Completions => "/v1/completions",
        }
    }

    /// The request field that holds the prompt, for error messages.
    pub fn prompt_param(self) -> &'static str {
        match self {
            ApiEndpoint::Chat => "messages",
            ApiEndpoint::Completions => "prompt",
        }
    }
}

/// The fields the gateway validates and acts on (tokenization, limits, streaming); everything
/// else is the upstream's to judge.
pub const CORE_FIELDS: [&str; 16] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "user",
];

/// A request on its way to an upstream: the client's body, whole.
#[derive(Clone, Debug, PartialEq)]
pub struct Forwarded {
    /// Which endpoint it came through (and goes to).
    pub endpoint: ApiEndpoint,
    /// The client's JSON body, unknown fields included.
    pub body: Map<String, Value>,
}

/// Validates what the gateway acts on and keeps the whole body for the upstream.
pub fn parse_forwarded(
    endpoint: ApiEndpoint,
    body: &[u8],
    limits: &Limits,
) -> Result<(GenerationRequest, Forwarded), ProtocolError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| crate::wire::request_json_error(&e))?;
    let Value::Object(map) = value else {
        return Err(ProtocolError::InvalidRequest {
            param: None,
            message: "The request body must be a JSON object.".into(),
        });
    };
    let mut core = Map::new();
    for key in CORE_FIELDS {
        if let Some(v) = map.get(key) {
            core.insert(key.to_owned(), core_value(key, v));
        }
    }
    // Straight from the value: the body is parsed once.
    let core = Value::Object(core);
    let req = match endpoint {
        ApiEndpoint::Chat => serde_json::from_value::<ChatCompletionRequest>(core)
            .map_err(|e| crate::wire::request_json_error(&e))?
            .validate(limits)?,
        ApiEndpoint::Completions => serde_json::from_value::<CompletionRequest>(core)
            .map_err(|e| crate::wire::request_json_error(&e))?
            .validate(limits)?,
    };
    Ok((req, Forwarded { endpoint, body: map }))
}

/// The part of a core field the strict parser checks.
fn core_value(key: &str, v: &Value) -> Value {
    match (key, v) {
        ("messages", Value::Array(msgs)) => Value::Array(msgs.iter().map(message_text).collect()),
        ("stream_options", Value::Object(o)) => {
            let mut keep = Map::new();
            if let Some(u) = o.get("include_usage") {
                keep.insert("include_usage".into(), u.clone());
            }
            Value::Object(keep)
        }
        _ => v.clone(),
    }
}

/// A message's role, name and text (its text parts; none: empty, as for an assistant turn
/// that only called tools).
fn message_text(m: &Value) -> Value {
    let Value::Object(o) = m else { return m.clone() };
    let mut keep = Map::new();
    for key in ["role", "name"] {
        if let Some(v) = o.get(key) {
            keep.insert(key.into(), v.clone());
        }
    }
    let content = match o.get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => Value::Array(
            parts.iter().filter(|p| p.get("type").and_then(Value::as_str) == Some("text")).cloned().collect(),
        ),
        Some(Value::Null) | None => Value::String(String::new()),
        Some(other) => other.clone(),
    };
    keep.insert("content".into(), content);
    Value::Object(keep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prompt;

    #[test]
    fn unknown_fields_are_kept_and_known_ones_still_checked() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi","extra":1},
            {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},
            {"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"x"}}]}],
            "max_tokens":5,"min_tokens":2,"include_metrics":true,"nvext":{"a":1},
            "stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#;
        let (req, fwd) = parse_forwarded(ApiEndpoint::Chat, body, &Limits::default()).unwrap();
        assert_eq!(req.params.max_tokens, Some(5));
        assert!(req.params.stream && req.params.include_usage);
        let Prompt::Chat(m) = &req.prompt else { panic!("{:?}", req.prompt) };
        assert_eq!(
            (m.len(), m[0].content.as_str(), m[1].content.as_str(), m[2].content.as_str()),
            (3, "hi", "", "look")
        );
        for k in ["min_tokens", "include_metrics", "nvext", "stream_options"] {
            assert!(fwd.body.contains_key(k), "{k}");
        }
        assert_eq!(fwd.body["stream_options"]["continuous_usage_stats"], true);
        assert_eq!(fwd.body["messages"][1]["tool_calls"][0]["id"], "1");

        let bad = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":9,"x":1}"#;
        let e = parse_forwarded(ApiEndpoint::Chat, bad, &Limits::default()).unwrap_err();
        assert!(
            matches!(e, ProtocolError::InvalidRequest { ref param, .. } if param.as_deref() == Some("temperature"))
        );
        assert!(parse_forwarded(ApiEndpoint::Completions, b"[1]", &Limits::default()).is_err());
        let (c, _) = parse_forwarded(
            ApiEndpoint::Completions,
            br#"{"model":"m","prompt":"a","echo":false,"best_of":2}"#,
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(c.prompt, Prompt::Text("a".into()));
    }
}
