//! The upstream pool: one task owns its membership (static upstreams from the command line or
//! the cluster file, upstreams registered through the admin API, upstreams found by DNS), each
//! member's failure record, and the prefix index; it answers routing questions over a channel.
//!
//! Routing: when a prefill and a decode upstream of one PD kind are both usable, the request is
//! split — prefill by the cache-aware choice within the balance bound ([`crate::route`]), decode
//! by the least busy (then the lowest KV usage the upstream reports); otherwise one colocated
//! upstream by the same cache-aware choice. Usable: its last health probe said yes, it is not
//! ejected, and this request has not already failed on it.
//!
//! Outlier ejection: [`EJECT_AFTER`] consecutive failures (unreachable, timed out, a 5xx, a
//! stream broken mid-way) take an upstream out of routing for [`EJECTION`], doubled on each
//! ejection in a row up to [`MAX_EJECTION`]; when that time is over it gets traffic again, and a
//! success clears its record. A client's mistakes (4xx) and a full upstream (429) are not
//! failures of the upstream.

use super::endpoint::Endpoint;
use super::{PoolConfig, UpstreamKind, UpstreamSpec};
use crate::route::{cache_aware, Candidate, PrefixIndex};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_protocol::backend::{Backend, BoxFuture, ModelInfo};
use tokenpath_protocol::cluster::WorkerRole as Role;
use tokenpath_protocol::work::{WorkRequest, WorkStream, WorkerStats};
use tokenpath_protocol::ProtocolError;
use tokio::sync::{mpsc, oneshot, watch};

/// Most upstreams one pool holds (registrations beyond are refused).
pub const MAX_UPSTREAMS: usize = 256;
/// Consecutive failures that eject an upstream.
pub const EJECT_AFTER: u32 = 3;
/// The first ejection's length.
pub const EJECTION: Duration = Duration::from_secs(10);
/// The longest ejection.
pub const MAX_EJECTION: Duration = Duration::from_secs(300);

/// How a registration went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Added {
    /// A new upstream.
    Added,
    /// Already known with this kind and role (registering again is harmless).
    Known,
    /// Already known as another kind or role: refused (remove it first).
    Conflict(String),
    /// The pool holds [`MAX_UPSTREAMS`] already.
    Full,
}

/// One upstream as the pool sees it (the admin API's answer).
#[derive(Clone, Debug, serde::Serialize)]
pub struct UpstreamView {
    /// Its base URL.
    pub url: String,
    /// Its protocol.
    pub kind: String,
    /// Its part.
    pub role: String,
    /// Its last health probe.
    pub healthy: bool,
    /// Seconds of ejection left (0: routable).
    pub ejected_for_s: f64,
    /// Consecutive failures.
    pub failures: u32,
    /// This gateway's legs there now.
    pub in_flight: usize,
    /// Where it came from: `static`, `admin` or `dns:NAME`.
    pub source: String,
    /// The shared KV pool it reads, when named.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_pool: Option<String>,
}

/// Where a member came from: DNS members come and go with the name's addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Source {
    Static,
    Admin,
    Dns(String),
}

/// Where one request goes.
#[derive(Clone, Debug)]
pub(super) enum Pick {
    One(Arc<Endpoint>),
    Pair { prefill: Arc<Endpoint>, decode: Arc<Endpoint> },
}

#[derive(Debug)]
struct Member {
    ep: Arc<Endpoint>,
    source: Source,
    failures: u32,
    ejections: u32,
    ejected_until: Option<Instant>,
}

impl Member {
    fn routable(&self, now: Instant) -> bool {
        self.ep.is_healthy() && self.ejected_until.is_none_or(|t| t <= now)
    }
}

/// What readers see without asking the task.
#[derive(Clone, Debug)]
struct Snap {
    ep: Arc<Endpoint>,
    ejected_until: Option<Instant>,
}

