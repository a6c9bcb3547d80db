//! Framing of every byte stream between tokenpath processes (gateway ↔ worker control messages,
//! prefill → decode KV blocks): a fixed 20-byte header, then the payload.
//!
//! ```text
//! magic "TPW1" | version u16 LE | kind u8 | reserved u8 (0) | payload length u32 LE | XXH3-64 u64 LE
//! ```
//!
//! Hand-written rather than a general codec crate because the whole point is what it refuses:
//! the length is checked against a per-kind bound BEFORE any allocation (a hostile peer cannot
//! make us reserve 4 GB), the version is explicit so mixed deployments fail loudly, and every
//! payload carries a 64-bit XXH3 checksum (not CRC-32: XXH3 runs at memory speed, and every KV
//! byte is checksummed twice on the transfer's critical path) so a corrupted KV transfer is
//! detected instead of silently decoding garbage tokens. The checksum is twox-hash's XXH3-64,
//! which picks its AVX2 kernel at run time (≈ 2× its SSE2 kernel on bytes in cache; a default
//! build without `target-cpu` flags would otherwise get SSE2), bit-identical to any other XXH3-64
//! (the tests compare it with xxhash-rust's). The header decoder is sans-IO and fuzzed; [`read_frame`] / [`write_frame`] are
//! thin async wrappers. Bulk payloads need not pass through a buffer of their own: a
//! [`PayloadReader`] reads one frame's payload into whatever memory the caller names (a decode
//! worker's KV blocks), hashing each piece as it lands while it is still in cache, and
//! [`write_frame_parts`] sends header and parts in one vectored write.

use crate::ProtocolError;
use std::hash::Hasher as _;
use std::io::IoSlice;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use twox_hash::XxHash3_64;

/// First bytes of every frame.
pub const FRAME_MAGIC: [u8; 4] = *b"TPW1";
/// The framing version this build speaks.
pub const FRAME_VERSION: u16 = 1;
/// Header size in bytes.
pub const FRAME_HEADER_LEN: usize = 20;
/// Largest control (JSON) payload.
pub const MAX_CONTROL_BYTES: u32 = 1 << 20;
/// Largest KV chunk payload (a few blocks; a transfer is many chunks).
pub const MAX_KV_CHUNK_BYTES: u32 = 16 << 20;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A JSON control message ([`crate::cluster`]).
    Control,
    /// Raw KV block bytes with a small binary prefix ([`crate::cluster::KvChunk`]).
    KvChunk,
}

impl FrameKind {
    fn code(self) -> u8 {
        match self {
            FrameKind::Control => 1,
            FrameKind::KvChunk => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(FrameKind::Control),
            2 => Some(FrameKind::KvChunk),
            _ => None,
        }
    }

    /// The largest payload of this kind.
    pub fn max_len(self) -> u32 {
        match self {
            FrameKind::Control => MAX_CONTROL_BYTES,
            FrameKind::KvChunk => MAX_KV_CHUNK_BYTES,
        }
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Payload kind.
    pub kind: FrameKind,
    /// Payload length (already checked against the kind's bound).
    pub len: u32,
    /// XXH3-64 of the payload.
    pub checksum: u64,
}

fn bad(message: impl Into<String>) -> ProtocolError {
    ProtocolError::InvalidFrame { message: message.into() }
}

impl FrameHeader {
    /// The header of `payload`.
    pub fn for_payload(kind: FrameKind, payload: &[u8]) -> Result<Self, ProtocolError> {
        let len = u32::try_from(payload.len()).ok().filter(|&l| l <= kind.max_len()).ok_or(
            ProtocolError::TooLarge {
                what: "frame payload",
                len: payload.len() as u64,
                max: kind.max_len().into(),
            },
        )?;
        Ok(Self { kind, len, checksum: checksum(payload) })
    }

    /// The header's [`FRAME_HEADER_LEN`] bytes.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[0..4].copy_from_slice(&FRAME_MAGIC);
        h[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
        h[6] = self.kind.code();
        h[8..12].copy_from_slice(&self.len.to_le_bytes());
        h[12..20].copy_from_slice(&self.checksum.to_le_bytes());
        h
    }

