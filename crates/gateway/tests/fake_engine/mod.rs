//! A fake engine over a real socket that speaks one part of an engine's protocol as its source
//! defines it (`docs/upstreams.md` has the references): a plain OpenAI server, a vLLM prefill
//! or decode server with a NIXL connector, an SGLang prefill or decode server, a TensorRT-LLM
//! context or generation server. It records every request (path, headers, body, when), counts
//! the responses dropped before their end, and misbehaves on command.

#![allow(dead_code, clippy::unwrap_used)] // each test file uses part of it

use crate::common::{self, MODEL};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenpath_gateway::upstream::{PoolConfig, UpstreamPool, UpstreamSpec};
use tokenpath_gateway::{Gateway, GatewayConfig};
use tokenpath_protocol::backend::ModelInfo;

/// Which part it plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persona {
    Plain,
    VllmPrefill,
    VllmDecode,
    SglangPrefill,
    SglangDecode,
    TrtContext,
    TrtGeneration,
}

/// How it misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Normal,
    /// 500 on every generation request.
    Fail500,
    /// A vLLM prefill answer without `kv_transfer_params`.
    NoParams,
    /// Headers, then silence (never a first event).
    StallBeforeFirst,
    /// The first event, then silence.
    StallAfterFirst,
    /// Headers, then the stream ends with no event.
    CloseBeforeFirst,
}

/// One request it got.
#[derive(Clone, Debug)]
pub struct Got {
    pub path: String,
    pub auth: Option<String>,
    pub request_id: Option<String>,
    pub body: Value,
    pub at: Instant,
}

#[derive(Debug)]
pub struct Fake {
    pub url: String,
    pub name: String,
    persona: Persona,
    mode: Mutex<Mode>,
    got: Mutex<Vec<Got>>,
    /// Responses whose body was dropped (finished or not).
    pub ended: AtomicUsize,
    /// Responses dropped before their last byte.
    pub cut: AtomicUsize,
    /// Gap between stream events.
    gap: Duration,
}

impl Fake {
    pub fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }

    /// The generation requests it got.
    pub fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }
}

/// Starts a fake `persona` named `name` on a loopback port.
pub async fn start(persona: Persona, name: &str) -> Arc<Fake> {
    start_with_gap(persona, name, Duration::from_millis(5)).await
}

/// The same, with `gap` between stream events.
pub async fn start_with_gap(persona: Persona, name: &str, gap: Duration) -> Arc<Fake> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake = Arc::new(Fake {
        url: format!("http://{}", l.local_addr().unwrap()),
        name: name.into(),
        persona,
        mode: Mutex::new(Mode::Normal),
        got: Mutex::new(Vec::new()),
        ended: AtomicUsize::new(0),
        cut: AtomicUsize::new(0),
        gap,
    });
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/chat/completions", post(generate))
        .route("/v1/completions", post(generate))
        .with_state(Arc::clone(&fake));
    tokio::spawn(async move { axum::serve(l, app).await });
    fake
}

/// Marks a response's end when dropped; `cut` unless it was finished.
struct EndFlag {
    fake: Arc<Fake>,
    finished: bool,
}

impl Drop for EndFlag {
    fn drop(&mut self) {
        self.fake.ended.fetch_add(1, Ordering::SeqCst);
        if !self.finished {
            self.fake.cut.fetch_add(1, Ordering::SeqCst);
        }
    }
}

pub const WORDS: [&str; 3] = [" tok0", " tok1", " tok2"];
/// The prompt size the fakes report.
pub const PROMPT_TOKENS: u64 = 40;

