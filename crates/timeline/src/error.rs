//! The crate's single error type: every way a definition can be asked something it cannot answer.

/// Errors from timeline definitions and parsers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TimelineError {
    /// An SLO spec entry that does not parse.
    #[error("bad SLO spec entry {entry:?}: {reason}")]
    BadSlo {
        /// The offending `metric:value` entry.
        entry: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A steady-state window that has no length.
    #[error("empty window: end ({end_ns} ns) must be after start ({start_ns} ns)")]
    EmptyWindow {
        /// Window start.
        start_ns: u64,
        /// Window end.
        end_ns: u64,
    },
    /// A percentile outside 0..=100.
    #[error("percentile {0} is outside 0..=100")]
    BadPercentile(f64),
    /// Marks stamped out of order on one clock.
    #[error("mark {later} at {later_ns} ns comes before {earlier} at {earlier_ns} ns")]
    MarksOutOfOrder {
        /// The mark that should come first.
        earlier: &'static str,
        /// Its time.
        earlier_ns: u64,
        /// The mark that should come after.
        later: &'static str,
        /// Its time.
        later_ns: u64,
    },
    /// A `traceparent` or a trace/span id that does not parse.
    #[error("bad trace context: {0}")]
    BadTraceContext(String),
    /// A latency histogram could not be built or merged.
    #[error("histogram: {0}")]
    Histogram(String),
}
