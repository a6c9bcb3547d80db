//! Fuzzes a worker's socket reader over a byte stream: `frame::read_frame`,
//! `frame::read_control_frame` and the KV receiver's path (`read_header`, `PayloadReader` into
//! fixed-size blocks, `KvChunk::blocks_in` / `parse_trailer`, `decode_control::<ToWorker>`), as
//! `worker::net` runs them. The stream is a `&[u8]` (always ready), so a no-op waker drives the
//! futures. Odd first byte: the stream is raw bytes. Even: the rest is records
//! `kind u8 | len u16 LE | payload` that the harness frames with correct checksums, so the
//! payload decoders behind the checksum are reached too (and every such frame must read back).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use tokenpath_protocol::cluster::{decode_control, FromWorker, KvChunk, ToWorker, KV_TRAILER};
use tokenpath_protocol::frame::{
    read_control_frame, read_frame, read_header, FrameHeader, FrameKind, PayloadReader, FRAME_HEADER_LEN,
};

fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// The decode worker's receive loop (`receive_chunks`) with `lent` blocks of `block_bytes`.
async fn receive(mut r: &[u8], block_bytes: usize, lent: usize) {
    let mut blocks = vec![vec![0u8; block_bytes]; lent];
    let mut next = 0;
    loop {
        let Ok(Some(header)) = read_header(&mut r).await else { return };
        let mut payload = PayloadReader::new(header);
        match header.kind {
            FrameKind::KvChunk => {
                let Ok(n) = KvChunk::blocks_in(header.len as usize, block_bytes) else { return };
                let n = n as usize;
                if n == 0 || next + n > lent {
                    return;
                }
                for b in &mut blocks[next..next + n] {
                    if payload.read_into(&mut r, b).await.is_err() {
                        return;
                    }
                }
                let mut trailer = [0u8; KV_TRAILER];
                if payload.read_into(&mut r, &mut trailer).await.is_err() || payload.finish().is_err() {
                    return;
                }
                let _ = KvChunk::parse_trailer(&trailer);
                next += n;
            }
            FrameKind::Control => {
                let mut bytes = vec![0u8; header.len as usize];
                if payload.read_into(&mut r, &mut bytes).await.is_err() || payload.finish().is_err() {
                    return;
                }
                let _ = decode_control::<ToWorker>(&bytes);
            }
        }
    }
}

/// Everything a reader does with one stream.
fn read_all(stream: &[u8], block_bytes: usize) {
    let mut r = stream;
    while let Ok(Some((kind, payload))) = block_on(read_frame(&mut r)) {
        assert!(payload.len() <= kind.max_len() as usize);
        match kind {
            FrameKind::Control => {
                let _ = decode_control::<ToWorker>(&payload);
                let _ = decode_control::<FromWorker>(&payload);
            }
            FrameKind::KvChunk => {
                let _ = KvChunk::decode(payload, block_bytes);
            }
        }
    }
    let mut r = stream;
    while let Ok(Some(payload)) = block_on(read_control_frame(&mut r)) {
        assert!(payload.len() <= FrameKind::Control.max_len() as usize);
    }
    block_on(receive(stream, block_bytes, 8));
}

fuzz_target!(|data: &[u8]| {
    let Some((&knob, rest)) = data.split_first() else { return };
    let block_bytes = 1 + usize::from(knob >> 1) % 64;
    if knob & 1 == 1 {
        read_all(rest, block_bytes);
        return;
    }
    let mut stream = Vec::new();
    let mut frames = Vec::new();
    let mut r = rest;
    while let [k, l0, l1, tail @ ..] = r {
        let len = usize::from(u16::from_le_bytes([*l0, *l1])).min(tail.len());
        let kind = if k & 1 == 0 { FrameKind::Control } else { FrameKind::KvChunk };
        let (payload, tail) = tail.split_at(len);
        let header = FrameHeader::for_payload(kind, payload).expect("u16 lengths fit every kind");
        stream.extend_from_slice(&header.encode());
        stream.extend_from_slice(payload);
        frames.push((kind, payload));
        r = tail;
    }
    // Well-formed frames read back exactly.
    let mut s = &stream[..];
    for (kind, payload) in &frames {
        let got = block_on(read_frame(&mut s)).expect("a well-formed frame reads").expect("not at the end");
        assert_eq!((got.0, &got.1[..]), (*kind, *payload));
    }
    assert!(block_on(read_frame(&mut s)).expect("clean end").is_none());
    assert!(stream.len() >= frames.len() * FRAME_HEADER_LEN);
    read_all(&stream, block_bytes);
});