    /// Decodes and checks a header: magic, version, kind, reserved byte and the length bound.
    pub fn decode(h: &[u8; FRAME_HEADER_LEN]) -> Result<Self, ProtocolError> {
        if h[0..4] != FRAME_MAGIC {
            return Err(bad("not a tokenpath frame (bad magic)"));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if version != FRAME_VERSION {
            return Err(bad(format!("frame version {version}, this build speaks {FRAME_VERSION}")));
        }
        let kind = FrameKind::from_code(h[6]).ok_or_else(|| bad(format!("unknown frame kind {}", h[6])))?;
        if h[7] != 0 {
            return Err(bad("reserved header byte is not zero"));
        }
        let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        if len > kind.max_len() {
            return Err(ProtocolError::TooLarge {
                what: "frame payload",
                len: len.into(),
                max: kind.max_len().into(),
            });
        }
        let mut c = [0u8; 8];
        c.copy_from_slice(&h[12..20]);
        Ok(Self { kind, len, checksum: u64::from_le_bytes(c) })
    }

    /// Checks `payload` against the header's length and checksum.
    pub fn verify(&self, payload: &[u8]) -> Result<(), ProtocolError> {
        if payload.len() != self.len as usize {
            return Err(bad(format!("payload is {} bytes, header says {}", payload.len(), self.len)));
        }
        let actual = checksum(payload);
        if actual != self.checksum {
            return Err(ProtocolError::Checksum { expected: self.checksum, actual });
        }
        Ok(())
    }
}

/// Reads and checks one frame header. `Ok(None)` on a clean end of stream before it.
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<FrameHeader>, ProtocolError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    let mut got = 0;
    while got < FRAME_HEADER_LEN {
        let n = r.read(&mut h[got..]).await.map_err(io)?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(bad("stream ended inside a frame header"));
        }
        got += n;
    }
    FrameHeader::decode(&h).map(Some)
}

/// Reads one frame. `Ok(None)` on a clean end of stream before a header; a stream that ends
/// inside a frame is an error (a truncated transfer).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<(FrameKind, Vec<u8>)>, ProtocolError> {
    let Some(header) = read_header(r).await? else { return Ok(None) };
    let mut payload = vec![0u8; header.len as usize];
    let mut reader = PayloadReader::new(header);
    reader.read_into(r, &mut payload).await?;
    reader.finish()?;
    Ok(Some((header.kind, payload)))
}

/// Reads one frame that must be a control message, refusing any other kind from its header,
/// before a byte of its payload is read or allocated (a control channel never holds more than
/// [`MAX_CONTROL_BYTES`] for a peer, whatever it announces). `Ok(None)` on a clean end of stream.
pub async fn read_control_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Vec<u8>>, ProtocolError> {
    let Some(header) = read_header(r).await? else { return Ok(None) };
    if header.kind != FrameKind::Control {
        return Err(bad(format!("a {:?} frame where a control message belongs", header.kind)));
    }
    let mut payload = vec![0u8; header.len as usize];
    let mut reader = PayloadReader::new(header);
    reader.read_into(r, &mut payload).await?;
    reader.finish()?;
    Ok(Some(payload))
}

/// One frame's payload, read piece by piece into memory the caller chooses (no buffer of its
/// own, nothing zeroed first) and hashed as each piece arrives. Nothing read is trustworthy
/// until [`PayloadReader::finish`] has checked the length and checksum: a caller writing into
/// live memory must treat it as garbage on any error.
#[derive(Clone)]
pub struct PayloadReader {
    header: FrameHeader,
    left: usize,
    hasher: Checksum,
}

impl std::fmt::Debug for PayloadReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadReader").field("header", &self.header).field("left", &self.left).finish()
    }
}

impl PayloadReader {
    /// The payload announced by `header` (whose length was bounded when it was decoded).
    pub fn new(header: FrameHeader) -> Self {
        Self { header, left: header.len as usize, hasher: Checksum::default() }
    }

    /// Payload bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.left
    }

    /// Fills all of `dst` with the next payload bytes. Asking for more than remains is an error
    /// (nothing is read), and so is a stream that ends first (a truncated frame).
    pub async fn read_into<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        dst: &mut [u8],
    ) -> Result<(), ProtocolError> {
        if dst.len() > self.left {
            return Err(bad(format!("{} payload bytes asked for, {} remain", dst.len(), self.left)));
        }
        let mut got = 0;
        while got < dst.len() {
            let n = r.read(&mut dst[got..]).await.map_err(io)?;
            if n == 0 {
                self.left -= got;
                return Err(bad("stream ended inside a frame payload"));
            }
            // Hashed right after the copy into `dst`, while the bytes are still in cache.
            self.hasher.update(&dst[got..got + n]);
            got += n;
        }
        self.left -= got;
        Ok(())
    }

    /// Checks that the whole payload was read and matches the header's checksum.
    pub fn finish(self) -> Result<(), ProtocolError> {
        if self.left != 0 {
            return Err(bad(format!(
                "{} of the frame's {} payload bytes were not read",
                self.left, self.header.len
            )));
        }
        let actual = self.hasher.digest();
        if actual != self.header.checksum {
            return Err(ProtocolError::Checksum { expected: self.header.checksum, actual });
        }
        Ok(())
    }
}

