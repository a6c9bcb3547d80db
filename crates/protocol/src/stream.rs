//! Streamed responses: `chat.completion.chunk` and streamed `text_completion` chunks, the
//! builders that emit OpenAI's standard sequence, and SSE framing.
//!
//! The sequence is fixed here, not in the gateway, so every stream has the same shape: (chat
//! only) a first chunk with `delta: {"role": "assistant"}`, then one chunk per piece of text,
//! then a chunk with an empty delta and `finish_reason`, then, with
//! `stream_options.include_usage`, a chunk with `choices: []` and `usage`; then `data: [DONE]`.
//! `usage` is `null` in every other chunk. Our `timing` extension rides on the *last* chunk
//! before `[DONE]` (the usage chunk when there is one, else the finish chunk), so a client that
//! reads to the end gets it and every other chunk stays byte-for-byte OpenAI.

use crate::chat::Role;
use crate::response::{CompletionChoice, CompletionResponse, FinishReason, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokenpath_timeline::ServerTiming;

/// The terminating SSE event of every OpenAI stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// Frames a value as one SSE event: `data: <compact JSON>\n\n` ([`sse_data`]). Serialization of
/// our types cannot fail; if a foreign `Serialize` impl does, the event carries an OpenAI
/// `server_error` body instead of panicking.
pub fn sse_event(value: &impl Serialize) -> String {
    match serde_json::to_string(value) {
        Ok(json) => sse_data(&json),
        Err(e) => {
            let body = crate::ApiError::server_error(format!("failed to serialize event: {e}")).body;
            let json = serde_json::to_string(&body).unwrap_or_else(|_| {
                r#"{"error":{"message":"failed to serialize event","type":"server_error","param":null,"code":null}}"#
                    .to_owned()
            });
            sse_data(&json)
        }
    }
}

/// Frames JSON text as one SSE event: one `data:` line — compact JSON (ours) never contains a raw
/// line break — or, for text that does (an engine's chunk relayed as it came: JSON allows line
/// breaks between tokens), one `data:` line per line, which a client joins back with `\n` into
/// the same JSON, so a break cannot end the event early.
pub fn sse_data(json: &str) -> String {
    let mut out = String::with_capacity(json.len() + 8);
    if memchr::memchr2(b'\n', b'\r', json.as_bytes()).is_none() {
        out.push_str("data: ");
        out.push_str(json);
        out.push('\n');
    } else {
        for line in json.split(['\n', '\r']).filter(|l| !l.is_empty()) {
            out.push_str("data: ");
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push('\n');
    out
}

/// A chat chunk's `delta`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// Only in the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// New text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a chat chunk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    /// Always 0 from us.
    #[serde(default)]
    pub index: u32,
    /// What is new.
    #[serde(default)]
    pub delta: Delta,
    /// Set in the finish chunk only.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// Always `null` from us.
    #[serde(default)]
    pub logprobs: Option<Value>,
}

/// A `chat.completion.chunk`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// Same id for every chunk of one completion.
    pub id: String,
    /// `"chat.completion.chunk"`.
    pub object: String,
    /// Unix seconds, same for every chunk.
    #[serde(default)]
    pub created: u64,
    /// The model.
    #[serde(default)]
    pub model: String,
    /// Build/config identity.
    #[serde(default)]
    pub system_fingerprint: Option<String>,
    /// One choice, or none in the usage chunk.
    #[serde(default)]
    pub choices: Vec<ChatChunkChoice>,
    /// `null` except in the usage chunk.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Extension: on the last chunk before `[DONE]` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<ServerTiming>,
}

impl ChatCompletionChunk {
    /// `object` of a chat chunk.
    pub const OBJECT: &'static str = "chat.completion.chunk";
}

/// A streamed legacy completion chunk (its `object` is `"text_completion"`, as at OpenAI).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChunk {
    /// Same id for every chunk.
    pub id: String,
    /// `"text_completion"`.
    pub object: String,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The model.
    #[serde(default)]
    pub model: String,
    /// Build/config identity.
    #[serde(default)]
    pub system_fingerprint: Option<String>,
    /// One choice, or none in the usage chunk.
    #[serde(default)]
    pub choices: Vec<CompletionChoice>,
    /// `null` except in the usage chunk.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Extension: on the last chunk before `[DONE]` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<ServerTiming>,
}

