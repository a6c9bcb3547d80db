//! What the KV-transfer tests share: a tiny engine, workers served on loopback, crafted frames
//! and transfers, and a few peers played by hand.
#![allow(dead_code, unused_imports, clippy::unwrap_used)]

pub use std::sync::Arc;
pub use std::time::{Duration, Instant};
pub use tokenpath_engine::model::Model;
pub use tokenpath_engine::sampling::SamplingParams;
pub use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
pub use tokenpath_engine::Engine;
pub use tokenpath_gateway::cluster::client::RemoteRequest;
pub use tokenpath_protocol::auth::ClusterSecret;
pub use tokenpath_protocol::cluster::{
    decode_control, encode_control, FromWorker, GenerateMsg, KvChunk, Mode, SameHost, ToWorker, TransferId,
    TransferToken,
};
pub use tokenpath_protocol::frame::{read_frame, write_frame, FrameHeader, FrameKind, FRAME_HEADER_LEN};
pub use tokenpath_timeline::{RequestId, WorkerId};
pub use tokenpath_worker::net::server::{serve, ServerConfig};
pub use tokenpath_worker::net::KvTransport;
pub use tokenpath_worker::{
    Role, Transfer, WorkMode, WorkRequest, WorkStream, Worker, WorkerConfig, WorkerHandle,
};
pub use tokio::io::AsyncWriteExt;
pub use tokio::net::{TcpListener, TcpStream};

pub fn engine() -> Arc<Engine> {
    let bytes = tiny_model_bytes(&TinySpec { n_ctx: 512, ..TinySpec::default() }).unwrap();
    Arc::new(Engine::from_model(Model::from_bytes(bytes).unwrap()).unwrap())
}

pub fn spawn(e: &Arc<Engine>, id: &str) -> (Worker, WorkerHandle) {
    let cfg = WorkerConfig {
        id: WorkerId(id.into()),
        prefill_chunk: 16,
        kv_tokens: Some(1024),
        prefix_cache: false,
        ..WorkerConfig::default()
    };
    let w = Worker::spawn(Arc::clone(e), cfg).unwrap();
    let h = w.handle();
    (w, h)
}

pub fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 31 + seed * 17) % 250).collect()
}

/// The secret every served worker of these tests demands.
pub fn secret() -> ClusterSecret {
    ClusterSecret::new("kv-net-test-cluster-secret").unwrap()
}

/// The token of transfer `id` in these tests (a real gateway draws them at random).
pub fn token(id: u64) -> TransferToken {
    let mut t = [0x5a; 16];
    t[..8].copy_from_slice(&id.to_le_bytes());
    TransferToken(t)
}

pub fn tr(id: u64) -> Transfer {
    Transfer { id, token: token(id) }
}

/// A connection to a served worker, authenticated with `secret()`.
pub async fn authed(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = s.split();
    tokenpath_protocol::auth::connect(&mut rd, &mut wr, &secret()).await.unwrap();
    s
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

pub async fn listen_with(h: &WorkerHandle, role: Role, kv_transport: KvTransport) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(serve(
        l,
        h.clone(),
        ServerConfig {
            role,
            fault_corrupt_kv: false,
            kv_transport,
            secret: secret(),
            draining: Arc::default(),
            spans: None,
            model: None,
        },
    ));
    addr
}

pub async fn listen(h: &WorkerHandle, role: Role) -> String {
    listen_with(h, role, KvTransport::Tcp).await
}

/// Whether this machine can run the same-host ring (Linux: a boot id and memfds).
pub fn ring_here() -> bool {
    cfg!(target_os = "linux") && std::fs::read_to_string("/proc/sys/kernel/random/boot_id").is_ok()
}

pub fn decode_request(id: u64, prompt: Vec<u32>, transfer: u64) -> WorkRequest {
    let now = Instant::now();
    WorkRequest {
        id: RequestId(id),
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(8),
        stop: Vec::new(),
        ignore_eos: true,
        arrived: now,
        admitted: now,
        mode: WorkMode::Decode(tr(transfer)),
        meter: None,
        cache_scope: None,
        forward: None,
        trace: None,
    }
}

