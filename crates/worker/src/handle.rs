//! The public face of a worker: configuration, the request and event types, and the cloneable
//! [`WorkerHandle`] that validates and submits requests to the batcher thread.
//!
//! Everything that can be decided without the engine's mutable state is decided here, on the
//! caller's thread, before any work is queued: context overflow, token ids outside the
//! vocabulary, invalid sampling parameters and a full queue all come back as a typed
//! [`WorkerError`] from [`WorkerHandle::submit`], so a rejected request never costs the batcher a
//! thing and the caller can answer at once.

use crate::batcher::{Batcher, Command, StepLog, Submission};
use crate::pd::KvBlocks;
use crate::WorkerError;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use tokenpath_engine::kv_cache::KvLayout;
use tokenpath_engine::sampling::{Sampler, SamplerState};
use tokenpath_engine::Engine;
use tokenpath_protocol::work::Transfer;
use tokenpath_protocol::work::{validate_request, Backlog, WorkRequest, WorkStream, WorkerStats};
use tokenpath_protocol::ProtocolError;
use tokenpath_timeline::WorkerId;
use tokio::sync::{mpsc as tmpsc, watch, Semaphore};

/// Default prompt tokens per step (`--prefill-chunk`).
pub const DEFAULT_PREFILL_CHUNK: usize = 512;
/// Default bound of the waiting queue (`--max-queue`).
pub const DEFAULT_MAX_QUEUE: usize = 256;
/// Default most sequences in one step (`--max-batch`).
pub const DEFAULT_MAX_BATCH: usize = 64;
/// Default tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// How a worker batches and what it may hold.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// The worker's name, reported in every response's `timing.workers`.
    pub id: WorkerId,
    /// Most prompt tokens prefilled per step, over all waiting sequences (chunked prefill: a long
    /// prompt cannot freeze running streams for longer than one chunk). A prompt whose rest would
    /// be at most an eighth of this is finished in the same step instead.
    pub prefill_chunk: usize,
    /// Most requests waiting for their first prefill chunk; more are rejected as overloaded.
    pub max_queue: usize,
    /// Most sequences running (prefilling or decoding) at once.
    pub max_batch: usize,
    /// KV cache size in tokens; `None`: four full contexts. Must hold at least one context.
    pub kv_tokens: Option<usize>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Reuse the KV of prompt prefixes seen before (chained block hashes, LRU eviction).
    pub prefix_cache: bool,
    /// Longest a decode-mode request waits for its first token (its prompt's KV is reserved
    /// meanwhile) before it fails and gives the blocks back.
    pub handoff_wait: std::time::Duration,
    /// Write one JSON line per forward step here (`{worker}` becomes the worker's name).
    pub step_log: Option<std::path::PathBuf>,
    /// Share prefix blocks through the host's KV pool (needs `prefix_cache`): every block a
    /// sequence completes is stored there, and a fresh sequence's prefix continues from it past
    /// what this worker's arena holds. Blocks bind the model file's digest, KV layout,
    /// numerics and tenant scope.
    pub kv_pool: Option<tokenpath_kv::pool::PoolConfig>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            id: WorkerId("w0".into()),
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            max_queue: DEFAULT_MAX_QUEUE,
            max_batch: DEFAULT_MAX_BATCH,
            kv_tokens: None,
            block_size: DEFAULT_BLOCK_SIZE,
            prefix_cache: true,
            handoff_wait: crate::pd::HANDOFF_WAIT,
            step_log: None,
            kv_pool: None,
        }
    }
}

/// Facts about the loaded model the gateway needs for validation.
#[derive(Clone, Debug)]
struct ModelFacts {
    n_ctx: usize,
    n_vocab: usize,
    layout: KvLayout,
}

/// A cloneable handle to a worker thread.
#[derive(Clone, Debug)]
pub struct WorkerHandle {
    id: WorkerId,
    tx: mpsc::Sender<Command>,
    queue: Arc<Semaphore>,
    max_queue: usize,
    stats: watch::Receiver<WorkerStats>,
    facts: ModelFacts,
    engine: Arc<Engine>,
}

/// A running worker: its handle and its thread.
#[derive(Debug)]
pub struct Worker {
    handle: WorkerHandle,
    thread: JoinHandle<()>,
}

impl Worker {
    /// Starts the batcher thread for `engine`. Fails on a configuration that cannot work or a KV
    /// cache that cannot be allocated.
    pub fn spawn(engine: Arc<Engine>, config: WorkerConfig) -> Result<Self, WorkerError> {
        let n_ctx = engine.model().config().n_ctx;
        let n_vocab = engine.model().config().n_vocab;
        for (name, v) in [
            ("prefill_chunk", config.prefill_chunk),
            ("max_queue", config.max_queue),
            ("max_batch", config.max_batch),
            ("block_size", config.block_size),
        ] {
            if v == 0 {
                return Err(WorkerError::Config(format!("{name} must be at least 1")));
            }
        }
        let kv_tokens = config.kv_tokens.unwrap_or(n_ctx.saturating_mul(4));
        if kv_tokens < n_ctx {
            return Err(WorkerError::Config(format!(
                "the KV cache ({kv_tokens} tokens) must hold at least one full context ({n_ctx} tokens)"
            )));
        }
        let cache = engine.new_cache(kv_tokens, config.block_size)?;
        let layout = cache.layout();
        let (tx, rx) = mpsc::channel();
        let (stats_tx, stats_rx) =
            watch::channel(WorkerStats { kv_blocks_free: cache.free_blocks(), ..WorkerStats::default() });
        let step_log = match &config.step_log {
            Some(p) => {
                let path = crate::batcher::step_log_path(p, &config.id.0);
                let log = StepLog::create(&path).map_err(|e| {
                    WorkerError::Config(format!("cannot create the step log {}: {e}", path.display()))
                })?;
                Some(log)
            }
            None => None,
        };
        if config.kv_pool.is_some() && !config.prefix_cache {
            return Err(WorkerError::Config("the KV pool needs the prefix cache".into()));
        }
        let batcher = Batcher::new(Arc::clone(&engine), cache, config.clone(), rx, stats_tx, step_log)?;
        let thread = std::thread::Builder::new()
            .name(format!("worker-{}", config.id))
            .spawn(move || batcher.run())
            .map_err(WorkerError::Spawn)?;
        let handle = WorkerHandle {
            id: config.id.clone(),
            tx,
            queue: Arc::new(Semaphore::new(config.max_queue)),
            max_queue: config.max_queue,
            stats: stats_rx,
            facts: ModelFacts { n_ctx, n_vocab, layout },
            engine,
        };
        Ok(Self { handle, thread })
    }

