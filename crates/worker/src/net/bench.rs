//! The KV transfer benchmark: the real transfer path (framing or the same-host ring, checksums
//! on both sides, the decode worker's receiver putting every block straight into its cache, the
//! batcher taking the blocks back and acknowledging), over TCP and over the ring, against a plain
//! loopback TCP copy of the same bytes; the three alternate repeat by repeat so their ratios mean
//! something on a shared machine.

use super::kv::{KvSender, KvTransport, SendOptions};
use super::server::{serve, ServerConfig};
use super::shm::PeerRings;
use super::{frame_blocks, frame_sums};
use crate::{Role, Transfer, WorkMode, WorkRequest, WorkerError, WorkerHandle};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_protocol::cluster::TransferToken;
use tokenpath_protocol::frame::Checksum;
use tokenpath_timeline::RequestId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;

/// One benchmark's figures.
#[derive(Clone, Debug)]
pub struct KvTransferBench {
    /// Prompt tokens whose KV moved.
    pub tokens: usize,
    /// Bytes moved per transfer.
    pub bytes: u64,
    /// Each repeat of the real transfer over TCP (first byte out → acknowledgement), ms.
    pub transfer_ms: Vec<f64>,
    /// Each repeat of the real transfer through the same-host ring, ms; empty when no ring could
    /// be set up here (then every transfer went over TCP).
    pub ring_ms: Vec<f64>,
    /// Why the ring was not measured, when it was not.
    pub ring_unavailable: Option<String>,
    /// Each repeat of a plain TCP copy of the same bytes (first byte out → 1-byte ack), ms.
    pub tcp_ms: Vec<f64>,
    /// Each repeat of one `memcpy` of the same bytes into memory already mapped, ms: the
    /// machine's memory speed at that moment (on a shared VM it varies severalfold).
    pub memcpy_ms: Vec<f64>,
}

/// The `q` quantile (0..=1) of `v`, nearest rank; NaN when empty.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let rank = ((q.clamp(0.0, 1.0) * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

impl KvTransferBench {
    /// Median real transfer time over TCP, ms.
    pub fn transfer_median_ms(&self) -> f64 {
        quantile(&self.transfer_ms, 0.5)
    }

    /// Median plain TCP copy time, ms.
    pub fn tcp_median_ms(&self) -> f64 {
        quantile(&self.tcp_ms, 0.5)
    }

    /// GB/s of a transfer taking `ms`.
    pub fn gbps(&self, ms: f64) -> f64 {
        self.bytes as f64 / (ms / 1e3) / 1e9
    }
}

fn io(e: std::io::Error) -> WorkerError {
    WorkerError::Remote(format!("benchmark connection: {e}"))
}

/// A loopback listener registered with the runtime of `side` (a listener belongs to the
/// runtime that polls it).
async fn listen_on(side: &Handle) -> Result<(TcpListener, String), WorkerError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    l.set_nonblocking(true).map_err(io)?;
    let addr = l.local_addr().map_err(io)?.to_string();
    let l =
        side.spawn(async move { TcpListener::from_std(l) }).await.map_err(|e| io(e.into()))?.map_err(io)?;
    Ok((l, addr))
}

/// What every transfer of a run shares.
struct Setup<'a> {
    decode: &'a WorkerHandle,
    addr: String,
    tokens: usize,
    chunks: Vec<(u32, Arc<[u8]>)>,
    /// The sending side's kept ring mappings, as a prefill worker's server has them.
    peers: PeerRings,
    /// The run's cluster secret (the transfer authenticates as a real one does).
    secret: ClusterSecret,
}

/// One real transfer of the whole payload: (ms, whether it went through the ring).
async fn one_transfer(
    s: &Setup<'_>,
    transfer: u64,
    transport: KvTransport,
) -> Result<(f64, bool), WorkerError> {
    let now = Instant::now();
    let token = TransferToken::random().map_err(|e| WorkerError::Remote(e.to_string()))?;
    let transfer = Transfer { id: transfer, token };
    let stream = s.decode.submit(WorkRequest {
        id: RequestId(transfer.id),
        prompt: vec![1; s.tokens],
        sampling: SamplingParams::greedy(),
        max_tokens: Some(1),
        stop: Vec::new(),
        ignore_eos: true,
        arrived: now,
        admitted: now,
        mode: WorkMode::Decode(transfer),
        meter: None,
        cache_scope: None,
        forward: None,
        trace: None,
    })?;
    // The reservation is queued before any chunk: the batcher's channel keeps order. The chunks
    // are copied, and their frames hashed, before the clock starts: on a prefill worker both
    // happen in the batcher's export (the hash right after the copy, in cache), not the transfer.
    let l = s.decode.kv_layout();
    let bb = l.block_bytes();
    let chunks: Vec<(u32, Vec<u8>, Vec<Checksum>)> = s
        .chunks
        .iter()
        .map(|(b, c)| {
            let bytes = c.to_vec();
            let sums = frame_sums(&bytes, bb);
            (*b, bytes, sums)
        })
        .collect();
    let t0 = Instant::now();
    let opts = SendOptions { transport, corrupt: false, secret: s.secret.clone() };
    let sender = KvSender::start(transfer, s.addr.clone(), s.tokens, s.decode, opts, &s.peers);
    for (first_block, c, sums) in chunks {
        sender.chunk(first_block, c, sums);
    }
    let sent = sender.finish().await.unwrap_or_default();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    // The sending task frees its export buffers right after the verdict (tens of MB of munmap);
    // the next measurement starts once it has: this runtime's one thread runs this empty task
    // only after that.
    let _ = tokio::spawn(async {}).await;
    drop(stream);
    if !sent.ok {
        return Err(WorkerError::Remote("the benchmark transfer was refused".into()));
    }
    // The next transfer starts on a drained worker (the cancelled request's blocks are back).
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.decode.stats().kv_blocks_used != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok((ms, sent.ring))
}

