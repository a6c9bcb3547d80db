//! The bench's reading of one SSE `data:` payload (or one non-streamed body) from *any*
//! OpenAI-compatible server — ours, vLLM, SGLang, llama.cpp server — reduced to what the metrics
//! need: the text generated in this event, reasoning text (counted apart), `finish_reason`,
//! `usage`, our `timing`, an in-stream error, and whether it is `[DONE]`.
//!
//! It walks a `serde_json::Value` instead of deserializing the typed chunks: servers differ in
//! which fields they omit, null out or add (`reasoning_content` vs `reasoning`, `stop_reason`,
//! `timings`), chat and completion chunks differ (`delta.content` vs `text`), and one reader for
//! all of them is simpler and more forgiving than several strict types. Only a known field with an
//! impossible type (`choices` not an array, `usage` with a string count) is an error; a `timing`
//! object not in our shape is ignored, as another server may use that name for something else.

use crate::response::{FinishReason, Usage};
use crate::{ErrorDetail, ProtocolError};
use serde_json::{Map, Value};
use std::borrow::Cow;
use tokenpath_timeline::ServerTiming;

/// What one event (or body) carries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamChunkView {
    /// The `[DONE]` sentinel.
    pub done: bool,
    /// Generated text in this event (`delta.content`, `text`, or `message.content`), all choices
    /// concatenated.
    pub text: String,
    /// Reasoning text (`reasoning_content` or `reasoning`), kept apart from `text`.
    pub reasoning_text: String,
    /// The first non-null `finish_reason`.
    pub finish_reason: Option<FinishReason>,
    /// `usage`, when present and not null.
    pub usage: Option<Usage>,
    /// Our timing extension, when present and well-formed.
    pub timing: Option<ServerTiming>,
    /// An error object sent in place of a chunk (`{"error": {...}}`).
    pub error: Option<ErrorDetail>,
}

impl StreamChunkView {
    /// Whether the event carries at least one generated token (text or reasoning): what makes it
    /// count for TTFT and inter-token gaps. Role-only, empty, usage and `[DONE]` events do not.
    pub fn carries_tokens(&self) -> bool {
        !self.text.is_empty() || !self.reasoning_text.is_empty()
    }
}

/// Reads one SSE `data` payload of a chat or completion stream.
pub fn parse_stream_chunk(data: &str) -> Result<StreamChunkView, ProtocolError> {
    if data.trim() == "[DONE]" {
        return Ok(StreamChunkView { done: true, ..Default::default() });
    }
    let v: Value = serde_json::from_str(data).map_err(|e| bad(format!("event is not JSON: {e}")))?;
    view_of(&v)
}

/// Reads a non-streamed chat or completion body (or an error body) the same way.
pub fn parse_response_body(body: &[u8]) -> Result<StreamChunkView, ProtocolError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| bad(format!("body is not JSON: {e}")))?;
    view_of(&v)
}

fn bad(message: String) -> ProtocolError {
    ProtocolError::InvalidResponse { message }
}

/// Reads an already-parsed event payload (a relay that passes the chunk on keeps the value).
pub fn parse_stream_value(v: &Value) -> Result<StreamChunkView, ProtocolError> {
    view_of(v)
}

fn view_of(v: &Value) -> Result<StreamChunkView, ProtocolError> {
    use serde::Deserialize as _;
    let Value::Object(obj) = v else {
        return Err(bad("expected a JSON object".to_owned()));
    };
    let mut view = StreamChunkView { error: error_of(obj), ..Default::default() };
    match obj.get("choices") {
        None | Some(Value::Null) => {}
        Some(Value::Array(choices)) => {
            for c in choices {
                read_choice(c, &mut view);
            }
        }
        Some(_) => return Err(bad("`choices` is not an array".to_owned())),
    }
    match obj.get("usage") {
        None | Some(Value::Null) => {}
        Some(u) => view.usage = Some(Usage::deserialize(u).map_err(|e| bad(format!("`usage`: {e}")))?),
    }
    if let Some(t) = obj.get(crate::TIMING_FIELD) {
        view.timing = ServerTiming::deserialize(t).ok();
    }
    Ok(view)
}

