//! The gateway in front of an HTTP upstream (kind `openai`), over real sockets: a fake upstream
//! that speaks the OpenAI protocol as vLLM does (records what it was sent, streams chunks with
//! a usage chunk when asked, reports per-request `metrics` and llama.cpp-style `timings`, and
//! fails on request), and a real one — a tokenpath gateway over the tiny engine.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod common;
mod fake_engine;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use common::{Events, MODEL};
use fake_engine::{base, chat};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenpath_gateway::upstream::{PoolConfig, UpstreamPool, UpstreamSpec};
use tokenpath_gateway::{Gateway, GatewayConfig};
use tokenpath_protocol::backend::ModelInfo;

/// One request the fake upstream got: its `authorization` and `x-request-id` headers and body.
type Received = (Option<String>, Option<String>, Value);

/// What the fake upstream was sent, and whether a stream it served was dropped early.
#[derive(Debug, Default)]
struct Seen {
    requests: Mutex<Vec<Received>>,
    dropped: AtomicBool,
    /// A redirect was followed.
    stolen: AtomicBool,
}

struct DropFlag(Arc<Seen>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.dropped.store(true, Ordering::SeqCst);
    }
}

const WORDS: [&str; 3] = [" tok0", " tok1", " tok2"];

async fn completions(
    State(seen): State<Arc<Seen>>,
    headers: axum::http::HeaderMap,
    body: String,
) -> Response {
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let header = |k: &str| headers.get(k).and_then(|h| h.to_str().ok()).map(str::to_owned);
    seen.requests.lock().unwrap().push((header("authorization"), header("x-request-id"), v.clone()));
    match v["fail"].as_str() {
        Some("400") => {
            let e = json!({"error": {"message": "max_tokens is too large for this model\u{1b}[31m", "type": "BadRequestError"}});
            return (StatusCode::BAD_REQUEST, e.to_string()).into_response();
        }
        Some("500") => return (StatusCode::INTERNAL_SERVER_ERROR, "engine crashed").into_response(),
        Some("busy") => return (StatusCode::SERVICE_UNAVAILABLE, "full").into_response(),
        // A redirect that would carry the body (and the gateway's key) elsewhere.
        Some("redirect") => {
            return (StatusCode::TEMPORARY_REDIRECT, [("location", "/stolen")], "").into_response();
        }
        _ => {}
    }
    let model = v["model"].as_str().unwrap_or("").to_owned();
    let usage = json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2}});
    if v["stream"] != json!(true) {
        let body = json!({"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": WORDS.concat(),
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                "finish_reason": "length"}],
            "usage": usage, "timings": {"prompt_ms": 4.5, "predicted_ms": 9.0}});
        return ([("content-type", "application/json")], body.to_string()).into_response();
    }
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut events = vec![chunk(json!({"role": "assistant", "content": ""}), Value::Null)];
    for (i, w) in WORDS.iter().enumerate() {
        let last = i + 1 == WORDS.len();
        events.push(chunk(json!({"content": w}), if last { json!("length") } else { Value::Null }));
    }
    let stall = v["stall"] == json!(true);
    let with_usage = v["stream_options"]["include_usage"] == json!(true);
    let flag = DropFlag(Arc::clone(&seen));
    let stream = async_stream(
        events,
        with_usage.then(|| {
            json!({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [], "usage": usage,
            "metrics": {"queue_time_ms": 1.5, "time_to_first_token_ms": 4.0, "generation_time_ms": 6.0}})
        }),
        stall,
        flag,
    );
    ([("content-type", "text/event-stream")], Body::from_stream(stream)).into_response()
}