/// Moves the KV of `tokens` prompt tokens into `decode` (a decode-capable worker, served on
/// loopback by a task of `decode_side`) `repeats` times over TCP and as often through the
/// same-host ring, and copies the same bytes over a plain loopback socket as often, the three
/// alternating. The sending ends run on the caller's runtime and the receiving ends on
/// `decode_side`'s, as they would in two worker processes.
pub async fn kv_transfer(
    decode: &WorkerHandle,
    decode_side: &Handle,
    tokens: usize,
    repeats: usize,
) -> Result<KvTransferBench, WorkerError> {
    let (listener, addr) = listen_on(decode_side).await?;
    let secret =
        ClusterSecret::new(&ClusterSecret::generate().map_err(|e| WorkerError::Remote(e.to_string()))?)
            .map_err(|e| WorkerError::Remote(e.to_string()))?;
    let config = ServerConfig {
        role: Role::Decode,
        fault_corrupt_kv: false,
        kv_transport: KvTransport::Auto,
        secret: secret.clone(),
        draining: Arc::default(),
        spans: None,
        model: None,
    };
    let server = decode_side.spawn(serve(listener, decode.clone(), config));
    let l = decode.kv_layout();
    let block_bytes = l.block_bytes();
    let n_blocks = tokens.div_ceil(l.block_size);
    // Finite f16 values (0x3c00 = 1.0 with varying low bits); the content does not change the cost.
    let payload: Arc<Vec<u8>> = Arc::new(
        (0..n_blocks * block_bytes).map(|i| if i % 2 == 1 { 0x3c } else { (i / 2) as u8 }).collect(),
    );
    // One KV frame's blocks per chunk, as the batcher hands them over.
    let per = frame_blocks(block_bytes);
    let chunks = payload
        .chunks(per * block_bytes)
        .enumerate()
        .map(|(i, c)| ((i * per) as u32, Arc::from(c)))
        .collect();
    let setup = Setup { decode, addr, tokens, chunks, peers: PeerRings::start(), secret };
    let mut out = KvTransferBench {
        tokens,
        bytes: payload.len() as u64,
        transfer_ms: Vec::new(),
        ring_ms: Vec::new(),
        ring_unavailable: None,
        tcp_ms: Vec::new(),
        memcpy_ms: Vec::new(),
    };
    let mut scratch = vec![1u8; payload.len()];
    for r in 0..repeats as u64 {
        let (ms, _) = one_transfer(&setup, 0xbe9c_0000 + 2 * r, KvTransport::Tcp).await?;
        out.transfer_ms.push(ms);
        if out.ring_unavailable.is_none() {
            match one_transfer(&setup, 0xbe9c_0001 + 2 * r, KvTransport::Auto).await? {
                (ms, true) => out.ring_ms.push(ms),
                (_, false) => {
                    out.ring_unavailable = Some("no shared-memory ring here (not Linux, or no memfd)".into());
                    out.ring_ms.clear();
                }
            }
        }
        out.tcp_ms.push(plain_copy(Arc::clone(&payload), decode_side).await?);
        let t0 = Instant::now();
        scratch.copy_from_slice(&payload);
        out.memcpy_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(&scratch);
    }
    server.abort();
    Ok(out)
}

/// A plain loopback TCP copy of `bytes`: a task on `receiving_side` reads them all and answers
/// one byte; a task on the caller's runtime sends them (the same split as a KV transfer's ends).
async fn plain_copy(bytes: Arc<Vec<u8>>, receiving_side: &Handle) -> Result<f64, WorkerError> {
    let (listener, addr) = listen_on(receiving_side).await?;
    let n = bytes.len();
    let sink = receiving_side.spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < n {
            let k = s.read(&mut buf).await?;
            if k == 0 {
                break;
            }
            got += k;
        }
        s.write_all(&[1]).await?;
        std::io::Result::Ok(())
    });
    let t0 = Instant::now();
    let send = tokio::spawn(async move {
        let mut c = TcpStream::connect(addr).await?;
        c.set_nodelay(true)?;
        c.write_all(&bytes).await?;
        let mut ack = [0u8; 1];
        c.read_exact(&mut ack).await?;
        std::io::Result::Ok(())
    });
    send.await.map_err(|e| WorkerError::Remote(e.to_string()))?.map_err(io)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    sink.await.map_err(|e| WorkerError::Remote(e.to_string()))?.map_err(io)?;
    Ok(ms)
}
