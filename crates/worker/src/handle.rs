//! The public face of a worker: configuration, the request and event types, and the cloneable
//! [`WorkerHandle`] that validates and submits requests to the batcher thread.
//!
//! Everything that can be decided without the engine's mutable state is decided here, on the
//! caller's thread, before any work is queued: context overflow, token ids outside the
//! vocabulary, invalid sampling parameters and a full queue all come back as a typed
//! [`WorkerError`] from [`WorkerHandle::submit`], so a rejected request never costs the batcher a
//! thing and the caller can answer at once.

use crate::batcher::{Batcher, Command, Submission};
use crate::pd::KvBlocks;
use crate::stream::{Backlog, WorkStream};
use crate::WorkerError;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use tokenpath_engine::kv_cache::KvLayout;
use tokenpath_engine::sampling::{Sampler, SamplerState, SamplingParams};
use tokenpath_engine::Engine;
pub use tokenpath_protocol::cluster::TransferToken;
use tokenpath_timeline::{FinishReason, RequestId, ServerTiming, WorkerId};
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
    /// prompt cannot freeze running streams for longer than one chunk).
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
        }
    }
}

/// Which part of the path a worker runs for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkMode {
    /// Prefill and decode here (colocated).
    Full,
    /// Prefill, sample the first token, stream the KV out ([`WorkEvent::Kv`]) and hand off
    /// ([`WorkEvent::Handoff`]).
    Prefill,
    /// Wait for the KV of a transfer and the handed-off first token, then decode.
    Decode(Transfer),
}

/// A decode-mode request's KV transfer: its id and the token that must come with its KV. Two
/// transfers are equal only when both match (the token in constant time), so a lookup by
/// `Transfer` is the authorization check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The gateway's transfer id.
    pub id: u64,
    /// The transfer's capability.
    pub token: TransferToken,
}

impl WorkMode {
    /// The role name reported in `timing.workers`.
    pub fn role_name(self) -> &'static str {
        match self {
            WorkMode::Full => "both",
            WorkMode::Prefill => "prefill",
            WorkMode::Decode(_) => "decode",
        }
    }
}

/// Charged with every token a request generates, the moment it is sampled (the gateway's
/// per-tenant output budget): a client that reads slowly, or not at all, is charged all the same.
pub trait TokenMeter: Send + Sync + std::fmt::Debug {
    /// `tokens` more tokens were generated.
    fn generated(&self, tokens: u32);
}

/// One generation request, already tokenized.
#[derive(Clone, Debug)]
pub struct WorkRequest {
    /// For logs.
    pub id: RequestId,
    /// Prompt token ids (never empty).
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Most tokens to generate; `None`: until EOS, a stop string or the context end.
    pub max_tokens: Option<u32>,
    /// Stop strings (not included in the output).
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// When the request arrived (origin of its timeline), on this process's clock.
    pub arrived: Instant,
    /// When the gateway admitted it (the `admitted` mark).
    pub admitted: Instant,
    /// Which part of the path runs here.
    pub mode: WorkMode,
    /// Charged with every generated token, if any.
    pub meter: Option<Arc<dyn TokenMeter>>,
    /// The prefix-cache scope (a tenant): blocks are shared only between requests of the same
    /// scope, so one tenant can neither plant KV for another nor learn from `cached_tokens` or
    /// TTFT what another sent. `None`: the worker-wide namespace.
    pub cache_scope: Option<String>,
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenUsage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens (an end-of-generation token that ended the turn is not counted).
    pub completion_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
}

/// The checksum state of each KV frame's block bytes in one export (see [`WorkEvent::Kv`]);
/// equal when every frame's digest so far is.
#[derive(Clone, Debug, Default)]
pub struct FrameSums(pub(crate) Vec<tokenpath_protocol::frame::Checksum>);

impl PartialEq for FrameSums {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len() && self.0.iter().zip(&other.0).all(|(a, b)| a.digest() == b.digest())
    }
}

/// What a request's stream carries, in order: zero or more `Text`, then exactly one `Finished`
/// or `Failed`. A stream that ends without either means the worker died.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkEvent {
    /// Text safe to send (complete UTF-8, never part of a stop string) and how many generated
    /// tokens it covers (≥ 1).
    Text {
        /// The new text.
        delta: String,
        /// Generated tokens since the previous `Text`.
        tokens: u32,
    },
    /// Generation ended normally.
    Finished {
        /// `Stop` (EOS / stop string) or `Length` (`max_tokens` / context end).
        reason: FinishReason,
        /// Token counts.
        usage: TokenUsage,
        /// The stages this worker measured (gateway included: it was handed `admitted`).
        timing: ServerTiming,
    },
    /// Prefill mode: KV blocks `first_block..` of the sequence, whole blocks in the cache's
    /// wire layout, sent as soon as they are written (the last one may be partly filled).
    Kv {
        /// Index of the first block.
        first_block: u32,
        /// Block bytes.
        bytes: Vec<u8>,
        /// The checksum state of each KV frame's block bytes, computed right after the export
        /// while they were in cache, so the transfer need not read them again to hash them.
        sums: FrameSums,
    },
    /// Prefill mode: the first token is sampled and every KV block was sent; a decode worker
    /// takes it from here. Ends the stream.
    Handoff {
        /// The sampled token.
        first_token: u32,
        /// The sampler's position after it.
        sampler: SamplerState,
        /// Token counts so far.
        usage: TokenUsage,
        /// The stages this worker measured.
        timing: ServerTiming,
        /// When the prefill ended (the transfer's remaining time is measured from here, so the
        /// wait for a busy core to pick the event up is counted, not lost).
        at: Instant,
    },
    /// Generation failed after it was accepted (an engine error).
    Failed {
        /// What went wrong, for logs and the client.
        message: String,
    },
}

