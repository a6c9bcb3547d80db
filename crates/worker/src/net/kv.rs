//! The KV transfer between a prefill and a decode worker: the sending end. The receiving end is
//! `kv_recv.rs`; the same-host ring both use is `shm.rs`.
//!
//! Sender ([`KvSender`]): a task owning the connection to the decode worker; the batcher's
//! exports arrive on a channel while the prefill runs. Over TCP they leave as `KvChunk` frames of
//! about [`KV_FRAME_TARGET_BYTES`], each one vectored write (header, block bytes straight from the
//! export buffer, trailer), each frame's checksum computed while the previous frame waits for the
//! socket (`kv_frames.rs`). When the decode worker is on the same host and offers a
//! ring ([`KvTransport::Auto`]), each chunk is instead copied into the ring (hashed as it is
//! copied) and announced with a small `KvRingChunk` control message; the decode worker's
//! `KvRingFree` answers say which ring space may be written again.

use super::kv_frames::{frame_target_bytes, FrameQueue};
use super::ring_door::Door;
use super::server::KV_CONNECT_TIMEOUT;
use super::shm::{host_id, PeerRing, PeerRings, RingSpace, RING_CHUNK_TARGET_BYTES};
use super::{connect_authenticated, read_control, within, write_control};
use crate::{Transfer, WorkerHandle};
use std::sync::Arc;
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_protocol::cluster::{FromWorker, SameHost, ToWorker, TransferId, TransferToken};
use tokenpath_protocol::frame::Checksum;
use tokenpath_protocol::ProtocolError;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

/// Target size of one KV frame.
pub(crate) const KV_FRAME_TARGET_BYTES: usize = 2 << 20;
/// Bytes copied into a ring (or out of it) and hashed at a time: small enough to stay in L1/L2
/// between the copy and the hash.
pub(crate) const COPY_PIECE: usize = 64 << 10;

/// How KV moves between workers on the same host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvTransport {
    /// Through a shared-memory ring when both workers are on the same host (and it can be set
    /// up), else TCP.
    #[default]
    Auto,
    /// Always over the TCP connection.
    Tcp,
}

impl std::str::FromStr for KvTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "tcp" => Ok(Self::Tcp),
            other => Err(format!("unknown KV transport {other:?}: expected auto or tcp")),
        }
    }
}

impl std::fmt::Display for KvTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Tcp => "tcp",
        })
    }
}

/// The outgoing half of a KV transfer: a task that owns the connection to the decode worker.
pub(crate) struct KvSender {
    chunks: mpsc::UnboundedSender<(u32, Vec<u8>, Vec<Checksum>)>,
    done: oneshot::Sender<()>,
    result: oneshot::Receiver<Sent>,
}

/// How a transfer went, on the sender's side.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Sent {
    /// The decode worker acknowledged every block.
    pub(crate) ok: bool,
    /// Block bytes sent.
    pub(crate) bytes: u64,
    /// The decode worker's hold time before its acknowledgement, ms.
    pub(crate) held_ms: f64,
    /// The blocks went through a same-host ring.
    pub(crate) ring: bool,
}

/// How one transfer is sent.
#[derive(Clone, Debug)]
pub(crate) struct SendOptions {
    /// Ask for a same-host ring.
    pub(crate) transport: KvTransport,
    /// Testing only: corrupt the first chunk after its checksum was computed.
    pub(crate) corrupt: bool,
    /// Proven to the decode worker, which must prove it back before any KV leaves.
    pub(crate) secret: ClusterSecret,
}