enum Cmd {
    Add {
        spec: UpstreamSpec,
        source: Source,
        reply: Option<oneshot::Sender<Added>>,
    },
    Remove {
        url: String,
        reply: oneshot::Sender<bool>,
    },
    Sync {
        source: Source,
        specs: Vec<UpstreamSpec>,
    },
    Route {
        prompt: Vec<u32>,
        scope: Option<String>,
        avoid: Vec<String>,
        reply: oneshot::Sender<Option<Pick>>,
    },
    Outcome {
        url: String,
        ok: bool,
    },
    List {
        reply: oneshot::Sender<Vec<UpstreamView>>,
    },
}

/// A pool of HTTP upstreams serving one model: a [`Backend`].
#[derive(Debug, Clone)]
pub struct UpstreamPool {
    pub(super) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(super) struct Inner {
    tx: mpsc::UnboundedSender<Cmd>,
    view: watch::Receiver<Vec<Snap>>,
    pub(super) config: PoolConfig,
    /// Requests accepted and not finished.
    pub(super) requests: AtomicUsize,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cmd")
    }
}

impl UpstreamPool {
    /// A pool over `specs` (each validated), on the current runtime. More upstreams may be
    /// added later ([`Self::add`], [`Self::discover`]).
    pub fn new(config: PoolConfig, specs: Vec<UpstreamSpec>) -> Result<Self, ProtocolError> {
        let specs = specs.into_iter().map(UpstreamSpec::validated).collect::<Result<Vec<_>, _>>()?;
        let client = reqwest::Client::builder()
            .connect_timeout(config.first_byte_timeout.min(Duration::from_secs(10)))
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            // An upstream's redirect is its failure, not a place to send the client's body (and
            // our upstream key) to; following none also spares the per-request redirect policy.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ProtocolError::Unavailable { message: format!("HTTP client: {e}") })?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (view_tx, view) = watch::channel(Vec::new());
        let mut state = State {
            members: Vec::new(),
            prefixes: PrefixIndex::default(),
            view: view_tx,
            client,
            api_key: config.api_key.clone(),
        };
        // Added before anyone can ask: a health check right after `new` sees them.
        for spec in specs {
            if let Added::Conflict(why) = state.add(spec, Source::Static) {
                return Err(ProtocolError::invalid("url", why));
            }
        }
        state.publish();
        tokio::spawn(state.run(rx));
        Ok(Self { inner: Arc::new(Inner { tx, view, config, requests: AtomicUsize::new(0) }) })
    }

    /// Adds an upstream at run time (the admin API); it serves once its health probe says yes.
    pub async fn add(&self, spec: UpstreamSpec) -> Result<Added, ProtocolError> {
        let spec = spec.validated()?;
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Add { spec, source: Source::Admin, reply: Some(reply) })?;
        rx.await.map_err(|_| ProtocolError::Stopped)
    }

    /// Removes the upstream at `url` (its requests in flight finish); whether it was there.
    pub async fn remove(&self, url: &str) -> Result<bool, ProtocolError> {
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Remove { url: url.trim_end_matches('/').to_owned(), reply })?;
        rx.await.map_err(|_| ProtocolError::Stopped)
    }

    /// The upstreams as of now.
    pub async fn upstreams(&self) -> Vec<UpstreamView> {
        let (reply, rx) = oneshot::channel();
        if self.send(Cmd::List { reply }).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Probes every upstream now; whether requests can be served.
    pub async fn check_health(&self) -> bool {
        let eps: Vec<Arc<Endpoint>> = self.inner.view.borrow().iter().map(|s| Arc::clone(&s.ep)).collect();
        futures_util::future::join_all(eps.iter().map(|e| e.check_health())).await;
        self.is_ready()
    }

    /// Waits until `check_health` says yes, or `timeout`.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.check_health().await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn send(&self, cmd: Cmd) -> Result<(), ProtocolError> {
        self.inner.tx.send(cmd).map_err(|_| ProtocolError::Stopped)
    }

    /// Members of `source` become exactly `specs` (DNS: the name's addresses now).
    pub(super) fn sync(&self, source: Source, specs: Vec<UpstreamSpec>) {
        let _ = self.send(Cmd::Sync { source, specs });
    }

    /// Picks where `prompt` goes, never to one of `avoid`; `None`: nothing usable.
    pub(super) async fn route(&self, prompt: &[u32], scope: Option<&str>, avoid: &[String]) -> Option<Pick> {
        let (reply, rx) = oneshot::channel();
        let cmd = Cmd::Route {
            prompt: prompt.to_vec(),
            scope: scope.map(str::to_owned),
            avoid: avoid.to_vec(),
            reply,
        };
        self.send(cmd).ok()?;
        rx.await.ok().flatten()
    }

    /// A leg on `url` succeeded (`ok`) or failed in a way that counts against the upstream.
    pub(super) fn outcome(&self, url: &str, ok: bool) {
        let _ = self.send(Cmd::Outcome { url: url.to_owned(), ok });
    }
}

