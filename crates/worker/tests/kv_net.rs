//! The KV transfer over real loopback sockets, into a decode worker's lent blocks: a handoff
//! through two served workers generates what one colocated worker generates; crafted transfers
//! that are truncated, corrupted, out of order, oversized, short of blocks or of another layout are
//! refused (so the prompt is recomputed) even though the blocks they were read into still hold an
//! earlier transfer's bytes; and every path gives the lent blocks back.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_engine::model::Model;
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::Engine;
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_protocol::cluster::{
    decode_control, encode_control, FromWorker, GenerateMsg, KvChunk, Mode, SameHost, SamplingMsg, ToWorker,
    TransferId, TransferToken,
};
use tokenpath_protocol::frame::{read_frame, write_frame, FrameHeader, FrameKind, FRAME_HEADER_LEN};
use tokenpath_timeline::{RequestId, WorkerId};
use tokenpath_worker::net::client::RemoteRequest;
use tokenpath_worker::net::server::{serve, ServerConfig};
use tokenpath_worker::net::KvTransport;
use tokenpath_worker::{
    Role, Transfer, WorkMode, WorkRequest, WorkStream, Worker, WorkerConfig, WorkerHandle,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

fn engine() -> Arc<Engine> {
    let bytes = tiny_model_bytes(&TinySpec { n_ctx: 512, ..TinySpec::default() }).unwrap();
    Arc::new(Engine::from_model(Model::from_bytes(bytes).unwrap()).unwrap())
}

fn spawn(e: &Arc<Engine>, id: &str) -> (Worker, WorkerHandle) {
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

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 31 + seed * 17) % 250).collect()
}

/// The secret every served worker of these tests demands.
fn secret() -> ClusterSecret {
    ClusterSecret::new("kv-net-test-cluster-secret").unwrap()
}

/// The token of transfer `id` in these tests (a real gateway draws them at random).
fn token(id: u64) -> TransferToken {
    let mut t = [0x5a; 16];
    t[..8].copy_from_slice(&id.to_le_bytes());
    TransferToken(t)
}

fn tr(id: u64) -> Transfer {
    Transfer { id, token: token(id) }
}

/// A connection to a served worker, authenticated with `secret()`.
async fn authed(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = s.split();
    tokenpath_protocol::auth::connect(&mut rd, &mut wr, &secret()).await.unwrap();
    s
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn listen_with(h: &WorkerHandle, role: Role, kv_transport: KvTransport) -> String {
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
        },
    ));
    addr
}

async fn listen(h: &WorkerHandle, role: Role) -> String {
    listen_with(h, role, KvTransport::Tcp).await
}

/// Whether this machine can run the same-host ring (Linux: a boot id and memfds).
fn ring_here() -> bool {
    cfg!(target_os = "linux") && std::fs::read_to_string("/proc/sys/kernel/random/boot_id").is_ok()
}

fn decode_request(id: u64, prompt: Vec<u32>, transfer: u64) -> WorkRequest {
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
    }
}

