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
