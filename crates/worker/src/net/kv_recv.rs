//! The KV transfer's receiving end, on the decode worker.
//!
//! [`receive_kv`] borrows the request's reserved blocks from the batcher ([`crate::KvBlocks`])
//! and puts every chunk's bytes straight into them: a `KvChunk` frame is read from the socket
//! into the blocks, hashing each piece as it lands; a `KvRingChunk` (same host) is copied out of
//! the ring this worker offered into the blocks, hashing each piece after the copy. No receive
//! buffer, nothing zeroed, no import copy on the batcher. Chunks must arrive in order (the
//! sender's exports are in order and the connection keeps it), which is what lets a frame's bytes
//! be placed before its trailer has said where they go; the trailer is then checked against that
//! place. Until the checksums, the count of chunks and the count of blocks all agree, the blocks
//! are garbage, and any failure hands them back as such: the batcher recomputes the prompt.

use super::kv::{KvTransport, COPY_PIECE};
use super::ring_door;
use super::shm::{host_id, OwnRing, RingPool, RING_BYTES};
use super::PEER_IDLE;
use super::{within, write_control};
use crate::{KvBlocks, Transfer, WorkerHandle};
use tokenpath_protocol::cluster::conn::within_for;
use tokenpath_protocol::cluster::{
    decode_control, FromWorker, KvChunk, SameHost, ToWorker, TransferId, KV_TRAILER,
};
use tokenpath_protocol::frame::{read_header, Checksum, FrameKind, PayloadReader};
use tokenpath_protocol::ProtocolError;
use tokio::io::{AsyncRead, AsyncWrite};

/// The ring for a layout's blocks: room for a few chunks of whole blocks, at most 64 MB.
pub(crate) fn ring_len(block_bytes: usize) -> usize {
    RING_BYTES.max(4 * block_bytes).min(64 << 20)
}

/// What the sender said in `KvBegin`.
#[derive(Debug)]
pub(crate) struct Begin {
    pub(crate) transfer: Transfer,
    pub(crate) n_tokens: u32,
    pub(crate) layout: [u32; 4],
    pub(crate) same_host: Option<SameHost>,
}

/// The incoming half: borrows the request's blocks, receives every chunk into them, hands them
/// back with the verdict, acknowledges.
pub(crate) async fn receive_kv<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    begin: Begin,
    mut rd: R,
    mut wr: W,
    handle: &WorkerHandle,
    transport: KvTransport,
    rings: &RingPool,
) -> Result<(), ProtocolError> {
    let Begin { transfer, n_tokens, layout, same_host } = begin;
    let l = handle.kv_layout();
    let ours = l.fingerprint();
    let block_bytes = l.block_bytes();
    let mut problem =
        (layout != ours).then(|| format!("KV layout {layout:?} does not match this worker's {ours:?}"));
    let mut blocks = None;
    if problem.is_none() {
        match handle.kv_lease(transfer, n_tokens as usize).await {
            Ok(b) => blocks = Some(b),
            Err(e) => problem = Some(e),
        }
    }
    let mut ring = None;
    if let Some(theirs) = same_host {
        // A sender that asked waits for this answer before sending any block.
        let same = transport == KvTransport::Auto && host_id().is_some_and(|h| h == theirs.host);
        if same && problem.is_none() {
            match pass_ring(&theirs.door, &transfer, rings, ring_len(block_bytes)).await {
                Ok(r) => ring = Some(r),
                Err(e) => tracing::debug!(transfer = transfer.id, "no KV ring, receiving over TCP: {e}"),
            }
        }
        write_control(&mut wr, &FromWorker::KvRing { offer: ring.as_ref().map(OwnRing::offer) }).await?;
    }
    if let Some(b) = blocks.as_mut() {
        let expected = (n_tokens as usize).div_ceil(l.block_size);
        let mut ends = Ends { rd: &mut rd, wr: &mut wr, ring: ring.as_ref() };
        if let Err(e) = receive_chunks(&mut ends, TransferId(transfer.id), b, expected).await {
            problem = Some(e);
        }
    }
    if let Some(r) = ring {
        rings.give(r);
    }
    let ok = problem.is_none();
    let ended = match blocks {
        Some(b) => b.end(n_tokens as usize, ok),
        // Never lent (unknown transfer, wrong token, already being received, wrong layout): the
        // batcher changes nothing unless the token is right and nobody else holds the blocks.
        None => handle.kv_end(transfer, n_tokens as usize, ok),
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

/// Knocks on the sender's door, lends a ring fit for that process and passes its descriptor;
/// a ring passed (even partly) stays marked as that process's.
async fn pass_ring(
    door: &str,
    transfer: &Transfer,
    rings: &RingPool,
    len: usize,
) -> std::io::Result<OwnRing> {
    let (stream, pid) = within_door(ring_door::knock(door)).await?;
    let mut ring = rings.take(len, pid).await?;
    ring.shared_with = Some(pid);
    match ring_door::pass(&stream, TransferId(transfer.id), &transfer.token, ring.fd()).await {
        Ok(()) => Ok(ring),
        Err(e) => {
            rings.give(ring);
            Err(e)
        }
    }
}

async fn within_door<T>(f: impl std::future::Future<Output = std::io::Result<T>>) -> std::io::Result<T> {
    tokio::time::timeout(ring_door::DOOR_WAIT, f)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other("the KV door did not answer in time")))
}

