//! The worker registry and router: one task owns every fact about the cluster's workers (their
//! address, role, health, last stats, requests routed to them, and which prompt prefixes each
//! prefill worker has seen) and answers routing questions over a channel.
//!
//! Health: every worker is polled for stats every [`POLL_INTERVAL`]; a failed poll (or a request
//! that found the worker dead) marks it down, a successful poll brings it back. Workers come from
//! the cluster file at start or register at run time; adding one never touches the others.
//!
//! Routing (PD): the prefill worker with the longest cached prefix of the prompt wins, unless it
//! already carries [`BALANCE_THRESHOLD`] more requests than the least-loaded one (the choice
//! written once in [`crate::route`], shared with the HTTP upstreams). The decode worker is the one with the fewest running plus routed sequences among
//! those whose free KV blocks hold the prompt.

pub use crate::route::BALANCE_THRESHOLD;
use crate::route::{cache_aware, decode_pick, Candidate, DecodeCandidate, PrefixIndex};
use std::time::Duration;
use tokenpath_kv::BlockHash;
use tokenpath_protocol::auth::{Bytes32, ClusterSecret};
use tokenpath_protocol::cluster::StatsMsg;
use tokenpath_protocol::cluster::WorkerRole as Role;
use tokenpath_protocol::ProtocolError;
use tokio::sync::{mpsc, oneshot, watch};

/// How often workers are polled.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// How long a poll may take.
pub const POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// Most workers one gateway knows (registrations beyond are refused).
pub const MAX_WORKERS: usize = 256;
/// Longest worker address accepted (a DNS name of 253 characters and a port).
pub const MAX_ADDR_LEN: usize = 260;
/// Worker-reported counts are clamped to this at poll time: no honest worker comes near it, and
/// routing arithmetic on clamped values cannot overflow.
const STAT_CAP: u64 = 1 << 40;

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
    /// Why its last answer was refused although it came (another model file): the worker is
    /// kept down until it serves this gateway's.
    pub refused: Option<String>,
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

/// How a registration went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    /// A new worker.
    Added,
    /// Already known with this role (registering again is harmless).
    Known,
    /// Already known with another role: refused (a role flip is an outage; remove it first).
    Conflict(Role),
    /// The registry holds [`MAX_WORKERS`] already.
    Full,
}

