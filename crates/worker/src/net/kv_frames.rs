//! The KV sender's TCP path: the batcher's exports leave as `KvChunk` frames, each one vectored
//! write of header, block bytes (straight from the export buffer) and trailer.
//!
//! A frame's checksum is in its header, so it must be computed before the frame's first byte
//! goes out. On a prefill worker it is computed before the transfer: the batcher exports one
//! frame's blocks at a time ([`frame_blocks`]) and hashes them ([`frame_sums`]) right after
//! copying them out of the cache, while they are still in cache: ≈ 3 ms per 94 MB there, on a
//! thread busy with a prefill of seconds, against ≈ 7–8 ms when the sender re-read them from
//! memory on the transfer's critical thread (on loopback a `writev` of a frame runs the whole
//! TCP path, the receiver's side included, and seldom finds the socket full, so a hash there
//! always adds to the transfer). The sender then only adds each frame's 16-byte trailer to its
//! state. Bytes without sums are
//! hashed by the sender, while the socket is full if it ever is: whenever the write of one frame
//! would block (the decode worker has not read the bytes already queued), the sender hashes the
//! next frame a piece at a time, yielding to the runtime between pieces so that it notices at
//! once when the socket takes bytes again. When the receiver is the slower end, every hash but
//! the first frame's hides in time the sender would have spent waiting; when the sender is,
//! nothing is lost (the hash runs when it would have anyway).

use super::kv::{COPY_PIECE, KV_FRAME_TARGET_BYTES};
use std::collections::VecDeque;
use std::io::IoSlice;
use std::ops::Range;
use std::sync::Arc;
use tokenpath_protocol::cluster::{KvChunk, TransferId, KV_TRAILER};
use tokenpath_protocol::frame::{Checksum, FrameHeader, FrameKind, MAX_KV_CHUNK_BYTES};
use tokenpath_protocol::ProtocolError;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;

fn conn_err(e: impl std::fmt::Display) -> ProtocolError {
    ProtocolError::Connection { message: e.to_string() }
}

/// Bytes hashed ahead between two looks at the socket: the hash of 256 KiB takes tens of µs,
/// far less than a full loopback socket buffer takes to drain.
const AHEAD_PIECE: usize = 4 * COPY_PIECE;

/// The frames an export of `len` bytes is split into: whole blocks, `blocks_per_frame` of them
/// (the last frame may hold fewer), as byte ranges.
fn frame_ranges(
    len: usize,
    block_bytes: usize,
    blocks_per_frame: usize,
) -> impl Iterator<Item = Range<usize>> {
    let step = blocks_per_frame * block_bytes;
    (0..len).step_by(step.max(1)).map(move |start| start..(start + step).min(len))
}

/// Whole blocks per frame for frames of about `target_bytes`.
fn blocks_per_frame(block_bytes: usize, target_bytes: usize) -> usize {
    (target_bytes / block_bytes.max(1)).max(1)
}

/// Whole blocks in one KV frame: an export of at most this many blocks is exactly one frame.
pub(crate) fn frame_blocks(block_bytes: usize) -> usize {
    blocks_per_frame(block_bytes, frame_target_bytes())
}

/// The checksum state of each frame's block bytes, for an export of `bytes` (whole blocks of
/// `block_bytes`) split as the TCP sender splits it: what the batcher computes right after the
/// export, with the bytes still in cache. The sender adds each frame's trailer.
pub(crate) fn frame_sums(bytes: &[u8], block_bytes: usize) -> Vec<Checksum> {
    let per = blocks_per_frame(block_bytes, frame_target_bytes());
    frame_ranges(bytes.len(), block_bytes.max(1), per)
        .map(|r| {
            let mut sum = Checksum::default();
            bytes[r].chunks(COPY_PIECE).for_each(|p| sum.update(p));
            sum
        })
        .collect()
}

