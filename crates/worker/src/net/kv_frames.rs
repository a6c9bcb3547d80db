//! The KV sender's TCP path: the batcher's exports leave as `KvChunk` frames, each one vectored
//! write of header, block bytes (straight from the export buffer) and trailer.
//!
//! A frame's checksum is in its header, so it must be computed before the frame's first byte
//! goes out. It is computed while the socket is full instead: whenever the write of one frame
//! would block (the decode worker has not read the bytes already queued), the sender hashes the
//! next frame a piece at a time, yielding to the runtime between pieces so that it notices at
//! once when the socket takes bytes again. When the receiver is the slower end, every hash but
//! the first frame's hides in time the sender would have spent waiting; when the sender is,
//! nothing is lost (the hash runs when it would have anyway).

use super::kv::COPY_PIECE;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::ops::Range;
use std::sync::Arc;
use tokenpath_protocol::cluster::{KvChunk, TransferId, KV_TRAILER};
use tokenpath_protocol::frame::{Checksum, FrameHeader, FrameKind};
use tokenpath_protocol::ProtocolError;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;

fn conn_err(e: impl std::fmt::Display) -> ProtocolError {
    ProtocolError::Connection { message: e.to_string() }
}

/// Bytes hashed ahead between two looks at the socket: the hash of 256 KiB takes tens of µs,
/// far less than a full loopback socket buffer takes to drain.
const AHEAD_PIECE: usize = 4 * COPY_PIECE;

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
        let blocks_per_frame = (target_bytes / block_bytes).max(1);
        Self { transfer, block_bytes, blocks_per_frame, frames: VecDeque::new(), sent: 0, bytes: 0 }
    }

    /// Queues one export (blocks from `first_block` on) as frames of whole blocks.
    pub(crate) fn push(&mut self, first_block: u32, bytes: Vec<u8>) {
        let export = Arc::new(bytes);
        let step = self.blocks_per_frame * self.block_bytes;
        for (i, start) in (0..export.len()).step_by(step).enumerate() {
            let range = start..(start + step).min(export.len());
            let first = first_block + (i * self.blocks_per_frame) as u32;
            let n_blocks = (range.len() / self.block_bytes) as u32;
            let trailer = KvChunk::trailer(self.transfer, first, n_blocks);
            let export = Arc::clone(&export);
            self.frames.push_back(Frame { export, range, trailer, sum: Checksum::default(), hashed: 0 });
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
        more: &mut impl FnMut() -> Option<(u32, Vec<u8>)>,
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
                    while let Some((first_block, bytes)) = more() {
                        self.push(first_block, bytes);
                    }
                    match self.frames.front_mut().filter(|f| !f.hashed_all()) {
                        Some(next) => {
                            next.hash_some(AHEAD_PIECE);
                            // Lets the runtime poll the socket's readiness before the next try.
                            tokio::task::yield_now().await;
                        }
                        None => wr.writable().await.map_err(conn_err)?,
                    }
                }
                Err(e) => return Err(conn_err(e)),
            }
        }
        wr.flush().await.map_err(conn_err)?;
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
        q.push(3, (0..50u8).collect());
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
}
