//! One upstream server: its spec, its health (polled in the background by a task that lives
//! as long as the endpoint), its own load from `/metrics`, and the gateway's requests in
//! flight there (counted by a guard, so every path that ends a leg ends the count).

use super::load::{self, Load};
use super::UpstreamSpec;
use reqwest::Url;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenpath_protocol::forward::ApiEndpoint;
use tokenpath_protocol::ProtocolError;
use tokenpath_timeline::TraceParent;

/// How often each upstream's health is asked.
pub(super) const HEALTH_INTERVAL: Duration = Duration::from_secs(5);
/// How long a health probe or a metrics scrape may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// One upstream server.
#[derive(Debug)]
pub(super) struct Endpoint {
    pub(super) spec: UpstreamSpec,
    pub(super) client: reqwest::Client,
    /// The key sent to it (its own, else the pool's).
    pub(super) api_key: Option<String>,
    /// Its two generation URLs, parsed once (a parse per request was ~2% of a relayed request's
    /// instructions).
    chat_url: Url,
    completions_url: Url,
    healthy: AtomicBool,
    in_flight: AtomicUsize,
    /// Its own load, published by the health task after each scrape.
    load: tokio::sync::watch::Receiver<Load>,
}

/// One leg in flight on an endpoint; the count drops with it.
#[derive(Debug)]
pub(super) struct InFlight(Arc<Endpoint>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Endpoint {
    /// An endpoint whose health and load are polled (on the current runtime) from now until
    /// the last reference to it is gone. `Err` when its URL does not take the API paths.
    pub(super) fn start(
        spec: UpstreamSpec,
        client: reqwest::Client,
        api_key: Option<String>,
    ) -> Result<Arc<Self>, String> {
        let url_of = |e: ApiEndpoint| {
            Url::parse(&format!("{}{}", spec.url, e.path())).map_err(|err| format!("{}: {err}", spec.url))
        };
        let (chat_url, completions_url) = (url_of(ApiEndpoint::Chat)?, url_of(ApiEndpoint::Completions)?);
        let (publish, load) = tokio::sync::watch::channel(Load::default());
        let ep = Arc::new(Self {
            spec,
            client,
            api_key,
            chat_url,
            completions_url,
            healthy: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            load,
        });
        let weak = Arc::downgrade(&ep);
        tokio::spawn(async move {
            while let Some(ep) = weak.upgrade() {
                let ok = ep.probe_health().await;
                if ok != ep.healthy.swap(ok, Ordering::Relaxed) {
                    tracing::info!(upstream = %ep.spec.url, healthy = ok, "upstream health changed");
                }
                publish.send_replace(if ok { ep.scrape_load().await } else { Load::default() });
                drop(ep);
                tokio::time::sleep(HEALTH_INTERVAL).await;
            }
        });
        Ok(ep)
    }

    pub(super) fn url(&self) -> &str {
        &self.spec.url
    }

    pub(super) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub(super) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub(super) fn load(&self) -> Load {
        *self.load.borrow()
    }

    /// What routing compares: the gateway's own requests there, or the upstream's own count of
    /// running and waiting requests when it is higher (other gateways send it work too).
    pub(super) fn busy(&self) -> u64 {
        let l = self.load();
        let theirs = l.waiting.unwrap_or(0.0) + l.running.unwrap_or(0.0);
        (self.in_flight() as u64).max(theirs.clamp(0.0, 1e12) as u64)
    }

    /// Counts a leg until the guard drops.
    pub(super) fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    /// Asks now (start-up waits for the first yes).
    pub(super) async fn check_health(&self) -> bool {
        let ok = self.probe_health().await;
        self.healthy.store(ok, Ordering::Relaxed);
        ok
    }

    /// `/health`; a tokenpath gateway's `/ready` (its `/health` is up before its backend is).
    async fn probe_health(&self) -> bool {
        let path = if self.spec.kind == super::UpstreamKind::Tokenpath { "/ready" } else { "/health" };
        let req = self.client.get(format!("{}{path}", self.spec.url)).timeout(PROBE_TIMEOUT);
        matches!(req.send().await, Ok(r) if r.status().is_success())
    }

    /// The upstream's `/metrics`, read up to [`load::MAX_METRICS_BYTES`]; nothing known when it
    /// has none or does not answer in time.
    async fn scrape_load(&self) -> Load {
        let url = format!("{}/metrics", self.spec.url);
        let Ok(resp) = self.client.get(url).timeout(PROBE_TIMEOUT).send().await else {
            return Load::default();
        };
        if !resp.status().is_success() {
            return Load::default();
        }
        match body_at_most(resp, load::MAX_METRICS_BYTES).await {
            Ok(body) => load::parse(&String::from_utf8_lossy(&body)),
            Err(_) => Load::default(),
        }
    }

    /// A POST of `body` to `endpoint` with the request id, its trace context and this upstream's key. No reqwest
    /// timeout: that one covers the whole body, and a stream may rightly run for longer than
    /// its first byte may take (the legs bound the headers and each silence themselves).
    pub(super) fn post(
        &self,
        endpoint: ApiEndpoint,
        request_id: &str,
        trace: Option<&TraceParent>,
        body: &serde_json::Map<String, serde_json::Value>,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(match endpoint {
                ApiEndpoint::Chat => self.chat_url.clone(),
                ApiEndpoint::Completions => self.completions_url.clone(),
            })
            .header("x-request-id", request_id)
            .json(body);
        // Every leg continues the request's trace: an engine that exports spans (vLLM) parents
        // its span to it, and a receiver joins the span back to the request by trace id.
        if let Some(tp) = trace {
            req = req.header("traceparent", tp.to_string());
        }
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        req
    }
}

/// The most of an upstream's `/v1/models` answer read (a list of a few models is a few KiB).
const MAX_MODELS_BYTES: usize = 1 << 20;

/// The context length of the first model the upstream at `url` lists, asked with its key (an
/// engine started with an API key guards `/v1/models` too), following no redirect, reading at
/// most [`MAX_MODELS_BYTES`]. vLLM, SGLang and tokenpath say `max_model_len`; llama.cpp's
/// server its per-slot context under `meta.n_ctx`.
pub async fn max_model_len(url: &str, api_key: Option<&str>) -> Result<usize, ProtocolError> {
    let unavailable = |message: String| ProtocolError::Unavailable { message };
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| unavailable(format!("HTTP client: {e}")))?;
    let url = format!("{}/v1/models", url.trim_end_matches('/'));
    let mut req = client.get(&url).timeout(Duration::from_secs(10));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.map_err(|e| unavailable(format!("{url}: {e}")))?;
    if !resp.status().is_success() {
        return Err(unavailable(format!("{url} answered {}", resp.status())));
    }
    let body = body_at_most(resp, MAX_MODELS_BYTES).await.map_err(|e| unavailable(format!("{url}: {e}")))?;
    let v: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| unavailable(format!("{url}: {e}")))?;
    v.pointer("/data/0/max_model_len")
        .or_else(|| v.pointer("/data/0/meta/n_ctx"))
        .and_then(serde_json::Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| unavailable(format!("{url} gives no max_model_len")))
}

/// `resp`'s whole body, refused once it passes `limit` bytes or breaks off.
async fn body_at_most(mut resp: reqwest::Response, limit: usize) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > limit {
            return Err(format!("the answer is over {limit} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