    /// A handle to submit requests.
    pub fn handle(&self) -> WorkerHandle {
        self.handle.clone()
    }

    /// Drops this worker's handle and waits for the thread to end, which it does once every
    /// handle is gone and every accepted request has finished.
    pub fn join(self) -> Result<(), WorkerError> {
        drop(self.handle);
        self.thread.join().map_err(|_| WorkerError::Stopped)
    }
}

impl WorkerHandle {
    /// The worker's name.
    pub fn id(&self) -> &WorkerId {
        &self.id
    }

    /// The engine (read-only: tokenizer, chat template, model config).
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The model's context length.
    pub fn n_ctx(&self) -> usize {
        self.facts.n_ctx
    }

    /// The KV cache layout (a transfer's sender and receiver must agree on it exactly).
    pub fn kv_layout(&self) -> KvLayout {
        self.facts.layout
    }

    /// Decode mode: KV blocks of `transfer` arrived (not yet verified as complete).
    pub fn kv_chunk(&self, transfer: Transfer, first_block: u32, bytes: Vec<u8>) -> Result<(), WorkerError> {
        self.tx.send(Command::KvChunk { transfer, first_block, bytes }).map_err(|_| WorkerError::Stopped)
    }

    /// Decode mode: the transfer of `n_tokens` tokens' KV ended, intact (`ok`) or not. The
    /// returned receiver says whether (and when) the blocks were imported.
    pub fn kv_end(
        &self,
        transfer: Transfer,
        n_tokens: usize,
        ok: bool,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<Instant, String>>, WorkerError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let cmd = Command::KvEnd { transfer, n_tokens, ok, lease: None, reply };
        self.tx.send(cmd).map_err(|_| WorkerError::Stopped)?;
        Ok(rx)
    }

    /// Decode mode: borrows the reserved blocks of `transfer` (of `n_tokens` tokens) to receive
    /// its KV straight into them. Refused when the transfer is unknown (or its token wrong),
    /// already being received or over, or of another length than the prompt.
    pub async fn kv_lease(&self, transfer: Transfer, n_tokens: usize) -> Result<KvBlocks, String> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let cmd = Command::KvLease { transfer, n_tokens, tx: self.tx.clone(), reply };
        self.tx.send(cmd).map_err(|_| "the worker stopped")?;
        rx.await.map_err(|_| "the worker stopped")?
    }

    /// Decode mode: the first token and sampler position of `transfer`'s request.
    pub fn handoff(&self, transfer: u64, first_token: u32, sampler: SamplerState) -> Result<(), WorkerError> {
        self.tx.send(Command::Handoff { transfer, first_token, sampler }).map_err(|_| WorkerError::Stopped)
    }

    /// The latest stats snapshot (never waits for a step).
    pub fn stats(&self) -> WorkerStats {
        self.stats.borrow().clone()
    }

    /// Fault injection for tests: makes the batcher thread panic at its next command, so what
    /// happens to a worker whose batcher died can be tested.
    #[doc(hidden)]
    pub fn fault_panic(&self) {
        let _ = self.tx.send(Command::FaultPanic);
    }

    /// Whether the worker thread is alive.
    pub fn is_alive(&self) -> bool {
        self.stats.has_changed().is_ok()
    }

    /// Requests accepted and not yet finished: queued in the channel, waiting or running.
    pub fn in_flight(&self) -> usize {
        let s = self.stats.borrow();
        let queued = self.max_queue.saturating_sub(self.queue.available_permits());
        // Waiting requests hold permits, so they are inside `queued` already (preempted ones
        // do not, and are counted separately to stay conservative).
        queued.max(s.waiting) + s.running
    }

    /// Validates `req` and queues it. The returned stream yields its events; dropping the stream
    /// cancels the request.
    pub fn submit(&self, req: WorkRequest) -> Result<WorkStream, ProtocolError> {
        let max_tokens = validate_request(&req, self.facts.n_ctx, self.facts.n_vocab)?;
        let sampler = Sampler::new(req.sampling.clone())
            .map_err(|e| ProtocolError::InvalidRequest { param: None, message: e.to_string() })?;
        let permit = Arc::clone(&self.queue)
            .try_acquire_owned()
            .map_err(|_| ProtocolError::Overloaded { max: self.max_queue })?;
        let (events, rx) = tmpsc::unbounded_channel();
        let id = req.id;
        let backlog = Backlog::default();
        let sub = Submission { req, max_tokens, sampler, events, backlog: backlog.clone(), permit };
        self.tx.send(Command::Submit(Box::new(sub))).map_err(|_| ProtocolError::Stopped)?;
        Ok(WorkStream::from_batcher(id, rx, backlog))
    }
}
