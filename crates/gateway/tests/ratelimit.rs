//! Per-tenant rate limits over real HTTP on loopback: a tenant over its input- or output-token
//! budget gets 429 with a sane `Retry-After`, other tenants are unaffected in the same run, and
//! authentication still comes first (a wrong key is a 401, not a 429).
//!
//! Budgets are sized so the outcome does not depend on the machine's speed: the refill during a
//! request (10 tokens/s) is far smaller than the deficits the tests create.

#![allow(clippy::unwrap_used)]

mod common;

use common::{metric, start, MODEL};
use serde_json::{json, Value};
use tokenpath_gateway::{ApiKeys, GatewayConfig};
use tokenpath_worker::WorkerConfig;

const KEYS: &str = r#"
[[key]]
tenant = "small"
key = "sk-small-000001"
input_tokens_per_minute = 600

[[key]]
tenant = "talker"
key = "sk-talker-00001"
output_tokens_per_minute = 600

[[key]]
tenant = "big"
key = "sk-big-00000001"
requests_per_minute = 10000

[[key]]
tenant = "pair"
key = "sk-pair-0000001"
max_concurrent_requests = 2

[[key]]
tenant = "three"
key = "sk-three-000001"
requests_per_minute = 3
"#;

async fn server() -> common::Server {
    let keys = ApiKeys::from_toml_str(KEYS).unwrap();
    start(WorkerConfig::default(), GatewayConfig { api_keys: keys, ..Default::default() }).await
}

/// Posts a completion of `prompt_tokens` token ids as `key`.
async fn complete(
    server: &common::Server,
    key: &str,
    prompt_tokens: usize,
    extra: Value,
) -> anyhow::Result<reqwest::Response> {
    let mut body =
        json!({"model": MODEL, "prompt": vec![40; prompt_tokens], "max_tokens": 2, "temperature": 0});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    Ok(server
        .client
        .post(server.url("/v1/completions"))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(body.to_string())
        .send()
        .await?)
}