/// The SSE body: each event 5 ms apart (a stalling upstream stops after the first and never
/// ends); the flag is dropped with the body, early or not.
fn async_stream(
    events: Vec<Value>,
    usage: Option<Value>,
    stall: bool,
    flag: DropFlag,
) -> impl futures_util::Stream<Item = Result<String, std::convert::Infallible>> {
    let mut all: Vec<String> = events.into_iter().map(|e| format!("data: {e}\n\n")).collect();
    all.extend(usage.map(|u| format!("data: {u}\n\n")));
    all.push("data: [DONE]\n\n".into());
    futures_util::stream::unfold((all.into_iter(), 0usize, flag), move |(mut it, n, flag)| async move {
        if stall && n == 1 {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let next = it.next()?;
        Some((Ok(next), (it, n + 1, flag)))
    })
}

async fn fake_upstream() -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(|| async {
                "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 3\n\
                 vllm:num_requests_running{engine=\"0\"} 2\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n"
            }),
        )
        .route("/v1/chat/completions", post(completions))
        .route("/v1/completions", post(completions))
        .route(
            "/stolen",
            post(|State(seen): State<Arc<Seen>>| async move { seen.stolen.store(true, Ordering::SeqCst) }),
        )
        .with_state(Arc::clone(&seen));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    (url, seen)
}

