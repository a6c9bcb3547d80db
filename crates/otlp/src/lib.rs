//! Engines' spans in: an OTLP trace receiver that joins what an engine exported to the request
//! it belongs to, by W3C trace id.
//!
//! vLLM exports one `llm_request` span per request and continues the `traceparent` it is sent;
//! nothing else joins that span to the client's record. This crate is shaped around that join:
//! one port takes both transports engines export with (OTLP/HTTP protobuf or JSON on HTTP/1.1,
//! OTLP/gRPC on HTTP/2), decoding is a pure function from bytes to [`EngineSpan`]s (`decode.rs`,
//! fuzzed), and the spans live in one owning task (`store.rs`) that keeps only traces someone
//! said it expects — so a hostile exporter can neither grow its memory with made-up trace ids nor
//! flood one trace — and that answers "wait at most this long for these traces" once. The bench
//! (`--otlp-listen`) and the gateway's upstream timeline are its users. Spans out
//! (`export.rs`): our own timeline of a request as a root span and one child per stage, shipped
//! by an owning task over OTLP/HTTP (`--otlp-endpoint`).

mod decode;
mod error;
mod export;
mod grpc;
mod server;
mod store;

pub use decode::{decode_json, decode_protobuf, encode_protobuf, inflate_gzip, MAX_INFLATED};
pub use error::OtlpError;
pub use export::{
    request_spans, unix_ns, worker_spans, SpanExporter, GATEWAY_SERVICE, REQUEST_SPAN, WORKER_SERVICE,
};
pub use grpc::frame as grpc_frame;
pub use server::{Receiver, ReceiverConfig, GRPC_EXPORT_PATH, HTTP_TRACES_PATH};
pub use store::{Collected, SpanStore, StoreLimits};
pub use tokenpath_timeline::{EngineSpan, SpanId, TraceId, TraceParent};

/// After a trace's first span, how long its other spans may take: an engine that exports
/// several spans per request (SGLang) and our own processes (gateway and workers, each its own
/// exporter) send them in separate batches.
pub const SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

/// A random, sampled context (the OS's CSPRNG: ids from two runs against one engine must not
/// collide, whatever their seeds). Without an OS RNG the ids are a BLAKE3 of the clock, the
/// process and a counter: unique, if not secret (a trace id is no secret).
pub fn fresh_context() -> TraceParent {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut bytes = [0u8; 24];
    if getrandom::fill(&mut bytes).is_err() || bytes[..16] == [0; 16] || bytes[16..] == [0; 8] {
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let mut h = blake3::Hasher::new();
        h.update(&now.to_le_bytes()).update(&std::process::id().to_le_bytes()).update(&n.to_le_bytes());
        h.finalize_xof().fill(&mut bytes);
    }
    let trace = TraceId::from_slice(&bytes[..16]).unwrap_or(TraceId([1; 16]));
    let span = SpanId::from_slice(&bytes[16..]).unwrap_or(SpanId([1; 8]));
    TraceParent::new(trace, span)
}
