//! The KV transfer between a prefill and a decode worker, both ends.
//!
//! Sender ([`KvSender`]): a task owning the connection to the decode worker; the batcher's
//! exports arrive on a channel while the prefill runs and leave as `KvChunk` frames of about
//! [`KV_FRAME_TARGET_BYTES`], each one vectored write (header, block bytes straight from the
//! export buffer, trailer), its checksum computed just before, so the socket copy reads bytes
//! the hash has just brought into cache.
//!
//! Receiver ([`receive_kv`]): borrows the request's reserved blocks from the batcher
//! ([`crate::KvBlocks`]) and reads every chunk's bytes straight into them, hashing each piece as
//! it lands. No receive buffer, nothing zeroed, no import copy: the bytes are copied once, by the
//! kernel, into the blocks the decode will read. Chunks must arrive in order (the sender's
//! exports are in order and TCP keeps it), which is what lets the receiver place a chunk's bytes
//! before its trailer has said where they go; the trailer is then checked against that place.
//! Until the checksum, the count of chunks and the count of blocks all agree, the blocks are
//! garbage, and any failure hands them back as such: the batcher recomputes the prompt.

use super::{read_control, write_control};
use crate::{KvBlocks, WorkerHandle};
use tokenpath_protocol::cluster::{decode_control, FromWorker, KvChunk, ToWorker, TransferId, KV_TRAILER};
use tokenpath_protocol::frame::{
    read_header, write_frame_parts, FrameHeader, FrameKind, PayloadReader, MAX_KV_CHUNK_BYTES,
};
use tokenpath_protocol::ProtocolError;
use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// Target size of one KV frame.
pub(crate) const KV_FRAME_TARGET_BYTES: usize = 2 << 20;

/// The outgoing half of a KV transfer: a task that owns the connection to the decode worker.
pub(crate) struct KvSender {
    chunks: mpsc::UnboundedSender<(u32, Vec<u8>)>,
    done: oneshot::Sender<()>,
    result: oneshot::Receiver<(bool, u64, f64)>,
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
        let (done, done_rx) = oneshot::channel();
        let (res_tx, result) = oneshot::channel();
        let l = handle.kv_layout();
        let layout = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
        let block_bytes = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
        tokio::spawn(async move {
            // Sent export buffers are freed only when the sender would wait anyway, or once the
            // verdict is out: returning tens of MB to the allocator costs milliseconds of munmap,
            // which must not sit between a transfer's frames.
            let mut spent = Vec::new();
            let r = send_kv(transfer, &addr, n_tokens, layout, block_bytes, rx, done_rx, corrupt, &mut spent)
                .await;
            let verdict = match r {
                Ok((b, held)) => (true, b, held),
                Err(e) => {
                    tracing::warn!(transfer = transfer.0, "KV transfer to {addr} failed: {e}");
                    (false, 0, 0.0)
                }
            };
            let _ = res_tx.send(verdict);
            drop(spent);
        });
        Self { chunks, done, result }
    }

    pub(crate) fn chunk(&self, first_block: u32, bytes: Vec<u8>) {
        let _ = self.chunks.send((first_block, bytes));
    }

    /// Every block was handed over; the receiver resolves with (acknowledged, bytes, the decode
    /// worker's hold time in ms).
    pub(crate) fn finish(self) -> oneshot::Receiver<(bool, u64, f64)> {
        let _ = self.done.send(());
        self.result
    }
}

fn conn_err(e: std::io::Error) -> ProtocolError {
    ProtocolError::Connection { message: e.to_string() }
}

#[allow(clippy::too_many_arguments)]
async fn send_kv(
    transfer: TransferId,
    addr: &str,
    n_tokens: usize,
    layout: [u32; 3],
    block_bytes: usize,
    mut chunks: mpsc::UnboundedReceiver<(u32, Vec<u8>)>,
    mut done: oneshot::Receiver<()>,
    corrupt: bool,
    spent: &mut Vec<Vec<u8>>,
) -> Result<(u64, f64), ProtocolError> {
    let conn = TcpStream::connect(addr).await.map_err(conn_err)?;
    let _ = conn.set_nodelay(true);
    let (mut rd, mut wr) = conn.into_split();
    let n = u32::try_from(n_tokens).unwrap_or(u32::MAX);
    write_control(&mut wr, &ToWorker::KvBegin { transfer, n_tokens: n, layout }).await?;
    let frame = KV_FRAME_TARGET_BYTES.min(MAX_KV_CHUNK_BYTES as usize) - KV_TRAILER;
    let per_frame = (frame / block_bytes.max(1)).max(1);
    let (mut frames, mut bytes_sent) = (0u32, 0u64);
    let mut finished = false;
    loop {
        if !finished && chunks.is_empty() {
            spent.clear();
        }
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
                write_corrupted(&mut wr, part, &trailer).await?;
            } else {
                write_frame_parts(&mut wr, FrameKind::KvChunk, &[part, &trailer]).await?;
            }
            frames += 1;
            bytes_sent += part.len() as u64;
        }
        spent.push(bytes);
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

