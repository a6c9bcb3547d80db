//! The OpenAI API over real HTTP on loopback: both endpoints streamed and not, every error status
//! followed by a successful request, concurrency, cancellation by disconnect, graceful shutdown,
//! and the timeline's stages adding up to E2E on every response.

mod common;

use common::{check_timing, metric, start, start_default, streamed_text, Events, MODEL};
use serde_json::{json, Value};
use tokenpath_gateway::GatewayConfig;
use tokenpath_worker::WorkerConfig;

/// `body` with the fields of `extra` added (replacing any of the same name).
fn with_extra(mut body: Value, extra: Value) -> Value {
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

fn chat_body(content: &str, extra: Value) -> Value {
    with_extra(
        json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0}),
        extra,
    )
}

fn completion_body(prompt: &str, extra: Value) -> Value {
    with_extra(json!({"model": MODEL, "prompt": prompt, "temperature": 0}), extra)
}

/// Posts a streamed request, requires a 200 and returns its events.
async fn open_stream(client: reqwest::Client, url: String, body: Value) -> anyhow::Result<Events> {
    let resp =
        client.post(url).header("content-type", "application/json").body(body.to_string()).send().await?;
    anyhow::ensure!(resp.status().as_u16() == 200, "status {}", resp.status());
    Ok(Events::new(resp))
}

/// The last event of a stream with `include_usage` counts `max` completion tokens and carries
/// a valid timeline.
fn check_usage_chunk(events: &[Value], max: u64) -> anyhow::Result<()> {
    let last = events.last().cloned().unwrap_or(Value::Null);
    anyhow::ensure!(last["usage"]["completion_tokens"] == json!(max), "usage {last}");
    check_timing(&last["timing"]);
    Ok(())
}