async fn gateway_over(url: &str, idle: Duration) -> common::Server {
    let spec = UpstreamSpec { model: Some("fake-model".into()), ..UpstreamSpec::openai(url.to_owned()) };
    fake_engine::pool_gateway(vec![spec], idle).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_forwarded_whole_and_comes_back_as_the_upstream_sent_it() {
    let (url, seen) = fake_upstream().await;
    let server = gateway_over(&url, Duration::from_secs(10)).await;
    let body = base(
        json!({"stream": true, "min_tokens": 2, "include_metrics": true, "nvext": {"extra_fields": ["timing"]},
        "stream_options": {"continuous_usage_stats": true}}),
    );
    let resp = chat(&server, &body).await;
    assert_eq!(resp.status(), 200);
    let events = Events::new(resp).rest().await.unwrap();
    // What the upstream got: the client's fields, its model name, usage forced, our key, an id.
    let (auth, rid, sent) = seen.requests.lock().unwrap()[0].clone();
    assert_eq!(auth.as_deref(), Some("Bearer upstream-key"), "the client's key never goes upstream");
    assert!(rid.is_some_and(|r| r.starts_with("tokenpath-")));
    assert_eq!(sent["model"], "fake-model");
    assert_eq!((sent["min_tokens"].clone(), sent["include_metrics"].clone()), (json!(2), json!(true)));
    assert_eq!(sent["nvext"], json!({"extra_fields": ["timing"]}));
    assert_eq!(sent["stream_options"], json!({"continuous_usage_stats": true, "include_usage": true}));
    // What the client got: the upstream's chunks under our model name, no usage chunk (not
    // asked for), timing on the finishing chunk.
    assert_eq!(common::streamed_text(&events), WORDS.concat());
    assert!(events.iter().all(|e| e["model"] == MODEL && e.get("usage").is_none()), "{events:?}");
    assert_eq!(events.len(), 4, "role + three content chunks: {events:?}");
    let timing = &events[3]["timing"];
    assert_eq!(events[3]["choices"][0]["finish_reason"], "length");
    for s in ["prefill", "decode"] {
        assert!(timing["stages_ms"][s].as_f64().unwrap() >= 0.0, "{timing}");
        assert_eq!(timing["sources"][s], "gateway", "{timing}");
    }
    assert!(timing["stages_ms"].get("kv_transfer").is_none() && timing["stages_ms"].get("queue").is_none());
    assert!(timing["ttft_ms"].as_f64().unwrap() <= timing["e2e_ms"].as_f64().unwrap());
    // The tenant was charged the upstream's output tokens.
    server.wait_metrics("output tokens", |m| m.contains("tokenpath_generation_tokens_total")).await;
    // The upstream's own load, scraped from its /metrics, is what ours exports.
    server
        .wait_metrics("the upstream's load", |m| {
            common::metric(m, "tokenpath_num_requests_waiting") == Some(3.0)
                && common::metric(m, "tokenpath_num_requests_running") == Some(2.0)
                && common::metric(m, "tokenpath_kv_cache_usage_perc") == Some(0.5)
        })
        .await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_the_client_asked_for_is_passed_with_the_engines_stages() {
    let (url, seen) = fake_upstream().await;
    let server = gateway_over(&url, Duration::from_secs(10)).await;
    // `stream_options: null` is no options: usage is still forced upstream, and not passed on.
    let resp = chat(&server, &base(json!({"stream": true, "stream_options": null}))).await;
    let events = Events::new(resp).rest().await.unwrap();
    assert!(events.iter().all(|e| e.get("usage").is_none()), "{events:?}");
    assert_eq!(seen.requests.lock().unwrap().last().unwrap().2["stream_options"]["include_usage"], true);
    let resp = chat(&server, &base(json!({"stream": true, "stream_options": {"include_usage": true}}))).await;
    let events = Events::new(resp).rest().await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 3);
    assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    assert_eq!(last["model"], MODEL);
    // Our timing rides on the last chunk, with the stages vLLM's `metrics` reported on it.
    assert_eq!(last["timing"]["stages_ms"]["queue"], 1.5);
    assert_eq!(last["timing"]["sources"]["queue"], "engine");
    assert_eq!(last["timing"]["sources"]["decode"], "engine");
    assert_eq!(events.iter().filter(|e| e.get("timing").is_some()).count(), 1);
    // Non-streamed: the body passes whole (tool calls included), llama.cpp's timings absorbed.
    let resp =
        chat(&server, &base(json!({"tools": [{"type": "function", "function": {"name": "f"}}]}))).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["model"], MODEL);
    assert_eq!(body["choices"][0]["message"]["tool_calls"][0]["id"], "call_1");
    assert_eq!(body["timing"]["stages_ms"]["prefill"], 4.5);
    assert_eq!(body["timing"]["sources"]["prefill"], "engine");
    assert_eq!(body["timing"]["sources"]["decode"], "engine");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_the_right_errors_and_nothing_hangs() {
    let (url, seen) = fake_upstream().await;
    let server = gateway_over(&url, Duration::from_secs(1)).await;
    // The fields we act on are still ours to check: nothing reaches the upstream.
    let resp = chat(&server, &base(json!({"temperature": 7}))).await;
    assert_eq!(resp.status(), 400);
    assert!(seen.requests.lock().unwrap().is_empty());
    // The upstream's refusal keeps its words, cleaned.
    let resp = chat(&server, &base(json!({"fail": "400"}))).await;
    assert_eq!(resp.status(), 400);
    let e: Value = resp.json().await.unwrap();
    let m = e["error"]["message"].as_str().unwrap();
    assert!(m.contains("max_tokens is too large") && !m.contains('\u{1b}'), "{m}");
    assert_eq!(chat(&server, &base(json!({"fail": "500"}))).await.status(), 500);
    assert_eq!(chat(&server, &base(json!({"fail": "busy"}))).await.status(), 503);
    // A stream that goes silent ends with an error event once the idle bound passes.
    let started = Instant::now();
    let resp = chat(&server, &base(json!({"stream": true, "stall": true}))).await;
    let mut ev = Events::new(resp);
    let mut error = None;
    while let Some(d) = ev.next().await.unwrap() {
        if d.contains("\"error\"") {
            error = Some(d);
        }
    }
    assert!(error.is_some(), "an in-stream error after the silence");
    assert!(started.elapsed() < Duration::from_secs(30));
    // A client that goes away mid-stream closes the upstream's connection too.
    seen.dropped.store(false, Ordering::SeqCst);
    let resp = chat(&server, &base(json!({"stream": true, "stall": true}))).await;
    let mut ev = Events::new(resp);
    assert!(ev.next().await.unwrap().is_some(), "the first chunk arrives");
    drop(ev);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.dropped.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the upstream stream was never dropped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown().await.unwrap();
    // An upstream that is not there: a 503 at once (no upstream is up), not a hang.
    let dead = gateway_over_dead().await;
    assert_eq!(chat(&dead, &base(json!({}))).await.status(), 503);
    let ready = dead.client.get(dead.url("/ready")).send().await.unwrap().status();
    assert_eq!(ready, 503, "not ready while the upstream is down");
    dead.shutdown().await.unwrap();
}

/// Regression: reqwest follows ten redirects by default, so an upstream could send the client's
/// body (and our upstream key) anywhere; its redirect is now its failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_redirect_is_not_followed() {
    let (url, seen) = fake_upstream().await;
    let server = gateway_over(&url, Duration::from_secs(1)).await;
    let resp = chat(&server, &base(json!({"fail": "redirect"}))).await;
    assert!(resp.status().is_server_error(), "{}", resp.status());
    assert!(!seen.stolen.load(Ordering::SeqCst), "the body went where the upstream redirected it");
    server.shutdown().await.unwrap();
}

