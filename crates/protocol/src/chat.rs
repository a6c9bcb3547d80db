//! `POST /v1/chat/completions` requests: the exact field set the official `openai` Python client
//! (v1) can send, parsed strictly, then validated into a [`GenerationRequest`].
//!
//! Unknown fields are a 400 (`deny_unknown_fields`), as at OpenAI ("Unrecognized request argument
//! supplied"): a misspelt `max_token` silently ignored would make a benchmark measure the wrong
//! thing. To keep that strictness from rejecting legitimate clients, *every* parameter of the
//! client's `chat.completions.create` is declared here, and falls in one of three groups:
//! implemented (sampling, stop, stream...), accepted and ignored because it cannot change the
//! generated text (`user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
//! `safety_identifier`, `parallel_tool_calls`, `stream_options.include_obfuscation`), or
//! rejected with a clear "not supported" because honouring it is impossible and ignoring it would
//! change the output (`logprobs`, `tools`, `response_format` other than text, audio, ...). Messages
//! likewise accept the fields a client echoes back from a previous response (`refusal: null`,
//! `tool_calls: null`, `annotations`...). The one extension is `ignore_eos` (vLLM/SGLang/llama.cpp
//! spelling), which benchmarks need for fixed output lengths.

use crate::params::{check_sampling, require_model, sampling_of, unsupported};
use crate::wire::{opt_finite_f32, opt_string_or_strings, request_json_error};
use crate::{GenerationRequest, Limits, Prompt, PromptMessage, ProtocolError, StreamOptions};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;

/// Who speaks a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions (older name of `developer`).
    System,
    /// Instructions, OpenAI's newer name; chat templates usually render it like `system`.
    Developer,
    /// The human.
    User,
    /// The model.
    Assistant,
    /// A tool result.
    Tool,
}

impl Role {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One part of an array `content`. Only `text` is supported; the others parse so that the error
/// can say "not supported" instead of "unknown variant".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ContentPart {
    /// `{"type": "text", "text": "..."}`.
    Text {
        /// The text.
        text: String,
    },
    /// An image (rejected).
    ImageUrl {
        /// As sent.
        image_url: Value,
    },
    /// Audio input (rejected).
    InputAudio {
        /// As sent.
        input_audio: Value,
    },
    /// A file (rejected).
    File {
        /// As sent.
        file: Value,
    },
    /// An assistant refusal in replayed history (rejected).
    Refusal {
        /// As sent.
        refusal: String,
    },
}

impl ContentPart {
    fn type_name(&self) -> &'static str {
        match self {
            ContentPart::Text { .. } => "text",
            ContentPart::ImageUrl { .. } => "image_url",
            ContentPart::InputAudio { .. } => "input_audio",
            ContentPart::File { .. } => "file",
            ContentPart::Refusal { .. } => "refusal",
        }
    }
}

/// A message's `content`: a string or an array of parts.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageContent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<ContentPart>()? {
                    parts.push(p);
                }
                Ok(MessageContent::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// One request message, with every field the client may send.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: Role,
    /// The text; may be absent or null only where OpenAI allows it (assistant tool calls), which
    /// we reject anyway.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Assistant tool calls in history (rejected unless null/empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// Deprecated assistant function call (rejected unless null).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_call: Option<Value>,
    /// The call a `tool` message answers; accepted and not used (tools are not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Assistant refusal in history (rejected unless null).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    /// Assistant audio in history (rejected unless null).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<Value>,
    /// Annotations echoed from a previous response (ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<Value>,
}

/// A chat completions request body.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // field meanings are OpenAI's; the module docs say how each is treated
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
    #[serde(default, deserialize_with = "opt_finite_f32", skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, deserialize_with = "opt_finite_f32", skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, deserialize_with = "opt_string_or_strings", skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    #[serde(default, deserialize_with = "opt_finite_f32", skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[serde(default, deserialize_with = "opt_finite_f32", skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Extension: generate past EOS until `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    // Accepted and ignored: cannot change the generated text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safety_identifier: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    // Rejected unless null or a no-op value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions: Option<Vec<Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_call: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modalities: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_search_options: Option<Value>,
    // The fields SGLang's gateway and vllm-router add to every body they forward, accepted at
    // the values that change nothing here (see `params::router_no_ops`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_stop_trim: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continue_final_message: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub separate_reasoning: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_reasoning: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_reasoning: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_hidden_states: Option<bool>,
}

/// Parses a chat completions body. Malformed JSON, wrong types and unknown fields become
/// [`ProtocolError::InvalidRequest`] with serde_json's line and column; ranges are checked later
/// by [`ChatCompletionRequest::validate`].
pub fn parse_chat_request(body: &[u8]) -> Result<ChatCompletionRequest, ProtocolError> {
    serde_json::from_slice(body).map_err(|e| request_json_error(&e))
}

