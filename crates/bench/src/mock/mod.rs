//! `tokenpath mock-engine`: an OpenAI-compatible server with no model, for measuring what sits in
//! front of an engine (our gateway, vllm-router, SGLang's gateway, LiteLLM) and for recording what
//! each of them sends. It answers at once and the same way every time — `tokens` content chunks,
//! then the finish, usage when asked — so a latency measured through a gateway minus the latency
//! measured directly is the gateway's.
//!
//! It can play one half of a PD pair as the engines define it (see `docs/upstreams.md`): a vLLM
//! prefill server answers a `kv_transfer_params.do_remote_decode` leg with transfer params, an
//! SGLang prefill server a leg carrying `bootstrap_room` with one token. With `log`, every
//! generation request is appended to a JSONL file (path, request id, whether credentials came,
//! the body), which is what the differential check compares between gateways.
//!
//! Written by hand rather than with a mock-server crate: what matters is the engines' PD field
//! semantics and a fast streaming path, which no generic mock server models.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokenpath_timeline::TraceParent;

mod spans;
pub use spans::MockOtlp;
use spans::SpanClock;

/// Which engine it plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persona {
    /// A colocated OpenAI server.
    Plain,
    /// vLLM with NIXL, prefill side.
    VllmPrefill,
    /// vLLM with NIXL, decode side.
    VllmDecode,
    /// SGLang, prefill side.
    SglangPrefill,
    /// SGLang, decode side.
    SglangDecode,
}

impl std::str::FromStr for Persona {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "plain" => Self::Plain,
            "vllm-prefill" => Self::VllmPrefill,
            "vllm-decode" => Self::VllmDecode,
            "sglang-prefill" => Self::SglangPrefill,
            "sglang-decode" => Self::SglangDecode,
            _ => {
                return Err(format!(
                    "unknown persona {s:?}: expected plain, vllm-prefill, vllm-decode, sglang-prefill or sglang-decode"
                ))
            }
        })
    }
}

/// How it answers.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// Which engine it plays.
    pub persona: Persona,
    /// Content chunks per answer (one token each); 0: as many as the request's `max_tokens`
    /// (at most [`MAX_REPLY_TOKENS`], [`DEFAULT_REPLY_TOKENS`] when it gives none).
    pub tokens: usize,
    /// Pause between a stream's events (zero: the whole stream in one write).
    pub token_delay: std::time::Duration,
    /// Send the usage chunk on every stream, asked for or not.
    pub always_usage: bool,
    /// Tokens each content chunk carries (an engine that batches its stream output).
    pub tokens_per_chunk: usize,
    /// Every content chunk carries the cumulative `usage` (vLLM's `continuous_usage_stats`).
    pub continuous_usage: bool,
    /// The model name it lists and answers with.
    pub model: String,
    /// Append every generation request here (JSONL).
    pub log: Option<PathBuf>,
    /// Export a vLLM-shaped span per traced request here.
    pub otlp: Option<MockOtlp>,
}

/// Most bytes of a request body it reads.
const MAX_BODY: usize = 1 << 20;
/// Longest reply, whatever `max_tokens` says: one request's cost stays bounded.
pub const MAX_REPLY_TOKENS: usize = 256;
/// Reply length when the request gives no `max_tokens` (and `tokens` is 0).
pub const DEFAULT_REPLY_TOKENS: usize = 4;

struct Mock {
    config: MockConfig,
    log: Option<Mutex<std::fs::File>>,
    running: AtomicUsize,
    served: AtomicU64,
    otlp_client: reqwest::Client,
}

