//! The worker process's listener: one task per connection; the first message says what the
//! connection is (a request from the gateway, a stats poll, or an incoming KV transfer).
//!
//! Request connections stay open for the request's life. The server watches both directions at
//! once: events from the batcher go out, and a read that ends (the gateway closed the
//! connection) drops the request's stream, which cancels it in the batcher and frees its blocks.
//! In prefill mode a second, outgoing connection carries the KV to the decode worker while the
//! prefill is still running (blocks leave as they fill); its duration after the prefill ended is
//! what the timeline reports as `kv_transfer`.

use super::{read_control, sampler_pos, sampler_state, sampling_params, stats_msg, usage_msg, write_control};
use crate::{Role, WorkEvent, WorkMode, WorkRequest, WorkerError, WorkerHandle};
use std::time::{Duration, Instant};
use tokenpath_protocol::cluster::{FromWorker, GenerateMsg, KvChunk, Mode, RejectKind, ToWorker, TransferId};
use tokenpath_protocol::frame::{read_frame, write_frame_parts, FrameKind, MAX_KV_CHUNK_BYTES};
use tokenpath_protocol::ProtocolError;
use tokenpath_timeline::RequestId;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How long a new connection may take to say what it is.
const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Target size of one KV frame.
const KV_FRAME_TARGET_BYTES: usize = 2 << 20;

/// What a worker process serves.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The worker's role; requests for another part of the path are refused.
    pub role: Role,
    /// Testing only: corrupt one byte of every outgoing KV transfer after its checksum was
    /// computed, so the decode worker's fallback can be exercised through real processes.
    pub fault_corrupt_kv: bool,
}

/// Serves `handle` on `listener` until the listener fails.
pub async fn serve(
    listener: TcpListener,
    handle: WorkerHandle,
    config: ServerConfig,
) -> Result<(), WorkerError> {
    loop {
        let (stream, peer) = listener.accept().await.map_err(WorkerError::Spawn)?;
        // A request's clock on this worker starts when its connection arrives, not when a busy
        // core got round to reading it.
        let accepted = Instant::now();
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        let config = config.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(stream, accepted, &handle, &config).await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
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
) -> Result<(), ProtocolError> {
    let (mut rd, mut wr) = stream.into_split();
    let first = tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, read_control::<_, ToWorker>(&mut rd))
        .await
        .map_err(|_| ProtocolError::Connection { message: "no first message in time".into() })??;
    match first {
        None => Ok(()),
        Some(ToWorker::Stats) => {
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
            write_control(&mut wr, &FromWorker::Stats(msg)).await
        }
        Some(ToWorker::Generate(msg)) => generate(msg, accepted, rd, wr, handle, config).await,
        Some(ToWorker::KvBegin { transfer, n_tokens, layout }) => {
            receive_kv(transfer, n_tokens, layout, rd, wr, handle).await
        }
        Some(other) => {
            Err(ProtocolError::InvalidFrame { message: format!("unexpected first message {other:?}") })
        }
    }
}

