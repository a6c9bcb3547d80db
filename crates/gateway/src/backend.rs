//! What the gateway sends admitted requests to: one worker thread in this process
//! ([`Backend::Local`], `tokenpath serve` colocated) or workers in other processes
//! ([`Backend::Cluster`], colocated or prefill/decode-disaggregated). Both answer with the same
//! [`WorkStream`], so the HTTP layer is written once.
//!
//! This is the engine boundary the architecture promises: anything that can turn a tokenized
//! request into a stream of text events — the embedded engine, a remote tokenpath worker, later a
//! simulated or external engine — stands here.

use crate::cluster::Cluster;
use std::sync::Arc;
use tokenpath_engine::Engine;
use tokenpath_worker::{validate_request, WorkRequest, WorkStream, WorkerError, WorkerHandle, WorkerStats};

/// Where requests run.
#[derive(Debug)]
pub enum Backend {
    /// One worker thread in this process.
    Local(WorkerHandle),
    /// Remote workers. The engine is opened only for its tokenizer, chat template and context
    /// length (the weights are memory-mapped and never touched here).
    Cluster {
        /// Tokenizer, template and model facts.
        engine: Arc<Engine>,
        /// The workers.
        cluster: Cluster,
    },
}

impl Backend {
    /// Tokenizer, chat template, model config.
    pub fn engine(&self) -> &Arc<Engine> {
        match self {
            Backend::Local(w) => w.engine(),
            Backend::Cluster { engine, .. } => engine,
        }
    }

    /// The model's context length.
    pub fn n_ctx(&self) -> usize {
        self.engine().model().config().n_ctx
    }

    /// Validates and starts `work`.
    pub async fn submit(&self, work: WorkRequest) -> Result<WorkStream, WorkerError> {
        match self {
            Backend::Local(w) => w.submit(work),
            Backend::Cluster { engine, cluster } => {
                let c = engine.model().config();
                validate_request(&work, c.n_ctx, c.n_vocab)?;
                cluster.submit(work).await
            }
        }
    }

    /// Worker stats; for a cluster, the sum over the workers that answered their last poll.
    pub fn stats(&self) -> WorkerStats {
        match self {
            Backend::Local(w) => w.stats(),
            Backend::Cluster { cluster, .. } => {
                let mut sum = WorkerStats::default();
                for s in cluster.registry().workers().iter().filter(|w| w.up).filter_map(|w| w.stats.as_ref())
                {
                    let s = tokenpath_worker::net::stats_of(s);
                    sum.waiting = sum.waiting.saturating_add(s.waiting);
                    sum.running = sum.running.saturating_add(s.running);
                    sum.kv_blocks_used = sum.kv_blocks_used.saturating_add(s.kv_blocks_used);
                    sum.kv_blocks_free = sum.kv_blocks_free.saturating_add(s.kv_blocks_free);
                    sum.busy_seconds += s.busy_seconds;
                    sum.uptime_seconds += s.uptime_seconds;
                    sum.flops += s.flops;
                    sum.prompt_tokens_computed =
                        sum.prompt_tokens_computed.saturating_add(s.prompt_tokens_computed);
                    sum.prompt_tokens_cached =
                        sum.prompt_tokens_cached.saturating_add(s.prompt_tokens_cached);
                    sum.generated_tokens = sum.generated_tokens.saturating_add(s.generated_tokens);
                    sum.kv_fallbacks = sum.kv_fallbacks.saturating_add(s.kv_fallbacks);
                }
                sum
            }
        }
    }

    /// Whether requests can run now.
    pub fn is_ready(&self) -> bool {
        match self {
            Backend::Local(w) => w.is_alive(),
            Backend::Cluster { cluster, .. } => cluster.registry().is_ready(),
        }
    }

    /// Requests accepted and not finished.
    pub fn in_flight(&self) -> usize {
        match self {
            Backend::Local(w) => w.in_flight(),
            Backend::Cluster { cluster, .. } => {
                cluster.registry().workers().iter().fold(0usize, |a, w| a.saturating_add(w.in_flight))
            }
        }
    }

    /// The cluster, when there is one (worker registration).
    pub fn cluster(&self) -> Option<&Cluster> {
        match self {
            Backend::Local(_) => None,
            Backend::Cluster { cluster, .. } => Some(cluster),
        }
    }
}
