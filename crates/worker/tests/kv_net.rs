//! The KV transfer over real loopback sockets, into a decode worker's lent blocks: a handoff
//! through two served workers generates what one colocated worker generates; crafted transfers
//! that are truncated, corrupted, out of order, oversized, short of blocks or of another layout are
//! refused (so the prompt is recomputed) even though the blocks they were read into still hold an
//! earlier transfer's bytes; and every path gives the lent blocks back.
#![allow(clippy::unwrap_used)]

mod support;

use support::*;

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
                            let bb = d.kv_layout().block_bytes();
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

#[test]
fn crafted_transfers_are_refused_and_the_lent_blocks_come_back() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    let l = d.kv_layout();
    let layout = l.fingerprint();
    let bb = l.block_bytes();
    // 40 tokens: three blocks.
    let (tokens, n_blocks) = (40u32, 3usize);
    let good: Vec<u8> = (0..n_blocks * bb).map(|i| if i % 2 == 1 { 0x3c } else { i as u8 }).collect();
    rt().block_on(async {
        let addr = listen(&d, Role::Decode).await;
        let mut next_id = 0u64;
        let mut run = |frames: Vec<Vec<u8>>, tokens_said: u32, layout_said: [u32; 4]| {
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
        let (_, ack) = run(vec![], tokens, [layout[0], layout[1], layout[2], layout[3] + 1]).await;
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

#[test]
fn ring_chunks_are_bounded_checked_and_refused_without_a_ring() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    let l = d.kv_layout();
    let layout = l.fingerprint();
    let bb = l.block_bytes();
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

/// A decode request reserves its prompt's whole KV when it opens, so a decode worker without
/// room refuses at once (`Overloaded`: the gateway tries another decode worker before any
/// prefill runs) instead of failing after the prefill did the work.
#[test]
fn a_decode_worker_without_kv_room_refuses_at_open() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0"); // 1,024 KV tokens: 64 blocks of 16
    rt().block_on(async {
        let da = listen(&d, Role::Decode).await;
        let sec = secret();
        let open = |i: u64| {
            let mode = Mode::Decode { transfer: TransferId(i), token: token(i) };
            RemoteRequest::open(&da, &sec, msg(i, prompt(i as u32, 400), mode), Duration::from_secs(30))
        };
        let held = (open(1).await.unwrap(), open(2).await.unwrap());
        // Two 400-token reservations: at least 50 of the 64 blocks.
        let deadline = Instant::now() + Duration::from_secs(30);
        while d.stats().kv_blocks_free > 14 {
            assert!(Instant::now() < deadline, "the reservations never showed: {:?}", d.stats());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match open(3).await {
            Err(tokenpath_protocol::ProtocolError::Overloaded { .. }) => {}
            Err(e) => panic!("expected Overloaded, got {e}"),
            Ok(_) => panic!("a decode worker without room accepted a 400-token reservation"),
        }
        drop(held);
        wait_free(&d).await;
    });
    drop(d);
    wd.join().unwrap();
}

/// Asks the worker at `addr` for its stats; `None` when it closes without answering.
async fn stats_of(addr: &str) -> Option<FromWorker> {
    let mut s = authed(addr).await;
    write_frame(&mut s, FrameKind::Control, &encode_control(&ToWorker::Stats).unwrap()).await.unwrap();
    match read_frame(&mut s).await {
        Ok(Some((FrameKind::Control, p))) => Some(decode_control(&p).unwrap()),
        _ => None,
    }
}

/// A worker whose batcher thread died (a panic in a step) must not look healthy: it answers no
/// stats, so the gateway marks it down, and it refuses requests instead of queueing them forever.
#[test]
fn a_worker_whose_batcher_died_answers_no_stats_and_takes_no_requests() {
    let e = engine();
    let (w, h) = spawn(&e, "x0");
    rt().block_on(async {
        let addr = listen(&h, Role::Both).await;
        assert!(matches!(stats_of(&addr).await, Some(FromWorker::Stats(_))), "alive: it answers");
        h.fault_panic();
        let deadline = Instant::now() + Duration::from_secs(30);
        while h.is_alive() {
            assert!(Instant::now() < deadline, "the batcher thread did not stop");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(stats_of(&addr).await.is_none(), "a dead worker answers no stats");
        let r =
            RemoteRequest::open(&addr, &secret(), msg(1, prompt(1, 8), Mode::Full), Duration::from_secs(30))
                .await;
        assert!(r.is_err(), "a dead worker takes no request");
    });
    drop(h);
    assert!(w.join().is_err(), "the batcher thread ended in a panic");
}
