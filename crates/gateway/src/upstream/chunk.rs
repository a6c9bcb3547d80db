//! One streamed chunk of an engine's answer, read once and written back without a round trip
//! through a JSON tree: the members the relay reads are parsed, and the chunk the client gets is
//! the engine's own bytes for every member the relay does not change (`choices` with its
//! tool calls and logprobs, `id`, engine extensions), in the engine's order. Only `model` (our
//! served name), `usage` (cached tokens rewritten in PD) and `timing` (ours, replacing any the
//! engine sent) are written by us. Re-serializing the whole tree per event was the largest part
//! of the relay's cost per chunk.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::borrow::Cow;

/// Members passed on untouched and never read as a tree (the relay parses all others).
const UNREAD: [&str; 4] = ["id", "created", "model", "system_fingerprint"];
/// `object` is read only when it says the chunk is an error (old vLLM's `{"object": "error"}`);
/// `chat.completion.chunk` and `text_completion` pass untouched like the [`UNREAD`] members.
const ERROR_OBJECT: &str = "\"error\"";
/// The member read from its bytes (`parse_stream_parts`), never as a tree.
const CHOICES: &str = "choices";

/// A chunk: its top-level members as sent, and the parsed ones the relay reads and may change.
#[derive(Debug)]
pub(super) struct Chunk<'a> {
    /// The chunk as it came.
    data: &'a str,
    members: Members<'a>,
    /// Every member but [`UNREAD`] ones and `choices`, parsed (what the view and the
    /// engine-stage readers look at; `usage` is written back from here).
    pub(super) value: Value,
    /// `choices` as it came.
    choices: Option<&'a str>,
}

impl<'a> Chunk<'a> {
    /// `Err` when `data` is not a JSON object.
    pub(super) fn parse(data: &'a str) -> Result<Self, serde_json::Error> {
        let members: Members<'a> = serde_json::from_str(data)?;
        let mut value = Map::new();
        let mut choices = None;
        for (k, raw) in &members.0 {
            if k == CHOICES {
                choices = Some(raw.get());
            } else if parsed(k, raw) {
                value.insert(k.to_string(), serde_json::from_str(raw.get())?);
            }
        }
        Ok(Self { data, members, value: Value::Object(value), choices })
    }

    /// The `choices` member's JSON text (absent: the chunk had none).
    pub(super) fn choices(&self) -> Option<&'a str> {
        self.choices
    }

    /// The chunk for the client: `model` set to `model`, the engine's `timing` dropped and
    /// `timing` appended when given, `usage` as it is in [`value`](Self::value) now (absent when
    /// removed there).
    pub(super) fn render(&self, model: &str, timing: Option<&Value>) -> String {
        if timing.is_none() && self.unchanged(model) {
            // Nothing to rewrite (most chunks when the engine's model name is ours): as it came.
            return self.data.to_owned();
        }
        let mut out = String::with_capacity(self.members.len() + 64);
        out.push('{');
        let member = |out: &mut String, key: &str, value: &str| {
            if out.len() > 1 {
                out.push(',');
            }
            push_json_str(out, key);
            out.push(':');
            out.push_str(value);
        };
        let mut model_json = String::with_capacity(model.len() + 2);
        push_json_str(&mut model_json, model);
        for (k, raw) in &self.members.0 {
            match k.as_ref() {
                "timing" => {}
                "model" => member(&mut out, k, &model_json),
                "usage" => {
                    // Taken off (`value` no longer has it) when the client did not ask for it.
                    if let Some(u) = self.value.get("usage") {
                        member(&mut out, k, &u.to_string());
                    }
                }
                _ => member(&mut out, k, raw.get()),
            }
        }
        if let Some(t) = timing {
            member(&mut out, "timing", &t.to_string());
        }
        out.push('}');
        out
    }

    /// Whether [`render`](Self::render) without a timing would write the chunk's own bytes: its
    /// `model` already `model` (as written), no `timing`, and `usage` (if any) not changed in
    /// [`value`](Self::value).
    fn unchanged(&self, model: &str) -> bool {
        self.members.0.iter().all(|(k, raw)| match k.as_ref() {
            "timing" => false,
            "model" => raw.get().strip_prefix('"').and_then(|r| r.strip_suffix('"')) == Some(model),
            // Taken off (no parse needed to know it changed), or compared as parsed.
            "usage" => self
                .value
                .get("usage")
                .is_some_and(|u| serde_json::from_str::<Value>(raw.get()).ok().as_ref() == Some(u)),
            _ => true,
        })
    }
}

/// Whether a top-level member other than `choices` is parsed into [`Chunk::value`].
fn parsed(name: &str, raw: &RawValue) -> bool {
    match name {
        "object" => raw.get() == ERROR_OBJECT,
        _ => !UNREAD.contains(&name),
    }
}

/// Appends `s` as a JSON string: as it is between quotes when nothing in it needs an escape
/// (every member name and model name in practice), else through serde_json.
fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        out.push_str(&Value::from(s).to_string());
    } else {
        out.push('"');
        out.push_str(s);
        out.push('"');
    }
}