impl KvSender {
    pub(crate) fn start(
        to: Transfer,
        addr: String,
        n_tokens: usize,
        handle: &WorkerHandle,
        opts: SendOptions,
        peers: &PeerRings,
    ) -> Self {
        let (chunks, rx) = mpsc::unbounded_channel();
        let (done, done_rx) = oneshot::channel();
        let (res_tx, result) = oneshot::channel();
        let l = handle.kv_layout();
        let layout = l.fingerprint();
        let block_bytes = l.block_bytes();
        let peers = peers.clone();
        tokio::spawn(async move {
            // Sent export buffers are freed only when the sender would wait anyway, or once the
            // verdict is out (`Exports::next`).
            let mut spent = Vec::new();
            let transfer = TransferId(to.id);
            let job = Job { transfer, token: to.token, n_tokens, layout, block_bytes, opts, peers };
            let exports = Exports { rx, done: done_rx, finished: false };
            let r = send_kv(&job, &addr, exports, &mut spent).await;
            let verdict = r.unwrap_or_else(|e| {
                tracing::warn!(transfer = transfer.0, "KV transfer to {addr} failed: {e}");
                Sent::default()
            });
            let _ = res_tx.send(verdict);
            drop(spent);
        });
        Self { chunks, done, result }
    }

    /// Blocks `first_block..` to send; `sums` as [`super::kv_frames::frame_sums`] of them, or
    /// empty (the sender hashes them then).
    pub(crate) fn chunk(&self, first_block: u32, bytes: Vec<u8>, sums: Vec<Checksum>) {
        let _ = self.chunks.send((first_block, bytes, sums));
    }

    /// Every block was handed over; the receiver resolves with how the transfer went.
    pub(crate) fn finish(self) -> oneshot::Receiver<Sent> {
        let _ = self.done.send(());
        self.result
    }
}

struct Job {
    transfer: TransferId,
    token: TransferToken,
    n_tokens: usize,
    layout: [u32; 4],
    block_bytes: usize,
    opts: SendOptions,
    /// This worker's kept mappings of decode workers' rings.
    peers: PeerRings,
}

fn conn_err(e: impl std::fmt::Display) -> ProtocolError {
    ProtocolError::Connection { message: e.to_string() }
}

fn refused(message: Option<String>) -> ProtocolError {
    conn_err(format!("the decode worker refused the transfer: {}", message.unwrap_or_default()))
}

/// Takes the ring the decode worker passed through `door` when it offered one; `None` means
/// TCP frames.
async fn negotiate_ring(
    job: &Job,
    rd: &mut OwnedReadHalf,
    door: Option<&Door>,
) -> Result<Option<(PeerRing, RingSpace)>, ProtocolError> {
    let Some(door) = door else {
        return Ok(None);
    };
    match within("waiting for a ring offer", read_control::<_, FromWorker>(rd)).await? {
        Some(FromWorker::KvRing { offer: Some(offer) }) => {
            let passed = door.receive(job.transfer, &job.token).await.map(std::fs::File::from);
            let opened = match passed {
                Ok(file) => job.peers.open(file, offer.len).await,
                Err(e) => Err(e),
            };
            match opened {
                // A ring must hold at least one chunk of whole blocks.
                Ok(ring) if ring.len() >= job.block_bytes => {
                    let space = RingSpace::new(ring.len());
                    Ok(Some((ring, space)))
                }
                Ok(ring) => {
                    job.peers.give(ring);
                    Ok(None)
                }
                Err(e) => {
                    tracing::debug!(
                        transfer = job.transfer.0,
                        "the offered KV ring is unusable, sending over TCP: {e}"
                    );
                    Ok(None)
                }
            }
        }
        Some(FromWorker::KvRing { offer: None }) => Ok(None),
        Some(FromWorker::KvAck { ok: false, message, .. }) => Err(refused(message)),
        other => Err(conn_err(format!("expected a ring offer, got {other:?}"))),
    }
}

/// One export: its first block, its bytes, its frames' checksum states (or none).
type Export = (u32, Vec<u8>, Vec<Checksum>);

/// The batcher's exports as they arrive, until every block was handed over.
struct Exports {
    rx: mpsc::UnboundedReceiver<(u32, Vec<u8>, Vec<Checksum>)>,
    done: oneshot::Receiver<()>,
    finished: bool,
}