async fn ok_chat(server: &common::Server) {
    let (status, body) =
        server.post_json("/v1/chat/completions", &chat_body("ping", json!({"max_tokens": 3}))).await;
    assert_eq!(status, 200, "{body}");
    check_timing(&body["timing"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_stream_has_usage_timing_and_server_timing_header() -> anyhow::Result<()> {
    let server = start_default().await;
    let resp = server
        .post(
            "/v1/chat/completions",
            &chat_body("Hello there", json!({"max_tokens": 12, "ignore_eos": true})),
        )
        .await;
    assert_eq!(resp.status().as_u16(), 200);
    let header = resp.headers()["server-timing"].to_str()?.to_owned();
    for s in ["gateway;dur=", "queue;dur=", "prefill;dur=", "decode_queue;dur=", "decode;dur="] {
        assert!(header.contains(s), "{header}");
    }
    let body: Value = serde_json::from_slice(&resp.bytes().await?)?;
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], MODEL);
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert!(body["choices"][0]["message"]["content"].is_string());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let usage = &body["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    assert!(usage["prompt_tokens"].as_u64().unwrap_or(0) > 3);
    assert_eq!(usage["total_tokens"], usage["prompt_tokens"].as_u64().unwrap_or(0) + 12);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    check_timing(&body["timing"]);
    assert_eq!(body["timing"]["workers"]["both"], "w0");
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_sends_role_content_timing_usage_and_done() -> anyhow::Result<()> {
    let server = start_default().await;
    let extra = json!({"max_tokens": 10, "ignore_eos": true});
    let (_, plain) = server.post_json("/v1/chat/completions", &chat_body("Tell me", extra.clone())).await;
    let mut extra = extra;
    extra["stream"] = json!(true);
    extra["stream_options"] = json!({"include_usage": true});
    let resp = server.post("/v1/chat/completions", &chat_body("Tell me", extra)).await;
    assert_eq!(resp.status().as_u16(), 200);
    assert!(resp.headers()["content-type"].to_str()?.starts_with("text/event-stream"));
    let events = Events::new(resp).rest().await?;
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant", "role chunk first");
    assert_eq!(events[0]["object"], "chat.completion.chunk");
    let finish = events.iter().find(|e| !e["choices"][0]["finish_reason"].is_null()).expect("finish chunk");
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let last = events.last().expect("events");
    assert_eq!(last["choices"].as_array().map(Vec::len), Some(0), "usage chunk has no choices");
    assert_eq!(last["usage"]["completion_tokens"], 10);
    check_timing(&last["timing"]);
    assert!(events[..events.len() - 1].iter().all(|e| e.get("timing").is_none()), "timing only on the last");
    // Greedy: streaming must not change the text.
    assert_eq!(streamed_text(&events), plain["choices"][0]["message"]["content"].as_str().unwrap_or(""));
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_stream_and_non_stream_agree() -> anyhow::Result<()> {
    let server = start_default().await;
    let extra = json!({"max_tokens": 7, "ignore_eos": true});
    let (status, plain) =
        server.post_json("/v1/completions", &completion_body("Once upon a time", extra.clone())).await;
    assert_eq!(status, 200, "{plain}");
    assert_eq!(plain["object"], "text_completion");
    assert_eq!(plain["usage"]["completion_tokens"], 7);
    assert_eq!(plain["choices"][0]["finish_reason"], "length");
    check_timing(&plain["timing"]);
    let mut extra = extra;
    extra["stream"] = json!(true);
    let resp = server.post("/v1/completions", &completion_body("Once upon a time", extra)).await;
    let events = Events::new(resp).rest().await?;
    let last = events.last().expect("events");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last.get("usage").is_none_or(Value::is_null), "no usage without include_usage");
    check_timing(&last["timing"]);
    assert_eq!(streamed_text(&events), plain["choices"][0]["text"].as_str().unwrap_or(""));
    // A body large enough to be tokenized on the blocking pool: over the context, a 400.
    let (status, body) =
        server.post_json("/v1/completions", &completion_body(&"a".repeat(40_000), json!({}))).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    assert_eq!(body["error"]["param"], "prompt", "{body}");
    // Token-id prompts work too.
    let (status, body) = server
        .post_json("/v1/completions", &completion_body("", json!({"prompt": [40, 41, 42], "max_tokens": 2})))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_has_its_status_and_the_server_stays_healthy() -> anyhow::Result<()> {
    let server =
        start(WorkerConfig::default(), GatewayConfig { max_body_bytes: 64 * 1024, ..Default::default() })
            .await;
    let url = server.url("/v1/chat/completions");
    let cases: Vec<(&str, reqwest::RequestBuilder, u16, &str)> = vec![
        ("malformed JSON", server.client.post(&url).body("{\"model\": "), 400, "invalid_request_error"),
        (
            "wrong type",
            server.client.post(&url).body(chat_body("x", json!({"temperature": "hot"})).to_string()),
            400,
            "invalid_request_error",
        ),
        (
            "unknown field",
            server.client.post(&url).body(chat_body("x", json!({"frobnicate": 1})).to_string()),
            400,
            "invalid_request_error",
        ),
        (
            "negative max_tokens",
            server.client.post(&url).body(chat_body("x", json!({"max_tokens": -1})).to_string()),
            400,
            "invalid_request_error",
        ),
        (
            "context too long",
            server.client.post(&url).body(chat_body(&"word ".repeat(9000), json!({})).to_string()),
            400,
            "invalid_request_error",
        ),
        (
            "unknown model",
            server
                .client
                .post(&url)
                .body(json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).to_string()),
            404,
            "invalid_request_error",
        ),
        (
            "body too large",
            server.client.post(&url).body("x".repeat(100 * 1024)),
            413,
            "invalid_request_error",
        ),
        ("unknown path", server.client.post(server.url("/v1/nope")).body("{}"), 404, "invalid_request_error"),
    ];
    for (what, req, want, kind) in cases {
        let resp = req.header("content-type", "application/json").send().await?;
        assert_eq!(resp.status().as_u16(), want, "{what}");
        let body: Value = serde_json::from_slice(&resp.bytes().await?)?;
        assert_eq!(body["error"]["type"], kind, "{what}: {body}");
        assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {body}");
        if what == "context too long" {
            assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
        }
        ok_chat(&server).await;
    }
    let m = server.metrics().await;
    assert_eq!(
        metric(&m, "tokenpath_requests_total{status=\"413\",finish_reason=\"none\"}"),
        Some(1.0),
        "{m}"
    );
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_503_with_retry_after_then_recovers() -> anyhow::Result<()> {
    let server = start(
        WorkerConfig { max_queue: 1, max_batch: 1, ..WorkerConfig::default() },
        GatewayConfig::default(),
    )
    .await;
    let long = chat_body("a long one", json!({"max_tokens": 8000, "ignore_eos": true, "stream": true}));
    let mut running = Events::new(server.post("/v1/chat/completions", &long).await);
    running.next().await?; // role chunk
    running.next().await?; // first token: it is in the batch
    let queued = server.post("/v1/chat/completions", &long).await;
    assert_eq!(queued.status().as_u16(), 200, "a streamed request answers once queued");
    let resp = server.post("/v1/chat/completions", &chat_body("one more", json!({"max_tokens": 2}))).await;
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    let body: Value = serde_json::from_slice(&resp.bytes().await?)?;
    assert_eq!(body["error"]["type"], "server_overloaded");
    drop(running);
    drop(queued);
    server
        .wait_metrics("the cancelled streams to leave", |m| {
            metric(m, "tokenpath_num_requests_running") == Some(0.0)
                && metric(m, "tokenpath_num_requests_waiting") == Some(0.0)
        })
        .await;
    // A client honouring Retry-After gets through once the queue has drained (bounded: a leaked
    // queue slot would fail here).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (status, body) =
            server.post_json("/v1/chat/completions", &chat_body("ping", json!({"max_tokens": 3}))).await;
        if status == 200 {
            check_timing(&body["timing"]);
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(std::time::Instant::now() < deadline, "still overloaded: {}", server.metrics().await);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_streams_complete_with_correct_usage() -> anyhow::Result<()> {
    let server = start_default().await;
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let client = server.client.clone();
        let url = server.url(if i % 2 == 0 { "/v1/chat/completions" } else { "/v1/completions" });
        let max = 5 + i;
        let body = if i % 2 == 0 {
            chat_body(&format!("request {i}"), json!({}))
        } else {
            completion_body(&format!("request {i}"), json!({}))
        };
        let mut body = body;
        body["max_tokens"] = json!(max);
        body["ignore_eos"] = json!(true);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        tasks.push(tokio::spawn(async move {
            let events = open_stream(client, url, body).await?.rest().await?;
            check_usage_chunk(&events, max)
        }));
    }
    for t in tasks {
        t.await??;
    }
    server.wait_metrics("all blocks back", |m| metric(m, "tokenpath_kv_blocks_used") == Some(0.0)).await;
    let m = server.metrics().await;
    assert_eq!(
        metric(&m, "tokenpath_requests_total{status=\"200\",finish_reason=\"length\"}"),
        Some(16.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "tokenpath_generation_tokens_total"),
        Some((0..16).map(|i| 5.0 + i as f64).sum()),
        "{m}"
    );
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnecting_clients_cancel_and_free_every_block() -> anyhow::Result<()> {
    let server = start_default().await;
    let mut streams = Vec::new();
    for i in 0..4 {
        let body =
            chat_body(&format!("long {i}"), json!({"max_tokens": 8000, "ignore_eos": true, "stream": true}));
        let mut events = Events::new(server.post("/v1/chat/completions", &body).await);
        for _ in 0..3 {
            events.next().await?.expect("event");
        }
        streams.push(events);
    }
    let m = server.metrics().await;
    assert!(metric(&m, "tokenpath_kv_blocks_used").unwrap_or(0.0) > 0.0, "{m}");
    drop(streams); // closes the sockets
    server
        .wait_metrics("blocks freed after disconnect", |m| {
            metric(m, "tokenpath_kv_blocks_used") == Some(0.0)
                && metric(m, "tokenpath_num_requests_running") == Some(0.0)
                && metric(m, "tokenpath_requests_total{status=\"200\",finish_reason=\"cancelled\"}")
                    == Some(4.0)
        })
        .await;
    // A non-streamed request whose client gives up is cancelled the same way.
    let body = chat_body("long plain", json!({"max_tokens": 8000, "ignore_eos": true}));
    let gave_up = server
        .client
        .post(server.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .timeout(std::time::Duration::from_millis(100))
        .body(body.to_string())
        .send()
        .await;
    assert!(gave_up.is_err(), "8000 tokens should outlast the client's patience");
    server
        .wait_metrics("non-streamed request cancelled", |m| {
            metric(m, "tokenpath_kv_blocks_used") == Some(0.0)
                && metric(m, "tokenpath_requests_total{status=\"499\",finish_reason=\"cancelled\"}")
                    == Some(1.0)
        })
        .await;
    ok_chat(&server).await;
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_running_streams_finish_and_refuses_new_work() -> anyhow::Result<()> {
    let mut server = start_default().await;
    let body = chat_body("drain me", json!({"max_tokens": 200, "ignore_eos": true, "stream": true}));
    let mut events = Events::new(server.post("/v1/chat/completions", &body).await);
    events.next().await?.expect("role chunk");
    server.signal_shutdown();
    // New work is refused: 503 on a live connection, or no answer at all (listener closed).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let probe =
            server.client.get(server.url("/ready")).timeout(std::time::Duration::from_secs(2)).send().await;
        match probe {
            Ok(resp) if resp.status().as_u16() == 200 => {
                assert!(std::time::Instant::now() < deadline, "still ready long after the shutdown signal");
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            Ok(resp) => {
                assert_eq!(resp.status().as_u16(), 503);
                break;
            }
            Err(_) => break,
        }
    }
    let rest = events.rest().await?;
    assert_eq!(rest.last().map(|e| e["choices"][0]["finish_reason"].clone()), Some(json!("length")));
    server.join().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_streams_half_cancelled_return_every_block() -> anyhow::Result<()> {
    let server = start_default().await;
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        let client = server.client.clone();
        let url = server.url("/v1/chat/completions");
        let cancel = i % 2 == 1;
        let max = if cancel { 8000 } else { 8 + i % 5 };
        let mut body =
            chat_body(&format!("stream {i}"), json!({"max_tokens": max, "ignore_eos": true, "stream": true}));
        body["stream_options"] = json!({"include_usage": true});
        tasks.push(tokio::spawn(async move {
            let mut events = open_stream(client, url, body).await?;
            if cancel {
                events.next().await?; // role
                events.next().await?; // first token
                return anyhow::Ok(()); // dropping the response closes the connection
            }
            check_usage_chunk(&events.rest().await?, max)
        }));
    }
    for t in tasks {
        t.await??;
    }
    server
        .wait_metrics("every block back after 32 disconnects", |m| {
            metric(m, "tokenpath_kv_blocks_used") == Some(0.0)
                && metric(m, "tokenpath_num_requests_running") == Some(0.0)
                && metric(m, "tokenpath_num_requests_waiting") == Some(0.0)
                && metric(m, "tokenpath_requests_total{status=\"200\",finish_reason=\"cancelled\"}")
                    == Some(32.0)
        })
        .await;
    let m = server.metrics().await;
    assert_eq!(
        metric(&m, "tokenpath_requests_total{status=\"200\",finish_reason=\"length\"}"),
        Some(32.0),
        "{m}"
    );
    ok_chat(&server).await;
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_are_required_when_configured() -> anyhow::Result<()> {
    let keys = tokenpath_gateway::ApiKeys::parse("alice:sk-alice-0001,bob:sk-bob-00002")
        .map_err(anyhow::Error::msg)?;
    let server = start(WorkerConfig::default(), GatewayConfig { api_keys: keys, ..Default::default() }).await;
    let body = chat_body("hi", json!({"max_tokens": 2})).to_string();
    let url = server.url("/v1/chat/completions");
    for (what, auth, want) in [
        ("missing", None, 401),
        ("wrong", Some("Bearer sk-alice-0002"), 401),
        ("not bearer", Some("sk-alice-0001"), 401),
        ("alice", Some("Bearer sk-alice-0001"), 200),
        ("bob", Some("Bearer sk-bob-00002"), 200),
    ] {
        let mut req = server.client.post(&url).header("content-type", "application/json").body(body.clone());
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await?;
        assert_eq!(resp.status().as_u16(), want, "{what}");
        let v: Value = serde_json::from_slice(&resp.bytes().await?)?;
        if want == 401 {
            assert_eq!(v["error"]["type"], "authentication_error", "{what}: {v}");
            assert_eq!(v["error"]["code"], "invalid_api_key", "{what}: {v}");
        } else {
            check_timing(&v["timing"]);
        }
    }
    let models = server.client.get(server.url("/v1/models")).send().await?;
    assert_eq!(models.status().as_u16(), 401);
    let m = server.metrics().await;
    assert_eq!(metric(&m, "tokenpath_tenant_requests_total{tenant=\"alice\"}"), Some(1.0), "{m}");
    assert_eq!(
        metric(&m, "tokenpath_requests_total{status=\"401\",finish_reason=\"none\"}"),
        Some(4.0), // the three chat requests and /v1/models
        "{m}"
    );
    for open in ["/health", "/ready"] {
        assert_eq!(server.client.get(server.url(open)).send().await?.status().as_u16(), 200, "{open}");
    }
    // /metrics is the operator's: no credential 401, a tenant's 403, the admin key 200.
    let metrics = |auth: Option<&'static str>| {
        let mut req = server.client.get(server.url("/metrics"));
        if let Some(a) = auth {
            req = req.bearer_auth(a);
        }
        req.send()
    };
    assert_eq!(metrics(None).await?.status().as_u16(), 401);
    assert_eq!(metrics(Some("sk-alice-0001")).await?.status().as_u16(), 403);
    assert_eq!(metrics(Some(common::ADMIN_KEY)).await?.status().as_u16(), 200);
    server.shutdown().await?;
    Ok(())
}