pub async fn wait_free(h: &WorkerHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.stats().kv_blocks_used != 0 || h.stats().waiting != 0 || h.stats().running != 0 {
        assert!(Instant::now() < deadline, "blocks leaked: {:?}", h.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn msg(id: u64, prompt: Vec<u32>, mode: Mode) -> GenerateMsg {
    GenerateMsg {
        id,
        prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: Some(1),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        },
        max_tokens: Some(8),
        stop: Vec::new(),
        ignore_eos: true,
        mode,
        cache_scope: None,
        trace: None,
    }
}

/// Reads a request's events to the end: (text, whether the KV was recomputed).
pub async fn drain(r: &mut RemoteRequest, mut text: String) -> (String, bool) {
    loop {
        match r.next().await.unwrap() {
            Some(FromWorker::Text { delta, .. }) => text.push_str(&delta),
            Some(FromWorker::Finished { timing, .. }) => return (text, timing.kv_recomputed),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// One crafted transfer of `tokens` tokens for `transfer` to the decode worker at `addr`: `frames`
/// are whole frame byte strings (header included); returns the acknowledgement.
pub async fn push(
    addr: &str,
    transfer: u64,
    tokens: u32,
    layout: [u32; 4],
    frames: Vec<Vec<u8>>,
) -> FromWorker {
    push_with(addr, transfer, token(transfer), tokens, layout, frames).await
}

/// [`push`] with the token the sender presents.
pub async fn push_with(
    addr: &str,
    transfer: u64,
    token: TransferToken,
    tokens: u32,
    layout: [u32; 4],
    frames: Vec<Vec<u8>>,
) -> FromWorker {
    let mut s = authed(addr).await;
    let begin = ToWorker::KvBegin {
        transfer: TransferId(transfer),
        token,
        n_tokens: tokens,
        layout,
        same_host: None,
    };
    write_frame(&mut s, FrameKind::Control, &encode_control(&begin).unwrap()).await.unwrap();
    for f in frames {
        if s.write_all(&f).await.is_err() {
            break; // the receiver gave up early and closed
        }
    }
    let _ = s.shutdown().await;
    match read_frame(&mut s).await.unwrap() {
        Some((FrameKind::Control, p)) => decode_control(&p).unwrap(),
        other => panic!("expected an acknowledgement, got {other:?}"),
    }
}

pub fn frame(kind: FrameKind, payload: &[u8]) -> Vec<u8> {
    let mut out = FrameHeader::for_payload(kind, payload).unwrap().encode().to_vec();
    out.extend_from_slice(payload);
    out
}

pub fn chunk(transfer: u64, first: u32, blocks: &[u8], block_bytes: usize) -> Vec<u8> {
    let c = KvChunk {
        transfer: TransferId(transfer),
        first_block: first,
        n_blocks: (blocks.len() / block_bytes) as u32,
        bytes: blocks.to_vec(),
    };
    frame(FrameKind::KvChunk, &c.encode())
}

pub fn end(transfer: u64, chunks: u32) -> Vec<u8> {
    frame(
        FrameKind::Control,
        &encode_control(&ToWorker::KvEnd { transfer: TransferId(transfer), chunks }).unwrap(),
    )
}

pub fn refused(ack: &FromWorker) -> String {
    match ack {
        FromWorker::KvAck { ok: false, message, .. } => message.clone().unwrap_or_default(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Builds a crafted transfer's frames from (transfer id, ring length).
pub type Frames = Box<dyn FnOnce(u64, u64) -> Vec<Vec<u8>>>;

/// A ring chunk's control frame.
pub fn ring_chunk(transfer: u64, first_block: u32, n_blocks: u32, offset: u64, checksum: u64) -> Vec<u8> {
    let m = ToWorker::KvRingChunk { transfer: TransferId(transfer), first_block, n_blocks, offset, checksum };
    frame(FrameKind::Control, &encode_control(&m).unwrap())
}

pub fn checksum(bytes: &[u8]) -> u64 {
    let mut c = tokenpath_protocol::frame::Checksum::default();
    c.update(bytes);
    c.digest()
}

/// One crafted same-host transfer: asks for a ring, writes `good` into it at offset 0 through its
/// own mapping, then sends `frames(ring_len)`; returns the acknowledgement (or the refusal of the
/// ring, `None`, when this machine cannot run one).
pub async fn push_ring(
    addr: &str,
    transfer: u64,
    tokens: u32,
    layout: [u32; 4],
    good: &[u8],
    frames: impl FnOnce(u64) -> Vec<Vec<u8>>,
) -> Option<FromWorker> {
    let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?.trim().to_owned();
    let mut s = authed(addr).await;
    let door = tokenpath_worker::net::KvDoor::open().unwrap();
    let begin = ToWorker::KvBegin {
        transfer: TransferId(transfer),
        token: token(transfer),
        n_tokens: tokens,
        layout,
        same_host: Some(SameHost { host, door: door.name().to_owned() }),
    };
    write_frame(&mut s, FrameKind::Control, &encode_control(&begin).unwrap()).await.unwrap();
    let offer = match read_frame(&mut s).await.unwrap() {
        Some((FrameKind::Control, p)) => match decode_control::<FromWorker>(&p).unwrap() {
            FromWorker::KvRing { offer } => offer?,
            other => panic!("expected a ring offer, got {other:?}"),
        },
        other => panic!("expected a ring offer, got {other:?}"),
    };
    let file = std::fs::File::from(door.receive(TransferId(transfer), &token(transfer)).await.unwrap());
    let map = memmap2::MmapOptions::new().len(offer.len as usize).map_raw(&file).unwrap();
    assert!(good.len() <= map.len());
    // SAFETY: inside the mapping (checked just above); the ring is sealed against shrinking.
    unsafe { std::ptr::copy_nonoverlapping(good.as_ptr(), map.as_mut_ptr(), good.len()) };
    for f in frames(offer.len) {
        if s.write_all(&f).await.is_err() {
            break;
        }
    }
    let _ = s.shutdown().await;
    loop {
        match read_frame(&mut s).await.unwrap() {
            Some((FrameKind::Control, p)) => match decode_control::<FromWorker>(&p).unwrap() {
                FromWorker::KvRingFree { .. } => {}
                ack => return Some(ack),
            },
            other => panic!("expected an acknowledgement, got {other:?}"),
        }
    }
}

/// The first `len` bytes of the crafted ring transfers' payload.
pub fn good_prefix(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7) as u8).collect()
}

/// Reads frames until the peer closes; every control message it sent on the way.
pub async fn read_to_close(s: &mut TcpStream) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    while let Ok(Ok(Some((_, p)))) = tokio::time::timeout(Duration::from_secs(15), read_frame(s)).await {
        got.push(p);
    }
    got
}

/// Runs a prefill of transfer `id` on the worker at `pa` that pushes its KV to `decode_addr`;
/// whether the transfer succeeded, by the worker's own report.
pub async fn prefill_to(pa: &str, id: u64, decode_addr: String) -> bool {
    let mode = Mode::Prefill { transfer: TransferId(id), token: token(id), decode_addr };
    let t = Duration::from_secs(30);
    let mut pre = RemoteRequest::open(pa, &secret(), msg(id, prompt(id as u32, 40), mode), t).await.unwrap();
    loop {
        match pre.next().await.unwrap() {
            Some(FromWorker::KvSent { ok, .. }) => return ok,
            Some(_) => {}
            None => panic!("the prefill worker closed without a transfer report"),
        }
    }
}

/// Plays an authenticated decode worker that offers a ring and passes `fd` through the prefill
/// worker's door (or nothing); returns the kind of the first frame that follows the offer.
pub async fn offer_a_ring_passing(rogue: TcpListener, fd: Option<std::fs::File>) -> Option<FrameKind> {
    use std::os::fd::AsFd;
    let (mut s, _) = rogue.accept().await.unwrap();
    let (mut rd, mut wr) = s.split();
    tokenpath_protocol::auth::accept(&mut rd, &mut wr, &secret()).await.unwrap();
    let Some((FrameKind::Control, p)) = read_frame(&mut s).await.unwrap() else { panic!("no KvBegin") };
    let ToWorker::KvBegin { transfer, token, same_host: Some(sh), .. } = decode_control(&p).unwrap() else {
        panic!("expected a same-host KvBegin");
    };
    if let Some(f) = fd {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(sh.door.as_bytes()).unwrap();
        let door = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        let mut m = transfer.0.to_le_bytes().to_vec();
        m.extend_from_slice(&token.0);
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut cmsg = rustix::net::SendAncillaryBuffer::new(&mut space);
        let fds = [f.as_fd()];
        cmsg.push(rustix::net::SendAncillaryMessage::ScmRights(&fds));
        rustix::net::sendmsg(&door, &[std::io::IoSlice::new(&m)], &mut cmsg, rustix::net::SendFlags::empty())
            .unwrap();
    }
    let offer = FromWorker::KvRing { offer: Some(tokenpath_protocol::cluster::RingOffer { len: 4096 }) };
    s.write_all(&frame(FrameKind::Control, &encode_control(&offer).unwrap())).await.unwrap();
    read_frame(&mut s).await.unwrap().map(|(k, _)| k)
}