impl Backend for UpstreamPool {
    fn submit(&self, work: WorkRequest) -> BoxFuture<'_, Result<WorkStream, ProtocolError>> {
        Box::pin(super::legs::submit(self.clone(), work))
    }

    fn model(&self) -> ModelInfo {
        self.inner.config.model_info
    }

    /// The upstreams' own gauges, summed, where their `/metrics` have them; else what the
    /// gateway knows: its legs in flight there. KV usage: the mean over those that report it.
    fn stats(&self) -> WorkerStats {
        let view = self.inner.view.borrow();
        let mut s = WorkerStats::default();
        let (mut kv, mut kv_n) = (0.0, 0u32);
        for ep in view.iter().map(|m| &m.ep).filter(|e| e.is_healthy()) {
            let load = ep.load();
            let count = |v: Option<f64>| v.map(|v| v.clamp(0.0, 1e12) as usize);
            s.waiting = s.waiting.saturating_add(count(load.waiting).unwrap_or(0));
            s.running = s.running.saturating_add(count(load.running).unwrap_or_else(|| ep.in_flight()));
            if let Some(u) = load.kv_usage {
                kv += u;
                kv_n += 1;
            }
        }
        s.kv_usage_reported = (kv_n > 0).then(|| kv / f64::from(kv_n));
        s
    }

    fn is_ready(&self) -> bool {
        let now = Instant::now();
        let view = self.inner.view.borrow();
        let up = |kind: Option<UpstreamKind>, role: Role| {
            view.iter().any(|s| {
                s.ep.is_healthy()
                    && s.ejected_until.is_none_or(|t| t <= now)
                    && s.ep.spec.role == role
                    && kind.is_none_or(|k| s.ep.spec.kind == k)
            })
        };
        up(None, Role::Both)
            || [UpstreamKind::VllmPd, UpstreamKind::SglangPd, UpstreamKind::TrtllmPd]
                .into_iter()
                .any(|k| up(Some(k), Role::Prefill) && up(Some(k), Role::Decode))
            // vLLM decode servers also serve alone (the prefill-failure fallback).
            || up(Some(UpstreamKind::VllmPd), Role::Decode)
    }

    fn in_flight(&self) -> usize {
        self.inner.requests.load(Ordering::Relaxed)
    }

    fn forwards(&self) -> bool {
        true
    }
}

struct State {
    members: Vec<Member>,
    prefixes: PrefixIndex,
    view: watch::Sender<Vec<Snap>>,
    client: reqwest::Client,
    api_key: Option<String>,
}