fn reject_of(e: &WorkerError) -> (RejectKind, String) {
    let kind = match e {
        WorkerError::Overloaded { .. } => RejectKind::Overloaded,
        WorkerError::ContextOverflow { .. } => RejectKind::ContextOverflow,
        WorkerError::InvalidRequest(_) => RejectKind::Invalid,
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
) -> Result<(), ProtocolError> {
    if !accepts(config.role, &msg.mode) {
        let message = format!("a {} worker does not run {:?} requests", config.role, msg.mode);
        return write_control(&mut wr, &FromWorker::Rejected { kind: RejectKind::Invalid, message }).await;
    }
    let now = accepted;
    let mode = match &msg.mode {
        Mode::Full => WorkMode::Full,
        Mode::Prefill { .. } => WorkMode::Prefill,
        Mode::Decode { transfer } => WorkMode::Decode(transfer.0),
    };
    let prompt_len = msg.prompt.len();
    let req = WorkRequest {
        id: RequestId(msg.id),
        prompt: msg.prompt,
        sampling: sampling_params(&msg.sampling),
        max_tokens: msg.max_tokens,
        stop: msg.stop,
        ignore_eos: msg.ignore_eos,
        arrived: now,
        admitted: now,
        mode,
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
        Mode::Prefill { transfer, decode_addr } => {
            Some(KvSender::start(*transfer, decode_addr.clone(), prompt_len, handle, config.fault_corrupt_kv))
        }
        _ => None,
    };
    loop {
        tokio::select! {
            event = stream.next() => {
                let Some(event) = event else {
                    return write_control(&mut wr, &FromWorker::Failed { message: "the worker stopped".into() }).await;
                };
                match event {
                    WorkEvent::Text { delta, tokens } => write_control(&mut wr, &FromWorker::Text { delta, tokens }).await?,
                    WorkEvent::Kv { first_block, bytes } => {
                        if let Some(kv) = &kv {
                            kv.chunk(first_block, bytes);
                        }
                    }
                    WorkEvent::Handoff { first_token, sampler, usage, timing, at } => {
                        let ended = at;
                        let result = kv.take().map(|k| k.finish());
                        write_control(&mut wr, &FromWorker::Handoff {
                            first_token,
                            sampler: sampler_pos(sampler),
                            timing,
                            usage: usage_msg(usage),
                        }).await?;
                        let (ok, bytes, held_ms) = match result {
                            Some(rx) => rx.await.unwrap_or((false, 0, 0.0)),
                            None => (false, 0, 0.0),
                        };
                        let ms = (ended.elapsed().as_secs_f64() * 1e3 - held_ms).max(0.0);
                        return write_control(&mut wr, &FromWorker::KvSent { ok, ms, bytes }).await;
                    }
                    WorkEvent::Finished { reason, usage, timing } => {
                        return write_control(&mut wr, &FromWorker::Finished { reason, usage: usage_msg(usage), timing }).await;
                    }
                    WorkEvent::Failed { message } => {
                        return write_control(&mut wr, &FromWorker::Failed { message }).await;
                    }
                }
            }
            incoming = read_control::<_, ToWorker>(&mut rd) => {
                match incoming {
                    Ok(Some(ToWorker::Handoff { first_token, sampler })) => {
                        if let WorkMode::Decode(t) = mode {
                            if handle.handoff(t, first_token, sampler_state(sampler)).is_err() {
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

/// The outgoing half of a KV transfer: a task that owns the connection to the decode worker.
pub(crate) struct KvSender {
    chunks: mpsc::UnboundedSender<(u32, Vec<u8>)>,
    done: tokio::sync::oneshot::Sender<()>,
    result: tokio::sync::oneshot::Receiver<(bool, u64, f64)>,
}

impl KvSender {
    pub(crate) fn start(
        transfer: TransferId,
        addr: String,
        n_tokens: usize,
        handle: &WorkerHandle,
        corrupt: bool,
    ) -> Self {
        let (chunks, rx) = mpsc::unbounded_channel();
        let (done, done_rx) = tokio::sync::oneshot::channel();
        let (res_tx, result) = tokio::sync::oneshot::channel();
        let l = handle.kv_layout();
        let layout = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
        let block_bytes = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
        tokio::spawn(async move {
            let r = send_kv(transfer, &addr, n_tokens, layout, block_bytes, rx, done_rx, corrupt).await;
            let verdict = match r {
                Ok((b, held)) => (true, b, held),
                Err(e) => {
                    tracing::warn!(transfer = transfer.0, "KV transfer to {addr} failed: {e}");
                    (false, 0, 0.0)
                }
            };
            let _ = res_tx.send(verdict);
        });
        Self { chunks, done, result }
    }

    pub(crate) fn chunk(&self, first_block: u32, bytes: Vec<u8>) {
        let _ = self.chunks.send((first_block, bytes));
    }

    /// Every block was handed over; the receiver resolves with (acknowledged, bytes).
    pub(crate) fn finish(self) -> tokio::sync::oneshot::Receiver<(bool, u64, f64)> {
        let _ = self.done.send(());
        self.result
    }
}

#[allow(clippy::too_many_arguments)]
async fn send_kv(
    transfer: TransferId,
    addr: &str,
    n_tokens: usize,
    layout: [u32; 3],
    block_bytes: usize,
    mut chunks: mpsc::UnboundedReceiver<(u32, Vec<u8>)>,
    mut done: tokio::sync::oneshot::Receiver<()>,
    corrupt: bool,
) -> Result<(u64, f64), ProtocolError> {
    let conn =
        TcpStream::connect(addr).await.map_err(|e| ProtocolError::Connection { message: e.to_string() })?;
    let _ = conn.set_nodelay(true);
    let (mut rd, mut wr) = conn.into_split();
    let n = u32::try_from(n_tokens).unwrap_or(u32::MAX);
    write_control(&mut wr, &ToWorker::KvBegin { transfer, n_tokens: n, layout }).await?;
    // Frames of about 2 MB: small enough that the checksums, the socket copies and the import overlap
    // across the two ends, large enough that per-frame costs vanish.
    let frame =
        KV_FRAME_TARGET_BYTES.min(MAX_KV_CHUNK_BYTES as usize) - tokenpath_protocol::cluster::KV_TRAILER;
    let per_frame = (frame / block_bytes.max(1)).max(1);
    let (mut frames, mut bytes_sent) = (0u32, 0u64);
    let mut finished = false;
    loop {
        let next = if finished {
            chunks.try_recv().ok()
        } else {
            tokio::select! {
                c = chunks.recv() => c,
                r = &mut done => {
                    if r.is_err() {
                        return Err(ProtocolError::Connection { message: "the request ended before its handoff".into() });
                    }
                    finished = true;
                    continue;
                }
            }
        };
        let Some((first_block, bytes)) = next else {
            if finished {
                break;
            }
            continue;
        };
        for (i, part) in bytes.chunks(per_frame * block_bytes).enumerate() {
            let n_blocks = (part.len() / block_bytes.max(1)) as u32;
            let trailer = KvChunk::trailer(transfer, first_block + (i * per_frame) as u32, n_blocks);
            if corrupt && frames == 0 {
                // Header (and checksum) of the true payload, then one flipped byte on the wire.
                let mut bad = part.to_vec();
                bad.extend_from_slice(&trailer);
                let header = tokenpath_protocol::frame::FrameHeader::for_payload(FrameKind::KvChunk, &bad)?;
                bad[0] ^= 0x5a;
                let io = |e: std::io::Error| ProtocolError::Connection { message: e.to_string() };
                wr.write_all(&header.encode()).await.map_err(io)?;
                wr.write_all(&bad).await.map_err(io)?;
            } else {
                write_frame_parts(&mut wr, FrameKind::KvChunk, &[part, &trailer]).await?;
            }
            frames += 1;
            bytes_sent += part.len() as u64;
        }
    }
    write_control(&mut wr, &ToWorker::KvEnd { transfer, chunks: frames }).await?;
    match read_control::<_, FromWorker>(&mut rd).await? {
        Some(FromWorker::KvAck { ok: true, held_ms, .. }) => Ok((bytes_sent, held_ms)),
        Some(FromWorker::KvAck { ok: false, message, .. }) => Err(ProtocolError::Connection {
            message: format!("the decode worker refused the transfer: {}", message.unwrap_or_default()),
        }),
        other => {
            Err(ProtocolError::Connection { message: format!("expected an acknowledgement, got {other:?}") })
        }
    }
}

/// The incoming half: verifies every frame, hands blocks to the batcher, acknowledges.
async fn receive_kv(
    transfer: TransferId,
    n_tokens: u32,
    layout: [u32; 3],
    mut rd: OwnedReadHalf,
    mut wr: OwnedWriteHalf,
    handle: &WorkerHandle,
) -> Result<(), ProtocolError> {
    let l = handle.kv_layout();
    let ours = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
    let block_bytes = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
    let expected_blocks = (n_tokens as usize).div_ceil(l.block_size);
    let mut problem =
        (layout != ours).then(|| format!("KV layout {layout:?} does not match this worker's {ours:?}"));
    let (mut frames, mut blocks) = (0u32, 0usize);
    while problem.is_none() {
        match read_frame(&mut rd).await {
            Ok(Some((FrameKind::KvChunk, payload))) => match KvChunk::decode(payload, block_bytes) {
                Ok(c) if c.transfer == transfer => {
                    frames += 1;
                    blocks += c.n_blocks as usize;
                    if handle.kv_chunk(transfer.0, c.first_block, c.bytes).is_err() {
                        problem = Some("the worker stopped".into());
                    }
                }
                Ok(_) => problem = Some("a chunk of another transfer".into()),
                Err(e) => problem = Some(e.to_string()),
            },
            Ok(Some((FrameKind::Control, payload))) => {
                match tokenpath_protocol::cluster::decode_control::<ToWorker>(&payload) {
                    Ok(ToWorker::KvEnd { transfer: t, chunks }) if t == transfer => {
                        if chunks != frames || blocks != expected_blocks {
                            problem = Some(format!(
                                "{frames} chunks / {blocks} blocks arrived, {chunks} chunks / {expected_blocks} blocks expected"
                            ));
                        }
                        break;
                    }
                    Ok(other) => problem = Some(format!("unexpected {other:?} in a transfer")),
                    Err(e) => problem = Some(e.to_string()),
                }
            }
            Ok(None) => problem = Some("the connection closed before the transfer ended".into()),
            Err(e) => problem = Some(e.to_string()),
        }
    }
    let verdict = match handle.kv_end(transfer.0, n_tokens as usize, problem.is_none()) {
        Ok(rx) => rx.await.unwrap_or_else(|_| Err("the worker stopped".into())),
        Err(e) => Err(e.to_string()),
    };
    let verdict = match (problem, verdict) {
        (Some(p), _) => Err(p),
        (None, v) => v,
    };
    let held_ms = verdict.as_ref().map_or(0.0, |at| at.elapsed().as_secs_f64() * 1e3);
    let ack = FromWorker::KvAck { ok: verdict.is_ok(), message: verdict.err(), held_ms };
    write_control(&mut wr, &ack).await
}