/// The frames' checksum (XXH3-64, seed 0) of `bytes` in one call.
pub fn checksum(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

/// The frames' checksum (XXH3-64, seed 0) computed piece by piece: a frame's payload as it is
/// read or written, or a payload that travels outside a frame (a same-host KV ring) but is
/// checked the same way. Splitting the bytes differently never changes the digest.
#[derive(Clone, Default)]
pub struct Checksum(XxHash3_64);

impl std::fmt::Debug for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Checksum")
    }
}

impl Checksum {
    /// Adds the next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The checksum of everything added.
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

/// Writes every byte of `parts` with as few (vectored) writes as the stream allows.
async fn write_all_parts<W: AsyncWrite + Unpin>(w: &mut W, parts: &[&[u8]]) -> Result<(), ProtocolError> {
    let mut slices: Vec<IoSlice<'_>> =
        parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await.map_err(io)?;
        if n == 0 {
            return Err(io(std::io::ErrorKind::WriteZero.into()));
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Writes one frame whose payload is the concatenation of `parts`, without joining them (the
/// KV sender's block bytes go out straight from its buffer), and flushes.
pub async fn write_frame_parts<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    parts: &[&[u8]],
) -> Result<(), ProtocolError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len32 = u32::try_from(len).ok().filter(|&l| l <= kind.max_len()).ok_or(ProtocolError::TooLarge {
        what: "frame payload",
        len: len as u64,
        max: kind.max_len().into(),
    })?;
    let mut hasher = Checksum::default();
    for p in parts {
        hasher.update(p);
    }
    let header = FrameHeader { kind, len: len32, checksum: hasher.digest() }.encode();
    let mut all = Vec::with_capacity(parts.len() + 1);
    all.push(&header[..]);
    all.extend_from_slice(parts);
    write_all_parts(w, &all).await?;
    w.flush().await.map_err(io)
}

/// Writes one frame (header and payload) and flushes.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    payload: &[u8],
) -> Result<(), ProtocolError> {
    let header = FrameHeader::for_payload(kind, payload)?.encode();
    write_all_parts(w, &[&header, payload]).await?;
    w.flush().await.map_err(io)
}

/// Reads one control frame from a blocking stream (the KV pool's clients live on their own
/// threads, never on a runtime): the same checks as [`read_control_frame`], the kind refused
/// from the header before any payload is read. `Ok(None)` on a clean end of stream.
pub fn read_control_frame_sync<R: std::io::Read>(r: &mut R) -> Result<Option<Vec<u8>>, ProtocolError> {
    read_frame_sync(r, FrameKind::Control)
}

/// Reads one frame of `kind` from a blocking stream (any other kind is refused from its header,
/// before any payload is read; the length is bounded by the kind). `Ok(None)` on a clean end.
pub fn read_frame_sync<R: std::io::Read>(
    r: &mut R,
    kind: FrameKind,
) -> Result<Option<Vec<u8>>, ProtocolError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    let mut got = 0;
    while got < FRAME_HEADER_LEN {
        let n = r.read(&mut h[got..]).map_err(io)?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(bad("stream ended inside a frame header"));
        }
        got += n;
    }
    let header = FrameHeader::decode(&h)?;
    if header.kind != kind {
        return Err(bad(format!("a {:?} frame where a {kind:?} frame belongs", header.kind)));
    }
    let mut payload = vec![0u8; header.len as usize];
    r.read_exact(&mut payload).map_err(io)?;
    header.verify(&payload)?;
    Ok(Some(payload))
}

/// Writes one control frame to a blocking stream, header and payload in one write.
pub fn write_control_frame_sync<W: std::io::Write>(w: &mut W, payload: &[u8]) -> Result<(), ProtocolError> {
    write_frame_sync(w, FrameKind::Control, payload)
}