/// A snapshot the batcher publishes after every step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerStats {
    /// Requests accepted but not yet running (including preempted ones).
    pub waiting: usize,
    /// Sequences in the running batch (prefilling or decoding).
    pub running: usize,
    /// KV blocks holding some sequence's tokens.
    pub kv_blocks_used: usize,
    /// KV blocks free.
    pub kv_blocks_free: usize,
    /// Seconds spent inside forward steps since start.
    pub busy_seconds: f64,
    /// Seconds since the worker started.
    pub uptime_seconds: f64,
    /// Forward steps run.
    pub steps: u64,
    /// Prompt tokens run through the model (recomputation after preemption included).
    pub prompt_tokens_computed: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Model FLOPs of all tokens run (the model's per-token estimate × tokens).
    pub flops: f64,
    /// Requests cancelled because their client went away.
    pub cancelled: u64,
    /// Sequences preempted (KV freed, recomputed later) to let others decode.
    pub preempted: u64,
    /// Prompt tokens served from the prefix cache instead of computed.
    pub prompt_tokens_cached: u64,
    /// Blocks held only by the prefix cache (counted in `kv_blocks_free`: reclaimable).
    pub kv_blocks_cached: usize,
    /// KV transfers received intact (decode mode).
    pub kv_imports: u64,
    /// KV transfers that failed and were recomputed here (decode mode).
    pub kv_fallbacks: u64,
}

impl WorkerStats {
    /// Share of wall time spent computing since start, 0..=1.
    pub fn busy_fraction(&self) -> f64 {
        if self.uptime_seconds > 0.0 {
            (self.busy_seconds / self.uptime_seconds).clamp(0.0, 1.0)
        } else {
            0.0
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
        let batcher = Batcher::new(Arc::clone(&engine), cache, config.clone(), rx, stats_tx);
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
    pub fn submit(&self, req: WorkRequest) -> Result<WorkStream, WorkerError> {
        let max_tokens = validate_request(&req, self.facts.n_ctx, self.facts.n_vocab)?;
        let sampler =
            Sampler::new(req.sampling.clone()).map_err(|e| WorkerError::InvalidRequest(e.to_string()))?;
        let permit = Arc::clone(&self.queue)
            .try_acquire_owned()
            .map_err(|_| WorkerError::Overloaded { max: self.max_queue })?;
        let (events, rx) = tmpsc::unbounded_channel();
        let id = req.id;
        let backlog = Backlog::default();
        let sub = Submission { req, max_tokens, sampler, events, backlog: backlog.clone(), permit };
        self.tx.send(Command::Submit(Box::new(sub))).map_err(|_| WorkerError::Stopped)?;
        Ok(WorkStream::from_batcher(id, rx, backlog))
    }
}

/// Checks a request against the model before any work: a non-empty prompt of in-vocabulary ids
/// that leaves room for at least one generated token (and for `max_tokens` when given). Returns
/// the completion budget. Every backend runs it, so a remote worker's refusal and a local one's
/// read the same.
pub fn validate_request(req: &WorkRequest, n_ctx: usize, n_vocab: usize) -> Result<usize, WorkerError> {
    if req.prompt.is_empty() {
        return Err(WorkerError::InvalidRequest("the prompt has no tokens".into()));
    }
    if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(WorkerError::InvalidRequest(format!(
            "token id {bad} is outside the vocabulary of {n_vocab} tokens"
        )));
    }
    // The gateway checked these already; a request arriving over the worker port is checked
    // again, since the stop strings' count and length are work on every generated token.
    use tokenpath_protocol::{MAX_STOP_BYTES, MAX_STOP_SEQUENCES};
    if req.stop.len() > MAX_STOP_SEQUENCES || req.stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(WorkerError::InvalidRequest(format!(
            "at most {MAX_STOP_SEQUENCES} stop strings of at most {MAX_STOP_BYTES} bytes each"
        )));
    }
    let prompt_tokens = req.prompt.len();
    let requested = req.max_tokens.map_or(0, |m| m as usize);
    if req.max_tokens == Some(0) {
        return Err(WorkerError::InvalidRequest("max_tokens must be at least 1".into()));
    }
    if prompt_tokens >= n_ctx || prompt_tokens + requested > n_ctx {
        return Err(WorkerError::ContextOverflow { prompt_tokens, max_tokens: requested, limit: n_ctx });
    }
    Ok(req.max_tokens.map_or(n_ctx - prompt_tokens, |m| m as usize))
}
