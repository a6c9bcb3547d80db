//! Framing of every byte stream between tokenpath processes (gateway ↔ worker control messages,
//! prefill → decode KV blocks): a fixed 16-byte header, then the payload.
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
//! detected instead of silently decoding
//! garbage tokens. The header decoder is sans-IO and fuzzed; [`read_frame`] / [`write_frame`] are
//! thin async wrappers.

use crate::ProtocolError;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

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
        Ok(Self { kind, len, checksum: xxh3_64(payload) })
    }

    /// The 16 header bytes.
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
        let actual = xxh3_64(payload);
        if actual != self.checksum {
            return Err(ProtocolError::Checksum { expected: self.checksum, actual });
        }
        Ok(())
    }
}

/// Reads one frame. `Ok(None)` on a clean end of stream before a header; a stream that ends
/// inside a frame is an error (a truncated transfer).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<(FrameKind, Vec<u8>)>, ProtocolError> {
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
    let header = FrameHeader::decode(&h)?;
    let mut payload = vec![0u8; header.len as usize];
    r.read_exact(&mut payload).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            bad("stream ended inside a frame payload")
        } else {
            io(e)
        }
    })?;
    header.verify(&payload)?;
    Ok(Some((header.kind, payload)))
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
    let mut hasher = Xxh3::new();
    for p in parts {
        hasher.update(p);
    }
    let header = FrameHeader { kind, len: len32, checksum: hasher.digest() };
    w.write_all(&header.encode()).await.map_err(io)?;
    for p in parts {
        w.write_all(p).await.map_err(io)?;
    }
    w.flush().await.map_err(io)
}

/// Writes one frame (header and payload) and flushes.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    payload: &[u8],
) -> Result<(), ProtocolError> {
    let header = FrameHeader::for_payload(kind, payload)?;
    w.write_all(&header.encode()).await.map_err(io)?;
    w.write_all(payload).await.map_err(io)?;
    w.flush().await.map_err(io)
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

    proptest! {
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
