//! The crate's one error type.

/// What can go wrong receiving spans.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    /// A body that is not an OTLP trace export in the transport's encoding.
    #[error("not an OTLP trace export: {0}")]
    Decode(String),
    /// A body (or its inflated form) over the bound.
    #[error("the export is {got} bytes, over the {limit}-byte limit")]
    TooLarge {
        /// Bytes seen (at least).
        got: usize,
        /// The bound.
        limit: usize,
    },
    /// The body could not be read (the exporter went away mid-body).
    #[error("reading the export: {0}")]
    Read(String),
    /// The export did not arrive within the receiver's timeout.
    #[error("the export took longer than {0:?}")]
    Timeout(std::time::Duration),
    /// A content type or encoding the receiver does not take.
    #[error("unsupported {0}")]
    Unsupported(String),
    /// The listening socket could not be bound.
    #[error("binding the OTLP receiver on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The store's task is gone (the receiver was shut down).
    #[error("the span store has stopped")]
    Stopped,
}