impl Mock {
    fn log_line(&self, line: &Value) {
        if let Some(Ok(mut f)) = self.log.as_ref().map(|l| l.lock()) {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// The mock's routes, ready for `axum::serve`.
pub fn router(config: MockConfig) -> Result<Router, std::io::Error> {
    let log = match &config.log {
        Some(p) => Some(Mutex::new(std::fs::OpenOptions::new().create(true).append(true).open(p)?)),
        None => None,
    };
    let otlp_client = match &config.otlp {
        // gRPC is HTTP/2 with prior knowledge on a plain port.
        Some(o) if o.grpc => reqwest::Client::builder().http2_prior_knowledge().build(),
        _ => reqwest::Client::builder().build(),
    }
    .map_err(std::io::Error::other)?;
    let mock =
        Arc::new(Mock { config, log, running: AtomicUsize::new(0), served: AtomicU64::new(0), otlp_client });
    Ok(Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        // SGLang's gateway probes these before it routes (a model path would make it try to
        // download a tokenizer: none is named).
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/v1/chat/completions", post(generate))
        .route("/v1/completions", post(generate))
        .with_state(mock))
}

/// Serves the mock on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: MockConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), std::io::Error> {
    axum::serve(listener, router(config)?).with_graceful_shutdown(shutdown).await
}

async fn models(State(m): State<Arc<Mock>>) -> Response {
    let body = json!({"object": "list", "data": [{"id": m.config.model, "object": "model",
        "owned_by": "tokenpath-mock", "max_model_len": 4096}]});
    ([("content-type", "application/json")], body.to_string()).into_response()
}

async fn server_info(State(m): State<Arc<Mock>>) -> Response {
    let mode = match m.config.persona {
        Persona::SglangPrefill | Persona::VllmPrefill => "prefill",
        Persona::SglangDecode | Persona::VllmDecode => "decode",
        Persona::Plain => "null",
    };
    let body = json!({"served_model_name": m.config.model, "disaggregation_mode": mode,
        "version": concat!("tokenpath-mock ", env!("CARGO_PKG_VERSION"))});
    ([("content-type", "application/json")], body.to_string()).into_response()
}

async fn model_info() -> Response {
    ([("content-type", "application/json")], json!({"is_generation": true}).to_string()).into_response()
}

/// vLLM's gauge names, so a gateway that reads load sees this server's.
async fn metrics(State(m): State<Arc<Mock>>) -> String {
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n\
         # TYPE tokenpath_mock_requests_total counter\ntokenpath_mock_requests_total {}\n",
        m.running.load(Ordering::Relaxed),
        m.served.load(Ordering::Relaxed)
    )
}

/// Counts a request as running until dropped (with its response body).
struct Running(Arc<Mock>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn generate(
    State(m): State<Arc<Mock>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if body.len() > MAX_BODY {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "body too large");
    }
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "the body is not JSON");
    };
    m.served.fetch_add(1, Ordering::Relaxed);
    m.running.fetch_add(1, Ordering::Relaxed);
    let running = Running(Arc::clone(&m));
    if m.log.is_some() {
        m.log_line(&json!({
            "path": uri.path(),
            "request_id": headers.get("x-request-id").and_then(|h| h.to_str().ok()),
            "authorization": headers.contains_key("authorization"),
            "body": v,
        }));
    }
    let chat = uri.path().ends_with("/chat/completions");
    let answer = Answer::new(&m.config, &v, chat);
    let trace = headers.get("traceparent").and_then(|h| h.to_str().ok()?.parse::<TraceParent>().ok());
    let mut clock = trace
        .filter(|_| m.config.otlp.is_some())
        .map(|t| SpanClock::start(&m, t, answer.prompt_tokens, answer.tokens as u64));
    if v["stream"] == json!(true) {
        let usage = m.config.always_usage || v.pointer("/stream_options/include_usage") == Some(&json!(true));
        let continuous = m.config.continuous_usage
            || v.pointer("/stream_options/continuous_usage_stats") == Some(&json!(true));
        let per_chunk = m.config.tokens_per_chunk.max(1);
        let chunks = answer.chunks(usage, per_chunk, continuous);
        // Which events carry content: after the role event of a chat stream, one per chunk.
        let first_content = usize::from(chat);
        let content = first_content..first_content + answer.tokens.div_ceil(per_chunk);
        let delay = m.config.token_delay;
        let body = if delay.is_zero() {
            // One write for the whole answer: the cheapest stream a server can send.
            drop(running);
            if let Some(c) = clock.as_mut() {
                c.content();
            }
            drop(clock);
            Body::from(chunks.concat())
        } else {
            let s = futures_util::stream::unfold(
                (chunks.into_iter().enumerate(), true, running, clock),
                move |(mut it, first, r, mut clock)| {
                    let content = content.clone();
                    async move {
                        if let Some(c) = clock.as_mut() {
                            c.polled();
                        }
                        let (i, c) = it.next()?;
                        if !first {
                            tokio::time::sleep(delay).await;
                        }
                        if let Some(clk) = clock.as_mut().filter(|_| content.contains(&i)) {
                            clk.content();
                        }
                        Some((Ok::<_, std::convert::Infallible>(Bytes::from(c)), (it, false, r, clock)))
                    }
                },
            );
            Body::from_stream(s)
        };
        Response::builder()
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(body)
            .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response"))
    } else {
        drop(running);
        if let Some(c) = clock.as_mut() {
            c.content();
        }
        drop(clock);
        ([("content-type", "application/json")], answer.whole().to_string()).into_response()
    }
}

