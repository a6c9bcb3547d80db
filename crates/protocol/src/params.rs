//! The engine-facing result of validating a request: [`GenerationRequest`] = model + [`Prompt`] +
//! [`GenerationParams`], with OpenAI's defaults filled in and every range already checked, so the
//! worker and engine never see a JSON shape or an optional they must interpret.
//!
//! Chat and legacy completions differ only in the prompt and a few rejected features; the sampling
//! parameters share one checker here so both endpoints word every error the same way. Messages
//! follow OpenAI's style ("Invalid 'temperature': decimal above maximum value. Expected a value
//! <= 2, but got 3 instead.") and always name the parameter.

use crate::chat::Role;
use crate::ProtocolError;
use serde::{Deserialize, Serialize};

/// OpenAI's limit on `stop` sequences.
pub const MAX_STOP_SEQUENCES: usize = 4;
/// Longest stop sequence accepted, in bytes (a stop is matched on every generated token: its
/// length is work per token, so it is bounded like the count).
pub const MAX_STOP_BYTES: usize = 1024;

/// `max_tokens` when a legacy completions request sets none (OpenAI's and vLLM's default).
/// Chat has no such default: it generates until a stop, EOS or the context end.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

/// Server-side limits that validation enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest `max_tokens` / `max_completion_tokens` accepted (the gateway sets it from the
    /// model's context length).
    pub max_tokens_cap: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_tokens_cap: 8192 }
    }
}

/// `stream_options` of both endpoints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `choices: []`) before `[DONE]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
    /// OpenAI's random padding of chunks against side channels; accepted and ignored (we never
    /// obfuscate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_obfuscation: Option<bool>,
}

/// Normalized sampling and streaming parameters, defaults applied (OpenAI's: temperature 1,
/// top_p 1, penalties 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationParams {
    /// Most tokens to generate; `None`: until stop/EOS or the context end.
    pub max_tokens: Option<u32>,
    /// 0..=2; 0 means greedy.
    pub temperature: f32,
    /// (0, 1].
    pub top_p: f32,
    /// Sampling seed. OpenAI's seed is a signed 64-bit integer; it is reinterpreted bit for bit
    /// (`-1` becomes `u64::MAX`), so distinct seeds stay distinct.
    pub seed: Option<u64>,
    /// Stop sequences, at most [`MAX_STOP_SEQUENCES`], none empty.
    pub stop: Vec<String>,
    /// -2..=2.
    pub presence_penalty: f32,
    /// -2..=2.
    pub frequency_penalty: f32,
    /// Respond with SSE.
    pub stream: bool,
    /// Streaming with `stream_options.include_usage`: a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Extension (vLLM, SGLang and llama.cpp server spell it the same): keep generating past EOS
    /// until `max_tokens`, so benchmarks get fixed output lengths.
    pub ignore_eos: bool,
}

impl Default for GenerationParams {
    fn default() -> Self {
        GenerationParams {
            max_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            stop: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            stream: false,
            include_usage: false,
            ignore_eos: false,
        }
    }
}

/// One chat message after validation: text only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptMessage {
    /// Who speaks.
    pub role: Role,
    /// The text; several text parts are joined with `"\n"` (as vLLM does).
    pub content: String,
    /// Optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl PromptMessage {
    /// A message without a participant name.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self { role, content: content.into(), name: None }
    }
}

/// What the engine is asked to continue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    /// Chat messages, to be rendered with the model's chat template. Never empty.
    Chat(Vec<PromptMessage>),
    /// Raw text (legacy completions). Never empty.
    Text(String),
    /// Token ids (legacy completions). Never empty; ids are not checked against the vocabulary
    /// here (the engine knows it).
    Tokens(Vec<u32>),
}

/// A validated request, ready for tokenization and scheduling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// The model the client asked for (the gateway checks that it exists).
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling and streaming.
    pub params: GenerationParams,
    /// The client's end-user id, for logs only.
    pub user: Option<String>,
}