impl State {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        while let Some(cmd) = rx.recv().await {
            // The view changes with the members and their ejections, not with every request
            // routed or every leg that went well (it was rebuilt and sent for each).
            if self.handle(cmd) {
                self.publish();
            }
        }
    }

    fn publish(&self) {
        let snaps = self
            .members
            .iter()
            .map(|m| Snap { ep: Arc::clone(&m.ep), ejected_until: m.ejected_until })
            .collect();
        self.view.send_replace(snaps);
    }

    fn find(&mut self, url: &str) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.ep.url() == url)
    }

    fn add(&mut self, spec: UpstreamSpec, source: Source) -> Added {
        if let Some(m) = self.find(&spec.url) {
            let s = &m.ep.spec;
            return if s.kind == spec.kind && s.role == spec.role {
                Added::Known
            } else {
                Added::Conflict(format!("{} is registered as a {} {} upstream", s.url, s.kind, s.role))
            };
        }
        if self.members.len() >= MAX_UPSTREAMS {
            return Added::Full;
        }
        let key = spec.api_key.clone().or_else(|| self.api_key.clone());
        let ep = match Endpoint::start(spec, self.client.clone(), key) {
            Ok(ep) => ep,
            Err(why) => return Added::Conflict(why),
        };
        let spec = &ep.spec;
        tracing::info!(upstream = %spec.url, kind = %spec.kind, role = %spec.role, "upstream added");
        self.members.push(Member { ep, source, failures: 0, ejections: 0, ejected_until: None });
        Added::Added
    }

    fn remove(&mut self, url: &str) -> bool {
        let before = self.members.len();
        let pool = self.members.iter().find(|m| m.ep.url() == url).and_then(pool_key);
        self.members.retain(|m| m.ep.url() != url);
        self.prefixes.forget(url);
        // A pool no member names any more is forgotten too.
        if let Some(k) = pool.filter(|k| !self.members.iter().any(|m| pool_key(m).as_ref() == Some(k))) {
            self.prefixes.forget(&k);
        }
        before != self.members.len()
    }

    /// Carries out `cmd`; whether the members or their ejections may have changed.
    fn handle(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Add { spec, source, reply } => {
                let outcome = self.add(spec, source);
                if let Some(r) = reply {
                    let _ = r.send(outcome);
                }
            }
            Cmd::Remove { url, reply } => {
                let _ = reply.send(self.remove(&url));
            }
            Cmd::Sync { source, specs } => {
                let gone: Vec<String> = self
                    .members
                    .iter()
                    .filter(|m| m.source == source && !specs.iter().any(|s| s.url == m.ep.url()))
                    .map(|m| m.ep.url().to_owned())
                    .collect();
                for url in gone {
                    tracing::info!(upstream = %url, "upstream no longer resolved: removed");
                    self.remove(&url);
                }
                for spec in specs {
                    if let Added::Conflict(why) = self.add(spec, source.clone()) {
                        tracing::warn!("discovered upstream not added: {why}");
                    }
                }
            }
            Cmd::Route { prompt, scope, avoid, reply } => {
                let _ = reply.send(self.route(&prompt, scope.as_deref(), &avoid));
                return false;
            }
            Cmd::Outcome { url, ok } => {
                let Some(m) = self.find(&url) else { return false };
                let before = m.ejected_until;
                if ok {
                    m.failures = 0;
                    m.ejections = 0;
                    m.ejected_until = None;
                } else {
                    m.failures = m.failures.saturating_add(1);
                    if m.failures >= EJECT_AFTER {
                        let pause = EJECTION.saturating_mul(1 << m.ejections.min(5)).min(MAX_EJECTION);
                        m.ejections = m.ejections.saturating_add(1);
                        m.ejected_until = Some(Instant::now() + pause);
                        tracing::warn!(upstream = %url, failures = m.failures, seconds = pause.as_secs(), "upstream ejected");
                    }
                }
                return m.ejected_until != before;
            }
            Cmd::List { reply } => {
                let now = Instant::now();
                let views = self
                    .members
                    .iter()
                    .map(|m| UpstreamView {
                        url: m.ep.url().to_owned(),
                        kind: m.ep.spec.kind.to_string(),
                        role: m.ep.spec.role.to_string(),
                        kv_pool: m.ep.spec.kv_pool.clone(),
                        healthy: m.ep.is_healthy(),
                        ejected_for_s: m
                            .ejected_until
                            .map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64()),
                        failures: m.failures,
                        in_flight: m.ep.in_flight(),
                        source: match &m.source {
                            Source::Static => "static".into(),
                            Source::Admin => "admin".into(),
                            Source::Dns(name) => format!("dns:{name}"),
                        },
                    })
                    .collect();
                let _ = reply.send(views);
                return false;
            }
        }
        true
    }

    fn route(&mut self, prompt: &[u32], scope: Option<&str>, avoid: &[String]) -> Option<Pick> {
        let now = Instant::now();
        let hashes = PrefixIndex::hashes(prompt, scope);
        let usable = |m: &Member, kind: Option<UpstreamKind>, role: Role| {
            m.routable(now)
                && m.ep.spec.role == role
                && kind.is_none_or(|k| m.ep.spec.kind == k)
                && !avoid.iter().any(|a| a == m.ep.url())
        };
        let cache_pick = |st: &Self, ok: &dyn Fn(&Member) -> bool| -> Option<Arc<Endpoint>> {
            let cands: Vec<Candidate<'_>> = st
                .members
                .iter()
                .filter(|m| ok(m))
                .map(|m| {
                    // What was sent here counts twice; what went to another member of its KV
                    // pool once (a load from the pool, not a computation, but not free either).
                    let own = st.prefixes.matched(m.ep.url(), &hashes);
                    let pool = pool_key(m).map_or(0, |k| st.prefixes.matched(&k, &hashes));
                    Candidate {
                        key: m.ep.url(),
                        load: m.ep.busy(),
                        matched: 2 * own + pool.saturating_sub(own),
                    }
                })
                .collect();
            let url = cache_aware(&cands)?;
            st.members.iter().find(|m| m.ep.url() == url).map(|m| Arc::clone(&m.ep))
        };
        let least_busy = |st: &Self, ok: &dyn Fn(&Member) -> bool| -> Option<Arc<Endpoint>> {
            st.members
                .iter()
                .filter(|m| ok(m))
                .min_by(|a, b| {
                    let key = |m: &Member| (m.ep.busy(), m.ep.load().kv_usage.unwrap_or(0.0));
                    let (ka, kb) = (key(a), key(b));
                    ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
                })
                .map(|m| Arc::clone(&m.ep))
        };
        let mut pick = None;
        for kind in [UpstreamKind::VllmPd, UpstreamKind::SglangPd, UpstreamKind::TrtllmPd] {
            let p = cache_pick(self, &|m| usable(m, Some(kind), Role::Prefill));
            let d = least_busy(self, &|m| usable(m, Some(kind), Role::Decode));
            if let (Some(prefill), Some(decode)) = (p, d) {
                pick = Some(Pick::Pair { prefill, decode });
                break;
            }
        }
        let pick = pick
            .or_else(|| cache_pick(self, &|m| usable(m, None, Role::Both)).map(Pick::One))
            // No prefill server: a vLLM decode server computes the prompt itself.
            .or_else(|| {
                least_busy(self, &|m| usable(m, Some(UpstreamKind::VllmPd), Role::Decode)).map(Pick::One)
            })?;
        let first = match &pick {
            Pick::One(e) => e.url().to_owned(),
            Pick::Pair { prefill, .. } => prefill.url().to_owned(),
        };
        self.prefixes.remember(&first, &hashes);
        if let Some(k) = self.members.iter().find(|m| m.ep.url() == first).and_then(pool_key) {
            self.prefixes.remember(&k, &hashes);
        }
        Some(pick)
    }
}

/// The prefix index's key for the KV pool a member reads (no URL starts with `pool:`).
fn pool_key(m: &Member) -> Option<String> {
    m.ep.spec.kv_pool.as_ref().map(|p| format!("pool:{p}"))
}