/// What both stream builders share: `new`, a chunk with this stream's header, and the closing
/// sequence (the finish chunk, then the usage chunk when `include_usage`, `timing` on the last).
macro_rules! stream_builder {
    ($stream:ident, $chunk:ident, $choice:ty, $object:expr) => {
        impl $stream {
            /// A stream without a system fingerprint.
            pub fn new(id: String, created: u64, model: String, include_usage: bool) -> Self {
                $stream { id, created, model, include_usage, system_fingerprint: None }
            }

            fn chunk(&self, choices: Vec<$choice>) -> $chunk {
                $chunk {
                    id: self.id.clone(),
                    object: $object.to_owned(),
                    created: self.created,
                    model: self.model.clone(),
                    system_fingerprint: self.system_fingerprint.clone(),
                    choices,
                    usage: None,
                    timing: None,
                }
            }

            fn closing(&self, finish: $choice, usage: Usage, timing: Option<ServerTiming>) -> Vec<$chunk> {
                let mut out = vec![self.chunk(vec![finish])];
                if self.include_usage {
                    let mut u = self.chunk(Vec::new());
                    u.usage = Some(usage);
                    out.push(u);
                }
                if let Some(last) = out.last_mut() {
                    last.timing = timing;
                }
                out
            }
        }
    };
}

/// Emits the chunks of one streamed chat completion in the standard order.
#[derive(Clone, Debug)]
pub struct ChatStream {
    /// `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// From `stream_options.include_usage`.
    pub include_usage: bool,
    /// Copied into every chunk.
    pub system_fingerprint: Option<String>,
}

stream_builder!(ChatStream, ChatCompletionChunk, ChatChunkChoice, ChatCompletionChunk::OBJECT);

impl ChatStream {
    fn choice(delta: Delta, finish_reason: Option<FinishReason>) -> ChatChunkChoice {
        ChatChunkChoice { index: 0, delta, finish_reason, logprobs: None }
    }

    /// The first chunk: `delta: {"role": "assistant"}`, no text.
    pub fn role_chunk(&self) -> ChatCompletionChunk {
        self.chunk(vec![Self::choice(Delta { role: Some(Role::Assistant), content: None }, None)])
    }

    /// A chunk carrying generated text.
    pub fn content_chunk(&self, text: impl Into<String>) -> ChatCompletionChunk {
        self.chunk(vec![Self::choice(Delta { role: None, content: Some(text.into()) }, None)])
    }

    /// The closing chunks: the finish chunk, then the usage chunk when `include_usage`; `timing`
    /// goes on the last of them. Follow them with [`SSE_DONE`].
    pub fn finish(
        &self,
        reason: FinishReason,
        usage: Usage,
        timing: Option<ServerTiming>,
    ) -> Vec<ChatCompletionChunk> {
        self.closing(Self::choice(Delta::default(), Some(reason)), usage, timing)
    }

    /// The whole stream as SSE text, for tests and non-incremental callers.
    pub fn render(
        &self,
        pieces: &[&str],
        reason: FinishReason,
        usage: Usage,
        timing: Option<ServerTiming>,
    ) -> String {
        let mut s = sse_event(&self.role_chunk());
        for p in pieces {
            s.push_str(&sse_event(&self.content_chunk(*p)));
        }
        for c in self.finish(reason, usage, timing) {
            s.push_str(&sse_event(&c));
        }
        s.push_str(SSE_DONE);
        s
    }
}

/// Emits the chunks of one streamed legacy completion (no role chunk).
#[derive(Clone, Debug)]
pub struct CompletionStream {
    /// `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// From `stream_options.include_usage`.
    pub include_usage: bool,
    /// Copied into every chunk.
    pub system_fingerprint: Option<String>,
}

stream_builder!(CompletionStream, CompletionChunk, CompletionChoice, CompletionResponse::OBJECT);

impl CompletionStream {
    fn choice(text: String, finish_reason: Option<FinishReason>) -> CompletionChoice {
        CompletionChoice { index: 0, text, finish_reason, logprobs: None }
    }

    /// A chunk carrying generated text.
    pub fn text_chunk(&self, text: impl Into<String>) -> CompletionChunk {
        self.chunk(vec![Self::choice(text.into(), None)])
    }

    /// The finish chunk (empty text), then the usage chunk when `include_usage`; `timing` on the
    /// last. Follow them with [`SSE_DONE`].
    pub fn finish(
        &self,
        reason: FinishReason,
        usage: Usage,
        timing: Option<ServerTiming>,
    ) -> Vec<CompletionChunk> {
        self.closing(Self::choice(String::new(), Some(reason)), usage, timing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_stream_chunk, SseDecoder};
    use tokenpath_timeline::Stage;

    fn timing() -> ServerTiming {
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Decode, 9.5);
        t
    }

