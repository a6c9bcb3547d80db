//! The request timeline and the one definition of every serving metric.
//!
//! A request walks gateway → queue → prefill → KV transfer → decode queue → decode → streamed
//! output. Each process stamps marks on its own clock and reports only durations it measured
//! itself ([`ServerTimeline`] → [`ServerTiming`]); the client stamps its own marks
//! ([`ClientRecord`]). Every metric — TTFT, TPOT, both ITL flavours, E2E, throughput, goodput,
//! percentiles, tail attribution — is defined here once, and the server, the bench and the
//! simulator all call these functions. What other engines report is mapped onto the same stages in
//! one table (`engines`), and the W3C ids that join an engine's span to a client record are here
//! too (`trace`). That is why this crate is pure (no I/O, no clocks): a
//! definition that depends on where it runs is not a definition.

mod client;
pub mod engines;
mod error;
mod hist;
mod ids;
mod server;
mod slo;
mod stats;
mod tail;
mod trace;
mod window;

pub use client::{ClientRecord, NOutSource, Outcome, StreamEvent, Usage};
pub use error::TimelineError;
pub use hist::LatencyHistogram;
pub use ids::{RequestId, WorkerId};
pub use server::{FinishReason, Mark, ServerTimeline, ServerTiming, Stage, StageSource};
pub use slo::{goodput, Goodput, SloMetric, SloSpec, SloTarget};
pub use stats::{percentile, Summary, P999_MIN_SAMPLES};
pub use tail::{tail_attribution, TailAttribution, TailMetric, OTHER_COMPONENT};
pub use trace::{EngineSpan, SpanId, TraceId, TraceParent};
pub use window::{throughput, Throughput, Window};

/// Nanoseconds on one process's monotonic clock, from an origin that process chose (run start
/// for the bench, `arrived` for a server request).
pub type Nanos = u64;

/// Milliseconds from nanoseconds, the unit every report uses.
pub fn ms(ns: Nanos) -> f64 {
    ns as f64 / 1e6
}
