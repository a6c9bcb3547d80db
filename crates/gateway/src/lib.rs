//! The gateway is the first stage of the path: API keys, validation, tokenization, routing to
//! the worker, SSE, `/metrics`, and per-tenant rate limits ([`ratelimit`]).
//!
//! It is the only crate that knows HTTP, and the only place where HTTP status codes are chosen
//! ([`error`]): every other crate returns typed errors and this crate maps them. Shape: an axum
//! router over one immutable [`AppState`] (config, the [`Backend`], the metrics registry
//! whose metrics are atomics, and a watch channel that says "draining"); the engine's mutable
//! state lives on the worker's thread, never here. [`Gateway::serve`] runs until its shutdown
//! future resolves, then drains: new requests get 503, running streams may finish within the
//! grace period, and whatever is left is dropped (which cancels it on the worker).

mod admin;
mod api;
mod auth;
pub mod cluster;
mod error;
mod guard;
mod keyfile;
pub mod metrics;
mod ratelimit;
pub mod route;
mod server;
mod spans;
mod stream;
pub mod upstream;

pub use auth::{AdminKey, ApiKeys, Tenant};
pub use cluster::Cluster;
pub use error::GatewayError;
pub use ratelimit::RateLimits;
pub use server::HttpLimits;
/// What requests run on (defined on the boundary, in the protocol crate).
pub use tokenpath_protocol::backend::Backend;
/// How the gateway tokenizes (defined on the boundary, in the protocol crate).
pub use tokenpath_protocol::tokenize::PromptTokenizer;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokenpath_protocol::Limits;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Default request body limit (`--max-body-bytes`).
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
/// Default time running streams get to finish after a shutdown signal.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// What the gateway serves and its limits.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The model name clients must ask for (`/v1/models` lists it).
    pub served_model_name: String,
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// How long running streams may take to finish after a shutdown signal.
    pub shutdown_grace: Duration,
    /// The machine's peak FLOP/s, exported next to the worker's achieved FLOPs.
    pub peak_flops: Option<f64>,
    /// API keys; empty: the API is open (health and readiness always are).
    pub api_keys: ApiKeys,
    /// The operator's key for `/admin/*` and `/metrics`; none: those routes are served only by a
    /// gateway bound to loopback ([`guard`]).
    pub admin_key: Option<AdminKey>,
    /// `/metrics` has a listener of its own ([`Gateway::metrics_router`]) and is not served on
    /// the API's.
    pub metrics_elsewhere: bool,
    /// Timeouts and the connection cap of the HTTP listener.
    pub http: HttpLimits,
    /// Who shares prefix-cache blocks; `None`: per tenant when API keys are configured.
    pub prefix_cache_scope: Option<PrefixScope>,
    /// Engines' spans received for the requests this gateway forwards (`--otlp-listen`).
    pub engine_spans: Option<EngineSpans>,
    /// Where this gateway's own spans go (`--otlp-endpoint`): a root span per request and one
    /// per stage.
    pub span_export: Option<tokenpath_otlp::SpanExporter>,
}

/// Where engines' spans arrive and how long a request's are waited for.
#[derive(Clone, Debug)]
pub struct EngineSpans {
    /// The receiver's store (`tokenpath_otlp::Receiver::store`).
    pub store: tokenpath_otlp::SpanStore,
    /// From admission, how long the spans of one request are waited for (an engine exports
    /// after the request ends, in batches).
    pub wait: Duration,
}

/// Who may reuse whose prompt KV (`--prefix-cache-scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixScope {
    /// Every request on a worker shares one cache: the most reuse, and a tenant can learn from
    /// `cached_tokens` or TTFT whether another recently sent a prefix.
    Global,
    /// Each tenant has its own namespace: no cross-tenant hit, plant or probe.
    Tenant,
}

impl std::str::FromStr for PrefixScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "global" => Ok(Self::Global),
            "tenant" => Ok(Self::Tenant),
            other => Err(format!("unknown prefix cache scope {other:?}: expected global or tenant")),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            served_model_name: "tokenpath".into(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            peak_flops: None,
            api_keys: ApiKeys::default(),
            admin_key: None,
            metrics_elsewhere: false,
            http: HttpLimits::default(),
            prefix_cache_scope: None,
            engine_spans: None,
            span_export: None,
        }
    }
}