/// The block bytes of one frame: the target frame size less its trailer.
pub(crate) fn frame_target_bytes() -> usize {
    KV_FRAME_TARGET_BYTES.min(MAX_KV_CHUNK_BYTES as usize) - KV_TRAILER
}

/// One frame waiting to go: some whole blocks of an export buffer, and its checksum so far.
struct Frame {
    export: Arc<Vec<u8>>,
    range: Range<usize>,
    trailer: [u8; KV_TRAILER],
    sum: Checksum,
    hashed: usize,
}

impl Frame {
    fn part(&self) -> &[u8] {
        &self.export[self.range.clone()]
    }

    fn hashed_all(&self) -> bool {
        self.hashed > self.range.len()
    }

    /// Hashes up to `max` more bytes (the trailer last); true once the whole payload is hashed.
    fn hash_some(&mut self, max: usize) -> bool {
        let len = self.range.len();
        if self.hashed < len {
            let end = self.hashed.saturating_add(max).min(len);
            let piece = &self.export[self.range.start + self.hashed..self.range.start + end];
            self.sum.update(piece);
            self.hashed = end;
        }
        if self.hashed == len {
            self.sum.update(&self.trailer);
            self.hashed = len + 1;
        }
        self.hashed_all()
    }

    fn checksum(&mut self) -> u64 {
        while !self.hash_some(usize::MAX) {}
        self.sum.digest()
    }
}

/// The frames of the exports received so far, in order, and the sender's count of them.
pub(crate) struct FrameQueue {
    transfer: TransferId,
    block_bytes: usize,
    blocks_per_frame: usize,
    frames: VecDeque<Frame>,
    /// Frames written.
    pub(crate) sent: u32,
    /// Block bytes written.
    pub(crate) bytes: u64,
}

impl FrameQueue {
    pub(crate) fn new(transfer: TransferId, block_bytes: usize, target_bytes: usize) -> Self {
        let block_bytes = block_bytes.max(1);
        let blocks_per_frame = blocks_per_frame(block_bytes, target_bytes);
        Self { transfer, block_bytes, blocks_per_frame, frames: VecDeque::new(), sent: 0, bytes: 0 }
    }

