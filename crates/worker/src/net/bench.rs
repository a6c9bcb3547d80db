//! The KV transfer benchmark: the real transfer path (framing, checksums on both sides, loopback
//! TCP, the decode worker's receiver reading every block straight into its cache, the batcher
//! taking the blocks back and acknowledging) against a plain loopback TCP copy of the same bytes,
//! the two alternating repeat by repeat so the ratio means something on a shared machine.

use super::kv::KvSender;
use super::server::{serve, ServerConfig};
use crate::{Role, WorkMode, WorkRequest, WorkerError, WorkerHandle};
use std::sync::Arc;
use std::time::Instant;
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_protocol::cluster::TransferId;
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
    /// Each repeat of the real transfer (first byte out → acknowledgement), ms.
    pub transfer_ms: Vec<f64>,
    /// Each repeat of a plain TCP copy of the same bytes (first byte out → 1-byte ack), ms.
    pub tcp_ms: Vec<f64>,
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
    /// Median real transfer time, ms.
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

/// Moves the KV of `tokens` prompt tokens into `decode` (a decode-capable worker, served on
/// loopback by a task of `decode_side`) `repeats` times, and copies the same bytes over a plain
/// loopback socket as often, alternating. The sending ends run on the caller's runtime and the
/// receiving ends on `decode_side`'s, as they would in two worker processes.
pub async fn kv_transfer(
    decode: &WorkerHandle,
    decode_side: &Handle,
    tokens: usize,
    repeats: usize,
) -> Result<KvTransferBench, WorkerError> {
    let (listener, addr) = listen_on(decode_side).await?;
    let server = decode_side.spawn(serve(
        listener,
        decode.clone(),
        ServerConfig { role: Role::Decode, fault_corrupt_kv: false },
    ));
    let l = decode.kv_layout();
    let block_bytes = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
    let n_blocks = tokens.div_ceil(l.block_size);
    // Finite f16 values (0x3c00 = 1.0 with varying low bits); the content does not change the cost.
    let payload: Arc<Vec<u8>> = Arc::new(
        (0..n_blocks * block_bytes).map(|i| if i % 2 == 1 { 0x3c } else { (i / 2) as u8 }).collect(),
    );
    let mut out =
        KvTransferBench { tokens, bytes: payload.len() as u64, transfer_ms: Vec::new(), tcp_ms: Vec::new() };
    for r in 0..repeats {
        let transfer = 0xbe9c_0000 + r as u64;
        let now = Instant::now();
        let stream = decode.submit(WorkRequest {
            id: RequestId(transfer),
            prompt: vec![1; tokens],
            sampling: SamplingParams::greedy(),
            max_tokens: Some(1),
            stop: Vec::new(),
            ignore_eos: true,
            arrived: now,
            admitted: now,
            mode: WorkMode::Decode(transfer),
        })?;
        // The reservation is queued before any chunk: the batcher's channel keeps order.
        // Sixteen chunks, as a chunked prefill would hand them over (copied before the clock
        // starts: on a prefill worker they come out of the batcher's export, not the transfer).
        let per = n_blocks.div_ceil(16).max(1);
        let chunks: Vec<Vec<u8>> = payload.chunks(per * block_bytes).map(<[u8]>::to_vec).collect();
        let t0 = Instant::now();
        let sender = KvSender::start(TransferId(transfer), addr.clone(), tokens, decode, false);
        for (i, c) in chunks.into_iter().enumerate() {
            sender.chunk((i * per) as u32, c);
        }
        let (ok, _, _) = sender.finish().await.unwrap_or((false, 0, 0.0));
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(stream);
        if !ok {
            return Err(WorkerError::Remote("the benchmark transfer was refused".into()));
        }
        out.transfer_ms.push(ms);
        // The next repeat starts on a drained worker (the cancelled request's blocks are back).
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while decode.stats().kv_blocks_used != 0 && Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let payload = Arc::clone(&payload);
        out.tcp_ms.push(plain_copy(payload, decode_side).await?);
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