impl ChatCompletionRequest {
    /// Checks every parameter and normalizes the request for the engine.
    pub fn validate(&self, limits: &Limits) -> Result<GenerationRequest, ProtocolError> {
        require_model(&self.model)?;
        self.reject_unsupported()?;
        crate::params::router_no_ops(&crate::params::RouterFields {
            no_stop_trim: self.no_stop_trim,
            continue_final_message: self.continue_final_message,
            skip_special_tokens: self.skip_special_tokens,
            return_hidden_states: self.return_hidden_states,
        })?;
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(a), Some(b)) if a != b => {
                return Err(ProtocolError::invalid(
                    "max_tokens",
                    "Invalid 'max_tokens': 'max_tokens' and 'max_completion_tokens' were both set, to \
                     different values. Set only 'max_completion_tokens'.",
                ))
            }
            (Some(a), _) => Some(("max_completion_tokens", a)),
            (None, Some(b)) => Some(("max_tokens", b)),
            (None, None) => None,
        };
        let sampling = sampling_of!(self, max_tokens: max_tokens, default_max_tokens: None);
        let params = check_sampling(sampling, limits)?;
        if self.messages.is_empty() {
            return Err(ProtocolError::invalid(
                "messages",
                "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an \
                 empty array instead.",
            ));
        }
        let messages =
            self.messages.iter().enumerate().map(|(i, m)| m.normalize(i)).collect::<Result<_, _>>()?;
        Ok(GenerationRequest {
            model: self.model.clone(),
            prompt: Prompt::Chat(messages),
            params,
            user: self.user.clone(),
        })
    }

    fn reject_unsupported(&self) -> Result<(), ProtocolError> {
        if self.logprobs == Some(true) {
            return Err(unsupported("logprobs", "logprobs are"));
        }
        if self.top_logprobs.is_some_and(|n| n != 0) {
            return Err(unsupported("top_logprobs", "logprobs are"));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(unsupported("logit_bias", "logit_bias is"));
        }
        if let Some(rf) = &self.response_format {
            if rf.get("type").and_then(Value::as_str) != Some("text") {
                return Err(unsupported(
                    "response_format",
                    "response_format other than {\"type\": \"text\"} is",
                ));
            }
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(unsupported("tools", "tools are"));
        }
        if let Some(tc) = &self.tool_choice {
            if tc.as_str() != Some("none") {
                return Err(unsupported("tool_choice", "tool_choice other than \"none\" is"));
            }
        }
        if self.functions.as_ref().is_some_and(|f| !f.is_empty()) {
            return Err(unsupported("functions", "functions are"));
        }
        if self.function_call.as_ref().is_some_and(|f| f.as_str() != Some("none")) {
            return Err(unsupported("function_call", "function_call is"));
        }
        if self.modalities.as_ref().is_some_and(|m| m.iter().any(|x| x != "text")) {
            return Err(unsupported("modalities", "output modalities other than \"text\" are"));
        }
        let rejected: [(&str, bool, &str); 5] = [
            ("audio", self.audio.is_some(), "audio output is"),
            ("prediction", self.prediction.is_some(), "predicted outputs are"),
            ("reasoning_effort", self.reasoning_effort.is_some(), "reasoning_effort is"),
            ("verbosity", self.verbosity.is_some(), "verbosity is"),
            ("web_search_options", self.web_search_options.is_some(), "web search is"),
        ];
        match rejected.iter().find(|r| r.1) {
            Some((param, _, what)) => Err(unsupported(param, what)),
            None => Ok(()),
        }
    }
}

impl ChatMessage {
    /// A plain text message.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: None,
            function_call: None,
            tool_call_id: None,
            refusal: None,
            audio: None,
            annotations: None,
        }
    }

    fn normalize(&self, i: usize) -> Result<PromptMessage, ProtocolError> {
        let at = |field: &str| format!("messages[{i}].{field}");
        if self.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(unsupported(&at("tool_calls"), "tool calls are"));
        }
        if self.function_call.is_some() {
            return Err(unsupported(&at("function_call"), "function calls are"));
        }
        if self.audio.is_some() {
            return Err(unsupported(&at("audio"), "audio is"));
        }
        if self.refusal.is_some() {
            return Err(unsupported(&at("refusal"), "refusal messages are"));
        }
        let content = match &self.content {
            None => {
                let param = at("content");
                return Err(ProtocolError::invalid(
                    &param,
                    format!("Invalid '{param}': content is required for a '{}' message.", self.role.as_str()),
                ));
            }
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    match p {
                        ContentPart::Text { text } => texts.push(text.as_str()),
                        other => {
                            let param = format!("messages[{i}].content[{j}].type");
                            return Err(ProtocolError::invalid(
                                &param,
                                format!(
                                    "Invalid '{param}': content parts of type '{}' are not supported by \
                                     this server; only 'text' is.",
                                    other.type_name()
                                ),
                            ));
                        }
                    }
                }
                texts.join("\n")
            }
        };
        Ok(PromptMessage { role: self.role, content, name: self.name.clone() })
    }
}
