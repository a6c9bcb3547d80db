//! The gateway's multi-process backend: workers in other processes (or hosts), colocated or
//! prefill/decode-disaggregated, reached over the worker protocol.
//!
//! [`Cluster::submit`] turns one admitted request into a [`WorkStream`] — the same type a local
//! worker returns — so the HTTP layer does not know which backend it talks to. Behind it, a task
//! per request drives the PD flow: open the decode worker (blocks reserved), open the prefill
//! worker (told where to push the KV), forward the first token the moment it exists, hand the
//! sampler position to the decode worker, forward its tokens, and assemble one timeline from the
//! durations each process measured on its own clock. A worker that cannot be reached before the
//! request started is marked down and another is tried; one that dies mid-stream ends the stream
//! with an error event (never a hang) and is marked down.

pub mod client;
pub mod registry;

pub use registry::{Registry, Route, WorkerView};

use client::RemoteRequest;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_protocol::backend::{Backend, BoxFuture, ModelInfo};
use tokenpath_protocol::cluster::{FromWorker, GenerateMsg, Mode, ToWorker, TransferId, TransferToken};
use tokenpath_protocol::sampling::SamplerState;
use tokenpath_protocol::work::{
    validate_request, StreamSender, TokenMeter, TokenUsage, WorkEvent, WorkRequest, WorkStream, WorkerStats,
};
use tokenpath_protocol::ProtocolError;
use tokenpath_timeline::{ms, FinishReason, ServerTiming, Stage};

/// How long opening a request on a worker may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// How many workers a request tries before giving up (dead ones are skipped).
const MAX_ATTEMPTS: usize = 3;
/// How long the gateway waits for the prefill worker's transfer report after the decode ended.
const KV_REPORT_WAIT: Duration = Duration::from_secs(2);

/// Remote workers behind one gateway.
#[derive(Debug)]
pub struct Cluster {
    registry: Registry,
    model: ModelInfo,
}

impl Cluster {
    /// A cluster over `registry`, whose workers all serve a model with these limits.
    pub fn new(registry: Registry, model: ModelInfo) -> Self {
        Self { registry, model }
    }

    /// The registry (health, registration, routing).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Routes and starts `work`; errors before any token are returned, later ones arrive as
    /// [`WorkEvent::Failed`] on the stream.
    pub async fn submit(&self, work: WorkRequest) -> Result<WorkStream, ProtocolError> {
        validate_request(&work, self.model.n_ctx, self.model.n_vocab)?;
        let mut avoid = Vec::new();
        let mut last_err = ProtocolError::Overloaded { max: 0 };
        for _ in 0..MAX_ATTEMPTS {
            let route =
                match self.registry.route(&work.prompt, work.cache_scope.as_deref(), avoid.clone()).await {
                    Ok(route) => route,
                    // Every worker left was tried: what they said, not that none is left.
                    Err(ProtocolError::NoWorker) if !avoid.is_empty() => return Err(last_err),
                    Err(e) => return Err(e),
                };
            match self.start(&work, &route).await {
                Ok(stream) => return Ok(stream),
                Err((failed, e)) => {
                    release(&self.registry, &route);
                    match failed {
                        // Full (no queue slot, no KV room for the prompt): another may not be.
                        Some(addr) if matches!(e, ProtocolError::Overloaded { .. }) => {
                            tracing::debug!(addr = ?addr, "worker full, trying another");
                            avoid.push(addr);
                            last_err = e;
                        }
                        Some(addr) => {
                            tracing::warn!(addr = ?addr, "worker unreachable, trying another: {e}");
                            self.registry.mark_down(&addr);
                            avoid.push(addr);
                            last_err = e;
                        }
                        None => return Err(e),
                    }
                }
            }
        }
        Err(last_err)
    }