/// The parameters both endpoints share, as sent.
#[derive(Debug, Default)]
pub(crate) struct Sampling<'a> {
    pub max_tokens: Option<(&'static str, i64)>,
    pub default_max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<&'a [String]>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
}

/// The [`Sampling`] of a request body: chat and completions name the shared fields alike, and
/// differ only in `max_tokens` (chat also has `max_completion_tokens`) and its default.
macro_rules! sampling_of {
    ($req:expr, max_tokens: $max_tokens:expr, default_max_tokens: $default:expr $(,)?) => {
        $crate::params::Sampling {
            max_tokens: $max_tokens,
            default_max_tokens: $default,
            temperature: $req.temperature,
            top_p: $req.top_p,
            seed: $req.seed,
            stop: $req.stop.as_deref(),
            presence_penalty: $req.presence_penalty,
            frequency_penalty: $req.frequency_penalty,
            n: $req.n,
            stream: $req.stream,
            stream_options: $req.stream_options,
            ignore_eos: $req.ignore_eos,
        }
    };
}
pub(crate) use sampling_of;

/// `model` must be set, on both endpoints.
pub(crate) fn require_model(model: &str) -> Result<(), ProtocolError> {
    if model.is_empty() {
        return Err(ProtocolError::invalid("model", "you must provide a model parameter"));
    }
    Ok(())
}

/// Checks the shared parameters and fills in defaults.
pub(crate) fn check_sampling(s: Sampling<'_>, limits: &Limits) -> Result<GenerationParams, ProtocolError> {
    let d = GenerationParams::default();
    let temperature = s.temperature.unwrap_or(d.temperature);
    decimal_range("temperature", temperature, 0.0, 2.0)?;
    let top_p = s.top_p.unwrap_or(d.top_p);
    if top_p.is_nan() || top_p <= 0.0 {
        return Err(ProtocolError::invalid(
            "top_p",
            format!("Invalid 'top_p': decimal below minimum value. Expected a value > 0, but got {top_p} instead."),
        ));
    }
    decimal_range("top_p", top_p, 0.0, 1.0)?;
    let presence_penalty = s.presence_penalty.unwrap_or(d.presence_penalty);
    decimal_range("presence_penalty", presence_penalty, -2.0, 2.0)?;
    let frequency_penalty = s.frequency_penalty.unwrap_or(d.frequency_penalty);
    decimal_range("frequency_penalty", frequency_penalty, -2.0, 2.0)?;

    if let Some(n) = s.n {
        integer_min("n", n, 1)?;
        if n > 1 {
            return Err(ProtocolError::invalid(
                "n",
                format!("Invalid 'n': only n=1 is supported by this server, but got {n}."),
            ));
        }
    }

    let max_tokens = match s.max_tokens {
        None => s.default_max_tokens.map(|m| m.min(limits.max_tokens_cap)),
        Some((param, v)) => {
            integer_min(param, v, 1)?;
            if v > i64::from(limits.max_tokens_cap) {
                return Err(ProtocolError::invalid(
                    param,
                    format!(
                        "{param} is too large: {v}. This model supports at most {} completion tokens, \
                         whereas you provided {v}.",
                        limits.max_tokens_cap
                    ),
                ));
            }
            Some(u32::try_from(v).unwrap_or(limits.max_tokens_cap))
        }
    };

    let stop = s.stop.map(<[String]>::to_vec).unwrap_or_default();
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(ProtocolError::invalid(
            "stop",
            format!(
                "Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP_SEQUENCES}, \
                 but got an array with length {} instead.",
                stop.len()
            ),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ProtocolError::invalid(
            format!("stop[{i}]"),
            format!("Invalid 'stop[{i}]': empty string. Expected a non-empty stop sequence."),
        ));
    }
    if let Some(i) = stop.iter().position(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ProtocolError::invalid(
            format!("stop[{i}]"),
            format!(
                "Invalid 'stop[{i}]': string too long. Expected a stop sequence of at most {MAX_STOP_BYTES} \
                 bytes, but got one of {} bytes instead.",
                stop[i].len()
            ),
        ));
    }

    let stream = s.stream.unwrap_or(false);
    let include_usage = match s.stream_options {
        None => false,
        Some(_) if !stream => {
            return Err(ProtocolError::invalid(
                "stream_options",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            ))
        }
        Some(o) => o.include_usage.unwrap_or(false),
    };

    Ok(GenerationParams {
        max_tokens,
        temperature,
        top_p,
        seed: s.seed.map(|v| v as u64),
        stop,
        presence_penalty,
        frequency_penalty,
        stream,
        include_usage,
        ignore_eos: s.ignore_eos.unwrap_or(false),
    })
}

