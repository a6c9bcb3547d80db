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
mod stream;

pub use handle::{
    validate_request, FrameSums, TokenMeter, TokenUsage, Transfer, TransferToken, WorkEvent, WorkMode,
    WorkRequest, Worker, WorkerConfig, WorkerHandle, WorkerStats, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK,
};
pub use pd::KvBlocks;
pub use stream::{StreamSender, WorkStream};

use std::{fmt, str::FromStr};

/// Errors of the worker layer.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A role name that is not `prefill`, `decode` or `both`.
    #[error("unknown worker role {0:?}: expected prefill, decode or both")]
    UnknownRole(String),
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

/// What part of the request path a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes the prompt's KV and the first token, then hands the KV on.
    Prefill,
    /// Receives KV and runs the token-by-token loop.
    Decode,
    /// Colocated: both on one engine.
    Both,
}

impl FromStr for Role {
    type Err = WorkerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            "both" => Ok(Self::Both),
            other => Err(WorkerError::UnknownRole(other.to_owned())),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_and_reject_unknown() {
        for r in [Role::Prefill, Role::Decode, Role::Both] {
            assert_eq!(r.to_string().parse::<Role>().unwrap(), r);
        }
        let err = "mixed".parse::<Role>().unwrap_err();
        assert!(err.to_string().contains("mixed"));
    }

    /// A relay (the gateway's, of a remote worker) that waits for `room` reads its source no
    /// faster than the stream's reader takes events: the reader's pace travels upstream.
    #[tokio::test]
    async fn a_relay_waits_while_its_reader_is_behind() {
        let (tx, mut stream) = WorkStream::channel(tokenpath_timeline::RequestId(1));
        let text = || WorkEvent::Text { delta: "x".into(), tokens: 1 };
        for _ in 0..stream::PAUSE_AT {
            assert!(tx.send(text()));
        }
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), tx.room()).await;
        assert!(waiting.is_err(), "room while the reader is {} behind", stream::PAUSE_AT);
        let room = tokio::spawn(async move {
            tx.room().await;
            tx
        });
        assert!(matches!(stream.next().await, Some(WorkEvent::Text { .. })));
        let tx = room.await.unwrap();
        assert!(tx.send(text()), "the reader took one: room again");
        drop(stream);
        tx.closed().await;
    }
}