    /// Queues one export (blocks from `first_block` on) as frames of whole blocks. `sums`, when
    /// there is one per frame, are the frames' block bytes already hashed ([`frame_sums`]).
    pub(crate) fn push(&mut self, first_block: u32, bytes: Vec<u8>, sums: Vec<Checksum>) {
        let export = Arc::new(bytes);
        let ranges: Vec<Range<usize>> =
            frame_ranges(export.len(), self.block_bytes, self.blocks_per_frame).collect();
        let mut sums = (sums.len() == ranges.len()).then(|| sums.into_iter());
        for (i, range) in ranges.into_iter().enumerate() {
            let first = first_block + (i * self.blocks_per_frame) as u32;
            let n_blocks = (range.len() / self.block_bytes) as u32;
            let trailer = KvChunk::trailer(self.transfer, first, n_blocks);
            let export = Arc::clone(&export);
            let (sum, hashed) = match sums.as_mut().and_then(Iterator::next) {
                Some(sum) => (sum, range.len()),
                None => (Checksum::default(), 0),
            };
            self.frames.push_back(Frame { export, range, trailer, sum, hashed });
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Writes the first queued frame, hashing the next one whenever the socket is full. `more`
    /// is polled for exports that arrive meanwhile, so the hash can run ahead into them. The
    /// written frame's export goes to `spent` (freed later, off the transfer's path) when it
    /// was the export's last frame. `corrupt`: testing only, one byte of this frame flipped
    /// after its checksum was computed.
    pub(crate) async fn write_next(
        &mut self,
        wr: &mut OwnedWriteHalf,
        more: &mut impl FnMut() -> Option<(u32, Vec<u8>, Vec<Checksum>)>,
        spent: &mut Vec<Arc<Vec<u8>>>,
        corrupt: bool,
    ) -> Result<(), ProtocolError> {
        let Some(mut frame) = self.frames.pop_front() else { return Ok(()) };
        let len = frame.range.len() + KV_TRAILER;
        let len32 = u32::try_from(len).map_err(conn_err)?;
        let header = FrameHeader { kind: FrameKind::KvChunk, len: len32, checksum: frame.checksum() };
        let header = header.encode();
        let mut flipped = None;
        if corrupt {
            let mut bad = frame.part().to_vec();
            bad[0] ^= 0x5a;
            flipped = Some(bad);
        }
        let part = flipped.as_deref().unwrap_or(frame.part());
        let mut slices = [IoSlice::new(&header), IoSlice::new(part), IoSlice::new(&frame.trailer)];
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            match wr.try_write_vectored(rest) {
                Ok(0) => return Err(conn_err(std::io::Error::from(std::io::ErrorKind::WriteZero))),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    while let Some((first_block, bytes, sums)) = more() {
                        self.push(first_block, bytes, sums);
                    }
                    match self.frames.front_mut().filter(|f| !f.hashed_all()) {
                        Some(next) => {
                            next.hash_some(AHEAD_PIECE);
                            // Lets the runtime poll the socket's readiness before the next try.
                            tokio::task::yield_now().await;
                        }
                        None => {
                            super::within("sending KV", async { wr.writable().await.map_err(conn_err) })
                                .await?
                        }
                    }
                }
                Err(e) => return Err(conn_err(e)),
            }
        }
        super::within("sending KV", async { wr.flush().await.map_err(conn_err) }).await?;
        self.sent += 1;
        self.bytes += frame.range.len() as u64;
        if Arc::strong_count(&frame.export) == 1 {
            spent.push(frame.export);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_cover_each_export_in_whole_blocks_and_hash_like_one_pass() {
        let mut q = FrameQueue::new(TransferId(7), 10, 25);
        q.push(3, (0..50u8).collect(), Vec::new());
        let got: Vec<(Range<usize>, [u8; KV_TRAILER])> =
            q.frames.iter().map(|f| (f.range.clone(), f.trailer)).collect();
        let want = vec![
            (0..20, KvChunk::trailer(TransferId(7), 3, 2)),
            (20..40, KvChunk::trailer(TransferId(7), 5, 2)),
            (40..50, KvChunk::trailer(TransferId(7), 7, 1)),
        ];
        assert_eq!(got, want);
        for f in q.frames.iter_mut() {
            let mut whole = f.part().to_vec();
            whole.extend_from_slice(&f.trailer);
            let want = tokenpath_protocol::frame::checksum(&whole);
            f.hash_some(3);
            f.hash_some(1);
            assert_eq!(f.checksum(), want, "hashed ahead in pieces, then finished");
        }
    }

    #[test]
    fn sums_from_the_export_give_the_frames_own_checksums() {
        let bb = 368_640;
        let bytes: Vec<u8> = (0..13 * bb).map(|i| (i * 31 / 7) as u8).collect();
        let sums = frame_sums(&bytes, bb);
        let target = frame_target_bytes();
        let (mut pre, mut own) =
            (FrameQueue::new(TransferId(1), bb, target), FrameQueue::new(TransferId(1), bb, target));
        assert_eq!(sums.len(), 3, "5 + 5 + 3 blocks");
        pre.push(40, bytes.clone(), sums);
        own.push(40, bytes, Vec::new());
        assert_eq!(pre.frames.len(), own.frames.len());
        for (a, b) in pre.frames.iter_mut().zip(own.frames.iter_mut()) {
            assert!(a.hashed == a.range.len() && b.hashed == 0);
            assert_eq!(a.checksum(), b.checksum());
        }
        // Sums that do not match the split are ignored, never trusted.
        let mut q = FrameQueue::new(TransferId(1), bb, target);
        q.push(0, vec![0; 2 * bb], vec![Checksum::default(); 3]);
        assert_eq!(q.frames[0].hashed, 0);
    }
}