    /// Opens the route's connections. On failure: which worker was unreachable (to avoid) or
    /// `None` when the worker refused (overloaded, invalid: no point trying another).
    async fn start(
        &self,
        work: &WorkRequest,
        route: &Route,
    ) -> Result<WorkStream, (Option<String>, ProtocolError)> {
        let msg = |mode: Mode| GenerateMsg {
            id: work.id.0,
            prompt: work.prompt.clone(),
            sampling: work.sampling.clone(),
            max_tokens: work.max_tokens,
            stop: work.stop.clone(),
            ignore_eos: work.ignore_eos,
            mode,
            cache_scope: work.cache_scope.clone(),
            // The worker's spans go under the gateway's root span (a worker of an older build
            // refuses the field: upgrade gateway and workers together, docs/engine-spans.md).
            trace: work.trace,
        };
        let secret = self.registry.secret();
        let open = |addr: String, mode: Mode| async move {
            RemoteRequest::open(&addr, secret, msg(mode), OPEN_TIMEOUT).await.map_err(|e| match e {
                ProtocolError::Unavailable { .. } | ProtocolError::Overloaded { .. } => (Some(addr), e),
                other => (None, other),
            })
        };
        let (tx, stream) = WorkStream::channel(work.id);
        let mut clock = Clock { arrived: work.arrived, admitted: work.admitted, dispatched: Instant::now() };
        match route {
            Route::Colocated(addr) => {
                clock.dispatched = Instant::now();
                let conn = open(addr.clone(), Mode::Full).await?;
                let registry = self.registry.clone();
                let addr = addr.clone();
                let meter = work.meter.clone();
                tokio::spawn(async move {
                    pump_colocated(conn, &tx, clock, &registry, meter).await;
                    registry.done(&addr);
                });
            }
            Route::Disaggregated { prefill, decode } => {
                // Random id and token per transfer: only the two workers of this request learn
                // them, and only the token lets a `KvBegin` deliver KV.
                let fresh = TransferId::random().and_then(|t| Ok((t, TransferToken::random()?)));
                let (transfer, token) =
                    fresh.map_err(|e| (None, ProtocolError::Unavailable { message: e.to_string() }))?;
                let dconn = open(decode.clone(), Mode::Decode { transfer, token }).await?;
                clock.dispatched = Instant::now();
                let mode = Mode::Prefill { transfer, token, decode_addr: decode.clone() };
                let pconn = open(prefill.clone(), mode).await?;
                let registry = self.registry.clone();
                let (p, d) = (prefill.clone(), decode.clone());
                let meter = work.meter.clone();
                tokio::spawn(async move {
                    pump_disaggregated(pconn, dconn, &tx, clock, &registry, meter).await;
                    registry.done(&p);
                    registry.done(&d);
                });
            }
        }
        Ok(stream)
    }
}

impl Backend for Cluster {
    fn submit(&self, work: WorkRequest) -> BoxFuture<'_, Result<WorkStream, ProtocolError>> {
        Box::pin(Cluster::submit(self, work))
    }

    fn model(&self) -> ModelInfo {
        self.model
    }

    /// The sum over the workers that answered their last poll.
    fn stats(&self) -> WorkerStats {
        let mut sum = WorkerStats::default();
        for w in self.registry.workers().iter().filter(|w| w.up) {
            if let Some(s) = &w.stats {
                sum.add(&s.stats);
            }
        }
        sum
    }

    fn is_ready(&self) -> bool {
        self.registry.is_ready()
    }

    fn in_flight(&self) -> usize {
        self.registry.workers().iter().fold(0usize, |a, w| a.saturating_add(w.in_flight))
    }
}

fn release(registry: &Registry, route: &Route) {
    match route {
        Route::Colocated(a) => registry.done(a),
        Route::Disaggregated { prefill, decode } => {
            registry.done(prefill);
            registry.done(decode);
        }
    }
}

/// The gateway's own marks of one request.
#[derive(Clone, Copy)]
struct Clock {
    arrived: Instant,
    admitted: Instant,
    /// When the request left for the worker that runs its prefill (routing and, in PD, the
    /// decode worker's reservation happen before): this part of the wait for a prefill slot is
    /// the gateway's, and is added to the `queue` stage.
    dispatched: Instant,
}

impl Clock {
    /// The gateway's stage, TTFT and E2E — its own marks through the timeline's one definition
    /// of each (invariant 1) — then every stage the workers measured.
    fn assemble(
        &self,
        first_token: Option<Instant>,
        reason: FinishReason,
        parts: &[&ServerTiming],
    ) -> ServerTiming {
        let since = |i: Instant| i.saturating_duration_since(self.arrived).as_nanos() as u64;
        let mut t = ServerTiming::gateway_part(
            since(self.admitted),
            first_token.map(since),
            since(Instant::now()),
            reason,
        );
        for p in parts {
            let mut p = (*p).clone();
            p.stages_ms.remove(&Stage::Gateway);
            t.absorb(&p);
        }
        let dispatch = ms(self.dispatched.saturating_duration_since(self.admitted).as_nanos() as u64);
        *t.stages_ms.entry(Stage::Queue).or_insert(0.0) += dispatch;
        t
    }
}

/// A worker's stages, those it says it sent the spans of itself marked as exported.
fn exported(mut timing: ServerTiming, spans: Vec<Stage>) -> ServerTiming {
    timing.exported.extend(spans);
    timing
}

fn fail(tx: &StreamSender, message: String) {
    let _ = tx.send(WorkEvent::Failed { message });
}

/// How a worker connection's part of a request ended, after [`relay`].
enum Relayed {
    /// The request finished on this worker.
    Finished(FinishReason, TokenUsage, ServerTiming),
    /// The prefill worker handed off: first token, sampler position, its stages and usage.
    Handoff(u32, SamplerState, ServerTiming, TokenUsage),
    /// Cancelled by the client, or already failed (the error event is sent, a dead worker
    /// marked down): nothing left to do.
    Over,
}

