//! Invariant 8 for the OTLP decoders, in the default suite: arbitrary and mutated bytes give a
//! typed error or spans, never a panic (the fuzz target `otlp_export` runs the same longer).

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use tokenpath_otlp::{
    decode_json, decode_protobuf, encode_protobuf, inflate_gzip, EngineSpan, SpanId, TraceId,
};

fn one_span() -> Vec<u8> {
    let span = EngineSpan {
        trace_id: TraceId([5; 16]),
        span_id: SpanId([6; 8]),
        parent: Some(SpanId([7; 8])),
        name: "llm_request".into(),
        service: Some("vllm".into()),
        start_unix_ns: 10,
        end_unix_ns: 20,
        attributes: serde_json::json!({"gen_ai.latency.time_in_queue": 0.5, "n": 3, "l": [1, {"k": "v"}]})
            .as_object()
            .unwrap()
            .clone(),
    };
    encode_protobuf(&[span])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_protobuf(&bytes);
        let _ = decode_json(&bytes);
        let _ = inflate_gzip(&bytes, 1 << 16);
    }

    #[test]
    fn a_valid_export_with_flipped_bytes_never_panics(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut b = one_span();
        for (i, x) in flips {
            let at = i.index(b.len());
            b[at] ^= x;
        }
        if let Ok(spans) = decode_protobuf(&b) {
            prop_assert_eq!(decode_protobuf(&encode_protobuf(&spans)).unwrap().len(), spans.len());
        }
    }
}
