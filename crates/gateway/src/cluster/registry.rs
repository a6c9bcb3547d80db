//! The worker registry and router: one task owns every fact about the cluster's workers (their
//! address, role, health, last stats, requests routed to them, and which prompt prefixes each
//! prefill worker has seen) and answers routing questions over a channel.
//!
//! Health: every worker is polled for stats every [`POLL_INTERVAL`]; a failed poll (or a request
//! that found the worker dead) marks it down, a successful poll brings it back. Workers come from
//! the cluster file at start or register at run time; adding one never touches the others.
//!
//! Routing (PD): the prefill worker with the longest cached prefix of the prompt wins, unless it
//! already carries [`BALANCE_THRESHOLD`] more requests than the least-loaded one — a cache-aware
//! router without that bound sends every request sharing a hot system prompt to one worker and
//! melts it. The decode worker is the one with the fewest running plus routed sequences among
//! those whose free KV blocks hold the prompt.

use std::collections::HashMap;
use std::time::Duration;
use tokenpath_kv::{block_hashes, BlockHash, PrefixCache};
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_protocol::cluster::StatsMsg;
use tokenpath_worker::{Role, WorkerError};
use tokio::sync::{mpsc, oneshot, watch};

/// How often workers are polled.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// How long a poll may take.
pub const POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// How many more in-flight requests the prefix-preferred prefill worker may carry than the
/// least-loaded one before the router ignores the prefix.
pub const BALANCE_THRESHOLD: usize = 4;
/// Block size the router hashes prompts with (must match the workers' for prefix affinity).
const ROUTER_BLOCK: usize = 16;
/// Most prefix entries remembered per prefill worker.
const MAX_PREFIX_ENTRIES: usize = 65_536;

/// One worker as the router sees it.
#[derive(Clone, Debug)]
pub struct WorkerView {
    /// `host:port` of its listener.
    pub addr: String,
    /// Its role.
    pub role: Role,
    /// Whether its last poll (or request) succeeded.
    pub up: bool,
    /// Its last stats.
    pub stats: Option<StatsMsg>,
    /// Requests this gateway routed to it that have not ended.
    pub in_flight: usize,
}

/// Where one request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// One worker runs everything.
    Colocated(String),
    /// Prefill here, decode there.
    Disaggregated {
        /// The prefill worker.
        prefill: String,
        /// The decode worker.
        decode: String,
    },
}

enum Cmd {
    Register { addr: String, role: Role },
    Polled { addr: String, result: Result<StatsMsg, String> },
    MarkDown { addr: String },
    Done { addr: String },
    Route { prompt: Vec<u32>, avoid: Vec<String>, reply: oneshot::Sender<Result<Route, WorkerError>> },
}

/// A handle to the registry task.
#[derive(Clone, Debug)]
pub struct Registry {
    tx: mpsc::UnboundedSender<Cmd>,
    view: watch::Receiver<Vec<WorkerView>>,
    secret: ClusterSecret,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cmd")
    }
}

impl Registry {
    /// Starts the registry task (on the current runtime) with `workers`, which must prove
    /// `secret` on every connection (polls included).
    pub fn start(workers: Vec<(String, Role)>, secret: ClusterSecret) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let (view_tx, view) = watch::channel(Vec::new());
        let state = State {
            workers: Vec::new(),
            prefixes: HashMap::new(),
            view: view_tx,
            tx: tx.clone(),
            secret: secret.clone(),
        };
        tokio::spawn(state.run(rx));
        let reg = Self { tx, view, secret };
        for (addr, role) in workers {
            reg.register(addr, role);
        }
        reg
    }

    /// Adds a worker (or changes a known one's role); it serves once a poll succeeds.
    pub fn register(&self, addr: String, role: Role) {
        let _ = self.tx.send(Cmd::Register { addr, role });
    }

    /// The cluster secret its workers share.
    pub fn secret(&self) -> &ClusterSecret {
        &self.secret
    }

    /// A request found `addr` dead.
    pub fn mark_down(&self, addr: &str) {
        let _ = self.tx.send(Cmd::MarkDown { addr: addr.to_owned() });
    }

    /// A request routed to `addr` ended.
    pub fn done(&self, addr: &str) {
        let _ = self.tx.send(Cmd::Done { addr: addr.to_owned() });
    }

    /// Picks the workers for `prompt`, never one of `avoid`.
    pub async fn route(&self, prompt: &[u32], avoid: Vec<String>) -> Result<Route, WorkerError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Route { prompt: prompt.to_vec(), avoid, reply })
            .map_err(|_| WorkerError::Stopped)?;
        rx.await.map_err(|_| WorkerError::Stopped)?
    }

    /// The workers as of now.
    pub fn workers(&self) -> Vec<WorkerView> {
        self.view.borrow().clone()
    }

    /// Waits until every role the cluster needs has a worker up (or `timeout`).
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let mut rx = self.view.clone();
        tokio::time::timeout(timeout, rx.wait_for(|w| ready(w))).await.is_ok_and(|r| r.is_ok())
    }

    /// Whether requests can be served now.
    pub fn is_ready(&self) -> bool {
        ready(&self.view.borrow())
    }
}

fn ready(w: &[WorkerView]) -> bool {
    let up = |r: Role| w.iter().any(|v| v.up && v.role == r);
    up(Role::Both) || (up(Role::Prefill) && up(Role::Decode))
}