async fn gateway_over_dead() -> common::Server {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let upstream = UpstreamPool::new(
        PoolConfig {
            served_model_name: MODEL.into(),
            api_key: None,
            model_info: ModelInfo { n_ctx: 4096, n_vocab: u32::MAX as usize },
            first_byte_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
        },
        vec![UpstreamSpec::openai(url)],
    )
    .unwrap();
    let config = GatewayConfig { served_model_name: MODEL.into(), ..GatewayConfig::default() };
    common::serve_gateway(Gateway::new(config, Arc::new(upstream), common::engine()).unwrap()).await
}

/// A real engine as the upstream: a tokenpath gateway over the tiny model. The text through our
/// gateway is the text straight from it (greedy), usage is its, and its own timing becomes the
/// engine's stages in ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenpath_server_as_an_openai_upstream_gives_the_same_answer() {
    let inner = common::start_default().await;
    let upstream = UpstreamPool::new(
        PoolConfig {
            served_model_name: MODEL.into(),
            api_key: None,
            model_info: ModelInfo { n_ctx: common::N_CTX, n_vocab: u32::MAX as usize },
            first_byte_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
        },
        vec![UpstreamSpec { model: None, ..UpstreamSpec::openai(inner.base.clone()) }],
    )
    .unwrap();
    assert!(upstream.check_health().await);
    let outer = common::serve_gateway(
        Gateway::new(
            GatewayConfig { served_model_name: MODEL.into(), ..GatewayConfig::default() },
            Arc::new(upstream),
            common::engine(),
        )
        .unwrap(),
    )
    .await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 12, "temperature": 0, "stream": true, "ignore_eos": true,
        "stream_options": {"include_usage": true}});
    let direct = Events::new(inner.post("/v1/chat/completions", &body).await).rest().await.unwrap();
    let through = Events::new(outer.post("/v1/chat/completions", &body).await).rest().await.unwrap();
    assert_eq!(common::streamed_text(&through), common::streamed_text(&direct));
    let (u_in, u_out) = (&direct.last().unwrap()["usage"], &through.last().unwrap()["usage"]);
    assert_eq!(u_out["completion_tokens"], 12);
    assert_eq!(u_out["prompt_tokens"], u_in["prompt_tokens"]);
    // The inner server's stages are the engine's in ours.
    let timing = through.iter().rev().find_map(|e| e.get("timing")).expect("timing").clone();
    assert_eq!(timing["sources"]["queue"], "engine", "{timing}");
    assert_eq!(timing["sources"]["prefill"], "engine", "{timing}");
    // Non-streamed too.
    let plain =
        json!({"model": MODEL, "prompt": "Once", "max_tokens": 5, "temperature": 0, "ignore_eos": true});
    let (s1, a) = inner.post_json("/v1/completions", &plain).await;
    let (s2, b) = outer.post_json("/v1/completions", &plain).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(b["usage"]["completion_tokens"], 5);
    outer.shutdown().await.unwrap();
    inner.shutdown().await.unwrap();
}
