//! HTTP upstreams: engines the gateway fronts instead of running them (kind `openai`: vLLM,
//! SGLang, TensorRT-LLM's or Dynamo's OpenAI frontend, llama.cpp's server, another tokenpath —
//! any OpenAI-compatible server).
//!
//! [`OpenAiUpstream`] is a [`Backend`]: the gateway admits a request exactly as for its own
//! engine (API key, tenant limits charged from its own tokenization, validation of the fields it
//! acts on), then the client's body goes on whole — unknown fields included, `model` rewritten
//! to the upstream's name, `stream_options.include_usage` forced on a stream so output tokens are
//! charged as they arrive. The upstream's chunks come back to the client as they are, except
//! that the model name is ours, the forced usage chunk is dropped when the client did not ask
//! for it, and the last chunk the client gets carries our `timing` (the engine's own is taken
//! in): the stages the gateway saw on its own clock, and those the engine reported (`relay.rs`).
//!
//! The client's credentials never reach the upstream; the upstream's own key (if any) is sent
//! instead. Every wait on the upstream is bounded: connecting, the first byte of the response,
//! and silence between chunks.

mod load;
mod relay;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenpath_protocol::backend::{Backend, BoxFuture, ModelInfo};
use tokenpath_protocol::cluster::peer_message;
use tokenpath_protocol::work::{validate_request, WorkRequest, WorkStream, WorkerStats};
use tokenpath_protocol::ProtocolError;

/// How long connecting to an upstream and getting its response headers may take.
pub const DEFAULT_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a streaming upstream may stay silent between chunks.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the upstream's `/health` is asked.
const HEALTH_INTERVAL: Duration = Duration::from_secs(5);
/// Largest non-streamed response body taken from an upstream.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Which protocol an upstream speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamKind {
    /// Any OpenAI-compatible server, one call per request.
    OpenAi,
}

impl std::str::FromStr for UpstreamKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "openai" => Ok(Self::OpenAi),
            other => Err(format!("unknown upstream kind {other:?}: expected openai")),
        }
    }
}

/// One upstream engine.
#[derive(Clone, Debug)]
pub struct UpstreamConfig {
    /// Base URL (`http://10.0.0.5:8000`); the endpoint paths are appended.
    pub url: String,
    /// The protocol it speaks.
    pub kind: UpstreamKind,
    /// The model name the upstream serves; `None`: the client's is sent as is.
    pub model: Option<String>,
    /// The name clients use (ours), written into every chunk and body passed back.
    pub served_model_name: String,
    /// Sent as `Authorization: Bearer` to the upstream (never the client's key).
    pub api_key: Option<String>,
    /// The model's limits (context length; token ids are the upstream's to check).
    pub model_info: ModelInfo,
    /// Connect + response headers.
    pub first_byte_timeout: Duration,
    /// Silence between chunks.
    pub idle_timeout: Duration,
}

/// An OpenAI-compatible upstream behind the gateway.
#[derive(Debug)]
pub struct OpenAiUpstream {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    config: UpstreamConfig,
    client: reqwest::Client,
    in_flight: AtomicUsize,
    healthy: AtomicBool,
    /// The upstream's own load, published by the health task after each scrape.
    load: tokio::sync::watch::Receiver<load::Load>,
}