async fn wait_free(h: &WorkerHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.stats().kv_blocks_used != 0 || h.stats().waiting != 0 || h.stats().running != 0 {
        assert!(Instant::now() < deadline, "blocks leaked: {:?}", h.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn msg(id: u64, prompt: Vec<u32>, mode: Mode) -> GenerateMsg {
    GenerateMsg {
        id,
        prompt,
        sampling: SamplingMsg {
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
    }
}

/// Reads a request's events to the end: (text, whether the KV was recomputed).
async fn drain(r: &mut RemoteRequest, mut text: String) -> (String, bool) {
    loop {
        match r.next().await.unwrap() {
            Some(FromWorker::Text { delta, .. }) => text.push_str(&delta),
            Some(FromWorker::Finished { timing, .. }) => return (text, timing.kv_recomputed),
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn a_handoff_through_served_workers_generates_what_one_worker_generates() {
    let e = engine();
    let (wc, c) = spawn(&e, "c0");
    let (wp, p) = spawn(&e, "p0");
    let (wd, d) = spawn(&e, "d0");
    rt().block_on(async {
        let ca = listen(&c, Role::Both).await;
        // Over TCP; through the ring (same host, both ends willing); and back to TCP when the
        // decode worker will not offer a ring.
        let cases = [
            (KvTransport::Tcp, KvTransport::Tcp, false),
            (KvTransport::Auto, KvTransport::Auto, ring_here()),
            (KvTransport::Auto, KvTransport::Tcp, false),
        ];
        let mut i = 0u64;
        for (pt, dt, want_ring) in cases {
            let (pa, da) =
                (listen_with(&p, Role::Prefill, pt).await, listen_with(&d, Role::Decode, dt).await);
            // 70 tokens: five blocks, the last one partly filled, sent over several prefill steps.
            for len in [70usize, 16, 5] {
                i += 1;
                let tokens = prompt(i as u32, len);
                let t = Duration::from_secs(30);
                let sec = secret();
                let mut colo =
                    RemoteRequest::open(&ca, &sec, msg(i, tokens.clone(), Mode::Full), t).await.unwrap();
                let (want, _) = drain(&mut colo, String::new()).await;

                let transfer = TransferId(100 + i);
                let token = TransferToken::random().unwrap();
                let mode = Mode::Decode { transfer, token };
                let mut dec = RemoteRequest::open(&da, &sec, msg(i, tokens.clone(), mode), t).await.unwrap();
                let mode = Mode::Prefill { transfer, token, decode_addr: da.clone() };
                let mut pre = RemoteRequest::open(&pa, &sec, msg(i, tokens.clone(), mode), t).await.unwrap();
                let mut text = String::new();
                loop {
                    match pre.next().await.unwrap() {
                        Some(FromWorker::Text { delta, .. }) => text.push_str(&delta),
                        Some(FromWorker::Handoff { first_token, sampler, .. }) => {
                            dec.send(&ToWorker::Handoff { first_token, sampler }).await.unwrap();
                        }
                        Some(FromWorker::KvSent { ok, bytes, ring, .. }) => {
                            assert!(ok, "the decode worker acknowledged the transfer");
                            assert_eq!(ring, want_ring, "{pt} -> {dt}");
                            let bb = d.kv_layout().n_layer
                                * 2
                                * d.kv_layout().kv_dim
                                * d.kv_layout().block_size
                                * 2;
                            assert_eq!(bytes as usize, len.div_ceil(16) * bb);
                            break;
                        }
                        other => panic!("unexpected {other:?}"),
                    }
                }
                let (got, recomputed) = drain(&mut dec, text).await;
                assert!(!recomputed, "the transferred KV was used");
                assert_eq!(got, want, "prompt of {len} tokens, {pt} -> {dt}");
            }
        }
        assert_eq!((d.stats().kv_imports, d.stats().kv_fallbacks), (9, 0));
        for h in [&c, &p, &d] {
            wait_free(h).await;
        }
    });
    drop((c, p, d));
    for w in [wc, wp, wd] {
        w.join().unwrap();
    }
}

/// One crafted transfer of `tokens` tokens for `transfer` to the decode worker at `addr`: `frames`
/// are whole frame byte strings (header included); returns the acknowledgement.
async fn push(addr: &str, transfer: u64, tokens: u32, layout: [u32; 3], frames: Vec<Vec<u8>>) -> FromWorker {
    push_with(addr, transfer, token(transfer), tokens, layout, frames).await
}

/// [`push`] with the token the sender presents.
async fn push_with(
    addr: &str,
    transfer: u64,
    token: TransferToken,
    tokens: u32,
    layout: [u32; 3],
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

fn frame(kind: FrameKind, payload: &[u8]) -> Vec<u8> {
    let mut out = FrameHeader::for_payload(kind, payload).unwrap().encode().to_vec();
    out.extend_from_slice(payload);
    out
}

fn chunk(transfer: u64, first: u32, blocks: &[u8], block_bytes: usize) -> Vec<u8> {
    let c = KvChunk {
        transfer: TransferId(transfer),
        first_block: first,
        n_blocks: (blocks.len() / block_bytes) as u32,
        bytes: blocks.to_vec(),
    };
    frame(FrameKind::KvChunk, &c.encode())
}

fn end(transfer: u64, chunks: u32) -> Vec<u8> {
    frame(
        FrameKind::Control,
        &encode_control(&ToWorker::KvEnd { transfer: TransferId(transfer), chunks }).unwrap(),
    )
}

fn refused(ack: &FromWorker) -> String {
    match ack {
        FromWorker::KvAck { ok: false, message, .. } => message.clone().unwrap_or_default(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn crafted_transfers_are_refused_and_the_lent_blocks_come_back() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    let l = d.kv_layout();
    let layout = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
    let bb = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
    // 40 tokens: three blocks.
    let (tokens, n_blocks) = (40u32, 3usize);
    let good: Vec<u8> = (0..n_blocks * bb).map(|i| if i % 2 == 1 { 0x3c } else { i as u8 }).collect();
    rt().block_on(async {
        let addr = listen(&d, Role::Decode).await;
        let mut next_id = 0u64;
        let mut run = |frames: Vec<Vec<u8>>, tokens_said: u32, layout_said: [u32; 3]| {
            next_id += 1;
            let (id, h, addr) = (next_id, d.clone(), addr.clone());
            async move {
                let stream: WorkStream =
                    h.submit(decode_request(id, prompt(1, tokens as usize), id)).unwrap();
                let ack = push(&addr, id, tokens_said, layout_said, frames).await;
                drop(stream);
                wait_free(&h).await;
                (id, ack)
            }
        };

        // The good transfer, in two chunks; its bytes stay behind in the freed blocks, which the
        // next requests get again (the free list is last in, first out).
        let (_, ack) = run(
            vec![chunk(1, 0, &good[..2 * bb], bb), chunk(1, 2, &good[2 * bb..], bb), end(1, 2)],
            tokens,
            layout,
        )
        .await;
        assert!(matches!(ack, FromWorker::KvAck { ok: true, .. }), "{ack:?}");

        // Truncated inside the second chunk's payload: the blocks hold the first transfer's
        // bytes where the missing ones belong, and it is still refused.
        let mut cut = chunk(2, 2, &good[2 * bb..], bb);
        cut.truncate(cut.len() - 100);
        let (_, ack) = run(vec![chunk(2, 0, &good[..2 * bb], bb), cut], tokens, layout).await;
        assert!(refused(&ack).contains("inside a frame payload"), "{ack:?}");

        // A block short: the last block is never sent, the chunk count agrees.
        let (_, ack) = run(vec![chunk(3, 0, &good[..2 * bb], bb), end(3, 1)], tokens, layout).await;
        assert!(refused(&ack).contains("2 blocks arrived"), "{ack:?}");

        // One flipped byte.
        let mut flipped = chunk(4, 0, &good, bb);
        flipped[FRAME_HEADER_LEN + 7] ^= 1;
        let (_, ack) = run(vec![flipped, end(4, 1)], tokens, layout).await;
        assert!(refused(&ack).contains("checksum"), "{ack:?}");

        // Out of order: the second chunk first.
        let (_, ack) = run(
            vec![chunk(5, 2, &good[2 * bb..], bb), chunk(5, 0, &good[..2 * bb], bb), end(5, 2)],
            tokens,
            layout,
        )
        .await;
        assert!(refused(&ack).contains("in order"), "{ack:?}");

        // More blocks than were lent: refused before a byte of the payload is read.
        let mut big = good.clone();
        big.extend_from_slice(&good[..bb]);
        let (_, ack) = run(vec![chunk(6, 0, &big, bb), end(6, 1)], tokens, layout).await;
        assert!(refused(&ack).contains("past the transfer's 3 blocks"), "{ack:?}");

        // Not a whole number of blocks.
        let (_, ack) = run(vec![chunk(7, 0, &good[..bb + 2], bb), end(7, 1)], tokens, layout).await;
        assert!(refused(&ack).contains("whole number"), "{ack:?}");

        // Another transfer's chunk, another token count, another layout.
        let (_, ack) = run(vec![chunk(99, 0, &good, bb), end(8, 1)], tokens, layout).await;
        assert!(refused(&ack).contains("another transfer"), "{ack:?}");
        let (_, ack) = run(vec![chunk(9, 0, &good, bb), end(9, 1)], tokens - 1, layout).await;
        assert!(refused(&ack).contains("the prompt has 40"), "{ack:?}");
        let (_, ack) = run(vec![], tokens, [layout[0] + 1, layout[1], layout[2]]).await;
        assert!(refused(&ack).contains("does not match"), "{ack:?}");

        // The connection closing mid-transfer (a dead prefill worker).
        let (_, ack) = run(vec![chunk(11, 0, &good[..bb], bb)], tokens, layout).await;
        assert!(refused(&ack).contains("closed before the transfer ended"), "{ack:?}");
    });
    assert_eq!(d.stats().kv_imports, 1, "only the good transfer was imported");
    drop(d);
    wd.join().unwrap();
}

#[test]
fn lent_blocks_come_back_however_the_receiver_ends() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    rt().block_on(async {
        let stream = d.submit(decode_request(1, prompt(2, 40), 7)).unwrap();
        assert!(d.kv_lease(tr(8), 40).await.is_err(), "an unknown transfer");
        let forged = Transfer { id: 7, token: token(8) };
        assert!(d.kv_lease(forged, 40).await.unwrap_err().contains("not expected"), "a wrong token");
        assert!(d.kv_lease(tr(7), 41).await.unwrap_err().contains("the prompt has 40"));
        let mut lent = d.kv_lease(tr(7), 40).await.unwrap();
        assert_eq!(lent.blocks(), 3);
        assert!(lent.block_mut(3).is_none());
        assert!(d.kv_lease(tr(7), 40).await.is_err(), "lent once at a time");
        // A verdict from anyone but the holder changes nothing (a second or forged KvBegin).
        assert!(d.kv_end(tr(7), 40, false).unwrap().await.unwrap().is_err());
        assert!(d.kv_end(forged, 40, false).unwrap().await.unwrap().is_err());
        drop(lent); // the receiver went away without a verdict
        let mut again = d.kv_lease(tr(7), 40).await.unwrap();
        assert_eq!(again.blocks(), 3, "the blocks went back to the request");
        again.block_mut(0).unwrap().fill(0);
        // The request is cancelled while its blocks are out: they stay allocated (nobody else
        // may get them while they are being written) and are freed when they come back.
        let until = |pred: fn(&tokenpath_worker::WorkerStats) -> bool| {
            let d = d.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(10);
                while !pred(&d.stats()) {
                    assert!(Instant::now() < deadline, "{:?}", d.stats());
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        };
        until(|s| s.waiting == 1 && s.kv_blocks_used == 3).await;
        drop(stream);
        until(|s| s.waiting == 0).await;
        assert_eq!(d.stats().kv_blocks_used, 3, "lent blocks are not reused while out");
        let verdict = again.end(40, true).unwrap().await.unwrap();
        assert!(verdict.is_err(), "{verdict:?}");
        wait_free(&d).await;
    });
    drop(d);
    wd.join().unwrap();
}

/// Builds a crafted transfer's frames from (transfer id, ring length).
type Frames = Box<dyn FnOnce(u64, u64) -> Vec<Vec<u8>>>;

/// A ring chunk's control frame.
fn ring_chunk(transfer: u64, first_block: u32, n_blocks: u32, offset: u64, checksum: u64) -> Vec<u8> {
    let m = ToWorker::KvRingChunk { transfer: TransferId(transfer), first_block, n_blocks, offset, checksum };
    frame(FrameKind::Control, &encode_control(&m).unwrap())
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut c = tokenpath_protocol::frame::Checksum::default();
    c.update(bytes);
    c.digest()
}

/// One crafted same-host transfer: asks for a ring, writes `good` into it at offset 0 through its
/// own mapping, then sends `frames(ring_len)`; returns the acknowledgement (or the refusal of the
/// ring, `None`, when this machine cannot run one).
async fn push_ring(
    addr: &str,
    transfer: u64,
    tokens: u32,
    layout: [u32; 3],
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

#[test]
fn ring_chunks_are_bounded_checked_and_refused_without_a_ring() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    let l = d.kv_layout();
    let layout = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
    let bb = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
    let (tokens, n) = (40u32, 3u32);
    let good: Vec<u8> = (0..n as usize * bb).map(|i| (i * 7) as u8).collect();
    let sum = checksum(&good);
    rt().block_on(async {
        let addr = listen_with(&d, Role::Decode, KvTransport::Auto).await;
        let tcp_only = listen_with(&d, Role::Decode, KvTransport::Tcp).await;
        let mut id = 0u64;
        let mut run = |addr: String, frames: Frames| {
            id += 1;
            let (t, h, good) = (id, d.clone(), good.clone());
            async move {
                let stream = h.submit(decode_request(t, prompt(4, tokens as usize), t)).unwrap();
                let ack = push_ring(&addr, t, tokens, layout, &good, |len| frames(t, len)).await;
                drop(stream);
                wait_free(&h).await;
                ack
            }
        };
        let Some(ack) =
            run(addr.clone(), Box::new(move |t, _| vec![ring_chunk(t, 0, n, 0, sum), end(t, 1)])).await
        else {
            assert!(!ring_here(), "a Linux machine with a boot id offers a ring");
            return; // no ring on this machine: the TCP tests cover the transfer
        };
        assert!(matches!(ack, FromWorker::KvAck { ok: true, .. }), "the good ring transfer: {ack:?}");

        let cases: Vec<(&str, Frames)> = vec![
            ("checksum mismatch", Box::new(move |t, _| vec![ring_chunk(t, 0, n, 0, sum ^ 1), end(t, 1)])),
            (
                "outside the",
                Box::new(move |t, len| vec![ring_chunk(t, 0, n, len - bb as u64, sum), end(t, 1)]),
            ),
            ("outside the", Box::new(move |t, _| vec![ring_chunk(t, 0, n, u64::MAX, sum), end(t, 1)])),
            ("outside the", Box::new(move |t, _| vec![ring_chunk(t, 0, n, u64::MAX - 8, sum), end(t, 1)])),
            (
                "past the transfer's 3 blocks",
                Box::new(move |t, _| vec![ring_chunk(t, 0, 4, 0, sum), end(t, 1)]),
            ),
            (
                "past the transfer's 3 blocks",
                Box::new(move |t, _| vec![ring_chunk(t, 0, 0, 0, sum), end(t, 1)]),
            ),
            ("in order", Box::new(move |t, _| vec![ring_chunk(t, 1, 2, 0, sum), end(t, 1)])),
            ("another transfer", Box::new(move |t, _| vec![ring_chunk(t + 100, 0, n, 0, sum), end(t, 1)])),
            (
                "2 blocks arrived",
                Box::new(move |t, _| {
                    let two = checksum(&good_prefix(2 * bb));
                    vec![ring_chunk(t, 0, 2, 0, two), end(t, 1)]
                }),
            ),
        ];
        for (want, frames) in cases {
            let ack = run(addr.clone(), frames).await.unwrap();
            assert!(refused(&ack).contains(want), "{want}: {ack:?}");
        }
        // A decode worker that offers no ring refuses ring chunks (the sender must use frames).
        let ack =
            run(tcp_only.clone(), Box::new(move |t, _| vec![ring_chunk(t, 0, n, 0, sum), end(t, 1)])).await;
        assert!(ack.is_none(), "no ring is offered by a TCP-only worker");
    });
    assert_eq!(d.stats().kv_imports, 1, "only the good transfer was imported");
    drop(d);
    wd.join().unwrap();
}

/// The first `len` bytes of the crafted ring transfers' payload.
fn good_prefix(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7) as u8).collect()
}

/// Reads frames until the peer closes; every control message it sent on the way.
async fn read_to_close(s: &mut TcpStream) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    while let Ok(Ok(Some((_, p)))) = tokio::time::timeout(Duration::from_secs(15), read_frame(s)).await {
        got.push(p);
    }
    got
}

#[test]
fn unauthenticated_connections_get_nothing_but_a_close() {
    let e = engine();
    let (wc, c) = spawn(&e, "c0");
    let (wp, p) = spawn(&e, "p0");
    rt().block_on(async {
        let ca = listen(&c, Role::Both).await;
        let pa = listen(&p, Role::Prefill).await;
        // A listener standing in for a decode worker: nothing may ever connect to it.
        let bait = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let bait_addr = bait.local_addr().unwrap().to_string();
        let generate = |mode: Mode| {
            frame(FrameKind::Control, &encode_control(&ToWorker::Generate(msg(1, prompt(1, 20), mode))).unwrap())
        };
        let prefill = Mode::Prefill { transfer: TransferId(1), token: token(1), decode_addr: bait_addr.clone() };
        for (addr, mode) in [(&ca, Mode::Full), (&pa, prefill.clone())] {
            // Skipping the handshake: the request goes out as the first frame.
            let mut s = TcpStream::connect(addr.as_str()).await.unwrap();
            s.write_all(&generate(mode.clone())).await.unwrap();
            let got = read_to_close(&mut s).await;
            assert!(got.len() <= 1, "only the challenge, then a close: {} frames", got.len());
            // Reading the challenge and answering with garbage.
            let mut s = TcpStream::connect(addr.as_str()).await.unwrap();
            let _challenge = read_frame(&mut s).await.unwrap().unwrap();
            let auth = br#"{"type":"auth","nonce":"00000000000000000000000000000000000000000000000000000000000000ff","mac":"00000000000000000000000000000000000000000000000000000000000000ff"}"#;
            s.write_all(&frame(FrameKind::Control, auth)).await.unwrap();
            s.write_all(&generate(mode.clone())).await.unwrap();
            assert!(read_to_close(&mut s).await.is_empty(), "no welcome, no answer");
            // A client with another secret.
            let other = ClusterSecret::new("not-the-cluster-secret").unwrap();
            let t = Duration::from_secs(10);
            let e = RemoteRequest::open(addr, &other, msg(1, prompt(1, 20), mode.clone()), t).await.unwrap_err();
            assert!(e.to_string().contains("unauthenticated"), "{e}");
            assert!(
                tokenpath_worker::net::client::stats(addr, &other, t).await.is_err(),
                "stats need the secret too"
            );
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(500), bait.accept()).await.is_err(),
            "the prefill worker connected to the address an unauthenticated peer named"
        );
        for h in [&c, &p] {
            let s = h.stats();
            assert_eq!((s.waiting, s.running, s.generated_tokens, s.prompt_tokens_computed), (0, 0, 0, 0));
        }
        // With the secret, the same worker serves.
        let mut ok = RemoteRequest::open(&ca, &secret(), msg(2, prompt(2, 20), Mode::Full), Duration::from_secs(30))
            .await
            .unwrap();
        assert!(!drain(&mut ok, String::new()).await.0.is_empty());
    });
    drop((c, p));
    for w in [wc, wp] {
        w.join().unwrap();
    }
}

/// Runs a prefill of transfer `id` on the worker at `pa` that pushes its KV to `decode_addr`;
/// whether the transfer succeeded, by the worker's own report.
async fn prefill_to(pa: &str, id: u64, decode_addr: String) -> bool {
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

#[test]
fn a_prefill_worker_sends_no_kv_to_a_peer_without_the_secret() {
    let e = engine();
    let (wp, p) = spawn(&e, "p0");
    rt().block_on(async {
        let pa = listen(&p, Role::Prefill).await;
        // A rogue "decode worker": it challenges, takes the proof, answers with a made-up one,
        // and records whatever comes next.
        let rogue = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let rogue_addr = rogue.local_addr().unwrap().to_string();
        let seen = tokio::spawn(async move {
            let (mut s, _) = rogue.accept().await.unwrap();
            let challenge = br#"{"type":"challenge","version":1,"nonce":"0101010101010101010101010101010101010101010101010101010101010101"}"#;
            s.write_all(&frame(FrameKind::Control, challenge)).await.unwrap();
            let _auth = read_frame(&mut s).await.unwrap();
            let welcome = br#"{"type":"welcome","mac":"0202020202020202020202020202020202020202020202020202020202020202"}"#;
            s.write_all(&frame(FrameKind::Control, welcome)).await.unwrap();
            read_to_close(&mut s).await
        });
        let sent = prefill_to(&pa, 3, rogue_addr).await;
        assert!(!sent, "a transfer to a peer without the secret cannot succeed");
        assert!(seen.await.unwrap().is_empty(), "the rogue peer received nothing after the handshake");
        wait_free(&p).await;
    });
    drop(p);
    wp.join().unwrap();
}

#[test]
fn a_forged_or_second_kv_begin_never_disturbs_a_good_transfer() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    let l = d.kv_layout();
    let layout = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
    let bb = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
    let good: Vec<u8> = (0..3 * bb).map(|i| if i % 2 == 1 { 0x3c } else { i as u8 }).collect();
    rt().block_on(async {
        let addr = listen(&d, Role::Decode).await;
        let stream = d.submit(decode_request(1, prompt(1, 40), 1)).unwrap();
        // The right id with a wrong token: refused, and the transfer is still pending.
        let mut wrong = token(1);
        wrong.0[15] ^= 1;
        let ack = push_with(&addr, 1, wrong, 40, layout, vec![chunk(1, 0, &good, bb), end(1, 1)]).await;
        assert!(refused(&ack).contains("not expected"), "{ack:?}");
        // The good transfer starts and sends its first chunk...
        let mut s = authed(&addr).await;
        let begin = ToWorker::KvBegin {
            transfer: TransferId(1),
            token: token(1),
            n_tokens: 40,
            layout,
            same_host: None,
        };
        write_frame(&mut s, FrameKind::Control, &encode_control(&begin).unwrap()).await.unwrap();
        s.write_all(&chunk(1, 0, &good[..bb], bb)).await.unwrap();
        // ...while a second KvBegin, even with the right token, arrives on another connection
        // (and so does a forged one): both refused, neither disturbs it.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ack = push_with(&addr, 1, token(1), 40, layout, vec![end(1, 0)]).await;
        assert!(refused(&ack).contains("already being received"), "{ack:?}");
        let ack = push_with(&addr, 1, wrong, 40, layout, vec![end(1, 0)]).await;
        assert!(refused(&ack).contains("not expected"), "{ack:?}");
        s.write_all(&chunk(1, 1, &good[bb..], bb)).await.unwrap();
        s.write_all(&end(1, 2)).await.unwrap();
        let ack = match read_frame(&mut s).await.unwrap() {
            Some((FrameKind::Control, p)) => decode_control::<FromWorker>(&p).unwrap(),
            other => panic!("expected an acknowledgement, got {other:?}"),
        };
        assert!(matches!(ack, FromWorker::KvAck { ok: true, .. }), "the good transfer: {ack:?}");
        assert_eq!(d.stats().kv_imports, 1);
        drop(stream);
        wait_free(&d).await;
    });
    assert_eq!(d.stats().kv_fallbacks, 0);
    drop(d);
    wd.join().unwrap();
}

#[test]
fn a_stalled_sender_gives_the_blocks_back_while_its_socket_stays_open() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    let l = d.kv_layout();
    let layout = [l.n_layer as u32, l.kv_dim as u32, l.block_size as u32];
    let bb = l.n_layer * 2 * l.kv_dim * l.block_size * 2;
    let good: Vec<u8> = (0..bb).map(|i| if i % 2 == 1 { 0x3c } else { i as u8 }).collect();
    rt().block_on(async {
        let addr = listen(&d, Role::Decode).await;
        let stream = d.submit(decode_request(1, prompt(1, 40), 1)).unwrap();
        let mut s = authed(&addr).await;
        let begin = ToWorker::KvBegin {
            transfer: TransferId(1),
            token: token(1),
            n_tokens: 40,
            layout,
            same_host: None,
        };
        write_frame(&mut s, FrameKind::Control, &encode_control(&begin).unwrap()).await.unwrap();
        s.write_all(&chunk(1, 0, &good, bb)).await.unwrap();
        // ...and then nothing, with the socket open: the receiver gives up after PEER_IDLE and
        // says so on the same socket; the lent blocks are back with the request.
        let t0 = Instant::now();
        let ack = match read_frame(&mut s).await.unwrap() {
            Some((FrameKind::Control, p)) => decode_control::<FromWorker>(&p).unwrap(),
            other => panic!("expected an acknowledgement, got {other:?}"),
        };
        assert!(refused(&ack).contains("sent nothing"), "{ack:?}");
        assert!(t0.elapsed() >= tokenpath_worker::net::PEER_IDLE / 2, "gave up early: {:?}", t0.elapsed());
        drop(stream);
        wait_free(&d).await;
        drop(s);
    });
    drop(d);
    wd.join().unwrap();
}

#[test]
fn a_prefill_worker_gives_up_on_a_decode_peer_that_never_answers() {
    let e = engine();
    let (wp, p) = spawn(&e, "p0");
    rt().block_on(async {
        let pa = listen(&p, Role::Prefill).await;
        // Accepts, never says a word (no challenge): the handshake's deadline ends it.
        let mute = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mute_addr = mute.local_addr().unwrap().to_string();
        let held = tokio::spawn(async move {
            let (s, _) = mute.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(120)).await;
            drop(s);
        });
        let t0 = Instant::now();
        assert!(!prefill_to(&pa, 4, mute_addr).await);
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
        wait_free(&p).await;
        held.abort();
    });
    drop(p);
    wp.join().unwrap();
}

/// Plays an authenticated decode worker that offers a ring and passes `fd` through the prefill
/// worker's door (or nothing); returns the kind of the first frame that follows the offer.
async fn offer_a_ring_passing(rogue: TcpListener, fd: Option<std::fs::File>) -> Option<FrameKind> {
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

/// Security review H2: the prefill worker used to open `/proc/<pid>/fd/<fd>` as named by whoever
/// answered at `decode_addr`. Now it maps only a descriptor passed through its own door, and only
/// a sealed memfd of the offered size: a peer that passes nothing, or a plain file, gets the KV
/// as TCP frames (after a bounded wait) and the file it passed is never written.
#[test]
fn a_prefill_worker_maps_only_a_sealed_ring_passed_through_its_door() {
    if !ring_here() {
        return; // no memfd or boot id here: every transfer is TCP anyway
    }
    let e = engine();
    let (wp, p) = spawn(&e, "p0");
    rt().block_on(async {
        let pa = listen_with(&p, Role::Prefill, KvTransport::Auto).await;
        let path = std::env::temp_dir().join(format!("tp-h2-plain-{}", std::process::id()));
        std::fs::write(&path, [0u8; 4096]).unwrap();
        for (id, passed) in [
            (11u64, None),
            (12, Some(std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap())),
        ] {
            let rogue = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let rogue_addr = rogue.local_addr().unwrap().to_string();
            let peer = tokio::spawn(offer_a_ring_passing(rogue, passed));
            let (kind, _) = tokio::join!(peer, prefill_to(&pa, id, rogue_addr));
            assert_eq!(kind.unwrap(), Some(FrameKind::KvChunk), "transfer {id}: KV went as TCP frames");
            wait_free(&p).await;
        }
        assert_eq!(std::fs::read(&path).unwrap(), vec![0u8; 4096], "the passed plain file was never written");
        let _ = std::fs::remove_file(&path);
    });
    drop(p);
    wp.join().unwrap();
}