    #[test]
    fn chat_stream_has_the_standard_sequence() {
        let s = ChatStream::new("chatcmpl-1".into(), 5, "m".into(), true);
        let text = s.render(&["Hel", "lo"], FinishReason::Stop, Usage::new(4, 2, 0), Some(timing()));
        let events: Vec<String> = text.split("\n\n").filter(|e| !e.is_empty()).map(str::to_owned).collect();
        assert_eq!(events.len(), 6);
        let v: Vec<Value> = events[..5]
            .iter()
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        assert_eq!(v[0]["choices"][0]["delta"], serde_json::json!({"role": "assistant"}));
        assert_eq!(v[0]["object"], "chat.completion.chunk");
        assert!(v[0]["usage"].is_null() && v[0].get("usage").is_some());
        assert_eq!(v[1]["choices"][0]["delta"], serde_json::json!({"content": "Hel"}));
        assert!(v[1]["choices"][0]["finish_reason"].is_null());
        assert_eq!(v[3]["choices"][0]["delta"], serde_json::json!({}));
        assert_eq!(v[3]["choices"][0]["finish_reason"], "stop");
        assert!(v[3].get("timing").is_none(), "timing only on the last chunk");
        assert_eq!(v[4]["choices"], serde_json::json!([]));
        assert_eq!(v[4]["usage"]["completion_tokens"], 2);
        assert_eq!(v[4]["timing"]["stages_ms"]["decode"], 9.5);
        assert_eq!(format!("{}\n\n", events[5]), SSE_DONE);
        assert!(v.iter().all(|c| c["id"] == "chatcmpl-1" && c["created"] == 5));
    }

    #[test]
    fn without_include_usage_timing_is_on_the_finish_chunk() {
        let s = ChatStream::new("chatcmpl-2".into(), 5, "m".into(), false);
        let end = s.finish(FinishReason::Length, Usage::new(1, 1, 0), Some(timing()));
        assert_eq!(end.len(), 1);
        assert_eq!(end[0].choices[0].finish_reason, Some(FinishReason::Length));
        assert!(end[0].usage.is_none() && end[0].timing.is_some());
    }

    #[test]
    fn completion_stream_chunks_and_round_trip() {
        let s = CompletionStream::new("cmpl-3".into(), 5, "m".into(), true);
        let c = s.text_chunk(" a");
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " a");
        assert_eq!(serde_json::from_value::<CompletionChunk>(v).unwrap(), c);
        let end = s.finish(FinishReason::Stop, Usage::new(2, 1, 0), Some(timing()));
        assert_eq!(end.len(), 2);
        assert!(end[1].choices.is_empty() && end[1].usage.is_some() && end[1].timing.is_some());
        assert!(end[0].timing.is_none());
    }

    #[test]
    fn rendered_stream_decodes_back_through_the_bench_path() {
        let s = ChatStream::new("chatcmpl-4".into(), 5, "m".into(), true);
        let text = s.render(&["a", "b"], FinishReason::Stop, Usage::new(3, 2, 1), Some(timing()));
        let mut d = SseDecoder::new();
        let mut events = Vec::new();
        d.feed(text.as_bytes(), &mut events).unwrap();
        let views: Vec<_> = events.iter().map(|e| parse_stream_chunk(&e.data).unwrap()).collect();
        let tokens: Vec<bool> = views.iter().map(|v| v.carries_tokens()).collect();
        assert_eq!(tokens, [false, true, true, false, false, false]);
        assert_eq!(views[4].usage.map(|u| u.completion_tokens), Some(2));
        assert_eq!(views[4].timing, Some(timing()));
        assert!(views[5].done);
    }

    /// Regression: a relayed chunk with line breaks between its tokens was written as one
    /// `data:` line, so a client read the event cut at the first break.
    #[test]
    fn a_chunk_with_line_breaks_is_one_event_with_the_same_json() {
        for json in [r#"{"a":1}"#, "{\"a\":\n [1,\r\n2]\r}", "\n{\"b\": \"x\"}\n\n"] {
            let mut events = Vec::new();
            crate::SseDecoder::new().feed(sse_data(json).as_bytes(), &mut events).unwrap();
            assert_eq!(events.len(), 1, "{json:?}");
            let (got, want): (serde_json::Value, serde_json::Value) =
                (serde_json::from_str(&events[0].data).unwrap(), serde_json::from_str(json).unwrap());
            assert_eq!(got, want);
        }
    }

    #[test]
    fn sse_event_is_one_data_line() {
        assert_eq!(sse_event(&serde_json::json!({"a": "x\ny"})), "data: {\"a\":\"x\\ny\"}\n\n");
    }
}