impl Exports {
    /// The next export, waiting for it if need be; `None` once every block was handed over and
    /// taken. Sent exports in `spent` are freed only when it really waits: returning tens of MB to
    /// the allocator costs milliseconds of munmap, which must not sit between the last frame and
    /// the end of the transfer.
    async fn next(&mut self, spent: &mut Vec<Arc<Vec<u8>>>) -> Result<Option<Export>, ProtocolError> {
        loop {
            if let Some(c) = self.ready() {
                return Ok(Some(c));
            }
            if self.finished {
                return Ok(None);
            }
            match self.done.try_recv() {
                Ok(()) => {
                    self.finished = true;
                    continue;
                }
                Err(oneshot::error::TryRecvError::Closed) => {
                    return Err(conn_err("the request ended before its handoff"));
                }
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
            spent.clear();
            tokio::select! {
                c = self.rx.recv() => if c.is_some() { return Ok(c) },
                r = &mut self.done => {
                    if r.is_err() {
                        return Err(conn_err("the request ended before its handoff"));
                    }
                    self.finished = true;
                }
            }
        }
    }

    /// The next export if one is already there.
    fn ready(&mut self) -> Option<Export> {
        self.rx.try_recv().ok()
    }
}

async fn send_kv(
    job: &Job,
    addr: &str,
    mut exports: Exports,
    spent: &mut Vec<Arc<Vec<u8>>>,
) -> Result<Sent, ProtocolError> {
    let conn = connect_authenticated(addr, &job.opts.secret, KV_CONNECT_TIMEOUT).await?;
    let (mut rd, mut wr) = conn.into_split();
    let transfer = job.transfer;
    let host = if job.opts.transport == KvTransport::Auto { host_id() } else { None };
    // Same host: a door for the decode worker to pass its ring through (none: TCP frames).
    let door = host.as_ref().and_then(|_| {
        Door::open()
            .map_err(|e| tracing::debug!(transfer = transfer.0, "no KV door, sending over TCP: {e}"))
            .ok()
    });
    let same_host = host.zip(door.as_ref()).map(|(host, d)| SameHost { host, door: d.name().to_owned() });
    let n = u32::try_from(job.n_tokens).unwrap_or(u32::MAX);
    let begin = ToWorker::KvBegin { transfer, token: job.token, n_tokens: n, layout: job.layout, same_host };
    within("starting a KV transfer", write_control(&mut wr, &begin)).await?;
    let mut ring = negotiate_ring(job, &mut rd, door.as_ref()).await?;
    drop(door);
    tracing::debug!(transfer = transfer.0, ring = ring.is_some(), "KV transfer to {addr} starts");
    let (sent, bytes_sent) = match ring.as_mut() {
        Some((r, space)) => send_ring(job, &mut rd, &mut wr, r, space, &mut exports, spent).await?,
        None => send_frames(job, &mut wr, &mut exports, spent).await?,
    };
    within("ending a KV transfer", write_control(&mut wr, &ToWorker::KvEnd { transfer, chunks: sent }))
        .await?;
    let ack = loop {
        match within("waiting for the KV acknowledgement", read_control::<_, FromWorker>(&mut rd)).await? {
            Some(FromWorker::KvRingFree { .. }) => {}
            Some(FromWorker::KvAck { ok, held_ms, message }) => break (ok, held_ms, message),
            other => return Err(conn_err(format!("expected an acknowledgement, got {other:?}"))),
        }
    };
    // The decode worker has its ring back in its pool; the mapping stays for its next loan.
    let through_ring = ring.is_some();
    if let Some((r, _)) = ring {
        job.peers.give(r);
    }
    match ack {
        (true, held_ms, _) => Ok(Sent { ok: true, bytes: bytes_sent, held_ms, ring: through_ring }),
        (false, _, message) => Err(refused(message)),
    }
}

/// Every export as `KvChunk` frames, each hashed while the previous one waits for the socket:
/// (frames, block bytes).
async fn send_frames(
    job: &Job,
    wr: &mut OwnedWriteHalf,
    exports: &mut Exports,
    spent: &mut Vec<Arc<Vec<u8>>>,
) -> Result<(u32, u64), ProtocolError> {
    let mut q = FrameQueue::new(job.transfer, job.block_bytes, frame_target_bytes());
    loop {
        while let Some((first_block, bytes, sums)) = exports.ready() {
            q.push(first_block, bytes, sums);
        }
        if q.is_empty() {
            match exports.next(spent).await? {
                Some((first_block, bytes, sums)) => q.push(first_block, bytes, sums),
                None => break,
            }
        }
        let corrupt = job.opts.corrupt && q.sent == 0;
        q.write_next(wr, &mut || exports.ready(), spent, corrupt).await?;
    }
    Ok((q.sent, q.bytes))
}

/// Every export through the ring, a chunk of whole blocks at a time: (chunks, block bytes).
async fn send_ring(
    job: &Job,
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    ring: &PeerRing,
    space: &mut RingSpace,
    exports: &mut Exports,
    spent: &mut Vec<Arc<Vec<u8>>>,
) -> Result<(u32, u64), ProtocolError> {
    let bb = job.block_bytes.max(1);
    let per_chunk = (RING_CHUNK_TARGET_BYTES.min(ring.len()) / bb).max(1);
    let (mut sent, mut bytes_sent) = (0u32, 0u64);
    loop {
        let Some((first_block, bytes, _)) = exports.next(spent).await? else { break };
        for (i, part) in bytes.chunks(per_chunk * bb).enumerate() {
            let first = first_block + (i * per_chunk) as u32;
            let at = (first, (part.len() / bb) as u32);
            let corrupt = job.opts.corrupt && sent == 0;
            send_ring_chunk(rd, wr, ring, space, job.transfer, at, part, corrupt).await?;
            sent += 1;
            bytes_sent += part.len() as u64;
        }
        spent.push(Arc::new(bytes));
    }
    Ok((sent, bytes_sent))
}

/// Writes blocks `at.0..at.0 + at.1` (`part`) into the ring, once the receiver has freed room
/// for them, and announces them.
#[allow(clippy::too_many_arguments)]
async fn send_ring_chunk(
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    ring: &PeerRing,
    space: &mut RingSpace,
    transfer: TransferId,
    at: (u32, u32),
    part: &[u8],
    corrupt: bool,
) -> Result<(), ProtocolError> {
    let offset = loop {
        if let Some(o) = space.place(part.len()) {
            break o;
        }
        match within("waiting for ring space", read_control::<_, FromWorker>(rd)).await? {
            Some(FromWorker::KvRingFree { chunks }) => space.free_upto(chunks).map_err(conn_err)?,
            Some(FromWorker::KvAck { ok: false, message, .. }) => return Err(refused(message)),
            other => return Err(conn_err(format!("expected ring space, got {other:?}"))),
        }
    };
    // Copied and hashed a piece at a time: the hash reads what the copy just brought into cache.
    let mut sum = Checksum::default();
    for (i, piece) in part.chunks(COPY_PIECE).enumerate() {
        ring.copy_in(offset + i * COPY_PIECE, piece).map_err(conn_err)?;
        sum.update(piece);
    }
    if corrupt {
        // Testing only: the checksum of the true bytes, one flipped byte in the ring.
        ring.copy_in(offset, &[part.first().copied().unwrap_or(0) ^ 0x5a]).map_err(conn_err)?;
    }
    let msg = ToWorker::KvRingChunk {
        transfer,
        first_block: at.0,
        n_blocks: at.1,
        offset: offset as u64,
        checksum: sum.digest(),
    };
    within("announcing a ring chunk", write_control(wr, &msg)).await
}
