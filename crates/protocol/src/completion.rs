//! `POST /v1/completions` (legacy) requests: the field set of the official client's
//! `completions.create`, parsed strictly like chat (see [`crate::chat`] for the unknown-field
//! rule), then validated into a [`GenerationRequest`] with a text or token-id prompt.
//!
//! `prompt` is OpenAI's four-way union (string, array of strings, array of token ids, array of
//! token-id arrays); since we serve one prompt per request, arrays must hold exactly one prompt,
//! and a batch is rejected with a clear message rather than answered with `n` choices we cannot
//! produce. `max_tokens` defaults to 16 here, as at OpenAI and vLLM.

use crate::params::{
    check_sampling, integer_min, require_model, sampling_of, unsupported, COMPLETIONS_DEFAULT_MAX_TOKENS,
};
use crate::wire::{opt_finite_f32, opt_string_or_strings, request_json_error};
use crate::{GenerationRequest, Limits, Prompt, ProtocolError, StreamOptions};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;

/// The `prompt` union as sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// `"text"`.
    Text(String),
    /// `["text", ...]`.
    Texts(Vec<String>),
    /// `[1, 2, 3]` (ids kept as sent; range-checked by validation).
    Tokens(Vec<i64>),
    /// `[[1, 2], [3]]`.
    TokenBatches(Vec<Vec<i64>>),
}

impl<'de> Deserialize<'de> for PromptInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptInput;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a string, an array of strings, an array of token ids or an array of token-id arrays",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptInput::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(PromptInput::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                // The first element decides the shape; the rest must match it.
                let Some(first) = seq.next_element::<Value>()? else {
                    return Ok(PromptInput::Texts(Vec::new()));
                };
                let mixed = || de::Error::custom("prompt arrays must not mix strings, token ids and arrays");
                match first {
                    Value::String(s) => {
                        let mut v = vec![s];
                        while let Some(x) = seq.next_element::<Value>()? {
                            v.push(x.as_str().ok_or_else(mixed)?.to_owned());
                        }
                        Ok(PromptInput::Texts(v))
                    }
                    Value::Number(n) => {
                        let mut v = vec![token_id(&n).ok_or_else(mixed)?];
                        while let Some(x) = seq.next_element::<Value>()? {
                            v.push(x.as_number().and_then(token_id).ok_or_else(mixed)?);
                        }
                        Ok(PromptInput::Tokens(v))
                    }
                    Value::Array(_) => {
                        let mut v = vec![ids(first).ok_or_else(mixed)?];
                        while let Some(x) = seq.next_element::<Value>()? {
                            v.push(ids(x).ok_or_else(mixed)?);
                        }
                        Ok(PromptInput::TokenBatches(v))
                    }
                    _ => Err(de::Error::custom(
                        "prompt array elements must be strings, token ids or token-id arrays",
                    )),
                }
            }
        }
        fn token_id(n: &serde_json::Number) -> Option<i64> {
            n.as_i64()
        }
        fn ids(v: Value) -> Option<Vec<i64>> {
            match v {
                Value::Array(a) => a.iter().map(|x| x.as_number().and_then(token_id)).collect(),
                _ => None,
            }
        }
        d.deserialize_any(V)
    }
}

/// A legacy completions request body.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // field meanings are OpenAI's; the module docs say how each is treated
pub struct CompletionRequest {
    pub model: String,
    /// Required by validation; `null` parses (the client allows it) and is then rejected.
    #[serde(default)]
    pub prompt: Option<PromptInput>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
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
    // Rejected unless null or a no-op value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f64>>,
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

/// Parses a completions body; errors as for [`crate::parse_chat_request`].
pub fn parse_completion_request(body: &[u8]) -> Result<CompletionRequest, ProtocolError> {
    serde_json::from_slice(body).map_err(|e| request_json_error(&e))
}

impl CompletionRequest {
    /// Checks every parameter and normalizes the request for the engine.
    pub fn validate(&self, limits: &Limits) -> Result<GenerationRequest, ProtocolError> {
        require_model(&self.model)?;
        crate::params::router_no_ops(&crate::params::RouterFields {
            no_stop_trim: self.no_stop_trim,
            continue_final_message: self.continue_final_message,
            skip_special_tokens: self.skip_special_tokens,
            return_hidden_states: self.return_hidden_states,
        })?;
        if self.echo == Some(true) {
            return Err(unsupported("echo", "echo is"));
        }
        if self.logprobs.is_some() {
            return Err(unsupported("logprobs", "logprobs are"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "suffix (insertion) is"));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(unsupported("logit_bias", "logit_bias is"));
        }
        if let Some(b) = self.best_of {
            integer_min("best_of", b, 1)?;
            if b > 1 {
                return Err(ProtocolError::invalid(
                    "best_of",
                    format!("Invalid 'best_of': only best_of=1 is supported by this server, but got {b}."),
                ));
            }
        }
        let sampling = sampling_of!(
            self,
            max_tokens: self.max_tokens.map(|v| ("max_tokens", v)),
            default_max_tokens: Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        );
        let params = check_sampling(sampling, limits)?;
        let prompt = self.prompt()?;
        Ok(GenerationRequest { model: self.model.clone(), prompt, params, user: self.user.clone() })
    }

    fn prompt(&self) -> Result<Prompt, ProtocolError> {
        let one = |len: usize| -> Result<(), ProtocolError> {
            match len {
                0 => Err(ProtocolError::invalid(
                    "prompt",
                    "Invalid 'prompt': empty array. Expected one prompt.",
                )),
                1 => Ok(()),
                n => Err(ProtocolError::invalid(
                    "prompt",
                    format!("Invalid 'prompt': got {n} prompts; this server accepts one prompt per request."),
                )),
            }
        };
        let prompt = match &self.prompt {
            None => return Err(ProtocolError::invalid("prompt", "Missing required parameter: 'prompt'.")),
            Some(PromptInput::Text(t)) => Prompt::Text(t.clone()),
            Some(PromptInput::Texts(v)) => {
                one(v.len())?;
                Prompt::Text(v.concat())
            }
            Some(PromptInput::Tokens(ids)) => Prompt::Tokens(token_ids(ids)?),
            Some(PromptInput::TokenBatches(b)) => {
                one(b.len())?;
                Prompt::Tokens(token_ids(b.concat().as_slice())?)
            }
        };
        let empty = match &prompt {
            Prompt::Text(t) => t.is_empty(),
            Prompt::Tokens(t) => t.is_empty(),
            Prompt::Chat(m) => m.is_empty(),
        };
        if empty {
            return Err(ProtocolError::invalid("prompt", "Invalid 'prompt': the prompt must not be empty."));
        }
        Ok(prompt)
    }
}

fn token_ids(ids: &[i64]) -> Result<Vec<u32>, ProtocolError> {
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id).map_err(|_| {
                ProtocolError::invalid(
                    format!("prompt[{i}]"),
                    format!("Invalid 'prompt[{i}]': token id {id} is out of range (0..=4294967295)."),
                )
            })
        })
        .collect()
}