/// Forwards `conn`'s text to the client (noting the first token's time in `first`) until the
/// worker finishes or hands off. Every other ending is handled here, once for all pumps.
async fn relay(
    conn: &mut RemoteRequest,
    tx: &StreamSender,
    first: &mut Option<Instant>,
    registry: &Registry,
    meter: Option<&dyn TokenMeter>,
) -> Relayed {
    loop {
        // The client's pace reaches the worker: with its reader behind, this stops reading the
        // worker's socket, the worker's writes wait, and its batcher pauses the sequence.
        tokio::select! {
            () = tx.room() => {}
            () = tx.closed() => return Relayed::Over,
        }
        let event = tokio::select! {
            r = conn.next() => r,
            () = tx.closed() => return Relayed::Over,
        };
        match event {
            Ok(Some(FromWorker::Text { delta, tokens })) => {
                first.get_or_insert_with(Instant::now);
                // Charged as the worker produced them (it produces no more than the client
                // reads, give or take the socket buffers).
                if let Some(m) = meter {
                    m.generated(tokens);
                }
                let _ = tx.send(WorkEvent::Text { delta, tokens });
            }
            Ok(Some(FromWorker::Finished { reason, usage, timing, spans })) => {
                return Relayed::Finished(reason, usage, exported(timing, spans))
            }
            Ok(Some(FromWorker::Handoff { first_token, sampler, timing, usage, spans })) => {
                return Relayed::Handoff(first_token, sampler, exported(timing, spans), usage)
            }
            Ok(Some(FromWorker::Failed { message })) => {
                fail(tx, tokenpath_protocol::cluster::peer_message(&message));
                return Relayed::Over;
            }
            Ok(Some(other)) => {
                fail(tx, format!("unexpected message from {}: {other:?}", conn.addr()));
                return Relayed::Over;
            }
            Ok(None) | Err(_) => {
                registry.mark_down(conn.addr());
                fail(tx, format!("worker {} died mid-request", conn.addr()));
                return Relayed::Over;
            }
        }
    }
}

async fn pump_colocated(
    mut conn: RemoteRequest,
    tx: &StreamSender,
    clock: Clock,
    registry: &Registry,
    meter: Option<Arc<dyn TokenMeter>>,
) {
    let mut first = None;
    match relay(&mut conn, tx, &mut first, registry, meter.as_deref()).await {
        Relayed::Finished(reason, usage, timing) => {
            let timing = clock.assemble(first, reason, &[&timing]);
            let _ = tx.send(WorkEvent::Finished { reason, usage, timing });
        }
        Relayed::Handoff(..) => fail(tx, format!("{} handed off a colocated request", conn.addr())),
        Relayed::Over => {}
    }
}

async fn pump_disaggregated(
    mut pconn: RemoteRequest,
    mut dconn: RemoteRequest,
    tx: &StreamSender,
    clock: Clock,
    registry: &Registry,
    meter: Option<Arc<dyn TokenMeter>>,
) {
    let mut first = None;
    // Phase 1: the prefill worker, up to the handoff.
    let (ptiming, pusage) = match relay(&mut pconn, tx, &mut first, registry, meter.as_deref()).await {
        Relayed::Handoff(first_token, sampler, timing, usage) => {
            if let Err(e) = dconn.send(&ToWorker::Handoff { first_token, sampler }).await {
                registry.mark_down(dconn.addr());
                return fail(tx, format!("decode worker lost at handoff: {e}"));
            }
            first.get_or_insert_with(Instant::now);
            (timing, usage)
        }
        Relayed::Finished(reason, usage, timing) => {
            // The first token ended the request; the decode worker's reservation is dropped
            // with its connection.
            let timing = clock.assemble(first, reason, &[&timing]);
            let _ = tx.send(WorkEvent::Finished { reason, usage, timing });
            return;
        }
        Relayed::Over => return,
    };
    // The prefill worker's transfer report arrives on its own time.
    let report = tokio::spawn(async move {
        match pconn.next().await {
            Ok(Some(FromWorker::KvSent { ok, ms, bytes, spans, .. })) => Some((ok, ms, bytes, spans)),
            _ => None,
        }
    });
    // Phase 2: the decode worker.
    let abort = report.abort_handle();
    let _abort = AbortOnDrop(abort);
    match relay(&mut dconn, tx, &mut first, registry, meter.as_deref()).await {
        Relayed::Finished(reason, usage, timing) => {
            let mut kv = ServerTiming::default();
            if let Ok(Ok(Some((ok, ms, bytes, spans)))) = tokio::time::timeout(KV_REPORT_WAIT, report).await {
                if ok {
                    kv.stages_ms.insert(Stage::KvTransfer, ms);
                    kv.kv_transfer_bytes = Some(bytes);
                    kv = exported(kv, spans);
                }
            }
            let mut timing = clock.assemble(first, reason, &[&ptiming, &kv, &timing]);
            timing.cached_tokens = pusage.cached_tokens;
            let mut usage = usage;
            usage.cached_tokens = pusage.cached_tokens;
            let _ = tx.send(WorkEvent::Finished { reason, usage, timing });
        }
        Relayed::Handoff(..) => fail(tx, format!("decode worker {} tried to hand off", dconn.addr())),
        Relayed::Over => {}
    }
}

/// Aborts a task when dropped: a report that never comes does not keep its task (and the
/// prefill worker's connection) alive past the request.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