impl OpenAiUpstream {
    /// An upstream; its `/health` is polled in the background (on the current runtime) from now.
    pub fn new(config: UpstreamConfig) -> Result<Self, ProtocolError> {
        let url = config.url.trim_end_matches('/').to_owned();
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ProtocolError::InvalidRequest {
                param: Some("url".into()),
                message: format!("an upstream URL must start with http:// or https://, not {url:?}"),
            });
        }
        let client = reqwest::Client::builder()
            .connect_timeout(config.first_byte_timeout.min(Duration::from_secs(10)))
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| ProtocolError::Unavailable { message: format!("HTTP client: {e}") })?;
        let (publish, load) = tokio::sync::watch::channel(load::Load::default());
        let shared = Arc::new(Shared {
            config: UpstreamConfig { url, ..config },
            client,
            in_flight: AtomicUsize::new(0),
            healthy: AtomicBool::new(false),
            load,
        });
        let weak = Arc::downgrade(&shared);
        // The health task owns the upstream's load: it scrapes and publishes; readers borrow.
        tokio::spawn(async move {
            while let Some(s) = weak.upgrade() {
                let ok = s.probe_health().await;
                if ok != s.healthy.swap(ok, Ordering::Relaxed) {
                    tracing::info!(upstream = %s.config.url, healthy = ok, "upstream health changed");
                }
                publish.send_replace(if ok { s.scrape_load().await } else { load::Load::default() });
                drop(s);
                tokio::time::sleep(HEALTH_INTERVAL).await;
            }
        });
        Ok(Self { shared })
    }

    /// Asks `/health` now (start-up waits for the first yes).
    pub async fn check_health(&self) -> bool {
        let ok = self.shared.probe_health().await;
        self.shared.healthy.store(ok, Ordering::Relaxed);
        ok
    }
}

impl Shared {
    async fn probe_health(&self) -> bool {
        let url = format!("{}/health", self.config.url);
        let req = self.client.get(url).timeout(Duration::from_secs(2));
        matches!(req.send().await, Ok(r) if r.status().is_success())
    }

    /// The upstream's `/metrics`, read up to [`load::MAX_METRICS_BYTES`]; nothing known when it
    /// has none or does not answer in time.
    async fn scrape_load(&self) -> load::Load {
        let url = format!("{}/metrics", self.config.url);
        let Ok(mut resp) = self.client.get(url).timeout(Duration::from_secs(2)).send().await else {
            return load::Load::default();
        };
        if !resp.status().is_success() {
            return load::Load::default();
        }
        let mut body = Vec::new();
        while let Ok(Some(chunk)) = resp.chunk().await {
            if body.len() + chunk.len() > load::MAX_METRICS_BYTES {
                return load::Load::default();
            }
            body.extend_from_slice(&chunk);
        }
        load::parse(&String::from_utf8_lossy(&body))
    }

