//! Fuzzes the KV pool's messages, what the pool's owner decodes from any local process that
//! connects to its socket and what a worker decodes from the pool: `PoolRequest::decode` and
//! `PoolReply::decode` (bounds included). Never a panic; whatever decodes re-encodes to the
//! same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_protocol::pool::{PoolReply, PoolRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = PoolRequest::decode(data) {
        assert_eq!(PoolRequest::decode(&req.encode()).expect("re-decodes"), req);
    }
    if let Ok(reply) = PoolReply::decode(data) {
        assert_eq!(PoolReply::decode(&reply.encode()).expect("re-decodes"), reply);
    }
});
