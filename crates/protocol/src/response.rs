//! Non-streamed responses (`chat.completion`, `text_completion`) and the pieces chunks share:
//! [`FinishReason`], [`Usage`], ids.
//!
//! These types are written by our gateway and read by the bench from *any* server, so they are
//! lenient on input: no `deny_unknown_fields`, `#[serde(default)]` wherever another server may
//! omit a field, and a [`FinishReason`] that keeps reasons we never produce (`tool_calls`, vLLM's
//! `abort`) instead of failing. On output they mirror OpenAI's shape, `logprobs: null` and
//! `system_fingerprint` included, plus our `timing` extension ([`crate::TIMING_FIELD`]) only when
//! present.

use crate::chat::Role;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use tokenpath_timeline::ServerTiming;

/// `"chatcmpl-<suffix>"`, the id of a chat completion and all its chunks.
pub fn chat_completion_id(suffix: impl std::fmt::Display) -> String {
    format!("chatcmpl-{suffix}")
}

/// `"cmpl-<suffix>"`, the id of a legacy completion and all its chunks.
pub fn completion_id(suffix: impl std::fmt::Display) -> String {
    format!("cmpl-{suffix}")
}

/// Why generation stopped, as on the wire. We produce `stop` and `length`; the rest are read from
/// other servers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS or a stop sequence.
    Stop,
    /// `max_tokens` or the context end.
    Length,
    /// OpenAI's content filter.
    ContentFilter,
    /// The model called tools.
    ToolCalls,
    /// Anything else a server sends (`function_call`, `abort`, ...), verbatim.
    Other(String),
}

impl FinishReason {
    /// The wire string.
    pub fn as_str(&self) -> &str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Other(s) => s,
        }
    }

    /// Parses a wire string (any string is accepted).
    pub fn from_wire(s: &str) -> Self {
        match s {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            "content_filter" => FinishReason::ContentFilter,
            "tool_calls" => FinishReason::ToolCalls,
            other => FinishReason::Other(other.to_owned()),
        }
    }

    /// The wire reason for a timeline finish; `None` for a cancelled request (nothing is sent to
    /// a client that went away).
    pub fn from_timeline(r: tokenpath_timeline::FinishReason) -> Option<Self> {
        match r {
            tokenpath_timeline::FinishReason::Stop => Some(FinishReason::Stop),
            tokenpath_timeline::FinishReason::Length => Some(FinishReason::Length),
            tokenpath_timeline::FinishReason::Cancelled => None,
        }
    }
}

impl Serialize for FinishReason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FinishReason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(FinishReason::from_wire(&s))
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: u64,
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens, cached ones included.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// `prompt_tokens + completion_tokens`.
    #[serde(default)]
    pub total_tokens: u64,
    /// Cached prompt tokens; absent from many servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// Usage with `total_tokens` computed and `cached_tokens` always reported.
    pub fn new(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }

    /// The bench's view of it (the timeline crate's client-side `Usage`).
    pub fn to_timeline(&self) -> tokenpath_timeline::Usage {
        tokenpath_timeline::Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: self.prompt_tokens_details.map(|d| d.cached_tokens),
        }
    }
}

/// The body of both responses' `new`: one choice, `usage`, no fingerprint and no timing.
macro_rules! one_choice_response {
    ($response:ident, $id:expr, $created:expr, $model:expr, $choice:expr, $usage:expr) => {
        $response {
            id: $id,
            object: $response::OBJECT.to_owned(),
            created: $created,
            model: $model,
            choices: vec![$choice],
            usage: Some($usage),
            system_fingerprint: None,
            timing: None,
        }
    };
}

/// The assistant message of a non-streamed chat choice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResponseMessage {
    /// Always `assistant` from us.
    pub role: Role,
    /// The generated text (`null` from other servers for tool calls).
    #[serde(default)]
    pub content: Option<String>,
    /// Reasoning text some servers (vLLM, SGLang) return separately; never sent by us.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// One choice of a chat completion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Always 0 from us (`n` = 1).
    #[serde(default)]
    pub index: u32,
    /// The answer.
    pub message: ResponseMessage,
    /// Why it ended.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// Always `null` from us (logprobs are not supported).
    #[serde(default)]
    pub logprobs: Option<Value>,
}

/// A non-streamed `chat.completion`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-…`.
    pub id: String,
    /// `"chat.completion"`.
    pub object: String,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The model that answered.
    #[serde(default)]
    pub model: String,
    /// One choice from us.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Build/config identity (`null` allowed).
    #[serde(default)]
    pub system_fingerprint: Option<String>,
    /// Extension: the server timeline ([`crate::TIMING_FIELD`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<ServerTiming>,
}

impl ChatCompletionResponse {
    /// `object` of a chat completion.
    pub const OBJECT: &'static str = "chat.completion";