/// Writes one frame of `kind` to a blocking stream (header and payload in one vectored write).
pub fn write_frame_sync<W: std::io::Write>(
    w: &mut W,
    kind: FrameKind,
    payload: &[u8],
) -> Result<(), ProtocolError> {
    let header = FrameHeader::for_payload(kind, payload)?.encode();
    let mut parts = [std::io::IoSlice::new(&header), std::io::IoSlice::new(payload)];
    let mut slices: &mut [std::io::IoSlice<'_>] = &mut parts;
    while !slices.is_empty() {
        let n = w.write_vectored(slices).map_err(io)?;
        if n == 0 {
            return Err(io(std::io::ErrorKind::WriteZero.into()));
        }
        std::io::IoSlice::advance_slices(&mut slices, n);
    }
    w.flush().map_err(io)
}

fn io(e: std::io::Error) -> ProtocolError {
    ProtocolError::Connection { message: e.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .map(|rt| rt.block_on(f))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn frames_round_trip_and_corruption_is_caught() {
        let mut buf = Vec::new();
        block_on(write_frame(&mut buf, FrameKind::KvChunk, b"hello kv")).unwrap();
        let mut r = &buf[..];
        let (kind, payload) = block_on(read_frame(&mut r)).unwrap().unwrap();
        assert_eq!((kind, payload.as_slice()), (FrameKind::KvChunk, &b"hello kv"[..]));
        assert_eq!(block_on(read_frame(&mut r)).unwrap(), None, "clean end");

        let mut flipped = buf.clone();
        flipped[FRAME_HEADER_LEN + 2] ^= 0x10;
        let err = block_on(read_frame(&mut &flipped[..])).unwrap_err();
        assert!(matches!(err, ProtocolError::Checksum { .. }), "{err:?}");

        let mut parts = Vec::new();
        block_on(write_frame_parts(&mut parts, FrameKind::KvChunk, &[b"hello", b" kv"])).unwrap();
        assert_eq!(parts, buf, "a payload in parts frames exactly like the joined payload");

        let truncated = &buf[..buf.len() - 1];
        let err = block_on(read_frame(&mut &truncated[..])).unwrap_err();
        assert!(err.to_string().contains("inside a frame payload"), "{err}");
    }

    #[test]
    fn headers_are_bounded_before_allocation() {
        let mut h = FrameHeader::for_payload(FrameKind::Control, b"{}").unwrap().encode();
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(FrameHeader::decode(&h), Err(ProtocolError::TooLarge { .. })));
        let mut v = FrameHeader::for_payload(FrameKind::Control, b"{}").unwrap().encode();
        v[4] = 9;
        assert!(FrameHeader::decode(&v).unwrap_err().to_string().contains("version 9"));
        assert!(
            FrameHeader::for_payload(FrameKind::Control, &vec![0; MAX_CONTROL_BYTES as usize + 1]).is_err()
        );
    }

    /// Reads every frame of `wire` into the same reused buffer, the way a receiver reuses its
    /// memory: (payload or error) per frame.
    fn read_all_into_one_buffer(wire: &[u8], buf: &mut [u8]) -> Vec<Result<Vec<u8>, ProtocolError>> {
        block_on(async {
            let mut r = wire;
            let mut out = Vec::new();
            while let Some(header) = match read_header(&mut r).await {
                Ok(h) => h,
                Err(e) => {
                    out.push(Err(e));
                    return out;
                }
            } {
                let len = header.len as usize;
                let mut p = PayloadReader::new(header);
                // In two pieces, as a receiver filling two blocks would.
                let (a, b) = buf[..len].split_at_mut(len / 2);
                let res = async {
                    p.read_into(&mut r, a).await?;
                    p.read_into(&mut r, b).await?;
                    p.finish()
                }
                .await;
                let failed = res.is_err();
                out.push(res.map(|()| buf[..len].to_vec()));
                if failed {
                    return out;
                }
            }
            out
        })
    }

    #[test]
    fn a_reused_buffer_never_passes_stale_bytes_off_as_a_frame() {
        let mut wire = Vec::new();
        block_on(write_frame(&mut wire, FrameKind::KvChunk, &[7u8; 64])).unwrap();
        block_on(write_frame(&mut wire, FrameKind::KvChunk, &[9u8; 16])).unwrap();
        let mut buf = vec![0u8; 128];
        let got: Vec<Vec<u8>> =
            read_all_into_one_buffer(&wire, &mut buf).into_iter().map(Result::unwrap).collect();
        assert_eq!(got, vec![vec![7u8; 64], vec![9u8; 16]], "each frame is exactly its own bytes");

        // A second frame cut short: the buffer still holds the first frame's bytes where the
        // missing ones belong, and the frame is reported truncated, never as complete.
        let mut cut = Vec::new();
        block_on(write_frame(&mut cut, FrameKind::KvChunk, &[7u8; 64])).unwrap();
        block_on(write_frame(&mut cut, FrameKind::KvChunk, &[7u8; 64])).unwrap();
        cut.truncate(cut.len() - 10);
        let got = read_all_into_one_buffer(&cut, &mut buf);
        assert!(got[0].is_ok());
        let err = got[1].as_ref().unwrap_err();
        assert!(err.to_string().contains("inside a frame payload"), "{err}");

        // Same length, one byte flipped: the stale bytes around it do not hide it.
        let mut flipped = wire.clone();
        flipped[FRAME_HEADER_LEN + 64 + FRAME_HEADER_LEN + 3] ^= 1;
        let got = read_all_into_one_buffer(&flipped, &mut buf);
        assert!(matches!(got[1], Err(ProtocolError::Checksum { .. })), "{:?}", got[1]);
    }

    #[test]
    fn payload_reader_refuses_to_overrun_or_stop_short() {
        let mut wire = Vec::new();
        block_on(write_frame(&mut wire, FrameKind::KvChunk, &[1u8; 8])).unwrap();
        block_on(async {
            let mut r = &wire[..];
            let h = read_header(&mut r).await.unwrap().unwrap();
            let mut p = PayloadReader::new(h);
            assert!(p.read_into(&mut r, &mut [0u8; 9]).await.is_err(), "more than the frame holds");
            p.read_into(&mut r, &mut [0u8; 5]).await.unwrap();
            assert_eq!(p.remaining(), 3);
            assert!(p.finish().unwrap_err().to_string().contains("not read"));
        });
    }

    /// The run-time-dispatched XXH3 (AVX2 on this machine) against an independent implementation
    /// (xxhash-rust, built for SSE2 or scalar), whole and in pieces, on sizes across every path of
    /// the algorithm: ≤ 16, ≤ 128, ≤ 240 bytes, then stripes, blocks of 1 KiB and a tail.
    #[test]
    fn checksum_matches_the_reference_xxh3() {
        assert_eq!(checksum(b""), 0x2d06_8005_38d3_94c2, "XXH3-64 of nothing, seed 0");
        let data: Vec<u8> =
            (0..(3 << 20) + 77).map(|i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in
            [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 65_536, 368_640 + 5, data.len()]
        {
            let d = &data[..len];
            let want = xxhash_rust::xxh3::xxh3_64(d);
            assert_eq!(checksum(d), want, "{len} bytes at once");
            for piece in [1, 7, 64, 1000, 4096, 65_536] {
                let mut sum = Checksum::default();
                d.chunks(piece).for_each(|p| sum.update(p));
                assert_eq!(sum.digest(), want, "{len} bytes in pieces of {piece}");
            }
        }
    }

    proptest! {
        #[test]
        fn checksum_in_any_pieces_is_the_reference(
            payload in proptest::collection::vec(any::<u8>(), 0..6000),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..6),
        ) {
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(payload.len() + 1)).collect();
            at.sort_unstable();
            let mut sum = Checksum::default();
            let mut from = 0;
            for &to in at.iter().chain(std::iter::once(&payload.len())) {
                sum.update(&payload[from..to]);
                from = to;
            }
            let want = xxhash_rust::xxh3::xxh3_64(&payload);
            prop_assert_eq!(sum.digest(), want);
            prop_assert_eq!(checksum(&payload), want);
        }

        #[test]
        fn header_decoder_never_panics(bytes in proptest::array::uniform20(any::<u8>())) {
            let _ = FrameHeader::decode(&bytes);
        }

        #[test]
        fn any_payload_round_trips(payload in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut buf = Vec::new();
            block_on(write_frame(&mut buf, FrameKind::Control, &payload)).unwrap();
            let got = block_on(read_frame(&mut &buf[..])).unwrap().unwrap();
            prop_assert_eq!(got.1, payload);
        }
    }
}