/// The connection's two halves and this transfer's ring, if one was offered.
pub(crate) struct Ends<'a, R, W> {
    pub(crate) rd: &'a mut R,
    pub(crate) wr: &'a mut W,
    pub(crate) ring: Option<&'a OwnRing>,
}

/// How long a transfer's first chunk may take: as long as a decode-mode request waits for its
/// first token ([`crate::pd::HANDOFF_WAIT`]), with its blocks reserved meanwhile.
pub(crate) const FIRST_KV_WAIT: std::time::Duration = crate::pd::HANDOFF_WAIT;

fn text(e: ProtocolError) -> String {
    e.to_string()
}

/// Receives chunks into `blocks` until `KvEnd`; `Ok` only when every chunk verified and exactly
/// the `expected` blocks arrived, in order, in the announced number of chunks.
pub(crate) async fn receive_chunks<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    ends: &mut Ends<'_, R, W>,
    transfer: TransferId,
    blocks: &mut KvBlocks,
    expected: usize,
) -> Result<(), String> {
    let (mut chunks, mut ring_chunks, mut next) = (0u32, 0u32, 0usize);
    let block_bytes = blocks.block_bytes();
    loop {
        // The first chunk exists only once the prefill worker has run the request's first
        // chunk, and the request may be queued there for longer than a peer's usual idle bound
        // (a 1P1D run at 0.3 req/s queued one for 15 s, and its transfer failed into a
        // recompute here): the first wait is as long as this worker waits for the first token.
        let idle = if chunks == 0 && ring_chunks == 0 && next == 0 { FIRST_KV_WAIT } else { PEER_IDLE };
        let header = within_for(idle, "waiting for KV", read_header(ends.rd))
            .await
            .map_err(text)?
            .ok_or("the connection closed before the transfer ended")?;
        let mut payload = PayloadReader::new(header);
        let n = match header.kind {
            FrameKind::KvChunk => {
                // Bounded before a byte is read: whole blocks, all inside the lent ones.
                let n = KvChunk::blocks_in(header.len as usize, block_bytes).map_err(text)? as usize;
                check_place(next, n, blocks.blocks())?;
                for i in next..next + n {
                    let dst = blocks.block_mut(i).ok_or("a lent block went missing")?;
                    within("receiving KV", payload.read_into(ends.rd, dst)).await.map_err(text)?;
                }
                let mut trailer = [0u8; KV_TRAILER];
                within("receiving KV", payload.read_into(ends.rd, &mut trailer)).await.map_err(text)?;
                payload.finish().map_err(text)?;
                check_chunk(transfer, next, n, KvChunk::parse_trailer(&trailer))?;
                n
            }
            FrameKind::Control => {
                let mut bytes = vec![0u8; header.len as usize];
                within("receiving KV", payload.read_into(ends.rd, &mut bytes)).await.map_err(text)?;
                payload.finish().map_err(text)?;
                match decode_control::<ToWorker>(&bytes).map_err(text)? {
                    ToWorker::KvRingChunk { transfer: t, first_block, n_blocks, offset, checksum } => {
                        let ring = ends.ring.ok_or("a ring chunk, but no ring was offered")?;
                        let n = n_blocks as usize;
                        check_chunk(transfer, next, n, (t, first_block, n_blocks))?;
                        check_place(next, n, blocks.blocks())?;
                        copy_from_ring(ring, blocks, next, n, offset, checksum)?;
                        ring_chunks += 1;
                        let free = FromWorker::KvRingFree { chunks: ring_chunks };
                        within("freeing ring space", write_control(ends.wr, &free)).await.map_err(text)?;
                        n
                    }
                    ToWorker::KvEnd { transfer: t, chunks: said } if t == transfer => {
                        return if said != chunks || next != expected {
                            Err(format!(
                                "{chunks} chunks / {next} blocks arrived, {said} chunks / {expected} blocks expected"
                            ))
                        } else {
                            Ok(())
                        };
                    }
                    other => return Err(format!("unexpected {other:?} in a transfer")),
                }
            }
        };
        next += n;
        chunks += 1;
    }
}