/// Top-level members in their order, each value as its bytes (names borrowed unless escaped).
#[derive(Debug)]
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

/// A member name, borrowed from the chunk when it has no escape.
#[derive(serde::Deserialize)]
struct Name<'a>(#[serde(borrow)] Cow<'a, str>);

impl Members<'_> {
    fn len(&self) -> usize {
        self.0.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum()
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Object;
        impl<'de> Visitor<'de> for Object {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                // A chunk has five to eight members: one allocation, not three.
                let mut out = Vec::with_capacity(8);
                while let Some((Name(k), v)) = map.next_entry::<Name<'de>, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(Object)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchanged_members_keep_the_engines_bytes_and_order() {
        let data = r#"{"id":"c-1","object":"chat.completion.chunk","created":7,"model":"llama",
            "choices":[{"index":0,"delta":{"content":"h\u00e9"},"logprobs":{"content":[{"token":"x","logprob":-0.5e0}]},"finish_reason":null}],
            "timing":{"stages_ms":{}},"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        let mut c = Chunk::parse(data).unwrap();
        assert!(c.value.get("model").is_none() && c.value.get("choices").is_none());
        assert!(c.choices().is_some_and(|raw| raw.starts_with(r#"[{"index":0"#)));
        c.value["usage"]["prompt_tokens_details"] = serde_json::json!({"cached_tokens": 2});
        let out = c.render("served", Some(&serde_json::json!({"stages_ms": {"gateway": 0.1}})));
        assert!(out.starts_with(r#"{"id":"c-1","object":"chat.completion.chunk","created":7,"model":"served","choices":[{"index":0,"delta":{"content":"h\u00e9"},"logprobs":{"content":[{"token":"x","logprob":-0.5e0}]}"#), "{out}");
        let back: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(back["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(back["timing"]["stages_ms"]["gateway"], 0.1);
        assert_eq!(out.matches("timing").count(), 1, "the engine's timing is replaced: {out}");
    }

    #[test]
    fn an_error_object_is_read_and_an_ordinary_one_passes_untouched() {
        let c = Chunk::parse(r#"{"object":"chat.completion.chunk","choices":[]}"#).unwrap();
        assert!(c.value.get("object").is_none());
        assert_eq!(c.render("m", None), r#"{"object":"chat.completion.chunk","choices":[]}"#);
        let e = Chunk::parse(r#"{"object":"error","message":"boom","code":400}"#).unwrap();
        let view = tokenpath_protocol::parse_stream_value(&e.value).unwrap();
        assert_eq!(view.error.map(|d| d.message), Some("boom".to_owned()));
    }

    #[test]
    fn a_chunk_with_nothing_to_rewrite_passes_as_it_came_and_any_change_is_written() {
        let data = r#"{"id":"c","model":"m","choices":[{"index":0,"delta":{"content":"x"}}], "x" : 1}"#;
        let c = Chunk::parse(data).unwrap();
        assert_eq!(c.render("m", None), data, "unchanged: the engine's own bytes");
        assert_eq!(
            c.render("n", None),
            r#"{"id":"c","model":"n","choices":[{"index":0,"delta":{"content":"x"}}],"x":1}"#
        );
        assert!(c.render("m", Some(&serde_json::json!({"a": 1}))).ends_with(r#","timing":{"a":1}}"#));
        // A model name spelled with an escape is rewritten, not compared byte for byte.
        let c = Chunk::parse(r#"{"model":"\u006d"}"#).unwrap();
        assert_eq!(c.render("m", None), r#"{"model":"m"}"#);
        // The engine's timing is dropped; usage changed in `value` is written.
        let c = Chunk::parse(r#"{"model":"m","timing":{"x":1}}"#).unwrap();
        assert_eq!(c.render("m", None), r#"{"model":"m"}"#);
        let mut c = Chunk::parse(r#"{"model":"m","usage":{"prompt_tokens":3}}"#).unwrap();
        assert_eq!(c.render("m", None), r#"{"model":"m","usage":{"prompt_tokens":3}}"#);
        c.value["usage"]["prompt_tokens_details"] = serde_json::json!({"cached_tokens": 2});
        assert!(c.render("m", None).contains("cached_tokens"));
        c.value.as_object_mut().unwrap().remove("usage");
        assert_eq!(c.render("m", None), r#"{"model":"m"}"#);
    }

    #[test]
    fn names_that_need_escapes_are_escaped() {
        let c = Chunk::parse(r#"{"a\"b":1,"model":"m","t\u0001":2}"#).unwrap();
        let out = c.render("x\"y", None);
        assert_eq!(out, r#"{"a\"b":1,"model":"x\"y","t\u0001":2}"#);
        assert!(serde_json::from_str::<Value>(&out).is_ok());
    }

    #[test]
    fn what_is_not_an_object_is_refused() {
        for bad in ["[1]", "\"x\"", "{\"a\":", "{\"a\":1} x", ""] {
            assert!(Chunk::parse(bad).is_err(), "{bad}");
        }
        let c = Chunk::parse(r#"{"model":"m"}"#).unwrap();
        assert_eq!(c.render("n", None), r#"{"model":"n"}"#);
    }
}
