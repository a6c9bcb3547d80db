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
//! (`--otlp-listen`) is its first user; the gateway's upstream timeline is the next.

mod decode;
mod error;
mod grpc;
mod server;
mod store;

pub use decode::{decode_json, decode_protobuf, encode_protobuf, inflate_gzip, MAX_INFLATED};
pub use error::OtlpError;
pub use grpc::frame as grpc_frame;
pub use server::{Receiver, ReceiverConfig, GRPC_EXPORT_PATH, HTTP_TRACES_PATH};
pub use store::{Collected, SpanStore, StoreLimits};
pub use tokenpath_timeline::{EngineSpan, SpanId, TraceId};
