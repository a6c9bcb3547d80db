//! [`Backend`]: what the gateway sends admitted requests to. The embedded engine's worker
//! thread, a cluster of tokenpath worker processes (colocated or prefill/decode) and HTTP
//! upstreams (any OpenAI-compatible server, vLLM/SGLang/TensorRT-LLM in PD) implement it; the
//! HTTP layer, the rate limiter and the timeline are written once against it.
//!
//! A trait object rather than an enum so the gateway crate does not depend on the engine: the
//! binary builds the backend (it is the one crate that knows every implementation) and hands
//! the gateway an `Arc<dyn Backend>`. The future is boxed by hand (no `async_trait` macro): one
//! allocation per request, nothing per token.

use crate::work::{WorkRequest, WorkStream, WorkerStats};
use crate::ProtocolError;
use std::future::Future;
use std::pin::Pin;

/// A boxed, sendable future (what [`Backend::submit`] returns).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the gateway must know of the model behind a backend to validate a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// Context length in tokens (prompt + completion).
    pub n_ctx: usize,
    /// Vocabulary size (token ids must be below it).
    pub n_vocab: usize,
}

/// Something that runs tokenized requests.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// Validates and starts `work`. A refusal before any work is a typed error
    /// ([`ProtocolError::Overloaded`], [`ProtocolError::ContextOverflow`],
    /// [`ProtocolError::InvalidRequest`], [`ProtocolError::Unavailable`],
    /// [`ProtocolError::Stopped`]); dropping the returned stream cancels the request.
    fn submit(&self, work: WorkRequest) -> BoxFuture<'_, Result<WorkStream, ProtocolError>>;

    /// The model's limits.
    fn model(&self) -> ModelInfo;

    /// Load and counters (a cluster: the sum over its workers that answered their last poll).
    fn stats(&self) -> WorkerStats;

    /// Whether requests can run now (`/ready`).
    fn is_ready(&self) -> bool;

    /// Requests accepted and not finished.
    fn in_flight(&self) -> usize;

    /// Whether this backend forwards the client's body to an HTTP upstream: the gateway then
    /// keeps unknown request fields (`WorkRequest::forward`) instead of refusing them, and relays
    /// the upstream's chunks ([`crate::work::WorkEvent::Chunk`]).
    fn forwards(&self) -> bool {
        false
    }
}