/// Everything a handler can see. Immutable, except through atomics and channels.
#[derive(Debug)]
pub(crate) struct AppState {
    config: GatewayConfig,
    limits: Limits,
    backend: Arc<dyn Backend>,
    /// The same backend when it is a cluster of worker processes (registration, `/admin`).
    cluster: Option<Arc<Cluster>>,
    /// The same backend when it is a pool of HTTP upstreams (registration, `/admin`).
    upstreams: Option<upstream::UpstreamPool>,
    /// The model's tokenizer and chat template (never its weights).
    tokenizer: Arc<dyn PromptTokenizer>,
    metrics: metrics::Metrics,
    /// Per-tenant buckets (atomics; see the module).
    limiter: ratelimit::RateLimiter,
    next_id: AtomicU64,
    started_unix: u64,
    draining: watch::Receiver<bool>,
    /// The API listener's address, once serving.
    local: OnceLock<std::net::SocketAddr>,
    /// Turns for parsing and tokenizing large bodies ([`api::MAX_CONCURRENT_TOKENIZATIONS`]).
    tokenizing: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Whether the API listens on loopback only (unknown, e.g. a router served by hand: no).
    fn is_loopback(&self) -> bool {
        self.local.get().is_some_and(|a| a.ip().is_loopback())
    }
}

/// An HTTP gateway in front of one worker.
#[derive(Debug)]
pub struct Gateway {
    state: Arc<AppState>,
    drain: watch::Sender<bool>,
}

impl Gateway {
    /// A gateway for `backend` (a local worker, an upstream engine), tokenizing with
    /// `tokenizer`.
    pub fn new(
        config: GatewayConfig,
        backend: Arc<dyn Backend>,
        tokenizer: Arc<dyn PromptTokenizer>,
    ) -> Result<Self, GatewayError> {
        Self::build(config, backend, None, None, tokenizer)
    }

    /// A gateway for a pool of HTTP upstreams (which can also be registered at run time).
    pub fn with_upstreams(
        config: GatewayConfig,
        pool: upstream::UpstreamPool,
        tokenizer: Arc<dyn PromptTokenizer>,
    ) -> Result<Self, GatewayError> {
        Self::build(config, Arc::new(pool.clone()), None, Some(pool), tokenizer)
    }

    /// A gateway for a cluster of worker processes (which can also register at run time).
    pub fn with_cluster(
        config: GatewayConfig,
        cluster: Arc<Cluster>,
        tokenizer: Arc<dyn PromptTokenizer>,
    ) -> Result<Self, GatewayError> {
        Self::build(config, Arc::clone(&cluster) as Arc<dyn Backend>, Some(cluster), None, tokenizer)
    }

    fn build(
        config: GatewayConfig,
        backend: Arc<dyn Backend>,
        cluster: Option<Arc<Cluster>>,
        upstreams: Option<upstream::UpstreamPool>,
        tokenizer: Arc<dyn PromptTokenizer>,
    ) -> Result<Self, GatewayError> {
        if config.served_model_name.is_empty() {
            return Err(GatewayError::Config("the served model name is empty".into()));
        }
        if config.max_body_bytes == 0 {
            return Err(GatewayError::Config("max_body_bytes must be at least 1".into()));
        }
        if config.admin_key.as_ref().is_some_and(|k| config.api_keys.holds(k)) {
            return Err(GatewayError::Config(
                "the admin key is also a tenant's API key; use a separate one".into(),
            ));
        }
        if config.peak_flops.is_some_and(|p| !(p.is_finite() && p > 0.0)) {
            return Err(GatewayError::Config("the peak FLOP/s must be a positive number".into()));
        }
        let (drain, draining) = watch::channel(false);
        let metrics = metrics::Metrics::with_peak_flops(config.peak_flops);
        let limits = Limits { max_tokens_cap: u32::try_from(backend.model().n_ctx).unwrap_or(u32::MAX) };
        let limiter = ratelimit::RateLimiter::new(
            config.api_keys.tenants(),
            Arc::new(ratelimit::MonotonicClock::new()),
        );
        let state = AppState {
            limiter,
            config,
            limits,
            backend,
            cluster,
            upstreams,
            tokenizer,
            metrics,
            next_id: AtomicU64::new(1),
            started_unix: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            draining,
            local: OnceLock::new(),
            tokenizing: Arc::new(tokio::sync::Semaphore::new(api::MAX_CONCURRENT_TOKENIZATIONS)),
        };
        Ok(Self { state: Arc::new(state), drain })
    }