/// `min <= v <= max`, with OpenAI's wording.
pub(crate) fn decimal_range(param: &str, v: f32, min: f32, max: f32) -> Result<(), ProtocolError> {
    if v.is_nan() || v < min {
        return Err(ProtocolError::invalid(
            param,
            format!("Invalid '{param}': decimal below minimum value. Expected a value >= {min}, but got {v} instead."),
        ));
    }
    if v > max {
        return Err(ProtocolError::invalid(
            param,
            format!("Invalid '{param}': decimal above maximum value. Expected a value <= {max}, but got {v} instead."),
        ));
    }
    Ok(())
}

/// `v >= min`, with OpenAI's wording.
pub(crate) fn integer_min(param: &str, v: i64, min: i64) -> Result<(), ProtocolError> {
    if v < min {
        return Err(ProtocolError::invalid(
            param,
            format!("Invalid '{param}': integer below minimum value. Expected a value >= {min}, but got {v} instead."),
        ));
    }
    Ok(())
}

/// A parameter we parse but do not implement.
/// The fields a router in front of us (SGLang's gateway, vllm-router) sets on every request,
/// whose values could change the output. `separate_reasoning`, `stream_reasoning` and
/// `include_reasoning` are accepted at any value: this server emits no reasoning content.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RouterFields {
    pub(crate) no_stop_trim: Option<bool>,
    pub(crate) continue_final_message: Option<bool>,
    pub(crate) skip_special_tokens: Option<bool>,
    pub(crate) return_hidden_states: Option<bool>,
}

/// Accepts the routers' fields at the values they send by default (which change nothing here)
/// and refuses the others by name, so tokenpath serves behind those routers.
pub(crate) fn router_no_ops(f: &RouterFields) -> Result<(), ProtocolError> {
    let checks = [
        ("no_stop_trim", f.no_stop_trim, false, "keeping the stop string is"),
        ("continue_final_message", f.continue_final_message, false, "continuing the final message is"),
        ("skip_special_tokens", f.skip_special_tokens, true, "emitting special tokens is"),
        ("return_hidden_states", f.return_hidden_states, false, "returning hidden states is"),
    ];
    for (param, value, no_op, what) in checks {
        if value.is_some_and(|v| v != no_op) {
            return Err(unsupported(param, what));
        }
    }
    Ok(())
}

