//! The worker process's listener: one task per connection. Every connection first proves it
//! holds the cluster secret ([`tokenpath_protocol::auth`]); one that does not is closed without
//! a word. Then the first message says what the connection is (a request from the gateway, a
//! stats poll, or an incoming KV transfer).
//!
//! Request connections stay open for the request's life. The server watches both directions at
//! once: events from the batcher go out, and a read that ends (the gateway closed the
//! connection) drops the request's stream, which cancels it in the batcher and frees its blocks.
//! In prefill mode a second, outgoing connection carries the KV to the decode worker while the
//! prefill is still running (blocks leave as they fill); its duration after the prefill ended is
//! what the timeline reports as `kv_transfer`.

use super::kv::{KvSender, KvTransport, SendOptions};
use super::kv_recv::{receive_kv, ring_len, Begin};
use super::shm::{host_id, PeerRings, RingPool};
use super::{read_control, stats_msg, tcp_keepalive, write_control, KEEPALIVE};
use crate::{Role, Transfer, WorkEvent, WorkMode, WorkRequest, WorkerError, WorkerHandle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_protocol::auth::{Bytes32, ClusterSecret};
use tokenpath_protocol::cluster::{FromWorker, GenerateMsg, Mode, RejectKind, ToWorker};
use tokenpath_protocol::ProtocolError;
use tokenpath_timeline::{RequestId, ServerTiming, Stage, TraceParent};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// How long a new connection may take to authenticate and say what it is.
const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting to (and authenticating with) a decode worker for a KV transfer may take.
pub(crate) const KV_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What a worker process serves.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The worker's role; requests for another part of the path are refused.
    pub role: Role,
    /// Testing only: corrupt one byte of every outgoing KV transfer after its checksum was
    /// computed, so the decode worker's fallback can be exercised through real processes.
    pub fault_corrupt_kv: bool,
    /// How KV moves to and from workers on the same host: a shared-memory ring when possible
    /// (`Auto`, offered and asked for), or always TCP.
    pub kv_transport: KvTransport,
    /// The cluster secret every connection must prove, and this worker proves to the decode
    /// workers it sends KV to.
    pub secret: ClusterSecret,
    /// Set when the worker drains: new requests are refused (the gateway goes elsewhere), the
    /// running ones finish.
    pub draining: Arc<AtomicBool>,
    /// Where this worker's spans go (`--otlp-endpoint`): a span per stage it ran, for every
    /// request that came with a trace context.
    pub spans: Option<tokenpath_otlp::SpanExporter>,
    /// BLAKE3 of the model file, reported in every stats answer (`StatsMsg::model`).
    pub model: Option<Bytes32>,
}

