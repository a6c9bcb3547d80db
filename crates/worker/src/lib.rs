//! A worker is one engine instance behind a batcher, in role `prefill`, `decode` or `both`.
//!
//! It is separate from the engine so the engine stays a pure model runner (no queues, no
//! sockets) and separate from the gateway so a worker can run in its own process, pinned to its
//! own cores. Continuous batching and chunked prefill live here, not in the engine.
//!
//! Shape: the engine and its KV cache are owned by ONE dedicated OS thread ([`batcher`]), because
//! a forward step is blocking compute that must never run on an async runtime. Everyone else
//! talks to it through a cloneable [`WorkerHandle`]: submissions go over a command channel, each
//! request gets its own event channel back ([`WorkStream`]), and the thread publishes a
//! [`WorkerStats`] snapshot after every step on a watch channel, so reading stats never waits for
//! a step to end. Admission is a semaphore of `max_queue` permits taken at submit time and given
//! back when the request leaves the waiting queue, so overload is answered synchronously
//! (`WorkerError::Overloaded`) without asking the busy thread.

mod batcher;
mod handle;
pub mod net;
mod pd;
mod seq;

pub use handle::{
    Worker, WorkerConfig, WorkerHandle, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_CHUNK,
};
pub use pd::KvBlocks;
/// What part of the request path a worker runs (defined with the worker messages).
pub use tokenpath_protocol::cluster::WorkerRole as Role;
/// The boundary types a worker speaks, defined once in the protocol crate.
pub use tokenpath_protocol::work::{
    validate_request, FrameSums, StreamSender, TokenMeter, TokenUsage, Transfer, TransferToken, WorkEvent,
    WorkMode, WorkRequest, WorkStream, WorkerStats,
};
use tokenpath_protocol::ProtocolError;

/// Errors of the worker layer.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The waiting queue is full; the client should retry later.
    #[error("the worker's queue is full ({max} requests waiting)")]
    Overloaded {
        /// The queue bound.
        max: usize,
    },
    /// The prompt, or the prompt plus `max_tokens`, does not fit the model's context.
    #[error("{prompt_tokens} prompt tokens + {max_tokens} completion tokens exceed the context of {limit}")]
    ContextOverflow {
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Requested completion tokens (0 when none was requested).
        max_tokens: usize,
        /// The model's context length.
        limit: usize,
    },
    /// A request the worker cannot run (empty prompt, token id outside the vocabulary, bad
    /// sampling parameters).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A configuration that cannot work (zero-sized limits, KV smaller than one context).
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// The engine failed (loading, allocating the cache, or a forward step).
    #[error(transparent)]
    Engine(#[from] tokenpath_engine::EngineError),
    /// The worker thread could not be started.
    #[error("cannot start the worker thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// A remote worker could not be reached, broke the protocol or refused for its own reasons.
    #[error("remote worker {0}")]
    Remote(String),
    /// The worker thread is gone (shut down or crashed).
    #[error("the worker has stopped")]
    Stopped,
}

impl From<ProtocolError> for WorkerError {
    fn from(e: ProtocolError) -> Self {
        match e {
            ProtocolError::ContextOverflow { prompt_tokens, max_tokens, limit } => {
                WorkerError::ContextOverflow { prompt_tokens, max_tokens, limit }
            }
            ProtocolError::Overloaded { max } => WorkerError::Overloaded { max },
            ProtocolError::Stopped => WorkerError::Stopped,
            ProtocolError::InvalidRequest { message, .. } => WorkerError::InvalidRequest(message),
            other => WorkerError::Remote(other.to_string()),
        }
    }
}

impl From<WorkerError> for ProtocolError {
    /// The boundary's refusal for a worker's (what [`tokenpath_protocol::backend::Backend`]
    /// callers see).
    fn from(e: WorkerError) -> Self {
        match e {
            WorkerError::ContextOverflow { prompt_tokens, max_tokens, limit } => {
                ProtocolError::ContextOverflow { prompt_tokens, max_tokens, limit }
            }
            WorkerError::Overloaded { max } => ProtocolError::Overloaded { max },
            WorkerError::Stopped => ProtocolError::Stopped,
            WorkerError::InvalidRequest(message) => ProtocolError::InvalidRequest { param: None, message },
            other => ProtocolError::Unavailable { message: other.to_string() },
        }
    }
}

impl tokenpath_protocol::backend::Backend for WorkerHandle {
    fn submit(
        &self,
        work: WorkRequest,
    ) -> tokenpath_protocol::backend::BoxFuture<'_, Result<WorkStream, ProtocolError>> {
        let started = WorkerHandle::submit(self, work).map_err(ProtocolError::from);
        Box::pin(std::future::ready(started))
    }

    fn model(&self) -> tokenpath_protocol::backend::ModelInfo {
        let c = self.engine().model().config();
        tokenpath_protocol::backend::ModelInfo { n_ctx: c.n_ctx, n_vocab: c.n_vocab }
    }

    fn stats(&self) -> WorkerStats {
        WorkerHandle::stats(self)
    }

    fn is_ready(&self) -> bool {
        self.is_alive()
    }

    fn in_flight(&self) -> usize {
        WorkerHandle::in_flight(self)
    }
}