fn read_choice(c: &Value, view: &mut StreamChunkView) {
    fn s(v: Option<&Value>) -> &str {
        v.and_then(Value::as_str).unwrap_or("")
    }
    let inner = c.get("delta").filter(|d| !d.is_null()).or_else(|| c.get("message"));
    view.text.push_str(s(inner.and_then(|d| d.get("content"))));
    view.text.push_str(s(c.get("text")));
    let reasoning = inner
        .and_then(|d| d.get("reasoning_content").filter(|r| !r.is_null()).or_else(|| d.get("reasoning")));
    view.reasoning_text.push_str(s(reasoning));
    if view.finish_reason.is_none() {
        view.finish_reason = c.get("finish_reason").and_then(Value::as_str).map(FinishReason::from_wire);
    }
}

/// Reads an event payload a relay split in two: `rest`, the chunk's other members parsed, and
/// `choices`, that member's JSON text as it came (absent when the chunk had none). The view is
/// [`parse_stream_value`]'s of the whole chunk; the flag says whether it had a choice.
///
/// The choices are read straight from their bytes into borrowed fields (`choices` is most of
/// every chunk, and a tree of it was the largest part of a relay's cost per chunk); anything
/// the borrowed shape does not take — a member of an unexpected type, a duplicate key, an
/// escape that needs a copy is fine — falls back to the tree walk, so the two readers cannot
/// disagree.
pub fn parse_stream_parts(
    rest: &Value,
    choices: Option<&str>,
) -> Result<(StreamChunkView, bool), ProtocolError> {
    let mut view = view_of(rest)?;
    let Some(raw) = choices else { return Ok((view, false)) };
    match serde_json::from_str::<Option<Vec<WireChoice<'_>>>>(raw) {
        Ok(cs) => {
            let cs = cs.unwrap_or_default();
            for c in &cs {
                let inner = c.delta.as_ref().or(c.message.as_ref());
                if let Some(d) = inner {
                    view.text.push_str(d.content.as_deref().unwrap_or(""));
                    let r = d.reasoning_content.as_deref().or(d.reasoning.as_deref());
                    view.reasoning_text.push_str(r.unwrap_or(""));
                }
                view.text.push_str(c.text.as_deref().unwrap_or(""));
                if view.finish_reason.is_none() {
                    view.finish_reason = c.finish_reason.as_deref().map(FinishReason::from_wire);
                }
            }
            Ok((view, !cs.is_empty()))
        }
        Err(_) => match serde_json::from_str::<Value>(raw) {
            Ok(Value::Null) => Ok((view, false)),
            Ok(Value::Array(cs)) => {
                for c in &cs {
                    read_choice(c, &mut view);
                }
                Ok((view, !cs.is_empty()))
            }
            Ok(_) => Err(bad("`choices` is not an array".to_owned())),
            Err(e) => Err(bad(format!("`choices`: {e}"))),
        },
    }
}

/// The members of one choice the view reads, borrowed from the chunk's bytes where they have
/// no escapes (every other member is skipped unparsed).
#[derive(serde::Deserialize)]
struct WireChoice<'a> {
    #[serde(borrow, default)]
    delta: Option<WireInner<'a>>,
    #[serde(borrow, default)]
    message: Option<WireInner<'a>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    finish_reason: Option<Cow<'a, str>>,
}

/// A choice's `delta` (streamed) or `message` (a whole body).
#[derive(serde::Deserialize)]
struct WireInner<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    reasoning: Option<Cow<'a, str>>,
}

