//! Fuzzes everything a worker decodes from another process: the frame header, the control
//! messages and KV chunks. No panic, no allocation beyond the header's checked bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_protocol::cluster::{decode_control, FromWorker, KvChunk, ToWorker, KV_TRAILER};
use tokenpath_protocol::frame::{FrameHeader, FRAME_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if data.len() >= FRAME_HEADER_LEN {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h.copy_from_slice(&data[..FRAME_HEADER_LEN]);
        if let Ok(header) = FrameHeader::decode(&h) {
            assert!(header.len <= header.kind.max_len());
            let _ = header.verify(&data[FRAME_HEADER_LEN..]);
        }
    }
    let _ = decode_control::<ToWorker>(data);
    let _ = decode_control::<FromWorker>(data);
    let block_bytes = data.first().map_or(1, |b| usize::from(*b) + 1);
    let _ = KvChunk::decode(data.to_vec(), block_bytes);
    // What a receiver reading chunks straight into its blocks decides before and after the bytes.
    if let Ok(n) = KvChunk::blocks_in(data.len(), block_bytes) {
        assert_eq!(n as usize * block_bytes + KV_TRAILER, data.len());
        let mut t = [0u8; KV_TRAILER];
        t.copy_from_slice(&data[data.len() - KV_TRAILER..]);
        let _ = KvChunk::parse_trailer(&t);
    }
});
