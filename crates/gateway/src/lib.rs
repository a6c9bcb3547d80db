//! The gateway is the first stage of the path: authentication, validation, rate limits, routing
//! to workers, SSE, and `/metrics`.
//!
//! It is the only crate that knows HTTP, and the only place where HTTP status codes are chosen:
//! every other crate returns typed errors and this crate maps them. It starts with that mapping's
//! error type; the HTTP server lands with `tokenpath serve`.

/// Errors of the gateway.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The listen address could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// Address that was asked for.
        addr: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
}
