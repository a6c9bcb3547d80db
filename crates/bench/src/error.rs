//! The crate's one error type.

use tokenpath_timeline::TimelineError;

/// Errors of the bench crate.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A records file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A report file could not be written.
    #[error("cannot write {path}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A records file is not valid.
    #[error("{path}:{line}: not a request record: {reason}")]
    BadRecord {
        /// The file.
        path: String,
        /// 1-based line (0 for a whole-file JSON document).
        line: usize,
        /// Why.
        reason: String,
    },
    /// A trace file line that is not a request.
    #[error("{path}:{line}: bad trace line: {reason}")]
    BadTrace {
        /// The file.
        path: String,
        /// 1-based line (0: the whole file).
        line: usize,
        /// Why.
        reason: String,
    },
    /// A `--find-max-rate` search that cannot run.
    #[error("bad rate search: {0}")]
    BadSearch(String),
    /// A run with no request in it.
    #[error("no requests to report on")]
    NoRequests,
    /// A workload spec that does not parse.
    #[error("bad workload {0}")]
    BadWorkload(String),
    /// An arrival process that cannot run.
    #[error("bad arrival process: {0}")]
    BadArrival(String),
    /// A regression gate that does not parse.
    #[error("bad gate {0}")]
    BadGate(String),
    /// The HTTP client could not be set up or a request task died.
    #[error("client: {0}")]
    Client(String),
    /// A metric definition refused its input.
    #[error(transparent)]
    Timeline(#[from] TimelineError),
}
