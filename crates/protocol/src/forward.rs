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
use serde::Deserialize;
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
    let Value::Object(map) = &value else { return Err(not_an_object()) };
    let req = if only_core(map) {
        as_is(endpoint, &value, limits)?
    } else {
        as_is(endpoint, &picked(map), limits)?
    };
    let Value::Object(map) = value else { return Err(not_an_object()) };
    Ok((req, Forwarded { endpoint, body: map }))
}

/// The request the strict parser reads from `body`'s tree (no copy of it): the client's own
/// body when it is only core fields ([`only_core`]), else the core fields [`picked`] out of it.
fn as_is(endpoint: ApiEndpoint, body: &Value, limits: &Limits) -> Result<GenerationRequest, ProtocolError> {
    let json = |e: serde_json::Error| crate::wire::request_json_error(&e);
    match endpoint {
        ApiEndpoint::Chat => ChatCompletionRequest::deserialize(body).map_err(json)?.validate(limits),
        ApiEndpoint::Completions => CompletionRequest::deserialize(body).map_err(json)?.validate(limits),
    }
}

/// The core fields picked out of `body` ([`core_value`]), as a body of their own.
fn picked(body: &Map<String, Value>) -> Value {
    let mut core = Map::new();
    for key in CORE_FIELDS {
        if let Some(v) = body.get(key) {
            core.insert(key.to_owned(), core_value(key, v));
        }
    }
    Value::Object(core)
}

fn not_an_object() -> ProtocolError {
    ProtocolError::InvalidRequest { param: None, message: "The request body must be a JSON object.".into() }
}

/// Whether `body` is already what [`core_value`] would pick out of it: core fields only,
/// `stream_options` with at most `include_usage`, every message an object of `role`, `name`
/// and a string `content` (the shape of nearly every request; anything else takes the copy).
fn only_core(body: &Map<String, Value>) -> bool {
    body.iter().all(|(k, v)| match (k.as_str(), v) {
        ("messages", Value::Array(msgs)) => msgs.iter().all(|m| {
            m.as_object().is_some_and(|o| {
                o.iter().all(|(k, v)| {
                    matches!((k.as_str(), v), ("role" | "name", _) | ("content", Value::String(_)))
                }) && o.contains_key("content")
            })
        }),
        ("messages", _) => true,
        ("stream_options", Value::Object(o)) => o.keys().all(|k| k == "include_usage"),
        (k, _) => CORE_FIELDS.contains(&k),
    })
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
    use proptest::prelude::*;

    /// A body of core fields only for `chat` or completions, each absent, valid (mostly) or not.
    fn core_body() -> impl Strategy<Value = (bool, Value)> {
        let role =
            prop_oneof![4 => Just("user"), 2 => Just("system"), 2 => Just("assistant"), 1 => Just("bogus")];
        let message = (role, ".{0,12}", proptest::option::of("[a-z]{1,4}")).prop_map(|(r, c, n)| match n {
            Some(n) => serde_json::json!({"role": r, "content": c, "name": n}),
            None => serde_json::json!({"role": r, "content": c}),
        });
        let number = prop_oneof![
            4 => (0u32..20).prop_map(Value::from),
            2 => (0.0f64..1.0).prop_map(Value::from),
            1 => Just(Value::from(-1)),
            1 => Just(Value::from(2.5)),
            1 => Just(Value::from(1_000_000_000u64)),
            1 => Just(Value::from("x")),
            1 => Just(Value::Null),
        ];
        let fields = (
            any::<bool>(),
            prop_oneof![9 => Just(Value::from("m")), 1 => Just(Value::from(3))],
            proptest::collection::vec(message, 1..3),
            prop_oneof![Just(Value::from("once upon")), Just(serde_json::json!([1, 2]))],
            (
                proptest::option::of(number.clone()),
                proptest::option::of(number.clone()),
                proptest::option::of(number.clone()),
            ),
            (
                proptest::option::of(number.clone()),
                proptest::option::of(number),
                proptest::option::of(any::<bool>()),
            ),
            proptest::option::of(prop_oneof![
                Just(serde_json::json!({"include_usage": true})),
                Just(serde_json::json!({})),
                Just(Value::Null)
            ]),
            proptest::option::of(prop_oneof![Just(Value::from("\n")), Just(serde_json::json!(["a", "b"]))]),
        );
        fields.prop_map(
            |(
                chat,
                model,
                messages,
                prompt,
                (max_tokens, temperature, top_p),
                (n, seed, stream),
                opts,
                stop,
            )| {
                let mut m = Map::new();
                let mut put = |k: &str, v: Option<Value>| {
                    if let Some(v) = v {
                        m.insert(k.to_owned(), v);
                    }
                };
                put("model", Some(model));
                if chat {
                    put("messages", Some(Value::from(messages)));
                } else {
                    put("prompt", Some(prompt));
                }
                put("max_tokens", max_tokens);
                put("temperature", temperature);
                put("top_p", top_p);
                put("n", n);
                put("seed", seed);
                put("stream", stream.map(Value::from));
                put("stream_options", opts);
                put("stop", stop);
                (chat, Value::Object(m))
            },
        )
    }

    proptest! {
        /// The body read as it is and the core fields picked out of it are the same request
        /// (or both refused), whenever the body is only core fields.
        #[test]
        fn a_core_only_body_reads_as_its_picked_core_does((chat, body) in core_body()) {
            let Value::Object(map) = &body else { unreachable!() };
            prop_assume!(only_core(map));
            let endpoint = if chat { ApiEndpoint::Chat } else { ApiEndpoint::Completions };
            let limits = Limits { max_tokens_cap: 10 };
            match (as_is(endpoint, &body, &limits), as_is(endpoint, &picked(map), &limits)) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "{a:?} against {b:?} for {body}"),
            }
        }
    }

    #[test]
    fn only_a_body_of_core_fields_in_their_plain_shape_is_read_as_it_is() {
        let only = |v: Value| only_core(v.as_object().unwrap());
        assert!(only(
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi", "name": "a"}],
            "stream": true, "stream_options": {"include_usage": true}})
        ));
        assert!(!only(serde_json::json!({"model": "m", "min_tokens": 2})));
        assert!(!only(
            serde_json::json!({"stream_options": {"include_usage": true, "continuous_usage_stats": true}})
        ));
        assert!(!only(
            serde_json::json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
        ));
        assert!(!only(
            serde_json::json!({"messages": [{"role": "assistant", "content": null, "tool_calls": []}]})
        ));
        assert!(!only(serde_json::json!({"messages": [{"role": "assistant"}]})));
    }

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
