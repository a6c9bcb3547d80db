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
//! (`ProtocolError::Overloaded`, the boundary's refusal) without asking the busy thread.

mod batcher;
mod handle;
pub mod net;
mod pd;
mod seq;

pub use batcher::{step_log_path, WORKER_PLACEHOLDER};
pub use handle::{
    Worker, WorkerConfig, WorkerHandle, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_CHUNK,
};
pub use pd::KvBlocks;
/// The KV pool a worker joins (`WorkerConfig::kv_pool`): the kv crate's type, named here.
pub use tokenpath_kv::pool::PoolConfig as KvPoolConfig;
/// What part of the request path a worker runs (defined with the worker messages).
pub use tokenpath_protocol::cluster::WorkerRole as Role;
/// The boundary types a worker speaks, defined once in the protocol crate.
pub use tokenpath_protocol::work::{
    validate_request, FrameSums, StepRecord, StreamSender, TokenMeter, TokenUsage, Transfer, TransferToken,
    WorkEvent, WorkMode, WorkRequest, WorkStream, WorkerStats,
};
use tokenpath_protocol::ProtocolError;

/// What a worker's prefix blocks are keyed under: the model's shape and numerics and the KV
/// layout; for blocks that outlive the process (`pooled`: the KV pool) the model file's digest
/// too. One function, so a worker and a standalone pool (`tokenpath kv-pool`) agree.
pub fn prefix_namespace(
    engine: &tokenpath_engine::Engine,
    layout: tokenpath_engine::kv_cache::KvLayout,
    pooled: bool,
) -> tokenpath_kv::BlockHash {
    let model = format!("{:?}", engine.model().config());
    let bf16 = if engine.model().bf16_prompts() { " with bf16 prompts" } else { "" };
    let numerics = format!("{:?}{bf16}", engine.model().numerics());
    let layout = format!("{layout:?}");
    let root = tokenpath_kv::BlockHash::namespace(&[
        model.as_bytes(),
        numerics.as_bytes(),
        layout.as_bytes(),
        b"f16",
    ]);
    if !pooled {
        return root;
    }
    // Blocks that outlive the process bind the very weights, not just their shape.
    tokenpath_kv::BlockHash::namespace(&[&root.0, b"weights", &engine.model().weights_digest()])
}

/// Errors of the worker layer.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
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
    /// A request refused at the boundary (queue full, context overflow, invalid request).
    #[error(transparent)]
    Refused(#[from] ProtocolError),
    /// The worker thread is gone (shut down or crashed).
    #[error("the worker has stopped")]
    Stopped,
}

impl tokenpath_protocol::backend::Backend for WorkerHandle {
    fn submit(
        &self,
        work: WorkRequest,
    ) -> tokenpath_protocol::backend::BoxFuture<'_, Result<WorkStream, ProtocolError>> {
        Box::pin(std::future::ready(WorkerHandle::submit(self, work)))
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

#[cfg(test)]
mod tests {
    use super::prefix_namespace;
    use tokenpath_engine::model::{Model, Numerics};
    use tokenpath_engine::quant::GgmlType;
    use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
    use tokenpath_engine::Engine;

    /// KV computed with bf16 prompts is keyed apart from the integer tiles' under the same
    /// numerics name: a model switched away from `Fast` and back has dropped its bf16 copies, and
    /// its namespace differs from a fresh one's exactly where the fresh one has them.
    #[test]
    fn the_prefix_namespace_names_bf16_prompts() {
        let bytes = tiny_model_bytes(&TinySpec { ty: GgmlType::Q8_0, ..TinySpec::default() }).unwrap();
        let fresh = Engine::from_model(Model::from_bytes(bytes.clone()).unwrap()).unwrap();
        let mut model = Model::from_bytes(bytes).unwrap();
        model.set_numerics(Numerics::Invariant).unwrap();
        model.set_numerics(Numerics::Fast).unwrap();
        let back = Engine::from_model(model).unwrap();
        assert!(!back.model().bf16_prompts());
        let layout = fresh.kv_layout(16);
        for pooled in [false, true] {
            let (a, b) = (prefix_namespace(&fresh, layout, pooled), prefix_namespace(&back, layout, pooled));
            assert_eq!(a != b, fresh.model().bf16_prompts(), "pooled {pooled}");
        }
    }
}