/// Testing only (`fault_corrupt_kv`): the header (and checksum) of the true payload, then the
/// payload with one byte flipped.
async fn write_corrupted(wr: &mut OwnedWriteHalf, part: &[u8], trailer: &[u8]) -> Result<(), ProtocolError> {
    let mut bad = part.to_vec();
    bad.extend_from_slice(trailer);
    let header = FrameHeader::for_payload(FrameKind::KvChunk, &bad)?;
    bad[0] ^= 0x5a;
    wr.write_all(&header.encode()).await.map_err(conn_err)?;
    wr.write_all(&bad).await.map_err(conn_err)
}

/// The incoming half: borrows the request's blocks, reads every chunk into them, hands them back
/// with the verdict, acknowledges.
pub(crate) async fn receive_kv(
    transfer: TransferId,
    n_tokens: u32,
    layout: [u32; 3],
    mut rd: OwnedReadHalf,
    mut wr: OwnedWriteHalf,
    handle: &WorkerHandle,
) -> Result<(), ProtocolError> {
    let l = handle.kv_layout();
    let ours = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
    let mut problem =
        (layout != ours).then(|| format!("KV layout {layout:?} does not match this worker's {ours:?}"));
    let mut blocks = None;
    if problem.is_none() {
        match handle.kv_lease(transfer.0, n_tokens as usize).await {
            Ok(b) => blocks = Some(b),
            Err(e) => problem = Some(e),
        }
    }
    if let Some(b) = blocks.as_mut() {
        let expected = (n_tokens as usize).div_ceil(l.block_size);
        if let Err(e) = receive_chunks(&mut rd, transfer, b, expected).await {
            problem = Some(e);
        }
    }
    let ok = problem.is_none();
    let ended = match blocks {
        Some(b) => b.end(n_tokens as usize, ok),
        None => handle.kv_end(transfer.0, n_tokens as usize, ok),
    };
    let verdict = match ended {
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

/// Reads `KvChunk` frames into `blocks` until `KvEnd`; `Ok` only when every frame verified and
/// exactly the `expected` blocks arrived, in order, in the announced number of chunks.
pub(crate) async fn receive_chunks<R: AsyncRead + Unpin>(
    rd: &mut R,
    transfer: TransferId,
    blocks: &mut KvBlocks,
    expected: usize,
) -> Result<(), String> {
    let (mut frames, mut next) = (0u32, 0usize);
    let block_bytes = blocks.block_bytes();
    loop {
        let header = read_header(rd)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("the connection closed before the transfer ended")?;
        let mut payload = PayloadReader::new(header);
        match header.kind {
            FrameKind::KvChunk => {
                // Bounded before a byte is read: whole blocks, all inside the lent ones.
                let n =
                    KvChunk::blocks_in(header.len as usize, block_bytes).map_err(|e| e.to_string())? as usize;
                if next + n > blocks.blocks() {
                    return Err(format!(
                        "a chunk of blocks {next}..{} past the transfer's {} blocks",
                        next + n,
                        blocks.blocks()
                    ));
                }
                for i in next..next + n {
                    let dst = blocks.block_mut(i).ok_or("a lent block went missing")?;
                    payload.read_into(rd, dst).await.map_err(|e| e.to_string())?;
                }
                let mut trailer = [0u8; KV_TRAILER];
                payload.read_into(rd, &mut trailer).await.map_err(|e| e.to_string())?;
                payload.finish().map_err(|e| e.to_string())?;
                let (t, first, count) = KvChunk::parse_trailer(&trailer);
                if t != transfer {
                    return Err("a chunk of another transfer".into());
                }
                if (first as usize, count as usize) != (next, n) {
                    return Err(format!(
                        "a chunk of blocks {first}..+{count} where blocks {next}..+{n} were due (chunks arrive in order)"
                    ));
                }
                next += n;
                frames += 1;
            }
            FrameKind::Control => {
                let mut bytes = vec![0u8; header.len as usize];
                payload.read_into(rd, &mut bytes).await.map_err(|e| e.to_string())?;
                payload.finish().map_err(|e| e.to_string())?;
                return match decode_control::<ToWorker>(&bytes).map_err(|e| e.to_string())? {
                    ToWorker::KvEnd { transfer: t, chunks } if t == transfer => {
                        if chunks != frames || next != expected {
                            Err(format!(
                                "{frames} chunks / {next} blocks arrived, {chunks} chunks / {expected} blocks expected"
                            ))
                        } else {
                            Ok(())
                        }
                    }
                    other => Err(format!("unexpected {other:?} in a transfer")),
                };
            }
        }
    }
}