async fn generate(
    State(fake): State<Arc<Fake>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    body: String,
) -> Response {
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let header = |k: &str| headers.get(k).and_then(|h| h.to_str().ok()).map(str::to_owned);
    fake.got.lock().unwrap().push(Got {
        path: uri.path().to_owned(),
        auth: header("authorization"),
        request_id: header("x-request-id"),
        body: v.clone(),
        at: Instant::now(),
    });
    let mode = *fake.mode.lock().unwrap();
    if mode == Mode::Fail500 {
        return (StatusCode::INTERNAL_SERVER_ERROR, "engine crashed").into_response();
    }
    let model = v["model"].as_str().unwrap_or("").to_owned();
    let id = format!("cmpl-{}", fake.name);
    match fake.persona {
        Persona::VllmPrefill => {
            let mut answer = one_token(&id, &model, "length", 16);
            answer["metrics"] = json!({"queue_time_ms": 2.5, "time_to_first_token_ms": 8.0});
            if mode != Mode::NoParams {
                answer["kv_transfer_params"] = json!({"do_remote_prefill": true, "do_remote_decode": false,
                    "remote_block_ids": [[3, 4, 5]], "remote_engine_id": format!("engine-{}", fake.name),
                    "remote_request_id": header("x-request-id"), "remote_host": "10.1.2.3",
                    "remote_port": 5600, "tp_size": 1});
            }
            return json_response(&answer);
        }
        Persona::TrtContext => {
            let finish = if v["finish_in_context"] == json!(true) { "stop" } else { "length" };
            let mut answer = one_token(&id, &model, finish, 8);
            answer["choices"][0]["disaggregated_params"] = json!({"request_type": "context_only",
                "first_gen_tokens": [11], "ctx_request_id": 42, "encoded_opaque_state": "b3BhcXVl",
                "draft_tokens": null});
            return json_response(&answer);
        }
        _ => {}
    }
    // Decode/generation servers report every transferred prompt token as cached.
    let cached =
        if matches!(fake.persona, Persona::Plain | Persona::SglangPrefill) { 2 } else { PROMPT_TOKENS };
    let usage = json!({"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3,
        "total_tokens": PROMPT_TOKENS + 3, "prompt_tokens_details": {"cached_tokens": cached}});
    if v["stream"] != json!(true) {
        let body = json!({"id": id, "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": WORDS.concat()},
                "finish_reason": "length"}], "usage": usage});
        return json_response(&body);
    }
    let chunk = |delta: Value, finish: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut events: Vec<String> = Vec::new();
    // An SGLang prefill server computes the prompt and one token, then is done.
    let words = if fake.persona == Persona::SglangPrefill { &WORDS[..1] } else { &WORDS[..] };
    // vLLM's `continuous_usage_stats`: the cumulative usage on every chunk.
    let continuous = v["stream_options"]["continuous_usage_stats"] == json!(true);
    for (i, w) in words.iter().enumerate() {
        let last = i + 1 == words.len();
        let mut c = chunk(json!({"content": w}), if last { json!("length") } else { Value::Null });
        if continuous {
            c["usage"] = json!({"prompt_tokens": PROMPT_TOKENS, "completion_tokens": i + 1,
                "total_tokens": PROMPT_TOKENS + i as u64 + 1});
        }
        events.push(c.to_string());
    }
    if v["stream_options"]["include_usage"] == json!(true) {
        events.push(
            json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [], "usage": usage})
            .to_string(),
        );
    }
    events.push("[DONE]".into());
    let flag = EndFlag { fake: Arc::clone(&fake), finished: false };
    let gap = fake.gap;
    let stream = futures_util::stream::unfold(
        (events.into_iter(), 0usize, flag),
        move |(mut it, n, mut flag)| async move {
            let stall = match mode {
                Mode::StallBeforeFirst => n == 0,
                Mode::StallAfterFirst => n == 1,
                Mode::CloseBeforeFirst => return None,
                _ => false,
            };
            if stall {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(gap).await;
            let Some(next) = it.next() else {
                flag.finished = true;
                drop(flag);
                return None;
            };
            Some((Ok::<_, std::convert::Infallible>(format!("data: {next}\n\n")), (it, n + 1, flag)))
        },
    );
    ([("content-type", "text/event-stream")], Body::from_stream(stream)).into_response()
}

fn one_token(id: &str, model: &str, finish: &str, cached: u64) -> Value {
    json!({"id": id, "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " tok0"}, "finish_reason": finish}],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1,
                  "prompt_tokens_details": {"cached_tokens": cached}}})
}

fn json_response(v: &Value) -> Response {
    ([("content-type", "application/json")], v.to_string()).into_response()
}

/// A gateway (tenant key `sk-client-0001`, the admin key) over a pool of `specs`, once they
/// answer `/health`.
pub async fn pool_gateway(specs: Vec<UpstreamSpec>, idle: Duration) -> (common::Server, UpstreamPool) {
    let pool = UpstreamPool::new(pool_config(Duration::from_secs(10), idle), specs).unwrap();
    assert!(pool.wait_ready(Duration::from_secs(10)).await, "the pool's upstreams answer /health");
    (serve_pool(pool.clone()).await, pool)
}

/// The tests' pool settings: our model, an upstream key, the given timeouts.
pub fn pool_config(first_byte: Duration, idle: Duration) -> PoolConfig {
    PoolConfig {
        served_model_name: MODEL.into(),
        api_key: Some("upstream-key".into()),
        model_info: ModelInfo { n_ctx: 4096, n_vocab: u32::MAX as usize },
        first_byte_timeout: first_byte,
        idle_timeout: idle,
    }
}

/// A gateway over `pool` (tenant `alice`, the admin key), serving on loopback.
pub async fn serve_pool(pool: UpstreamPool) -> common::Server {
    serve_pool_with_keys(pool, tokenpath_gateway::ApiKeys::parse("alice:sk-client-0001").unwrap()).await
}

/// [`serve_pool`] with these API keys (tenants and their limits).
pub async fn serve_pool_with_keys(
    pool: UpstreamPool,
    api_keys: tokenpath_gateway::ApiKeys,
) -> common::Server {
    let config = GatewayConfig {
        served_model_name: MODEL.into(),
        api_keys,
        admin_key: Some(tokenpath_gateway::AdminKey::new(common::ADMIN_KEY).unwrap()),
        ..GatewayConfig::default()
    };
    let gateway = Gateway::with_upstreams(config, pool, common::engine()).unwrap();
    common::serve_gateway(gateway).await
}

pub async fn chat(server: &common::Server, body: &Value) -> reqwest::Response {
    server
        .client
        .post(server.url("/v1/chat/completions"))
        .bearer_auth("sk-client-0001")
        .json(body)
        .send()
        .await
        .unwrap()
}

pub fn base(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}