    async fn start(self: &Arc<Self>, work: WorkRequest) -> Result<WorkStream, ProtocolError> {
        let c = &self.config;
        validate_request(&work, c.model_info.n_ctx, c.model_info.n_vocab)?;
        let Some(fwd) = work.forward.clone() else {
            return Err(ProtocolError::InvalidRequest {
                param: None,
                message: "an upstream backend needs the client's body".into(),
            });
        };
        let mut body = fwd.body.clone();
        let stream = body.get("stream").and_then(serde_json::Value::as_bool).unwrap_or(false);
        let client_usage = body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        if let Some(m) = &c.model {
            body.insert("model".into(), m.clone().into());
        }
        if stream {
            let opts = body.entry("stream_options").or_insert_with(|| serde_json::json!({}));
            if !opts.is_object() {
                // `null` (validated as "no options" already): replaced, so usage is forced.
                *opts = serde_json::json!({});
            }
            if let Some(o) = opts.as_object_mut() {
                o.insert("include_usage".into(), true.into());
            }
        }
        let mut req = self
            .client
            .post(format!("{}{}", c.url, fwd.endpoint.path()))
            .header("x-request-id", format!("tokenpath-{}", work.id.0))
            .json(&body)
            .timeout(c.first_byte_timeout);
        if let Some(key) = &c.api_key {
            req = req.bearer_auth(key);
        }
        let sent = std::time::Instant::now();
        let resp = req.send().await.map_err(|e| unreachable(&c.url, &e))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(refusal(&c.url, status.as_u16(), &text));
        }
        let (tx, out) = WorkStream::channel(work.id);
        let ctx = relay::Relay {
            shared: Arc::clone(self) as Arc<dyn relay::Names>,
            arrived: work.arrived,
            admitted: work.admitted,
            sent,
            prompt_tokens: work.prompt.len() as u64,
            meter: work.meter.clone(),
            client_usage,
        };
        let me = Arc::clone(self);
        me.in_flight.fetch_add(1, Ordering::Relaxed);
        let idle = c.idle_timeout;
        tokio::spawn(async move {
            if stream {
                ctx.stream(resp, &tx, idle).await;
            } else {
                ctx.body(resp, &tx).await;
            }
            me.in_flight.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(out)
    }
}

impl relay::Names for Shared {
    fn served_model_name(&self) -> &str {
        &self.config.served_model_name
    }
    fn url(&self) -> &str {
        &self.config.url
    }
}

/// The upstream could not be reached or did not answer in time.
fn unreachable(url: &str, e: &reqwest::Error) -> ProtocolError {
    let what = if e.is_timeout() { "timed out" } else { "unreachable" };
    ProtocolError::Unavailable { message: format!("upstream {url} {what}: {e}") }
}

/// The error for an upstream's non-2xx answer: the client's fault (4xx but auth) keeps the
/// upstream's words (cut and cleaned); a full upstream is overloaded; the rest is ours.
fn refusal(url: &str, status: u16, body: &str) -> ProtocolError {
    let said = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(|m| m.as_str().map(str::to_owned)))
        .unwrap_or_else(|| body.to_owned());
    let said = peer_message(&said);
    match status {
        429 | 503 => ProtocolError::Overloaded { max: 0 },
        401 | 403 => ProtocolError::Unavailable {
            message: format!("upstream {url} refused our credentials ({status}): {said}"),
        },
        400..=499 => ProtocolError::InvalidRequest {
            param: None,
            message: format!("The upstream engine refused the request: {said}"),
        },
        _ => ProtocolError::Unavailable { message: format!("upstream {url} answered {status}: {said}") },
    }
}

impl Backend for OpenAiUpstream {
    fn submit(&self, work: WorkRequest) -> BoxFuture<'_, Result<WorkStream, ProtocolError>> {
        Box::pin(self.shared.start(work))
    }

    fn model(&self) -> ModelInfo {
        self.shared.config.model_info
    }

    /// The upstream's own gauges when its `/metrics` has them; else what the gateway knows:
    /// its requests in flight there.
    fn stats(&self) -> WorkerStats {
        let load = *self.shared.load.borrow();
        let count = |v: Option<f64>| v.map(|v| v.min(1e12) as usize);
        WorkerStats {
            waiting: count(load.waiting).unwrap_or(0),
            running: count(load.running).unwrap_or_else(|| self.shared.in_flight.load(Ordering::Relaxed)),
            kv_usage_reported: load.kv_usage,
            ..WorkerStats::default()
        }
    }

    fn is_ready(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
    }

    fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    fn forwards(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_refusals_map_to_the_clients_or_ours() {
        let body =
            r#"{"error":{"message":"max_tokens is too large\u001b[31m","type":"invalid_request_error"}}"#;
        match refusal("u", 400, body) {
            ProtocolError::InvalidRequest { message, .. } => {
                assert!(
                    message.contains("max_tokens is too large") && !message.contains('\u{1b}'),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(refusal("u", 429, ""), ProtocolError::Overloaded { .. }));
        assert!(matches!(refusal("u", 503, ""), ProtocolError::Overloaded { .. }));
        assert!(matches!(refusal("u", 401, ""), ProtocolError::Unavailable { .. }));
        assert!(matches!(refusal("u", 500, "boom"), ProtocolError::Unavailable { .. }));
        assert_eq!("openai".parse::<UpstreamKind>(), Ok(UpstreamKind::OpenAi));
        assert!("vllm".parse::<UpstreamKind>().is_err());
    }
}
