//! Fuzzes the KV chunk payload a decode worker receives: `KvChunk::decode` (whole payload),
//! `KvChunk::blocks_in` + `KvChunk::parse_trailer` (the zero-copy receiver) must agree, never
//! panic, and an accepted chunk re-encodes to the same bytes. The first two bytes pick the
//! receiver's block size (never from the wire in production), the rest is the payload.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_protocol::cluster::{KvChunk, KV_TRAILER};

fuzz_target!(|data: &[u8]| {
    let Some((knob, payload)) = data.split_first_chunk::<2>() else { return };
    // 0 (refused) and small sizes, so whole-block payloads are reachable.
    let block_bytes = usize::from(u16::from_le_bytes(*knob) % 257);
    let decoded = KvChunk::decode(payload.to_vec(), block_bytes);
    if let Ok(c) = &decoded {
        assert_eq!(c.encode(), payload);
        assert_eq!(c.n_blocks as usize * block_bytes, c.bytes.len());
    }
    match KvChunk::blocks_in(payload.len(), block_bytes) {
        Ok(n) => {
            assert!(n > 0);
            assert_eq!(n as usize * block_bytes + KV_TRAILER, payload.len());
            let mut t = [0u8; KV_TRAILER];
            t.copy_from_slice(&payload[payload.len() - KV_TRAILER..]);
            let (transfer, first_block, said) = KvChunk::parse_trailer(&t);
            // Where the trailer agrees with the bytes, the whole-payload decoder accepts too.
            if said == n {
                let c = decoded.as_ref().expect("blocks_in and the trailer agree");
                assert_eq!((c.transfer, c.first_block, c.n_blocks), (transfer, first_block, n));
            } else {
                assert!(decoded.is_err(), "the trailer's count disagrees with the bytes");
            }
        }
        // A chunk with no whole block: decode may only accept it with zero blocks.
        Err(_) => {
            if let Ok(c) = &decoded {
                assert!(c.n_blocks == 0 || block_bytes == 0 || c.bytes.is_empty());
            }
        }
    }
});