/// A chunk of `n` blocks from `next` on must lie inside the `lent` blocks and hold at least one.
fn check_place(next: usize, n: usize, lent: usize) -> Result<(), String> {
    if n == 0 || next + n > lent {
        return Err(format!("a chunk of blocks {next}..{} past the transfer's {lent} blocks", next + n));
    }
    Ok(())
}

/// A chunk must belong to this transfer and start where the previous one ended.
fn check_chunk(
    transfer: TransferId,
    next: usize,
    n: usize,
    said: (TransferId, u32, u32),
) -> Result<(), String> {
    let (t, first, count) = said;
    if t != transfer {
        return Err("a chunk of another transfer".into());
    }
    if (first as usize, count as usize) != (next, n) {
        return Err(format!(
            "a chunk of blocks {first}..+{count} where blocks {next}..+{n} were due (chunks arrive in order)"
        ));
    }
    Ok(())
}

/// Copies blocks `next..next + n` out of the ring from `offset` into the lent blocks, hashing each
/// piece after it is in private memory (what the peer does to the ring meanwhile cannot pass).
fn copy_from_ring(
    ring: &OwnRing,
    blocks: &mut KvBlocks,
    next: usize,
    n: usize,
    offset: u64,
    checksum: u64,
) -> Result<(), String> {
    let bb = blocks.block_bytes() as u64;
    let mut sum = Checksum::default();
    for i in 0..n {
        let dst = blocks.block_mut(next + i).ok_or("a lent block went missing")?;
        let at =
            (i as u64).checked_mul(bb).and_then(|d| offset.checked_add(d)).ok_or("ring offset overflows")?;
        for (j, piece) in dst.chunks_mut(COPY_PIECE).enumerate() {
            let piece_at = at.checked_add((j * COPY_PIECE) as u64).ok_or("ring offset overflows")?;
            ring.copy_out(piece_at, piece)?;
            sum.update(piece);
        }
    }
    let actual = sum.digest();
    if actual != checksum {
        return Err(format!("ring chunk checksum mismatch: expected {checksum:016x}, got {actual:016x}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokenpath_engine::kv_cache::{BlockTable, KvCache, KvLayout};
    use tokenpath_protocol::cluster::TransferToken;

    /// A lent block to receive into, and what the batcher would get back.
    fn blocks() -> (KvBlocks, std::sync::mpsc::Receiver<crate::batcher::Command>) {
        let layout = KvLayout { n_layer: 1, kv_dim: 4, head_dim: 4, block_size: 4 };
        let mut cache = KvCache::new(layout, 2).unwrap();
        let mut table = BlockTable::default();
        cache.reserve(&mut table, 4).unwrap();
        let lease = cache.lease(&mut table).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Transfer { id: 1, token: TransferToken([3; 16]) };
        (KvBlocks::new(t, lease, tx), rx)
    }

    /// The connection closes `after` into the transfer, nothing sent: the error says which bound
    /// ended the wait.
    async fn silent_peer_for(after: std::time::Duration) -> String {
        let (peer, ours) = tokio::io::duplex(1024);
        let (mut rd, mut wr) = tokio::io::split(ours);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            drop(peer);
        });
        let (mut b, _back) = blocks();
        let mut ends = Ends { rd: &mut rd, wr: &mut wr, ring: None };
        receive_chunks(&mut ends, TransferId(1), &mut b, 1).await.unwrap_err()
    }

    /// Regression: the first chunk of a request queued on its prefill worker for longer than
    /// PEER_IDLE was given up on, and the decode worker recomputed the prompt.
    #[tokio::test(start_paused = true)]
    async fn the_first_chunk_may_come_after_a_long_prefill_queue_but_not_forever() {
        let queued = silent_peer_for(PEER_IDLE * 2).await;
        assert!(queued.contains("closed before the transfer ended"), "{queued}");
        let gone = silent_peer_for(FIRST_KV_WAIT + PEER_IDLE).await;
        assert!(gone.contains("sent nothing for 120 s"), "{gone}");
    }
}