/// One request's answer.
struct Answer {
    chat: bool,
    model: String,
    tokens: usize,
    prompt_tokens: u64,
    cached: u64,
    extra: Option<(&'static str, Value)>,
}

impl Answer {
    fn new(config: &MockConfig, v: &Value, chat: bool) -> Self {
        let asked = v.get("max_completion_tokens").or_else(|| v.get("max_tokens")).and_then(Value::as_u64);
        let tokens = match config.tokens {
            0 => asked.map_or(DEFAULT_REPLY_TOKENS, |n| usize::try_from(n).unwrap_or(MAX_REPLY_TOKENS)),
            n => n,
        };
        let mut a = Self {
            chat,
            model: v["model"].as_str().unwrap_or(&config.model).to_owned(),
            tokens: tokens.clamp(1, MAX_REPLY_TOKENS),
            prompt_tokens: prompt_words(v),
            cached: 0,
            extra: None,
        };
        match config.persona {
            Persona::VllmPrefill
                if v.pointer("/kv_transfer_params/do_remote_decode") == Some(&json!(true)) =>
            {
                a.tokens = 1;
                a.cached = 2;
                a.extra = Some((
                    "kv_transfer_params",
                    json!({"do_remote_prefill": true, "do_remote_decode": false,
                        "remote_engine_id": "mock-prefill", "remote_block_ids": [1, 2, 3],
                        "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}),
                ));
            }
            Persona::VllmDecode if v.get("kv_transfer_params").is_some() => a.cached = a.prompt_tokens,
            Persona::SglangPrefill => {
                a.tokens = 1;
                a.cached = 2;
            }
            Persona::SglangDecode => a.cached = a.prompt_tokens,
            _ => {}
        }
        a
    }

    fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens as u64,
            "prompt_tokens_details": {"cached_tokens": self.cached}})
    }

    fn choice(&self, text: &str, finish: Value, whole: bool) -> Value {
        match (self.chat, whole) {
            (true, true) => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
            }
            (true, false) => json!({"index": 0, "delta": {"content": text}, "finish_reason": finish}),
            (false, _) => json!({"index": 0, "text": text, "finish_reason": finish}),
        }
    }

    fn object(&self, whole: bool) -> &'static str {
        match (self.chat, whole) {
            (true, true) => "chat.completion",
            (true, false) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    fn whole(&self) -> Value {
        let text = " tok".repeat(self.tokens);
        let mut v = json!({"id": "mock-1", "object": self.object(true), "created": 1, "model": self.model,
            "choices": [self.choice(&text, json!("length"), true)], "usage": self.usage()});
        if let Some((k, x)) = &self.extra {
            v[*k] = x.clone();
        }
        v
    }

    fn chunks(&self, usage: bool, per_chunk: usize, continuous: bool) -> Vec<String> {
        let event = |v: Value| format!("data: {v}\n\n");
        let chunk = |choices: Value| json!({"id": "mock-1", "object": self.object(false), "created": 1, "model": self.model, "choices": choices});
        // A chat stream opens with the role, as the engines' do.
        let role = self.chat.then(|| {
            event(chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
            ))
        });
        let mut out: Vec<String> = role.into_iter().collect();
        let mut sent = 0;
        while sent < self.tokens {
            let n = per_chunk.min(self.tokens - sent);
            sent += n;
            let finish = if sent == self.tokens { json!("length") } else { Value::Null };
            let mut c = chunk(json!([self.choice(&" tok".repeat(n), finish, false)]));
            if continuous {
                c["usage"] = json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": sent,
                    "total_tokens": self.prompt_tokens + sent as u64});
            }
            out.push(event(c));
        }
        if usage {
            let mut last = chunk(json!([]));
            last["usage"] = self.usage();
            out.push(event(last));
        }
        out.push("data: [DONE]\n\n".into());
        out
    }
}