enum Cmd {
    Register {
        addr: String,
        role: Role,
        reply: Option<oneshot::Sender<Registered>>,
    },
    Polled {
        addr: String,
        result: Box<Result<StatsMsg, String>>,
    },
    MarkDown {
        addr: String,
    },
    Done {
        addr: String,
    },
    Route {
        prompt: Vec<u32>,
        scope: Option<String>,
        avoid: Vec<String>,
        reply: oneshot::Sender<Result<Route, ProtocolError>>,
    },
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
        Self::start_for_model(workers, secret, None)
    }

    /// [`Registry::start`] for the model file whose BLAKE3 is `model`: a worker serving another
    /// file (or not saying which) is kept down, with the reason in `WorkerView::refused`.
    pub fn start_for_model(
        workers: Vec<(String, Role)>,
        secret: ClusterSecret,
        model: Option<Bytes32>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let (view_tx, view) = watch::channel(Vec::new());
        let state = State {
            workers: Vec::new(),
            prefixes: PrefixIndex::default(),
            view: view_tx,
            tx: tx.clone(),
            secret: secret.clone(),
            polling: std::collections::HashSet::new(),
            model,
        };
        tokio::spawn(state.run(rx));
        let reg = Self { tx, view, secret };
        for (addr, role) in workers {
            let _ = reg.tx.send(Cmd::Register { addr, role, reply: None });
        }
        reg
    }

    /// Adds a worker; it serves once a poll succeeds. A known address keeps its role.
    pub async fn register(&self, addr: String, role: Role) -> Result<Registered, ProtocolError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Register { addr, role, reply: Some(reply) }).map_err(|_| ProtocolError::Stopped)?;
        rx.await.map_err(|_| ProtocolError::Stopped)
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

    /// Picks the workers for `prompt`, never one of `avoid`. Prefix affinity is kept within
    /// `scope` (a tenant's prompts never steer another tenant's routing).
    pub async fn route(
        &self,
        prompt: &[u32],
        scope: Option<&str>,
        avoid: Vec<String>,
    ) -> Result<Route, ProtocolError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Route { prompt: prompt.to_vec(), scope: scope.map(str::to_owned), avoid, reply })
            .map_err(|_| ProtocolError::Stopped)?;
        rx.await.map_err(|_| ProtocolError::Stopped)?
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
    prefixes: PrefixIndex,
    view: watch::Sender<Vec<WorkerView>>,
    tx: mpsc::UnboundedSender<Cmd>,
    secret: ClusterSecret,
    /// Workers whose poll is still out: never polled twice at once, so a worker that hangs
    /// (or an address that blackholes) holds one socket, not one per tick.
    polling: std::collections::HashSet<String>,
    /// BLAKE3 of the model file this gateway tokenizes for, when it has one: a worker must
    /// report the same (`StatsMsg::model`) to be routed to.
    model: Option<Bytes32>,
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

    fn poll_all(&mut self) {
        for w in &self.workers {
            if !self.polling.insert(w.addr.clone()) {
                continue;
            }
            let addr = w.addr.clone();
            let tx = self.tx.clone();
            let secret = self.secret.clone();
            tokio::spawn(async move {
                let result =
                    super::client::stats(&addr, &secret, POLL_TIMEOUT).await.map_err(|e| e.to_string());
                let _ = tx.send(Cmd::Polled { addr, result: Box::new(result) });
            });
        }
    }

    fn find(&mut self, addr: &str) -> Option<&mut WorkerView> {
        self.workers.iter_mut().find(|w| w.addr == addr)
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { addr, role, reply } => {
                let known = self.find(&addr).map(|w| w.role);
                let outcome = match known {
                    Some(r) if r == role => Registered::Known,
                    Some(r) => Registered::Conflict(r),
                    None if self.workers.len() >= MAX_WORKERS => Registered::Full,
                    None => {
                        tracing::info!(addr = ?addr, %role, "worker registered");
                        self.workers.push(WorkerView {
                            addr,
                            role,
                            up: false,
                            stats: None,
                            in_flight: 0,
                            refused: None,
                        });
                        self.poll_all();
                        Registered::Added
                    }
                };
                if let Some(r) = reply {
                    let _ = r.send(outcome);
                }
            }
            Cmd::Polled { addr, result } => {
                self.polling.remove(&addr);
                let mut left_pool = None;
                let refusal = result.as_ref().as_ref().ok().and_then(|s| other_model(self.model, s.model));
                if let Some(w) = self.find(&addr) {
                    if w.refused != refusal {
                        if let Some(why) = &refusal {
                            tracing::warn!(addr = ?addr, "worker refused: {why}");
                        }
                        w.refused = refusal.clone();
                    }
                    match *result {
                        Ok(_) if refusal.is_some() => w.up = false,
                        Ok(s) => {
                            if !w.up {
                                tracing::info!(addr = ?addr, role = %w.role, "worker up");
                            }
                            w.up = true;
                            let before = pool_key(w);
                            w.stats = Some(clamped(s));
                            left_pool = before.filter(|k| pool_key(w).as_ref() != Some(k));
                        }
                        Err(e) => {
                            if w.up {
                                tracing::warn!(addr = ?addr, "worker down: {e}");
                            }
                            w.up = false;
                        }
                    }
                }
                // A pool no worker reports any more is forgotten: the router holds one prefix
                // index per pool in use, however often a worker's id changes.
                if let Some(old) = left_pool {
                    if !self.workers.iter().any(|o| pool_key(o).as_ref() == Some(&old)) {
                        self.prefixes.forget(&old);
                    }
                }
            }
            Cmd::MarkDown { addr } => {
                if let Some(w) = self.find(&addr) {
                    if w.up {
                        tracing::warn!(addr = ?addr, "worker down (a request found it dead)");
                    }
                    w.up = false;
                }
                self.prefixes.forget(&addr);
            }
            Cmd::Done { addr } => {
                if let Some(w) = self.find(&addr) {
                    w.in_flight = w.in_flight.saturating_sub(1);
                }
            }
            Cmd::Route { prompt, scope, avoid, reply } => {
                let _ = reply.send(self.route(&prompt, scope.as_deref(), &avoid));
            }
        }
    }

    fn route(
        &mut self,
        prompt: &[u32],
        scope: Option<&str>,
        avoid: &[String],
    ) -> Result<Route, ProtocolError> {
        let hashes = PrefixIndex::hashes(prompt, scope);
        let usable = |w: &WorkerView, role: Role| {
            w.up && w.role == role && !avoid.contains(&w.addr) && w.stats.as_ref().is_none_or(|s| !s.draining)
        };
        let prefill = self.pick_prefill(&hashes, |w| usable(w, Role::Prefill));
        let decode = self.pick_decode(prompt.len(), |w| usable(w, Role::Decode));
        let route = match (prefill, decode) {
            (Some(p), Some(d)) => Route::Disaggregated { prefill: p, decode: d },
            _ => match self.pick_prefill(&hashes, |w| usable(w, Role::Both)) {
                Some(c) => Route::Colocated(c),
                None => return Err(ProtocolError::NoWorker),
            },
        };
        let (first, second) = match &route {
            Route::Colocated(c) => (c.clone(), None),
            Route::Disaggregated { prefill, decode } => (prefill.clone(), Some(decode.clone())),
        };
        self.prefixes.remember(&first, &hashes);
        // What the first worker computes lands in its host's KV pool too: cheap for every worker
        // that shares that pool.
        if let Some(pool) = self.find(&first).and_then(|w| pool_key(w)) {
            self.prefixes.remember(&pool, &hashes);
        }
        for addr in std::iter::once(first).chain(second) {
            if let Some(w) = self.find(&addr) {
                w.in_flight = w.in_flight.saturating_add(1);
            }
        }
        Ok(route)
    }

    fn load(w: &WorkerView) -> u64 {
        (w.in_flight as u64).max(w.stats.as_ref().map_or(0, |s| s.in_flight))
    }

    fn pick_prefill(&self, hashes: &[BlockHash], ok: impl Fn(&WorkerView) -> bool) -> Option<String> {
        let candidates: Vec<Candidate<'_>> = self
            .workers
            .iter()
            .filter(|w| ok(w))
            .map(|w| {
                // A block in the worker's own arena counts twice a block it would load from its
                // host's KV pool (a copy, not a computation, but not free either).
                let arena = self.prefixes.matched(&w.addr, hashes);
                let pool = pool_key(w).map_or(0, |k| self.prefixes.matched(&k, hashes));
                Candidate {
                    key: &w.addr,
                    load: Self::load(w),
                    matched: 2 * arena + pool.saturating_sub(arena),
                }
            })
            .collect();
        cache_aware(&candidates).map(str::to_owned)
    }

    fn pick_decode(&self, prompt_len: usize, ok: impl Fn(&WorkerView) -> bool) -> Option<String> {
        let cands: Vec<DecodeCandidate<'_>> = self
            .workers
            .iter()
            .filter(|w| ok(w))
            .map(|w| DecodeCandidate {
                key: &w.addr,
                load: Self::load(w).saturating_add(w.stats.as_ref().map_or(0, |s| s.stats.running as u64)),
                room: w.stats.as_ref().map(|s| (s.stats.kv_blocks_free as u64, s.block_size)),
            })
            .collect();
        decode_pick(&cands, prompt_len).map(str::to_owned)
    }
}