struct State {
    workers: Vec<WorkerView>,
    prefixes: HashMap<String, PrefixCache<()>>,
    view: watch::Sender<Vec<WorkerView>>,
    tx: mpsc::UnboundedSender<Cmd>,
    secret: ClusterSecret,
}

impl State {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        loop {
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                },
                _ = tick.tick() => self.poll_all(),
            }
            self.view.send_replace(self.workers.clone());
        }
    }

    fn poll_all(&self) {
        for w in &self.workers {
            let addr = w.addr.clone();
            let tx = self.tx.clone();
            let secret = self.secret.clone();
            tokio::spawn(async move {
                let result = tokenpath_worker::net::client::stats(&addr, &secret, POLL_TIMEOUT)
                    .await
                    .map_err(|e| e.to_string());
                let _ = tx.send(Cmd::Polled { addr, result });
            });
        }
    }

    fn find(&mut self, addr: &str) -> Option<&mut WorkerView> {
        self.workers.iter_mut().find(|w| w.addr == addr)
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { addr, role } => {
                tracing::info!(%addr, %role, "worker registered");
                match self.find(&addr) {
                    Some(w) => w.role = role,
                    None => {
                        self.workers.push(WorkerView { addr, role, up: false, stats: None, in_flight: 0 })
                    }
                }
                self.poll_all();
            }
            Cmd::Polled { addr, result } => {
                if let Some(w) = self.find(&addr) {
                    match result {
                        Ok(s) => {
                            if !w.up {
                                tracing::info!(%addr, role = %w.role, "worker up");
                            }
                            w.up = true;
                            w.stats = Some(s);
                        }
                        Err(e) => {
                            if w.up {
                                tracing::warn!(%addr, "worker down: {e}");
                            }
                            w.up = false;
                        }
                    }
                }
            }
            Cmd::MarkDown { addr } => {
                if let Some(w) = self.find(&addr) {
                    if w.up {
                        tracing::warn!(%addr, "worker down (a request found it dead)");
                    }
                    w.up = false;
                }
                self.prefixes.remove(&addr);
            }
            Cmd::Done { addr } => {
                if let Some(w) = self.find(&addr) {
                    w.in_flight = w.in_flight.saturating_sub(1);
                }
            }
            Cmd::Route { prompt, avoid, reply } => {
                let _ = reply.send(self.route(&prompt, &avoid));
            }
        }
    }

    fn route(&mut self, prompt: &[u32], avoid: &[String]) -> Result<Route, WorkerError> {
        let hashes = block_hashes(prompt, ROUTER_BLOCK).unwrap_or_default();
        let usable = |w: &WorkerView, role: Role| w.up && w.role == role && !avoid.contains(&w.addr);
        let prefill = self.pick_prefill(&hashes, |w| usable(w, Role::Prefill));
        let decode = self.pick_decode(prompt.len(), |w| usable(w, Role::Decode));
        let route = match (prefill, decode) {
            (Some(p), Some(d)) => Route::Disaggregated { prefill: p, decode: d },
            _ => match self.pick_prefill(&hashes, |w| usable(w, Role::Both)) {
                Some(c) => Route::Colocated(c),
                None => return Err(WorkerError::Overloaded { max: 0 }),
            },
        };
        let (first, second) = match &route {
            Route::Colocated(c) => (c.clone(), None),
            Route::Disaggregated { prefill, decode } => (prefill.clone(), Some(decode.clone())),
        };
        self.remember(&first, &hashes);
        for addr in std::iter::once(first).chain(second) {
            if let Some(w) = self.find(&addr) {
                w.in_flight += 1;
            }
        }
        Ok(route)
    }

    fn load(w: &WorkerView) -> usize {
        w.in_flight.max(w.stats.as_ref().map_or(0, |s| s.in_flight as usize))
    }

    fn pick_prefill(&self, hashes: &[BlockHash], ok: impl Fn(&WorkerView) -> bool) -> Option<String> {
        let candidates: Vec<&WorkerView> = self.workers.iter().filter(|w| ok(w)).collect();
        let least = candidates.iter().map(|w| Self::load(w)).min()?;
        let matched = |w: &WorkerView| self.prefixes.get(&w.addr).map_or(0, |p| p.matched(hashes));
        candidates
            .iter()
            .filter(|w| Self::load(w) <= least + BALANCE_THRESHOLD)
            .max_by(|a, b| matched(a).cmp(&matched(b)).then(Self::load(b).cmp(&Self::load(a))))
            .map(|w| w.addr.clone())
    }

    fn pick_decode(&self, prompt_len: usize, ok: impl Fn(&WorkerView) -> bool) -> Option<String> {
        self.workers
            .iter()
            .filter(|w| ok(w))
            .filter(|w| {
                w.stats
                    .as_ref()
                    .is_none_or(|s| s.kv_blocks_free as usize * (s.block_size.max(1) as usize) > prompt_len)
            })
            .min_by_key(|w| {
                (
                    Self::load(w) + w.stats.as_ref().map_or(0, |s| s.running as usize),
                    std::cmp::Reverse(w.stats.as_ref().map_or(0, |s| s.kv_blocks_free)),
                )
            })
            .map(|w| w.addr.clone())
    }

    fn remember(&mut self, addr: &str, hashes: &[BlockHash]) {
        let p = self.prefixes.entry(addr.to_owned()).or_default();
        let mut parent = None;
        for h in hashes {
            p.insert(parent, *h, ());
            parent = Some(*h);
        }
        while p.len() > MAX_PREFIX_ENTRIES {
            if p.evict(|()| true).is_none() {
                break;
            }
        }
    }
}