    /// The routes, for serving or for in-process tests. Every request passes [`guard`] first.
    pub fn router(&self) -> Router {
        let mut r = Router::new()
            .route("/v1/chat/completions", post(api::chat))
            .route("/v1/completions", post(api::completions))
            .route("/v1/models", get(api::models))
            .route("/health", get(api::health))
            .route("/ready", get(api::ready))
            .route("/admin/workers", get(admin::list_workers).post(admin::register_worker))
            .route(
                "/admin/upstreams",
                get(admin::list_upstreams).post(admin::register_upstream).delete(admin::remove_upstream),
            );
        if !self.state.config.metrics_elsewhere {
            r = r.route("/metrics", get(api::metrics));
        }
        r.fallback(api::fallback)
            .layer(DefaultBodyLimit::max(self.state.config.max_body_bytes))
            .layer(axum::middleware::from_fn_with_state(Arc::clone(&self.state), guard::guard))
            .with_state(Arc::clone(&self.state))
    }

    /// `/metrics` alone, open, for a listener of its own (`--metrics-listen`, typically bound
    /// where only the scraper reaches).
    pub fn metrics_router(&self) -> Router {
        Router::new()
            .route("/metrics", get(api::metrics))
            .fallback(api::fallback)
            .with_state(Arc::clone(&self.state))
    }

    /// Serves [`Gateway::metrics_router`] on `listener` until the process ends.
    pub fn serve_metrics(
        &self,
        listener: TcpListener,
    ) -> impl Future<Output = Result<(), GatewayError>> + Send + 'static {
        let router = self.metrics_router();
        let limits = self.state.config.http;
        async move {
            server::serve(listener, router, limits, std::future::pending()).await;
            Ok(())
        }
    }

    /// Serves on `listener` until `shutdown` resolves, then drains (see the module docs).
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), GatewayError> {
        if let Ok(a) = listener.local_addr() {
            let _ = self.state.local.set(a);
        }
        let router = self.router();
        let grace = self.state.config.shutdown_grace;
        let open = server::serve(listener, router, self.state.config.http, shutdown).await;
        let in_flight = self.state.backend.in_flight();
        tracing::info!(in_flight, grace_s = grace.as_secs_f64(), "shutting down: no new requests, draining");
        self.drain.send_replace(true);
        match tokio::time::timeout(grace, open.shutdown()).await {
            Ok(()) => Ok(()),
            Err(_) => {
                tracing::warn!(
                    in_flight = self.state.backend.in_flight(),
                    "grace period over; cancelling the requests still running"
                );
                Ok(())
            }
        }
    }
}

/// Serves `/metrics` (the worker gauges of `backend`'s stats: waiting, running, KV blocks and
/// usage fraction, busy time, FLOPs) and `/health` (200 while `backend` is ready, else 503) on
/// `listener` until the process ends: what an endpoint picker (llm-d's, vllm-router,
/// sglang-router) scrapes from a `tokenpath worker` that has no gateway of its own in front.
pub async fn serve_backend_metrics(listener: TcpListener, backend: Arc<dyn Backend>, limits: HttpLimits) {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    let metrics = Arc::new(metrics::Metrics::with_peak_flops(None));
    let for_health = Arc::clone(&backend);
    let router = Router::new()
        .route(
            "/metrics",
            get(move || {
                let (metrics, backend) = (Arc::clone(&metrics), Arc::clone(&backend));
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.render(&backend.stats()),
                    )
                        .into_response()
                }
            }),
        )
        .route(
            "/health",
            get(move || {
                let ready = for_health.is_ready();
                async move {
                    if ready {
                        (StatusCode::OK, "{\"status\":\"ok\"}").into_response()
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "{\"status\":\"worker_down\"}").into_response()
                    }
                }
            }),
        )
        .fallback(api::fallback);
    server::serve(listener, router, limits, std::future::pending()).await;
}

/// Binds `addr` (e.g. `127.0.0.1:8000`).
pub async fn bind(addr: &str) -> Result<TcpListener, GatewayError> {
    TcpListener::bind(addr).await.map_err(|source| GatewayError::Bind { addr: addr.to_owned(), source })
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