/// The prefix index's key for the KV pool a worker reads (none without a pool).
fn pool_key(w: &WorkerView) -> Option<String> {
    let id = &w.stats.as_ref()?.stats.kv_pool.as_ref()?.id;
    (!id.is_empty()).then(|| format!("pool:{id}"))
}

/// A worker's stats with every count clamped to [`STAT_CAP`] and every figure finite and
/// non-negative: whatever a worker (or something answering on its port) reports, routing and
/// `/metrics` arithmetic stays in range.
/// Why a worker serving the model file `got` may not take this gateway's requests (`want`),
/// or `None` when it may: the same file, or a gateway that knows no file of its own.
fn other_model(want: Option<Bytes32>, got: Option<Bytes32>) -> Option<String> {
    let short = |d: &Bytes32| d.0[..6].iter().map(|b| format!("{b:02x}")).collect::<String>();
    match (want, got) {
        (Some(w), Some(g)) if w != g => Some(format!(
            "it serves another model file (BLAKE3 {}…) than this gateway's ({}…)",
            short(&g),
            short(&w)
        )),
        (Some(w), None) => Some(format!(
            "it does not say which model file it serves (an older build?); this gateway's is {}…",
            short(&w)
        )),
        _ => None,
    }
}

fn clamped(mut s: StatsMsg) -> StatsMsg {
    for v in [&mut s.n_ctx, &mut s.block_size, &mut s.in_flight] {
        *v = (*v).min(STAT_CAP);
    }
    s.stats.clamp(STAT_CAP);
    s.role.truncate(16);
    s.worker_id.truncate(128);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_protocol::work::WorkerStats;

    fn stats(in_flight: u64, running: u64, free: u64, bs: u64) -> StatsMsg {
        StatsMsg {
            role: "decode".into(),
            in_flight,
            block_size: bs,
            n_ctx: 4096,
            stats: WorkerStats {
                running: running as usize,
                kv_blocks_free: free as usize,
                busy_seconds: f64::NAN,
                flops: f64::INFINITY,
                ..WorkerStats::default()
            },
            ..StatsMsg::default()
        }
    }

    /// A worker that accepts a poll and never answers holds one connection, not one per tick:
    /// the next poll starts only after this one timed out ([`POLL_TIMEOUT`] > 3 ticks).
    #[tokio::test]
    async fn a_hanging_worker_is_never_polled_twice_at_once() {
        let mute = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = mute.local_addr().unwrap().to_string();
        let reg = Registry::start(Vec::new(), ClusterSecret::open());
        assert_eq!(reg.register(addr, Role::Both).await.unwrap(), Registered::Added);
        let (first, _) = mute.accept().await.unwrap();
        let window = POLL_TIMEOUT - POLL_INTERVAL;
        let mut held = vec![first];
        let deadline = tokio::time::Instant::now() + window;
        while let Ok(Ok((s, _))) = tokio::time::timeout_at(deadline, mute.accept()).await {
            held.push(s);
        }
        assert_eq!(held.len(), 1, "polls overlapped while the first was still out");
    }

    #[tokio::test]
    async fn hostile_stats_neither_panic_nor_win_the_routing() {
        let reg = Registry::start(Vec::new(), ClusterSecret::open());
        for (a, r) in
            [("127.0.0.1:1", Role::Prefill), ("127.0.0.1:2", Role::Decode), ("127.0.0.1:3", Role::Decode)]
        {
            assert_eq!(reg.register(a.into(), r).await.unwrap(), Registered::Added);
        }
        let polled = |addr: &str, s: StatsMsg| {
            let _ = reg.tx.send(Cmd::Polled { addr: addr.into(), result: Box::new(Ok(s)) });
        };
        // Nothing listens at these addresses, so the registry's own polls mark them down now
        // and then; every route that finds them up must avoid the rogue.
        let mut routed = 0;
        for _ in 0..500 {
            polled("127.0.0.1:1", stats(0, 0, 1000, 16));
            // The rogue: every count at the maximum, huge free KV, NaN time.
            polled("127.0.0.1:2", stats(u64::MAX, u64::MAX, u64::MAX, u64::MAX));
            polled("127.0.0.1:3", stats(1, 1, 1000, 16));
            if let Ok(route) = reg.route(&[1; 40], None, Vec::new()).await {
                assert_eq!(
                    route,
                    Route::Disaggregated { prefill: "127.0.0.1:1".into(), decode: "127.0.0.1:3".into() }
                );
                routed += 1;
                if routed == 5 {
                    break;
                }
            }
        }
        assert_eq!(routed, 5);
        let w = reg.workers();
        let rogue = w.iter().find(|w| w.addr == "127.0.0.1:2").and_then(|w| w.stats.clone()).unwrap();
        assert_eq!(rogue.in_flight, STAT_CAP);
        assert_eq!(rogue.stats.running as u64, STAT_CAP);
        assert_eq!(rogue.stats.busy_seconds, 0.0);
        assert_eq!(rogue.stats.flops, 0.0);
    }

    /// A session's prompt whose first worker is too busy goes to a worker that shares its
    /// host's KV pool (it loads the prefix instead of computing it), not to one on another pool.
    #[tokio::test]
    async fn a_busy_workers_session_moves_to_a_worker_on_the_same_kv_pool() {
        let reg = Registry::start(Vec::new(), ClusterSecret::open());
        // Worker 3 (another pool) registered before worker 2: without pool scoring a tie would
        // go to it.
        for a in ["127.0.0.1:1", "127.0.0.1:3", "127.0.0.1:2"] {
            assert_eq!(reg.register(a.into(), Role::Both).await.unwrap(), Registered::Added);
        }
        let on_pool = |in_flight: u64, pool: &str| {
            let mut s = stats(in_flight, 0, 1000, 16);
            s.stats.kv_pool =
                Some(Box::new(tokenpath_protocol::pool::PoolStats { id: pool.into(), ..Default::default() }));
            s
        };
        let polled = |addr: &str, s: StatsMsg| {
            let _ = reg.tx.send(Cmd::Polled { addr: addr.into(), result: Box::new(Ok(s)) });
        };
        let prompt: Vec<u32> = (0..64).collect();
        let route = |busy: u64| {
            // Nothing listens there, so the registry's own polls mark workers down now and then:
            // poll and route until all three were up for one route.
            let (reg, prompt, polled) = (&reg, &prompt, &polled);
            async move {
                for _ in 0..500 {
                    polled("127.0.0.1:1", on_pool(busy, "boot:/pools/a"));
                    polled("127.0.0.1:3", on_pool(0, "boot:/pools/b"));
                    polled("127.0.0.1:2", on_pool(0, "boot:/pools/a"));
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    if reg.workers().iter().all(|w| w.up) {
                        if let Ok(Route::Colocated(c)) = reg.route(prompt, None, Vec::new()).await {
                            reg.done(&c);
                            return c;
                        }
                    }
                }
                panic!("never routed");
            }
        };
        assert_eq!(route(0).await, "127.0.0.1:1", "the first turn: ties go to the first");
        assert_eq!(route(0).await, "127.0.0.1:1", "the next turn: its arena holds the prefix");
        let moved = route(10).await;
        assert_eq!(moved, "127.0.0.1:2", "too busy: the worker sharing its pool, not the one on another");
    }

    #[tokio::test]
    async fn a_known_address_keeps_its_role_and_the_registry_has_a_cap() {
        let reg = Registry::start(vec![("127.0.0.1:9".into(), Role::Decode)], ClusterSecret::open());
        assert_eq!(reg.register("127.0.0.1:9".into(), Role::Decode).await.unwrap(), Registered::Known);
        assert_eq!(
            reg.register("127.0.0.1:9".into(), Role::Prefill).await.unwrap(),
            Registered::Conflict(Role::Decode)
        );
        assert_eq!(
            reg.workers().iter().find(|w| w.addr == "127.0.0.1:9").map(|w| w.role),
            Some(Role::Decode)
        );
        for i in 1..MAX_WORKERS {
            assert_eq!(reg.register(format!("10.0.0.1:{i}"), Role::Both).await.unwrap(), Registered::Added);
        }
        assert_eq!(reg.register("10.0.0.2:1".into(), Role::Both).await.unwrap(), Registered::Full);
        assert_eq!(reg.workers().len(), MAX_WORKERS);
    }
}