/// A prompt's length in whitespace-separated words: it reads no tokenizer, and a count that is
/// consistent between the answer and `usage` is all a client benchmark needs.
fn prompt_words(v: &Value) -> u64 {
    let words = |s: &str| s.split_whitespace().count() as u64;
    match (v.get("messages"), v.get("prompt")) {
        (Some(Value::Array(msgs)), _) => msgs
            .iter()
            .map(|m| match m.get("content") {
                Some(Value::String(s)) => words(s),
                Some(Value::Array(parts)) => {
                    parts.iter().filter_map(|p| p.get("text")?.as_str()).map(words).sum()
                }
                _ => 0,
            })
            .sum(),
        (_, Some(Value::String(s))) => words(s),
        (_, Some(Value::Array(a))) => a.len() as u64,
        _ => 0,
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    let body =
        json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}});
    (status, [("content-type", "application/json")], body.to_string()).into_response()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn config(persona: Persona) -> MockConfig {
        MockConfig {
            persona,
            tokens: 3,
            model: "m".into(),
            log: None,
            otlp: None,
            token_delay: std::time::Duration::ZERO,
            always_usage: false,
            tokens_per_chunk: 1,
            continuous_usage: false,
        }
    }

    #[test]
    fn a_stream_has_one_chunk_per_token_then_usage_and_done() {
        let a = Answer::new(&config(Persona::Plain), &json!({"model": "x"}), true);
        let c = a.chunks(true, 1, false);
        assert_eq!(c.len(), 1 + 3 + 2);
        assert!(c[0].contains("\"role\":\"assistant\""), "{}", c[0]);
        assert!(c[3].contains("\"finish_reason\":\"length\""), "{}", c[3]);
        assert!(c[4].contains("\"completion_tokens\":3"), "{}", c[4]);
        assert_eq!(c[5], "data: [DONE]\n\n");
        assert_eq!(a.chunks(false, 1, false).len(), 5, "no usage unless asked");
        let text = Answer::new(&config(Persona::Plain), &json!({"prompt": "a b"}), false);
        assert_eq!(text.chunks(false, 1, false).len(), 3 + 1, "no role event on a completions stream");
    }

    #[test]
    fn with_tokens_0_the_answer_is_as_long_as_asked_and_bounded() {
        let c = MockConfig { tokens: 0, ..config(Persona::Plain) };
        let body = json!({"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 7});
        let w = Answer::new(&c, &body, true).whole();
        assert_eq!(
            (w["usage"]["completion_tokens"].as_u64(), w["usage"]["prompt_tokens"].as_u64()),
            (Some(7), Some(3))
        );
        assert_eq!(Answer::new(&c, &json!({}), true).tokens, DEFAULT_REPLY_TOKENS);
        assert_eq!(Answer::new(&c, &json!({"max_tokens": 1_000_000}), true).tokens, MAX_REPLY_TOKENS);
    }

    #[test]
    fn a_vllm_prefill_leg_gets_transfer_params_and_one_token() {
        let leg = json!({"model": "x", "kv_transfer_params": {"do_remote_decode": true}});
        let w = Answer::new(&config(Persona::VllmPrefill), &leg, true).whole();
        assert_eq!(w["kv_transfer_params"]["do_remote_prefill"], true);
        assert_eq!(w["usage"]["completion_tokens"], 1);
        let plain = Answer::new(&config(Persona::VllmPrefill), &json!({"model": "x"}), true).whole();
        assert!(plain.get("kv_transfer_params").is_none(), "only a prefill leg");
    }

    #[test]
    fn personas_parse_by_name() {
        assert_eq!("sglang-decode".parse::<Persona>(), Ok(Persona::SglangDecode));
        assert!("tgi".parse::<Persona>().unwrap_err().contains("expected plain"));
    }
}