pub(crate) fn unsupported(param: &str, what: &str) -> ProtocolError {
    ProtocolError::invalid(param, format!("Invalid '{param}': {what} not supported by this server."))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(e: ProtocolError) -> String {
        match e {
            ProtocolError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("not an invalid request: {other}"),
        }
    }

    #[test]
    fn defaults_are_openai_defaults() {
        let p = check_sampling(Sampling::default(), &Limits::default()).unwrap();
        assert_eq!(p, GenerationParams::default());
    }

    #[test]
    fn every_range_error_names_its_param() {
        let l = Limits { max_tokens_cap: 100 };
        let cases: Vec<(Sampling<'_>, &str)> = vec![
            (Sampling { temperature: Some(2.5), ..Default::default() }, "temperature"),
            (Sampling { temperature: Some(-0.1), ..Default::default() }, "temperature"),
            (Sampling { top_p: Some(0.0), ..Default::default() }, "top_p"),
            (Sampling { top_p: Some(1.01), ..Default::default() }, "top_p"),
            (Sampling { presence_penalty: Some(2.1), ..Default::default() }, "presence_penalty"),
            (Sampling { frequency_penalty: Some(-2.1), ..Default::default() }, "frequency_penalty"),
            (Sampling { n: Some(0), ..Default::default() }, "n"),
            (Sampling { n: Some(2), ..Default::default() }, "n"),
            (Sampling { max_tokens: Some(("max_tokens", 0)), ..Default::default() }, "max_tokens"),
            (
                Sampling { max_tokens: Some(("max_completion_tokens", 101)), ..Default::default() },
                "max_completion_tokens",
            ),
            (
                Sampling { stream_options: Some(StreamOptions::default()), ..Default::default() },
                "stream_options",
            ),
        ];
        for (s, want) in cases {
            let dbg = format!("{s:?}");
            assert_eq!(param_of(check_sampling(s, &l).unwrap_err()), want, "{dbg}");
        }
        let five: Vec<String> = (0..5).map(|i| i.to_string()).collect();
        let e = check_sampling(Sampling { stop: Some(&five), ..Default::default() }, &l).unwrap_err();
        assert!(e.to_string().contains("maximum length 4"), "{e}");
        assert_eq!(param_of(e), "stop");
        let empty = vec!["a".to_owned(), String::new()];
        let e = check_sampling(Sampling { stop: Some(&empty), ..Default::default() }, &l).unwrap_err();
        assert_eq!(param_of(e), "stop[1]");
        // A 100,000-character stop string (the review's) is refused; the longest allowed is not.
        let long = vec!["a".to_owned(), "x".repeat(100_000)];
        let e = check_sampling(Sampling { stop: Some(&long), ..Default::default() }, &l).unwrap_err();
        assert!(e.to_string().contains("too long"), "{e}");
        assert_eq!(param_of(e), "stop[1]");
        let max = vec!["é".repeat(MAX_STOP_BYTES / 2)];
        assert!(check_sampling(Sampling { stop: Some(&max), ..Default::default() }, &l).is_ok());
    }

    #[test]
    fn error_wording_follows_openai() {
        let e = check_sampling(Sampling { temperature: Some(3.0), ..Default::default() }, &Limits::default());
        assert_eq!(
            e.unwrap_err().to_string(),
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 3 instead."
        );
        let e = check_sampling(
            Sampling { max_tokens: Some(("max_tokens", 9000)), ..Default::default() },
            &Limits::default(),
        );
        assert!(e
            .unwrap_err()
            .to_string()
            .starts_with("max_tokens is too large: 9000. This model supports at most 8192"));
    }

    #[test]
    fn bounds_are_inclusive_and_values_pass_through() {
        let stop = vec!["\n\n".to_owned()];
        let s = Sampling {
            max_tokens: Some(("max_tokens", 100)),
            temperature: Some(0.0),
            top_p: Some(1.0),
            presence_penalty: Some(-2.0),
            frequency_penalty: Some(2.0),
            seed: Some(-1),
            stop: Some(&stop),
            n: Some(1),
            stream: Some(true),
            stream_options: Some(StreamOptions { include_usage: Some(true), include_obfuscation: None }),
            ignore_eos: Some(true),
            default_max_tokens: None,
        };
        let p = check_sampling(s, &Limits { max_tokens_cap: 100 }).unwrap();
        assert_eq!(p.max_tokens, Some(100));
        assert_eq!(p.seed, Some(u64::MAX));
        assert!(p.stream && p.include_usage && p.ignore_eos);
        assert_eq!(p.stop, stop);
    }

    #[test]
    fn default_max_tokens_is_capped() {
        let s = Sampling { default_max_tokens: Some(16), ..Default::default() };
        assert_eq!(check_sampling(s, &Limits { max_tokens_cap: 8 }).unwrap().max_tokens, Some(8));
    }
}