/// `{"error": {...}}`, `{"error": "text"}`, or old vLLM's top-level `{"object": "error", ...}`.
fn error_of(obj: &Map<String, Value>) -> Option<ErrorDetail> {
    use serde::Deserialize as _;
    let lenient = |v: &Value| {
        ErrorDetail::deserialize(v).unwrap_or_else(|_| ErrorDetail {
            message: v.to_string(),
            kind: String::new(),
            param: None,
            code: None,
        })
    };
    match obj.get("error") {
        Some(Value::Null) | None => {}
        Some(Value::String(message)) => {
            return Some(ErrorDetail {
                message: message.clone(),
                kind: String::new(),
                param: None,
                code: None,
            })
        }
        Some(e) => return Some(lenient(e)),
    }
    if obj.get("object").and_then(Value::as_str) == Some("error") {
        return Some(lenient(&Value::Object(obj.clone())));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn done_and_role_only_events_carry_no_tokens() {
        let v = parse_stream_chunk(" [DONE] ").unwrap();
        assert!(v.done && !v.carries_tokens());
        let role = r#"{"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        let v = parse_stream_chunk(role).unwrap();
        assert!(!v.done && !v.carries_tokens() && v.finish_reason.is_none());
    }

    #[test]
    fn vllm_chat_chunk_with_reasoning() {
        let c = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",
            "choices":[{"index":0,"delta":{"reasoning_content":"think","content":null},"logprobs":null,
            "finish_reason":null,"stop_reason":null}]}"#;
        let v = parse_stream_chunk(c).unwrap();
        assert_eq!((v.text.as_str(), v.reasoning_text.as_str()), ("", "think"));
        assert!(v.carries_tokens());
        let newer = r#"{"choices":[{"delta":{"reasoning":"r2"}}]}"#;
        assert_eq!(parse_stream_chunk(newer).unwrap().reasoning_text, "r2");
    }

    #[test]
    fn completion_chunk_and_final_usage_chunk() {
        let c = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" hi","logprobs":null,"finish_reason":"length"}],"usage":null}"#;
        let v = parse_stream_chunk(c).unwrap();
        assert_eq!(v.text, " hi");
        assert_eq!(v.finish_reason, Some(FinishReason::Length));
        assert_eq!(v.usage, None);
        let u = r#"{"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12,
            "prompt_tokens_details":{"cached_tokens":2}},"timing":{"stages_ms":{"prefill":3.5},"cached_tokens":2}}"#;
        let v = parse_stream_chunk(u).unwrap();
        assert_eq!(v.usage, Some(Usage::new(5, 7, 2)));
        assert_eq!(v.timing.unwrap().stage_ms(tokenpath_timeline::Stage::Prefill), Some(3.5));
    }

    #[test]
    fn llama_cpp_chunk_with_foreign_timings_field() {
        let c = r#"{"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1,"id":"chatcmpl-z",
            "model":"gpt-3.5-turbo","object":"chat.completion.chunk","usage":{"completion_tokens":4,
            "prompt_tokens":9,"total_tokens":13},"timings":{"prompt_n":9,"predicted_ms":30.1},"timing":"n/a"}"#;
        let v = parse_stream_chunk(c).unwrap();
        assert_eq!(v.finish_reason, Some(FinishReason::Stop));
        assert_eq!(v.usage.map(|u| u.completion_tokens), Some(4));
        assert_eq!(v.timing, None, "a foreign `timing` is ignored, not an error");
    }

    #[test]
    fn in_stream_errors_in_several_dialects() {
        let ours = r#"{"error":{"message":"boom","type":"server_error","param":null,"code":null}}"#;
        assert_eq!(parse_stream_chunk(ours).unwrap().error.unwrap().message, "boom");
        let old_vllm =
            r#"{"object":"error","message":"too long","type":"BadRequestError","param":null,"code":400}"#;
        let e = parse_stream_chunk(old_vllm).unwrap().error.unwrap();
        assert_eq!((e.message.as_str(), e.code.as_deref()), ("too long", Some("400")));
        assert_eq!(parse_stream_chunk(r#"{"error":"plain"}"#).unwrap().error.unwrap().message, "plain");
    }

    #[test]
    fn non_streamed_bodies_read_the_same_way() {
        let b = br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
        let v = parse_response_body(b).unwrap();
        assert_eq!(v.text, "Hello");
        assert_eq!(v.usage.map(|u| u.total_tokens), Some(2));
    }

    #[test]
    fn garbage_is_a_typed_error() {
        for bad in ["", "{", "[1]", "42", r#"{"choices":3}"#, r#"{"usage":{"prompt_tokens":"x"}}"#] {
            assert!(matches!(parse_stream_chunk(bad), Err(ProtocolError::InvalidResponse { .. })), "{bad}");
        }
    }

    /// The split reading (`choices` from its bytes) against the tree walk of the whole chunk.
    fn split_agrees(chunk: &str) -> Result<(), String> {
        let whole: Value = serde_json::from_str(chunk).map_err(|e| e.to_string())?;
        let Value::Object(mut rest) = whole.clone() else { return Ok(()) };
        let raw = rest.remove("choices").map(|c| c.to_string());
        let split = parse_stream_parts(&Value::Object(rest), raw.as_deref());
        let tree = parse_stream_value(&whole);
        match (split, tree) {
            (Ok((a, any)), Ok(b)) => {
                let has = whole.get("choices").and_then(Value::as_array).is_some_and(|c| !c.is_empty());
                if a != b || any != has {
                    return Err(format!("{chunk}: {a:?} / {b:?} ({any} vs {has})"));
                }
                Ok(())
            }
            (Err(_), Err(_)) => Ok(()),
            (a, b) => Err(format!("{chunk}: {a:?} / {b:?}")),
        }
    }

    #[test]
    fn the_split_reading_agrees_with_the_tree_on_every_dialect() {
        for c in [
            r#"{"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":"think","content":null},"logprobs":null}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":null,"reasoning":"r"}}]}"#,
            r#"{"choices":[{"index":0,"text":" hi","finish_reason":"length"}],"usage":null}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#,
            r#"{"choices":[{"delta":{"content":"a\u00e9\n"}},{"delta":{"content":"b"},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"message":{"content":"whole"},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"delta":null,"message":{"content":"m"}}]}"#,
            r#"{"choices":[{"delta":"odd","text":5,"finish_reason":7}]}"#,
            r#"{"choices":[{"delta":{"content":["part"]}}]}"#,
            r#"{"choices":null}"#,
            r#"{"choices":3}"#,
            r#"{"choices":[1,"x",null]}"#,
            r#"{"error":{"message":"boom"},"choices":[]}"#,
        ] {
            split_agrees(c).unwrap();
        }
    }

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i32>().prop_map(Value::from),
            "[a-z\\\\\"é\n]{0,6}".prop_map(Value::from),
        ]
    }

    fn member(names: &'static [&'static str]) -> impl Strategy<Value = Value> {
        let inner = proptest::collection::vec((proptest::sample::select(names), leaf()), 0..4)
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()));
        prop_oneof![leaf(), inner]
    }

    fn choice() -> impl Strategy<Value = Value> {
        const INNER: &[&str] = &["content", "reasoning_content", "reasoning", "role"];
        let fields = (
            proptest::option::of(member(INNER)),
            proptest::option::of(member(INNER)),
            proptest::option::of(leaf()),
            proptest::option::of(prop_oneof![leaf(), Just(Value::from("stop")), Just(Value::from("length"))]),
        );
        prop_oneof![
            leaf(),
            fields.prop_map(|(d, m, t, f)| {
                let mut o = Map::new();
                for (k, v) in [("delta", d), ("message", m), ("text", t), ("finish_reason", f)] {
                    if let Some(v) = v {
                        o.insert(k.to_owned(), v);
                    }
                }
                Value::Object(o)
            }),
        ]
    }

    proptest! {
        /// Any chunk shape: the split reading and the tree walk give the same view (or both
        /// refuse it).
        #[test]
        fn the_split_reading_agrees_with_the_tree(
            choices in proptest::option::of(prop_oneof![
                leaf(),
                proptest::collection::vec(choice(), 0..4).prop_map(Value::Array),
            ]),
            usage in proptest::option::of(Just(serde_json::json!({"prompt_tokens": 1, "completion_tokens": 2}))),
        ) {
            let mut o = Map::new();
            if let Some(c) = choices {
                o.insert("choices".into(), c);
            }
            if let Some(u) = usage {
                o.insert("usage".into(), u);
            }
            let chunk = Value::Object(o).to_string();
            prop_assert!(split_agrees(&chunk).is_ok(), "{}", split_agrees(&chunk).unwrap_err());
        }
    }
}
