//! The boundary between the gateway and whatever runs a request: a tokenized [`WorkRequest`]
//! goes in, a [`WorkStream`] of [`WorkEvent`]s comes out. The embedded engine's batcher, a
//! tokenpath worker process, and an HTTP upstream (vLLM, SGLang, llama.cpp, any OpenAI server)
//! all stand behind [`crate::backend::Backend`] and speak these types, so the HTTP layer, the
//! rate limiter and the timeline are written once.
//!
//! They live in the protocol crate, not in the worker, because they cross every crate
//! boundary on the path (gateway, worker, engine sampler, bench): one definition, converted at
//! the edges (the OpenAI request in `params`, the worker messages in `cluster`), never copied.

mod step;
mod stream;

pub use step::StepRecord;
pub use stream::{Backlog, StreamSender, WorkStream, PAUSE_AT, RESUME_AT};

use crate::frame::Checksum;
use crate::sampling::{SamplerState, SamplingParams};
use crate::ProtocolError;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;
use tokenpath_timeline::{FinishReason, RequestId, ServerTiming, TraceParent};

pub use crate::cluster::TransferToken;

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
    /// The client's whole body, for a backend that forwards it to an HTTP upstream
    /// ([`crate::backend::Backend::forwards`]); `None` for every other backend.
    pub forward: Option<Arc<crate::forward::Forwarded>>,
    /// The W3C trace context the request continues (the client's `traceparent`, or a fresh one
    /// when the gateway receives engines' spans), sent on to the engines that serve it.
    pub trace: Option<TraceParent>,
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens (an end-of-generation token that ended the turn is not counted).
    pub completion_tokens: u64,
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: u64,
}

/// The checksum state of each KV frame's block bytes in one export (see [`WorkEvent::Kv`]);
/// equal when every frame's digest so far is.
#[derive(Clone, Debug, Default)]
pub struct FrameSums(pub Vec<Checksum>);

impl PartialEq for FrameSums {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len() && self.0.iter().zip(&other.0).all(|(a, b)| a.digest() == b.digest())
    }
}

/// What a request's stream carries, in order: zero or more `Text`, then exactly one `Finished`
/// or `Failed`. A stream that ends without either means the backend died.
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
        /// The stages the backend measured (gateway included: it was handed `admitted`).
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
    /// An upstream's stream chunk, passed to the client as one SSE `data:` payload (model name
    /// rewritten, forced usage removed, `timing` added on the finishing chunk), and how many
    /// generated tokens it carries.
    Chunk {
        /// The chunk's JSON.
        json: String,
        /// Generated tokens in it (0 for role-only, usage and empty chunks).
        tokens: u32,
    },
    /// An upstream's whole non-streamed response body (rewritten like a chunk), before
    /// `Finished`.
    Body {
        /// The response JSON.
        json: String,
    },
    /// Generation failed after it was accepted.
    Failed {
        /// What went wrong, for logs and the client.
        message: String,
    },
}

