//! Gateway overhead benchmark (issue 4's "performance" item), not a test: an in-process server on
//! the tiny random-weight model, `CONCURRENCY` clients sending short non-streamed chat requests
//! (`max_tokens: 1`) over loopback for `SECONDS`, then the `gateway` stage's distribution (from
//! each response's `timing`, i.e. measured by the server itself) and the achieved request rate.
//!
//! Run: `cargo run -p tokenpath-gateway --example gateway_bench [-- SECONDS CONCURRENCY]`.
//! The request rate includes the worker's (tiny) compute; the `gateway` stage does not.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_engine::model::Model;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::Engine;
use tokenpath_gateway::{Gateway, GatewayConfig};
use tokenpath_timeline::Summary;
use tokenpath_worker::{Worker, WorkerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let seconds: f64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5.0);
    let concurrency: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(8);

    let engine = Arc::new(Engine::from_model(Model::from_bytes(tiny_model_bytes(&TinySpec::default())?)?)?);
    let worker = Worker::spawn(Arc::clone(&engine), WorkerConfig::default())?;
    let gateway = Gateway::new(
        GatewayConfig { served_model_name: "tiny".into(), ..GatewayConfig::default() },
        Arc::new(worker.handle()),
        engine,
    )?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/chat/completions", listener.local_addr()?);
    tokio::spawn(gateway.serve(listener, std::future::pending()));

    let body = serde_json::json!({
        "model": "tiny", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    let client = reqwest::Client::new();
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut gateway_ms = Vec::new();
            while Instant::now() < end {
                let resp = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await?;
                anyhow::ensure!(resp.status().is_success(), "status {}", resp.status());
                let v: serde_json::Value = serde_json::from_slice(&resp.bytes().await?)?;
                if let Some(ms) = v["timing"]["stages_ms"]["gateway"].as_f64() {
                    gateway_ms.push(ms);
                }
            }
            anyhow::Ok(gateway_ms)
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let s = Summary::from_samples(&samples).ok_or_else(|| anyhow::anyhow!("no request completed"))?;
    println!(
        "{} requests in {elapsed:.1} s with {concurrency} clients: {:.0} req/s",
        s.count,
        s.count as f64 / elapsed
    );
    println!("gateway stage: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms", s.p50, s.p99, s.max);
    Ok(())
}