/// Serves `handle` on `listener` for ever (accept errors — out of descriptors, a connection
/// reset before it was accepted — are logged and retried, never fatal).
pub async fn serve(
    listener: TcpListener,
    handle: WorkerHandle,
    config: ServerConfig,
) -> Result<(), WorkerError> {
    // A decode-capable worker that may take same-host transfers keeps a ring ready.
    let l = handle.kv_layout();
    let decodes = matches!(config.role, Role::Decode | Role::Both);
    let warm = (decodes && config.kv_transport == KvTransport::Auto && host_id().is_some())
        .then(|| ring_len(l.block_bytes()));
    let rings = Rings { own: RingPool::start(warm), peers: PeerRings::start() };
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("accept failed, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // A request's clock on this worker starts when its connection arrives, not when a busy
        // core got round to reading it.
        let accepted = Instant::now();
        let _ = stream.set_nodelay(true);
        tcp_keepalive(&stream);
        let handle = handle.clone();
        let config = config.clone();
        let rings = rings.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(stream, accepted, &handle, &config, &rings).await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
}

/// The same-host rings of one worker: those it lends to senders (as a decode worker) and its
/// mappings of those lent to it (as a prefill worker).
#[derive(Clone, Debug)]
struct Rings {
    own: RingPool,
    peers: PeerRings,
}

fn accepts(role: Role, mode: &Mode) -> bool {
    matches!(
        (role, mode),
        (Role::Both, _) | (Role::Prefill, Mode::Prefill { .. }) | (Role::Decode, Mode::Decode { .. })
    )
}

async fn connection(
    stream: TcpStream,
    accepted: Instant,
    handle: &WorkerHandle,
    config: &ServerConfig,
    rings: &Rings,
) -> Result<(), ProtocolError> {
    let (mut rd, mut wr) = stream.into_split();
    let opening = async {
        tokenpath_protocol::auth::accept(&mut rd, &mut wr, &config.secret).await?;
        read_control::<_, ToWorker>(&mut rd).await
    };
    let first = tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, opening)
        .await
        .map_err(|_| ProtocolError::Connection { message: "no first message in time".into() })??;
    match first {
        None => Ok(()),
        Some(ToWorker::Stats) => {
            if !handle.is_alive() {
                // The batcher thread is gone: no answer, so the gateway marks this worker down
                // instead of routing to a worker that cannot run anything.
                return Err(ProtocolError::Connection { message: "the batcher thread died".into() });
            }
            let s = handle.stats();
            let bs = handle.kv_layout().block_size;
            let msg = stats_msg(
                &s,
                &config.role.to_string(),
                &handle.id().0,
                handle.n_ctx(),
                bs,
                handle.in_flight(),
            );
            let msg = tokenpath_protocol::cluster::StatsMsg {
                draining: config.draining.load(Ordering::Acquire),
                model: config.model,
                ..msg
            };
            write_control(&mut wr, &FromWorker::Stats(msg)).await
        }
        Some(ToWorker::Generate(msg)) => generate(msg, accepted, rd, wr, handle, config, &rings.peers).await,
        Some(ToWorker::KvBegin { transfer, token, n_tokens, layout, same_host }) => {
            let begin = Begin { transfer: Transfer { id: transfer.0, token }, n_tokens, layout, same_host };
            receive_kv(begin, rd, wr, handle, config.kv_transport, &rings.own).await
        }
        Some(other) => {
            Err(ProtocolError::InvalidFrame { message: format!("unexpected first message {other:?}") })
        }
    }
}

/// Longest a write to the gateway may wait. The gateway stops reading while its client does
/// (the request then pauses here) and cuts such a client off after its write timeout, which
/// ends this connection; this bounds the wait on a gateway that stopped reading altogether.
pub const GATEWAY_WRITE_STALL: Duration = Duration::from_secs(120);

async fn to_gateway<W: tokio::io::AsyncWrite + Unpin>(
    wr: &mut W,
    msg: &FromWorker,
) -> Result<(), ProtocolError> {
    tokio::time::timeout(GATEWAY_WRITE_STALL, write_control(wr, msg)).await.map_err(|_| {
        ProtocolError::Connection {
            message: format!("the gateway took nothing for {} s", GATEWAY_WRITE_STALL.as_secs()),
        }
    })?
}

fn reject_of(e: &ProtocolError) -> (RejectKind, String) {
    let kind = match e {
        ProtocolError::Overloaded { .. } => RejectKind::Overloaded,
        ProtocolError::ContextOverflow { .. } => RejectKind::ContextOverflow,
        ProtocolError::InvalidRequest { .. } => RejectKind::Invalid,
        _ => RejectKind::Unavailable,
    };
    (kind, e.to_string())
}