/// Checks a 429: OpenAI's rate-limit body, and a `Retry-After` of whole seconds in [1, 60].
async fn check_429(resp: reqwest::Response, unit: &str) -> anyhow::Result<u64> {
    assert_eq!(resp.status().as_u16(), 429);
    let retry: u64 = resp.headers()["retry-after"].to_str()?.parse()?;
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    let v: Value = serde_json::from_slice(&resp.bytes().await?)?;
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains(unit) && !msg.contains("sk-"), "{msg}");
    Ok(retry)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_token_budget_gives_429_and_other_tenants_are_unaffected() -> anyhow::Result<()> {
    let server = server().await;
    // 400 of 600 tokens: admitted, 200 left.
    let resp = complete(&server, "sk-small-000001", 400, json!({})).await?;
    assert_eq!(resp.status().as_u16(), 200);
    let v: Value = serde_json::from_slice(&resp.bytes().await?)?;
    assert_eq!(v["usage"]["prompt_tokens"], 400);
    // Another 400: 200 short at 10 tokens/s, about 20 s.
    let retry =
        check_429(complete(&server, "sk-small-000001", 400, json!({})).await?, "input tokens").await?;
    assert!((10..=20).contains(&retry), "Retry-After {retry}");
    // The refusal charged nothing: 100 tokens still fit.
    assert_eq!(complete(&server, "sk-small-000001", 100, json!({})).await?.status().as_u16(), 200);
    // Another tenant, in the same run, after the 429.
    assert_eq!(complete(&server, "sk-big-00000001", 400, json!({})).await?.status().as_u16(), 200);
    // Authentication comes first.
    assert_eq!(complete(&server, "sk-small-000002", 400, json!({})).await?.status().as_u16(), 401);
    // Larger than a minute's budget: refused, and it says why.
    check_429(complete(&server, "sk-small-000001", 700, json!({})).await?, "Request too large").await?;
    let m = server.metrics().await;
    let limited = "tokenpath_rate_limited_requests_total{tenant=\"small\",limit=\"input_tokens\"}";
    assert_eq!(metric(&m, limited), Some(2.0), "{m}");
    assert_eq!(
        metric(&m, "tokenpath_requests_total{status=\"429\",finish_reason=\"none\"}"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(metric(&m, "tokenpath_tenant_requests_total{tenant=\"small\"}"), Some(4.0), "{m}");
    assert_eq!(metric(&m, "tokenpath_tenant_requests_total{tenant=\"big\"}"), Some(1.0), "{m}");
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_tokens_are_charged_as_streamed_and_the_next_request_waits() -> anyhow::Result<()> {
    let server = server().await;
    // 900 tokens generated against a budget of 600: admitted (the budget is not known in
    // advance), streamed to the end, and the tenant is 300 tokens in debt.
    let extra = json!({"max_tokens": 900, "ignore_eos": true, "stream": true,
                       "stream_options": {"include_usage": true}});
    let resp = complete(&server, "sk-talker-00001", 4, extra).await?;
    assert_eq!(resp.status().as_u16(), 200);
    let events = common::Events::new(resp).rest().await?;
    assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 900);
    // Debt of ~300 tokens at 10 tokens/s: about 30 s.
    let retry = check_429(complete(&server, "sk-talker-00001", 4, json!({})).await?, "output tokens").await?;
    assert!(retry >= 10, "Retry-After {retry}");
    assert_eq!(complete(&server, "sk-big-00000001", 4, json!({})).await?.status().as_u16(), 200);
    let m = server.metrics().await;
    let limited = "tokenpath_rate_limited_requests_total{tenant=\"talker\",limit=\"output_tokens\"}";
    assert_eq!(metric(&m, limited), Some(1.0), "{m}");
    server.shutdown().await?;
    Ok(())
}

/// A streamed completion opened over a raw socket whose body is never read.
fn unread_stream(server: &common::Server, key: &str, max_tokens: u32) -> std::net::TcpStream {
    use std::io::Write;
    let port: u16 = server.base.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap();
    let body = json!({"model": MODEL, "prompt": vec![40; 4], "max_tokens": max_tokens, "ignore_eos": true,
                      "stream": true, "temperature": 0})
    .to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         authorization: Bearer {key}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_tokens_are_charged_as_generated_even_when_the_client_never_reads() -> anyhow::Result<()> {
    let server = server().await;
    // 900 tokens against a budget of 600, and the client reads nothing: the tokens are charged
    // as the worker generates them, so the tenant is in debt long before anyone reads them.
    let held = unread_stream(&server, "sk-talker-00001", 900);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let resp = complete(&server, "sk-talker-00001", 4, json!({"max_tokens": 1})).await?;
        if resp.status().as_u16() == 429 {
            check_429(resp, "output tokens").await?;
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the unread stream was never charged");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    drop(held);
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_runs_at_most_its_concurrent_requests() -> anyhow::Result<()> {
    let server = server().await;
    let extra = || json!({"max_tokens": 4000, "ignore_eos": true, "stream": true});
    let a = complete(&server, "sk-pair-0000001", 4, extra()).await?;
    let b = complete(&server, "sk-pair-0000001", 4, extra()).await?;
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    check_429(complete(&server, "sk-pair-0000001", 4, extra()).await?, "concurrent requests").await?;
    // Others are not held back by it.
    assert_eq!(complete(&server, "sk-big-00000001", 4, json!({})).await?.status().as_u16(), 200);
    // One ends (the client goes away): its slot is free again.
    drop(a);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let r = complete(&server, "sk-pair-0000001", 4, json!({})).await?;
        if r.status().as_u16() == 200 {
            break;
        }
        assert_eq!(r.status().as_u16(), 429);
        assert!(std::time::Instant::now() < deadline, "the slot never came back");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    drop(b);
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_by_a_full_worker_is_refunded() -> anyhow::Result<()> {
    let keys = ApiKeys::from_toml_str(KEYS).unwrap();
    let worker = WorkerConfig { max_queue: 1, max_batch: 1, ..WorkerConfig::default() };
    let server = start(worker, GatewayConfig { api_keys: keys, ..Default::default() }).await;
    let long = || json!({"max_tokens": 4000, "ignore_eos": true, "stream": true});
    // One running, one queued (3 requests a minute: two spent)...
    let a = complete(&server, "sk-three-000001", 4, long()).await?;
    assert_eq!(a.status().as_u16(), 200);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let b = loop {
        let r = complete(&server, "sk-big-00000001", 4, long()).await?;
        if r.status().as_u16() == 200 {
            break r;
        }
        assert!(std::time::Instant::now() < deadline, "no queue slot");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    // ...so the third finds the queue full: 503, and its request is given back.
    let c = complete(&server, "sk-three-000001", 4, json!({})).await?;
    assert_eq!(c.status().as_u16(), 503);
    drop((a, b));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let r = complete(&server, "sk-three-000001", 4, json!({})).await?;
        match r.status().as_u16() {
            200 => break,
            503 => {} // the cancelled ones are still leaving
            other => panic!("status {other}: the refused request was charged"),
        }
        assert!(std::time::Instant::now() < deadline, "the worker never freed up");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    server.shutdown().await?;
    Ok(())
}