/// A backend's load and counters: a worker's batcher publishes one after every step, a cluster
/// sums its workers', an HTTP upstream fills what its `/metrics` says.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// Requests accepted but not yet running (including preempted ones).
    pub waiting: usize,
    /// Sequences in the running batch (prefilling or decoding).
    pub running: usize,
    /// KV blocks holding some sequence's tokens.
    pub kv_blocks_used: usize,
    /// KV blocks free (prefix-cache blocks nobody uses count as free).
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
    /// Of those, tokens loaded from the KV pool's SSD tier (verified) rather than found in the
    /// worker's arena.
    #[serde(default)]
    pub prompt_tokens_cached_ssd: u64,
    /// Of those, tokens loaded from the KV pool's host-RAM tier (verified).
    #[serde(default)]
    pub prompt_tokens_cached_host: u64,
    /// Of those, tokens loaded from the KV pool's remote tier (verified).
    #[serde(default)]
    pub prompt_tokens_cached_remote: u64,
    /// Bytes of KV loaded from the KV pool into this worker's blocks.
    #[serde(default)]
    pub kv_pool_load_bytes: u64,
    /// Blocks this worker copied from the KV pool that failed their check (recomputed; never
    /// served).
    #[serde(default)]
    pub kv_pool_failed_loads: u64,
    /// Jobs storing this worker's fresh blocks in the KV pool, in flight now (its writer
    /// thread's; 0 once every block computed so far is stored or given up).
    #[serde(default)]
    pub kv_pool_stores_pending: u64,
    /// Store jobs not taken because too many were in flight (those blocks were not stored).
    #[serde(default)]
    pub kv_pool_stores_dropped: u64,
    /// The host's KV pool as it last answered this worker (one pool per host: a cluster's sum
    /// keeps one of its workers' views, not a sum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_pool: Option<Box<crate::pool::PoolStats>>,
    /// Blocks held only by the prefix cache (counted in `kv_blocks_free`: reclaimable).
    pub kv_blocks_cached: usize,
    /// KV transfers received intact (decode mode).
    pub kv_imports: u64,
    /// KV transfers that failed and were recomputed here (decode mode).
    pub kv_fallbacks: u64,
    /// The KV usage fraction a backend reports without block counts (an HTTP upstream's
    /// `/metrics`); preferred by [`WorkerStats::kv_usage`] when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_usage_reported: Option<f64>,
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

    /// The share of KV blocks in use, 0..=1 (what an endpoint picker reads as KV usage); 0
    /// when the backend reports no blocks.
    pub fn kv_usage(&self) -> f64 {
        if let Some(u) = self.kv_usage_reported {
            return u;
        }
        let total = self.kv_blocks_used.saturating_add(self.kv_blocks_free);
        if total == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / total as f64
        }
    }

    /// Every count at most `cap`, every figure finite and in `0..=1e30`: whatever a peer reports
    /// (a worker, or something answering on its port, an upstream's `/metrics`), routing and
    /// `/metrics` arithmetic stays in range.
    pub fn clamp(&mut self, cap: u64) {
        let cap_usize = usize::try_from(cap).unwrap_or(usize::MAX);
        for v in [
            &mut self.waiting,
            &mut self.running,
            &mut self.kv_blocks_used,
            &mut self.kv_blocks_free,
            &mut self.kv_blocks_cached,
        ] {
            *v = (*v).min(cap_usize);
        }
        for v in [
            &mut self.steps,
            &mut self.prompt_tokens_computed,
            &mut self.generated_tokens,
            &mut self.cancelled,
            &mut self.preempted,
            &mut self.prompt_tokens_cached,
            &mut self.prompt_tokens_cached_ssd,
            &mut self.prompt_tokens_cached_host,
            &mut self.prompt_tokens_cached_remote,
            &mut self.kv_pool_load_bytes,
            &mut self.kv_pool_failed_loads,
            &mut self.kv_pool_stores_pending,
            &mut self.kv_pool_stores_dropped,
            &mut self.kv_imports,
            &mut self.kv_fallbacks,
        ] {
            *v = (*v).min(cap);
        }
        for v in [&mut self.busy_seconds, &mut self.uptime_seconds, &mut self.flops] {
            *v = if v.is_finite() { v.clamp(0.0, 1e30) } else { 0.0 };
        }
        self.kv_usage_reported = self.kv_usage_reported.filter(|u| u.is_finite()).map(|u| u.clamp(0.0, 1.0));
        if let Some(p) = self.kv_pool.as_mut() {
            // A peer's pool id is a routing key: bounded like any other report.
            if p.id.len() > crate::pool::MAX_POOL_ID {
                p.id.clear();
            }
        }
    }

    /// Adds `other`'s counts and gauges to these (a cluster's sum over its workers).
    pub fn add(&mut self, o: &WorkerStats) {
        self.waiting = self.waiting.saturating_add(o.waiting);
        self.running = self.running.saturating_add(o.running);
        self.kv_blocks_used = self.kv_blocks_used.saturating_add(o.kv_blocks_used);
        self.kv_blocks_free = self.kv_blocks_free.saturating_add(o.kv_blocks_free);
        self.busy_seconds += o.busy_seconds;
        self.uptime_seconds += o.uptime_seconds;
        self.steps = self.steps.saturating_add(o.steps);
        self.prompt_tokens_computed = self.prompt_tokens_computed.saturating_add(o.prompt_tokens_computed);
        self.generated_tokens = self.generated_tokens.saturating_add(o.generated_tokens);
        self.flops += o.flops;
        self.cancelled = self.cancelled.saturating_add(o.cancelled);
        self.preempted = self.preempted.saturating_add(o.preempted);
        self.prompt_tokens_cached = self.prompt_tokens_cached.saturating_add(o.prompt_tokens_cached);
        self.prompt_tokens_cached_ssd =
            self.prompt_tokens_cached_ssd.saturating_add(o.prompt_tokens_cached_ssd);
        self.prompt_tokens_cached_host =
            self.prompt_tokens_cached_host.saturating_add(o.prompt_tokens_cached_host);
        self.prompt_tokens_cached_remote =
            self.prompt_tokens_cached_remote.saturating_add(o.prompt_tokens_cached_remote);
        self.kv_pool_load_bytes = self.kv_pool_load_bytes.saturating_add(o.kv_pool_load_bytes);
        self.kv_pool_failed_loads = self.kv_pool_failed_loads.saturating_add(o.kv_pool_failed_loads);
        self.kv_pool_stores_pending = self.kv_pool_stores_pending.saturating_add(o.kv_pool_stores_pending);
        self.kv_pool_stores_dropped = self.kv_pool_stores_dropped.saturating_add(o.kv_pool_stores_dropped);
        if self.kv_pool.is_none() {
            self.kv_pool.clone_from(&o.kv_pool);
        }
        self.kv_blocks_cached = self.kv_blocks_cached.saturating_add(o.kv_blocks_cached);
        self.kv_imports = self.kv_imports.saturating_add(o.kv_imports);
        self.kv_fallbacks = self.kv_fallbacks.saturating_add(o.kv_fallbacks);
        // A fraction does not add up: the fullest backend's.
        self.kv_usage_reported = match (self.kv_usage_reported, o.kv_usage_reported) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// Checks a request against the model before any work: a non-empty prompt of in-vocabulary ids
/// that leaves room for at least one generated token (and for `max_tokens` when given), bounded
/// stop strings, valid sampling. Returns the completion budget. Every backend runs it, so a
/// remote worker's refusal and a local one's read the same.
pub fn validate_request(req: &WorkRequest, n_ctx: usize, n_vocab: usize) -> Result<usize, ProtocolError> {
    let invalid = |message: String| ProtocolError::InvalidRequest { param: None, message };
    if req.prompt.is_empty() {
        return Err(invalid("the prompt has no tokens".into()));
    }
    if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(invalid(format!("token id {bad} is outside the vocabulary of {n_vocab} tokens")));
    }
    // The gateway checked these already; a request arriving over the worker port is checked
    // again, since the stop strings' count and length are work on every generated token.
    use crate::{MAX_STOP_BYTES, MAX_STOP_SEQUENCES};
    if req.stop.len() > MAX_STOP_SEQUENCES || req.stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(invalid(format!(
            "at most {MAX_STOP_SEQUENCES} stop strings of at most {MAX_STOP_BYTES} bytes each"
        )));
    }
    req.sampling.validate()?;
    let prompt_tokens = req.prompt.len();
    let requested = req.max_tokens.map_or(0, |m| m as usize);
    if req.max_tokens == Some(0) {
        return Err(invalid("max_tokens must be at least 1".into()));
    }
    if prompt_tokens >= n_ctx || prompt_tokens + requested > n_ctx {
        return Err(ProtocolError::ContextOverflow { prompt_tokens, max_tokens: requested, limit: n_ctx });
    }
    Ok(req.max_tokens.map_or(n_ctx - prompt_tokens, |m| m as usize))
}