async fn generate(
    msg: GenerateMsg,
    accepted: Instant,
    mut rd: OwnedReadHalf,
    mut wr: OwnedWriteHalf,
    handle: &WorkerHandle,
    config: &ServerConfig,
    peers: &PeerRings,
) -> Result<(), ProtocolError> {
    if !accepts(config.role, &msg.mode) {
        let message = format!("a {} worker does not run {:?} requests", config.role, msg.mode);
        return write_control(&mut wr, &FromWorker::Rejected { kind: RejectKind::Invalid, message }).await;
    }
    if config.draining.load(Ordering::Acquire) {
        let message = "the worker is draining".to_owned();
        return write_control(&mut wr, &FromWorker::Rejected { kind: RejectKind::Unavailable, message })
            .await;
    }
    if let Mode::Decode { .. } = msg.mode {
        // A decode request reserves its whole prompt's KV at once: refused now (so the gateway
        // picks another decode worker before any prefill runs) rather than failed later.
        let s = handle.stats();
        let room = s.kv_blocks_free.saturating_mul(handle.kv_layout().block_size);
        if room < msg.prompt.len() {
            let message = format!("no KV room for {} prompt tokens ({room} free)", msg.prompt.len());
            return write_control(&mut wr, &FromWorker::Rejected { kind: RejectKind::Overloaded, message })
                .await;
        }
    }
    let now = accepted;
    let mode = match &msg.mode {
        Mode::Full => WorkMode::Full,
        Mode::Prefill { .. } => WorkMode::Prefill,
        Mode::Decode { transfer, token } => WorkMode::Decode(Transfer { id: transfer.0, token: *token }),
    };
    let prompt_len = msg.prompt.len();
    let req = WorkRequest {
        id: RequestId(msg.id),
        prompt: msg.prompt,
        sampling: msg.sampling.clone(),
        max_tokens: msg.max_tokens,
        stop: msg.stop,
        ignore_eos: msg.ignore_eos,
        arrived: now,
        admitted: now,
        mode,
        meter: None,
        cache_scope: msg.cache_scope.clone(),
        forward: None,
        trace: msg.trace,
    };
    let mut stream = match handle.submit(req) {
        Ok(s) => s,
        Err(e) => {
            let (kind, message) = reject_of(&e);
            return write_control(&mut wr, &FromWorker::Rejected { kind, message }).await;
        }
    };
    write_control(&mut wr, &FromWorker::Accepted).await?;
    let mut kv = match &msg.mode {
        Mode::Prefill { transfer, token, decode_addr } => {
            let opts = SendOptions {
                transport: config.kv_transport,
                corrupt: config.fault_corrupt_kv,
                secret: config.secret.clone(),
            };
            let to = Transfer { id: transfer.0, token: *token };
            Some(KvSender::start(to, decode_addr.clone(), prompt_len, handle, opts, peers))
        }
        _ => None,
    };
    // The gateway's messages are read by a task of their own: a frame is never half-read when
    // another branch of the loop below wins (the keepalive tick, an event), which would lose its
    // first bytes and misread the rest.
    let (in_tx, mut incoming) = tokio::sync::mpsc::channel(2);
    let reader = tokio::spawn(async move {
        loop {
            let m = read_control::<_, ToWorker>(&mut rd).await;
            let more = matches!(m, Ok(Some(_)));
            if in_tx.send(m).await.is_err() || !more {
                return;
            }
        }
    });
    let _reader = AbortOnDrop(reader.abort_handle());
    let mut alive = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    loop {
        tokio::select! {
            _ = alive.tick() => to_gateway(&mut wr, &FromWorker::KeepAlive).await?,
            event = stream.next() => {
                alive.reset();
                let Some(event) = event else {
                    return write_control(&mut wr, &FromWorker::Failed { message: "the worker stopped".into() }).await;
                };
                match event {
                    WorkEvent::Text { delta, tokens } => to_gateway(&mut wr, &FromWorker::Text { delta, tokens }).await?,
                    WorkEvent::Kv { first_block, bytes, sums } => {
                        if let Some(kv) = &kv {
                            kv.chunk(first_block, bytes, sums.0);
                        }
                    }
                    WorkEvent::Handoff { first_token, sampler, usage, timing, at } => {
                        let ended = at;
                        let result = kv.take().map(|k| k.finish());
                        // Prefill's end on the wall clock: where its spans end and the transfer's starts.
                        let prefill_end = tokenpath_otlp::unix_ns(at);
                        let spans = export(config, msg.trace, prefill_end, &timing, &[Stage::Queue, Stage::Prefill]);
                        let workers = timing.workers.clone();
                        write_control(&mut wr, &FromWorker::Handoff {
                            first_token,
                            sampler,
                            timing,
                            usage,
                            spans,
                        }).await?;
                        let sent = match result {
                            Some(rx) => rx.await.unwrap_or_default(),
                            None => Default::default(),
                        };
                        let (ok, bytes, held_ms, ring) = (sent.ok, sent.bytes, sent.held_ms, sent.ring);
                        let ms = (ended.elapsed().as_secs_f64() * 1e3 - held_ms).max(0.0);
                        let mut kv = ServerTiming::default();
                        kv.stages_ms.insert(Stage::KvTransfer, ms);
                        kv.workers = workers;
                        let end = prefill_end.saturating_add((ms * 1e6).round() as u64);
                        let spans = if ok { export(config, msg.trace, end, &kv, &[Stage::KvTransfer]) } else { Vec::new() };
                        return write_control(&mut wr, &FromWorker::KvSent { ok, ms, bytes, ring, spans }).await;
                    }
                    WorkEvent::Finished { reason, usage, timing } => {
                        let now = tokenpath_otlp::unix_ns(Instant::now());
                        // A decode worker's timing may say how its prefill went when it
                        // recomputed the prompt; those stages are the prefill worker's.
                        let ran: &[Stage] = match mode {
                            WorkMode::Decode(_) => &[Stage::DecodeQueue, Stage::Decode],
                            _ => &[Stage::Queue, Stage::Prefill, Stage::DecodeQueue, Stage::Decode],
                        };
                        let spans = export(config, msg.trace, now, &timing, ran);
                        return write_control(&mut wr, &FromWorker::Finished { reason, usage, timing, spans }).await;
                    }
                    WorkEvent::Failed { message } => {
                        return write_control(&mut wr, &FromWorker::Failed { message }).await;
                    }
                    // A batcher never relays an upstream's chunks.
                    WorkEvent::Chunk { .. } | WorkEvent::Body { .. } => {
                        return write_control(&mut wr, &FromWorker::Failed { message: "an upstream event in a worker".into() }).await;
                    }
                }
            }
            incoming = incoming.recv() => {
                match incoming.unwrap_or(Ok(None)) {
                    Ok(Some(ToWorker::Handoff { first_token, sampler })) => {
                        if let WorkMode::Decode(t) = mode {
                            if handle.handoff(t.id, first_token, sampler).is_err() {
                                return write_control(&mut wr, &FromWorker::Failed { message: "the worker stopped".into() }).await;
                            }
                        }
                    }
                    // The gateway went away (or broke the protocol): cancel by dropping the stream.
                    Ok(None) | Err(_) => {
                        tracing::debug!(request = msg.id, "gateway closed the connection; cancelling");
                        return Ok(());
                    }
                    Ok(Some(other)) => {
                        tracing::warn!(request = msg.id, "unexpected message mid-request: {other:?}");
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// Exports the spans of `stages` (those `timing` has) for a request that came with a trace
/// context, when this worker exports spans; the stages it exported.
fn export(
    config: &ServerConfig,
    trace: Option<TraceParent>,
    end_unix_ns: u64,
    timing: &ServerTiming,
    stages: &[Stage],
) -> Vec<Stage> {
    let (Some(exporter), Some(ctx)) = (&config.spans, trace) else { return Vec::new() };
    let spans = tokenpath_otlp::worker_spans(ctx, end_unix_ns, timing, stages);
    let done = stages.iter().copied().filter(|s| timing.stages_ms.contains_key(s)).collect();
    if !spans.is_empty() {
        exporter.export(spans);
    }
    done
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
