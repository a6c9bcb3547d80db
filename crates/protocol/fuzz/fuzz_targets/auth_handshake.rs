//! Fuzzes the worker handshake, the first bytes any peer sends to a worker before it is
//! authenticated: `auth::Handshake` (and the `Bytes32` / `TransferToken` hex fields it and
//! `KvBegin` carry) from serde_json, as `auth::accept` / `connect` decode a control payload.
//! Never a panic; whatever parses re-serializes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_protocol::auth::{Bytes32, Handshake};
use tokenpath_protocol::cluster::{TransferId, TransferToken};

fn round_trip<T>(data: &[u8])
where
    T: serde::Serialize + for<'de> serde::Deserialize<'de> + PartialEq + std::fmt::Debug,
{
    if let Ok(v) = serde_json::from_slice::<T>(data) {
        let bytes = serde_json::to_vec(&v).expect("a parsed value serializes");
        let again: T = serde_json::from_slice(&bytes).expect("a serialized value parses");
        assert_eq!(again, v);
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<Handshake>(data);
    round_trip::<Bytes32>(data);
    round_trip::<TransferToken>(data);
    round_trip::<TransferId>(data);
});