    /// A one-choice response.
    pub fn new(
        id: String,
        created: u64,
        model: String,
        content: String,
        finish_reason: FinishReason,
        usage: Usage,
    ) -> Self {
        let message =
            ResponseMessage { role: Role::Assistant, content: Some(content), reasoning_content: None };
        let choice = ChatChoice { index: 0, message, finish_reason: Some(finish_reason), logprobs: None };
        one_choice_response!(ChatCompletionResponse, id, created, model, choice, usage)
    }
}

/// One choice of a legacy completion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Always 0 from us.
    #[serde(default)]
    pub index: u32,
    /// The generated text.
    #[serde(default)]
    pub text: String,
    /// Why it ended (`null` in intermediate stream chunks).
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// Always `null` from us.
    #[serde(default)]
    pub logprobs: Option<Value>,
}

/// A non-streamed `text_completion`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// `cmpl-…`.
    pub id: String,
    /// `"text_completion"`.
    pub object: String,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The model that answered.
    #[serde(default)]
    pub model: String,
    /// One choice from us.
    pub choices: Vec<CompletionChoice>,
    /// Token counts.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Build/config identity (`null` allowed).
    #[serde(default)]
    pub system_fingerprint: Option<String>,
    /// Extension: the server timeline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<ServerTiming>,
}

impl CompletionResponse {
    /// `object` of a legacy completion (streamed chunks use it too).
    pub const OBJECT: &'static str = "text_completion";

    /// A one-choice response.
    pub fn new(
        id: String,
        created: u64,
        model: String,
        text: String,
        finish_reason: FinishReason,
        usage: Usage,
    ) -> Self {
        let choice = CompletionChoice { index: 0, text, finish_reason: Some(finish_reason), logprobs: None };
        one_choice_response!(CompletionResponse, id, created, model, choice, usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_timeline::Stage;

    #[test]
    fn chat_response_has_openai_shape_and_timing_only_when_set() {
        let mut r = ChatCompletionResponse::new(
            chat_completion_id("req-1"),
            1_700_000_000,
            "smollm2".into(),
            "Hi!".into(),
            FinishReason::Stop,
            Usage::new(10, 3, 4),
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["id"], "chatcmpl-req-1");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"], serde_json::json!({"role": "assistant", "content": "Hi!"}));
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(v["choices"][0]["logprobs"].is_null() && v["choices"][0].get("logprobs").is_some());
        assert_eq!(v["usage"]["total_tokens"], 13);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
        assert!(v.get("system_fingerprint").is_some());
        assert!(v.get(crate::TIMING_FIELD).is_none());

        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Prefill, 5.0);
        r.timing = Some(t);
        let json = serde_json::to_string(&r).unwrap();
        let back: ChatCompletionResponse = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        assert_eq!(serde_json::to_value(&r).unwrap()[crate::TIMING_FIELD]["stages_ms"]["prefill"], 5.0);
    }

    #[test]
    fn completion_response_round_trips() {
        let r = CompletionResponse::new(
            completion_id(7),
            1,
            "m".into(),
            " world".into(),
            FinishReason::Length,
            Usage::new(1, 16, 0),
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " world");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        let back: CompletionResponse = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn responses_from_other_servers_parse_leniently() {
        // vLLM-style: extra fields everywhere, no cached tokens, an unusual finish reason.
        let body = r#"{"id":"chatcmpl-x","object":"chat.completion","created":1,"model":"m",
            "choices":[{"index":0,"message":{"role":"assistant","content":"ok","reasoning_content":"hm",
            "tool_calls":[]},"logprobs":null,"finish_reason":"abort","stop_reason":null}],
            "usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":null},
            "prompt_logprobs":null,"kv_transfer_params":null}"#;
        let r: ChatCompletionResponse = serde_json::from_str(body).unwrap();
        assert_eq!(r.choices[0].finish_reason, Some(FinishReason::Other("abort".into())));
        assert_eq!(r.choices[0].message.reasoning_content.as_deref(), Some("hm"));
        let u = r.usage.unwrap().to_timeline();
        assert_eq!((u.prompt_tokens, u.completion_tokens, u.cached_tokens), (3, 2, None));
    }

    #[test]
    fn finish_reasons_map_from_the_timeline() {
        use tokenpath_timeline::FinishReason as T;
        assert_eq!(FinishReason::from_timeline(T::Stop), Some(FinishReason::Stop));
        assert_eq!(FinishReason::from_timeline(T::Length), Some(FinishReason::Length));
        assert_eq!(FinishReason::from_timeline(T::Cancelled), None);
        for s in ["stop", "length", "content_filter", "tool_calls", "function_call"] {
            assert_eq!(FinishReason::from_wire(s).as_str(), s);
        }
    }
}
