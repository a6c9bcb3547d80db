//! A real server on an ephemeral loopback port, in-process, on the tiny random-weight model, and
//! a small client for it (reqwest + the protocol crate's SSE decoder).

#![allow(dead_code)]

use anyhow::{bail, Context as _};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_engine::model::Model;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::Engine;
use tokenpath_gateway::{Gateway, GatewayConfig};
use tokenpath_protocol::SseDecoder;
use tokenpath_worker::{Worker, WorkerConfig};
use tokio::sync::oneshot;

pub const MODEL: &str = "tiny";
/// The admin key of every test server that has API keys and no admin key of its own.
pub const ADMIN_KEY: &str = "test-admin-key-0123456789";
/// Long enough that a 8000-token stream outlives any client-side scheduling hiccup.
pub const N_CTX: usize = 8192;

pub struct Server {
    pub base: String,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), tokenpath_gateway::GatewayError>>>,
}

pub fn engine() -> Arc<Engine> {
    let bytes = tiny_model_bytes(&TinySpec { n_ctx: N_CTX, ..TinySpec::default() }).expect("tiny model");
    Arc::new(Engine::from_model(Model::from_bytes(bytes).expect("model")).expect("engine"))
}

pub async fn start(worker: WorkerConfig, mut gateway: GatewayConfig) -> Server {
    if !gateway.api_keys.is_empty() && gateway.admin_key.is_none() {
        gateway.admin_key = Some(tokenpath_gateway::AdminKey::new(ADMIN_KEY).expect("admin key"));
    }
    let engine = engine();
    let worker = Worker::spawn(Arc::clone(&engine), worker).expect("worker");
    let gateway =
        local_gateway(GatewayConfig { served_model_name: MODEL.into(), ..gateway }, &worker, engine)
            .expect("gateway");
    serve_gateway(gateway).await
}

/// A gateway over `worker` in this process, tokenizing with `engine`.
pub fn local_gateway(
    config: GatewayConfig,
    worker: &Worker,
    engine: Arc<Engine>,
) -> Result<Gateway, tokenpath_gateway::GatewayError> {
    Gateway::new(config, Arc::new(worker.handle()), engine)
}

/// A gateway over an (empty) cluster of worker processes, tokenizing with the tiny model's
/// tokenizer.
pub fn cluster_gateway(config: GatewayConfig) -> Result<Gateway, tokenpath_gateway::GatewayError> {
    use tokenpath_gateway::cluster::{Cluster, Registry};
    let engine = engine();
    let c = engine.model().config();
    let model = tokenpath_protocol::backend::ModelInfo { n_ctx: c.n_ctx, n_vocab: c.n_vocab };
    let registry = Registry::start(Vec::new(), tokenpath_protocol::auth::ClusterSecret::open());
    Gateway::with_cluster(config, Arc::new(Cluster::new(registry, model)), engine)
}

/// Serves `gateway` on an ephemeral loopback port.
pub async fn serve_gateway(gateway: Gateway) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(gateway.serve(listener, async move {
        let _ = stopped.await;
    }));
    Server { base, client: reqwest::Client::new(), stop: Some(stop), task: Some(task) }
}

pub async fn start_default() -> Server {
    start(WorkerConfig::default(), GatewayConfig::default()).await
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("send")
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.post(path, body).await;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.expect("body");
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    pub async fn metrics(&self) -> String {
        let req = self.client.get(self.url("/metrics")).bearer_auth(ADMIN_KEY);
        req.send().await.expect("metrics").text().await.expect("text")
    }

    /// Polls `/metrics` until `ok` holds (bounded; the poll interval is not an assertion).
    pub async fn wait_metrics(&self, what: &str, ok: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let m = self.metrics().await;
            if ok(&m) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}:\n{m}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Signals shutdown and waits for `serve` to return.
    pub async fn shutdown(mut self) -> Result<(), tokenpath_gateway::GatewayError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(t) => t.await.expect("serve task"),
            None => Ok(()),
        }
    }

    pub fn signal_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub async fn join(mut self) -> Result<(), tokenpath_gateway::GatewayError> {
        match self.task.take() {
            Some(t) => t.await.expect("serve task"),
            None => Ok(()),
        }
    }
}

/// The value of an unlabelled (or exactly labelled) sample line, e.g. `tokenpath_kv_blocks_used`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// An SSE response read event by event.
pub struct Events {
    resp: reqwest::Response,
    decoder: SseDecoder,
    ready: std::collections::VecDeque<String>,
}

impl Events {
    pub fn new(resp: reqwest::Response) -> Self {
        Self { resp, decoder: SseDecoder::new(), ready: Default::default() }
    }

    /// The next event's data, `None` at the end of the body.
    pub async fn next(&mut self) -> anyhow::Result<Option<String>> {
        loop {
            if let Some(d) = self.ready.pop_front() {
                return Ok(Some(d));
            }
            match self.resp.chunk().await.context("reading the stream")? {
                Some(bytes) => {
                    let mut out = Vec::new();
                    self.decoder.feed(&bytes, &mut out)?;
                    self.ready.extend(out.into_iter().map(|e| e.data));
                }
                None => return Ok(self.decoder.finish()?.map(|e| e.data)),
            }
        }
    }

    /// Every remaining event; the last must be `[DONE]` and is not included.
    pub async fn rest(&mut self) -> anyhow::Result<Vec<Value>> {
        let mut out = Vec::new();
        while let Some(d) = self.next().await? {
            if d == "[DONE]" {
                if self.next().await?.is_some() {
                    bail!("events after [DONE]");
                }
                return Ok(out);
            }
            out.push(serde_json::from_str(&d).with_context(|| format!("event {d:?}"))?);
        }
        bail!("stream ended without [DONE]")
    }
}

/// The text a streamed response carried (chat deltas or completion texts).
pub fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| {
            let c = e["choices"].get(0)?;
            c["delta"]["content"].as_str().or_else(|| c["text"].as_str()).map(str::to_owned)
        })
        .collect()
}

/// Checks the `timing` object: every colocated stage present, and they add up to `e2e_ms`.
pub fn check_timing(timing: &Value) {
    let stages = timing["stages_ms"].as_object().expect("stages_ms");
    for s in ["gateway", "queue", "prefill", "decode_queue", "decode"] {
        assert!(stages[s].as_f64().expect(s) >= 0.0, "{s} in {timing}");
    }
    assert!(stages.get("kv_transfer").is_none(), "no kv_transfer when colocated");
    let sum: f64 = stages.values().filter_map(Value::as_f64).sum();
    let e2e = timing["e2e_ms"].as_f64().expect("e2e_ms");
    assert!((sum - e2e).abs() <= 1.0, "stages add up to {sum} ms, e2e is {e2e} ms");
    if let Some(ttft) = timing["ttft_ms"].as_f64() {
        assert!(ttft <= e2e, "ttft {ttft} ms after e2e {e2e} ms");
    }
}
