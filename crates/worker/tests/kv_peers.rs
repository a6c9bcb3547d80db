//! The KV plane against hostile peers, over real loopback sockets: unauthenticated connections
//! get nothing but a close, a prefill worker sends no KV to a peer without the secret and maps
//! only a ring passed through its own door, forged or second `KvBegin`s never disturb a good
//! transfer, and a stalled or mute peer is given up in bounded time with every lent block back.
#![allow(clippy::unwrap_used)]

mod support;

use support::*;

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
                tokenpath_gateway::cluster::client::stats(addr, &other, t).await.is_err(),
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
    let layout = l.fingerprint();
    let bb = l.block_bytes();
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
    let layout = l.fingerprint();
    let bb = l.block_bytes();
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
