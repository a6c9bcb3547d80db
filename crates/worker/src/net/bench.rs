//! The KV transfer benchmark: the real transfer path (framing, checksums on both sides, loopback
//! TCP, the decode worker's batcher writing every block into its cache, the acknowledgement)
//! against a plain loopback TCP copy of the same bytes, measured in the same run so the ratio
//! means something on a shared machine.

use super::server::{serve, KvSender, ServerConfig};
use crate::{Role, WorkMode, WorkRequest, WorkerError, WorkerHandle};
use std::time::Instant;
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_protocol::cluster::TransferId;
use tokenpath_timeline::RequestId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

impl KvTransferBench {
    /// Median real transfer time, ms.
    pub fn transfer_median_ms(&self) -> f64 {
        median(&self.transfer_ms)
    }

    /// Median plain TCP copy time, ms.
    pub fn tcp_median_ms(&self) -> f64 {
        median(&self.tcp_ms)
    }

    /// GB/s of a transfer taking `ms`.
    pub fn gbps(&self, ms: f64) -> f64 {
        self.bytes as f64 / (ms / 1e3) / 1e9
    }
}

fn io(e: std::io::Error) -> WorkerError {
    WorkerError::Remote(format!("benchmark connection: {e}"))
}

/// Moves the KV of `tokens` prompt tokens into `decode` (a decode-capable worker, served here on
/// loopback) `repeats` times, and copies the same bytes over a plain loopback socket as often.
pub async fn kv_transfer(
    decode: &WorkerHandle,
    tokens: usize,
    repeats: usize,
) -> Result<KvTransferBench, WorkerError> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(io)?;
    let addr = listener.local_addr().map_err(io)?.to_string();
    let server = tokio::spawn(serve(
        listener,
        decode.clone(),
        ServerConfig { role: Role::Decode, fault_corrupt_kv: false },
    ));
    let l = decode.kv_layout();
    let block_bytes = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
    let n_blocks = tokens.div_ceil(l.block_size);
    // Finite f16 values (0x3c00 = 1.0 with varying low bits); the content does not change the cost.
    let payload: Vec<u8> =
        (0..n_blocks * block_bytes).map(|i| if i % 2 == 1 { 0x3c } else { (i / 2) as u8 }).collect();
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
        out.tcp_ms.push(plain_copy(&payload).await?);
    }
    server.abort();
    Ok(out)
}

/// A plain loopback TCP copy of `bytes`: the receiver reads them all and answers one byte.
async fn plain_copy(bytes: &[u8]) -> Result<f64, WorkerError> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let n = bytes.len();
    let sink = tokio::spawn(async move {
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
    let mut c = TcpStream::connect(addr).await.map_err(io)?;
    c.set_nodelay(true).map_err(io)?;
    c.write_all(bytes).await.map_err(io)?;
    let mut ack = [0u8; 1];
    c.read_exact(&mut ack).await.map_err(io)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    sink.await.map_err(|e| WorkerError::Remote(e.to_string()))?.map_err(io)?;
    Ok(ms)
}
