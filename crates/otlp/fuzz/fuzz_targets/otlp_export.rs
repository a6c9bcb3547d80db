//! Every decoder the OTLP receiver runs on an exporter's bytes: protobuf, JSON, gzip (bounded),
//! gRPC framing. None may panic or allocate past its bound; what decodes must re-encode and
//! decode to the same spans.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_otlp::{decode_json, decode_protobuf, encode_protobuf, inflate_gzip};

fuzz_target!(|data: &[u8]| {
    if let Ok(spans) = decode_protobuf(data) {
        let again = decode_protobuf(&encode_protobuf(&spans)).expect("what we encode decodes");
        assert_eq!(again.len(), spans.len());
    }
    let _ = decode_json(data);
    let _ = inflate_gzip(data, 1 << 16);
});
