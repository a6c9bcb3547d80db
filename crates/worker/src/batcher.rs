//! The batcher: one OS thread that owns the engine's KV cache and runs continuous batching with
//! chunked prefill.
//!
//! Every sequence is the same state machine: `tokens` (prompt, then each sampled token) and
//! `fed` (how many of them are in the KV cache). A step feeds each running sequence some of its
//! unfed tokens — one for a decoding sequence, a chunk for a prefilling one, within the
//! per-step prefill budget — in ONE `Model::forward` call, and samples a new token for every
//! sequence whose tokens are now all fed. Prefill, decode, and recomputation after preemption
//! are therefore one code path, which is why batching cannot change what a sequence generates.
//!
//! KV policy: a waiting request is admitted only when its whole prompt fits in the free blocks
//! left after this step's decodes; when decoding sequences need a block the cache does not have,
//! the youngest running sequence is preempted (its blocks freed, its tokens kept, recomputed
//! later). Running sequences' KV is never touched by anyone else, so a full cache delays work but
//! never corrupts it. A sequence's blocks are freed whenever it leaves the running set: finished,
//! failed, cancelled (its event receiver was dropped) or preempted.
//!
//! Slow readers: a sequence whose reader fell `PAUSE_AT` text events behind is paused — not
//! stepped — until it catches up, so generation never runs ahead of a client that stopped
//! reading. A paused sequence keeps its KV while nobody waits for room; when a request is
//! waiting, paused sequences are parked (blocks freed, tokens kept, recomputed on resuming),
//! so a client that does not read can never hold KV others need.

use crate::handle::WorkerConfig;
use crate::pd::KvBlocks;
use crate::seq::{Ending, Seq};
use crate::{Transfer, WorkEvent, WorkMode, WorkRequest, WorkerStats};
use tokenpath_protocol::work::{Backlog, StepRecord};

mod prefix;
mod steplog;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
pub(crate) use steplog::StepLog;
pub use steplog::{step_log_path, WORKER_PLACEHOLDER};
use tokenpath_engine::kv_cache::{KvCache, KvLease};
use tokenpath_engine::model::BatchItem;
use tokenpath_engine::sampling::{Sampler, SamplerState};

use tokenpath_engine::Engine;
use tokenpath_kv::BlockHash;
use tokenpath_scheduler::{Policy, Scheduler, SeqCore, Sequence, Stuck};
use tokenpath_timeline::Mark;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit};

/// Messages to the batcher thread.
pub(crate) enum Command {
    /// A validated request.
    Submit(Box<Submission>),
    /// Decode mode: KV blocks of a transfer.
    KvChunk { transfer: Transfer, first_block: u32, bytes: Vec<u8> },
    /// Decode mode: lend a transfer's reserved blocks to the task receiving it. The blocks travel
    /// back in a [`KvBlocks`] built on `tx`, so they come home however the reply is lost.
    KvLease {
        transfer: Transfer,
        n_tokens: usize,
        tx: mpsc::Sender<Command>,
        reply: oneshot::Sender<Result<KvBlocks, String>>,
    },
    /// Decode mode: lent blocks come back without a verdict (their receiver went away).
    ReturnLease { transfer: u64, lease: KvLease },
    /// Decode mode: a transfer ended (`ok`: every chunk arrived and verified), with the blocks it
    /// was received into when they were lent.
    KvEnd {
        transfer: Transfer,
        n_tokens: usize,
        ok: bool,
        lease: Option<KvLease>,
        reply: oneshot::Sender<Result<Instant, String>>,
    },
    /// Decode mode: the first token of a transfer's request.
    Handoff { transfer: u64, first_token: u32, sampler: SamplerState },
    /// Fault injection for tests: the batcher thread panics, as it would on a bug in a step.
    FaultPanic,
}

/// A request that passed validation and holds a queue slot.
pub(crate) struct Submission {
    pub(crate) req: WorkRequest,
    pub(crate) max_tokens: usize,
    pub(crate) sampler: Sampler,
    pub(crate) events: UnboundedSender<WorkEvent>,
    pub(crate) backlog: Backlog,
    pub(crate) permit: OwnedSemaphorePermit,
}

/// The thread's state.
pub(crate) struct Batcher {
    pub(crate) engine: Arc<Engine>,
    /// The queues, the block accounting (the engine's cache) and the prefix index: every
    /// scheduling decision (`tokenpath_scheduler`, shared with the simulator).
    pub(crate) sched: Scheduler<Seq>,
    pub(crate) cfg: WorkerConfig,
    rx: mpsc::Receiver<Command>,
    stats_tx: watch::Sender<WorkerStats>,
    /// Decode mode: sequences waiting for their KV and first token.
    pub(crate) awaiting: Vec<Seq>,
    /// The namespace every chain of this worker starts from: the model, its KV layout and
    /// numerics (sequences narrow it to their scope).
    root: BlockHash,
    started: Instant,
    busy: Duration,
    pub(crate) stats: WorkerStats,
    flops_per_token: f64,
    closed: bool,
    step_log: Option<StepLog>,
    /// The host's KV pool, when configured: lookups and loads on this thread...
    pool: Option<tokenpath_kv::pool::PoolClient>,
    /// ...stores on the writer's (see `tokenpath_kv::pool::PoolWriter`).
    pool_writer: Option<tokenpath_kv::pool::PoolWriter>,
    /// When the pool's counters were last asked for (at most once a second).
    pool_stats_at: Option<Instant>,
}

impl Batcher {
    pub(crate) fn new(
        engine: Arc<Engine>,
        cache: KvCache,
        cfg: WorkerConfig,
        rx: mpsc::Receiver<Command>,
        stats_tx: watch::Sender<WorkerStats>,
        step_log: Option<StepLog>,
    ) -> Result<Self, crate::WorkerError> {
        let flops_per_token = engine.model().config().flops_per_token() as f64;
        let root = crate::prefix_namespace(&engine, cache.layout(), cfg.kv_pool.is_some());
        // The writer connects first and hosts the pool when nobody does; this thread's client
        // only connects, so it never stalls a step to host (or re-host) the pool.
        let (pool, pool_writer) = match &cfg.kv_pool {
            None => (None, None),
            Some(p) => match tokenpath_kv::pool::PoolWriter::start(p.clone(), root, cache.block_bytes()) {
                Ok(w) => {
                    let client =
                        tokenpath_kv::pool::PoolClient::connect_only(p.clone(), root, cache.block_bytes());
                    (Some(client), Some(w))
                }
                Err(e) => {
                    tracing::warn!("no KV pool writer thread ({e}): storing on the batcher's thread");
                    (Some(tokenpath_kv::pool::PoolClient::new(p.clone(), root, cache.block_bytes())), None)
                }
            },
        };
        let policy =
            Policy { block_size: cfg.block_size, prefill_chunk: cfg.prefill_chunk, max_batch: cfg.max_batch };
        let sched = Scheduler::new(cache, policy, cfg.prefix_cache)
            .map_err(|e| crate::WorkerError::Config(e.to_string()))?;
        Ok(Self {
            root,
            engine,
            sched,
            cfg,
            rx,
            stats_tx,
            awaiting: Vec::new(),
            started: Instant::now(),
            busy: Duration::ZERO,
            stats: WorkerStats::default(),
            flops_per_token,
            closed: false,
            step_log,
            pool,
            pool_writer,
            pool_stats_at: None,
        })
    }

    /// Runs until every handle is dropped and every accepted request has ended.
    pub(crate) fn run(mut self) {
        tracing::info!(worker = %self.cfg.id, "worker started");
        loop {
            self.sched.resume_parked();
            let paused = self.sched.running.iter().any(Seq::paused) || !self.sched.parked.is_empty();
            if self.sched.waiting.is_empty() && self.sched.running.iter().all(Seq::paused) {
                if self.closed && self.awaiting.is_empty() && self.sched.running.is_empty() {
                    break;
                }
                // Idle: block until there is work or every handle is gone. Requests waiting for
                // a KV transfer need their deadlines checked, and paused ones their readers
                // (which do not signal this thread), so they bound the wait.
                let storing = self.pool_writer.as_ref().is_some_and(tokenpath_kv::pool::PoolWriter::busy);
                let wait =
                    if paused || storing { Duration::from_millis(5) } else { Duration::from_millis(100) };
                let got = if self.closed {
                    // No handle left to send anything: only time passes (never a busy loop).
                    std::thread::sleep(wait);
                    Err(false)
                } else if self.awaiting.is_empty() && !paused && !storing {
                    self.rx.recv().map_err(|_| true)
                } else {
                    self.rx.recv_timeout(wait).map_err(|e| matches!(e, mpsc::RecvTimeoutError::Disconnected))
                };
                match got {
                    Ok(cmd) => self.accept(cmd),
                    Err(true) => self.closed = true,
                    Err(false) => {}
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => self.accept(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        self.closed = true;
                        break;
                    }
                }
            }
            self.fill_pool();
            self.reap_cancelled();
            self.activate_ready();
            if !self.sched.waiting.is_empty() || self.sched.running.iter().any(|s| !s.paused()) {
                self.step();
            }
            self.publish();
        }
        // Stores still in flight get their blocks (the cache is intact until this returns).
        let until = Instant::now() + Duration::from_secs(2);
        while self.pool_writer.as_ref().is_some_and(tokenpath_kv::pool::PoolWriter::busy)
            && Instant::now() < until
        {
            self.fill_pool();
            std::thread::sleep(Duration::from_millis(1));
        }
        tracing::info!(worker = %self.cfg.id, "worker stopped");
    }

    fn accept(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => {
                let mut seq = Seq::new(*sub);
                seq.root = self.root.scoped(seq.cache_scope.as_deref());
                if let WorkMode::Decode(_) = seq.mode {
                    self.await_kv(seq);
                } else {
                    self.sched.waiting.push_back(seq);
                }
            }
            Command::KvChunk { transfer, first_block, bytes } => self.kv_chunk(transfer, first_block, &bytes),
            Command::KvLease { transfer, n_tokens, tx, reply } => {
                let blocks = self.kv_lease(transfer, n_tokens).map(|l| KvBlocks::new(transfer, l, tx));
                // Unanswered, the blocks come back as a `ReturnLease` when they are dropped here.
                let _ = reply.send(blocks);
            }
            Command::ReturnLease { transfer, lease } => self.return_lease(transfer, lease),
            Command::KvEnd { transfer, n_tokens, ok, lease, reply } => {
                if let Some(lease) = lease {
                    self.return_lease(transfer.id, lease);
                }
                let _ = reply.send(self.kv_end(transfer, n_tokens, ok));
            }
            Command::Handoff { transfer, first_token, sampler } => {
                self.set_handoff(transfer, first_token, sampler);
            }
            Command::FaultPanic => panic!("fault injection: the batcher thread was told to panic"),
        }
    }

    pub(crate) fn free(&mut self, seq: &mut Seq) {
        self.sched.free(seq);
    }

    /// Drops sequences whose client went away, returning their blocks.
    fn reap_cancelled(&mut self) {
        let mut n = self.sched.reap(|s| s.events.is_closed());
        let mut gone = Vec::new();
        self.awaiting.retain_mut(|s| {
            let closed = s.events.is_closed();
            if closed {
                gone.push(std::mem::take(&mut s.table));
            }
            !closed
        });
        n += gone.len();
        for mut table in gone {
            if let Err(e) = self.sched.cache.free_table(&mut table) {
                tracing::error!("freeing KV blocks of a cancelled request failed: {e}");
            }
        }
        if n > 0 {
            tracing::debug!(cancelled = n, "requests cancelled by their clients");
            self.stats.cancelled += n as u64;
        }
    }

    /// Decides how many tokens each running sequence feeds this step (the shared scheduler,
    /// with prefixes from the arena and then the host's KV pool).
    fn plan(&mut self) -> Vec<usize> {
        let mut source = prefix::PoolSource { pool: self.pool.as_mut(), stats: &mut self.stats };
        self.sched.plan(&mut source)
    }

    /// Runs one forward step over the planned batch and handles its outputs.
    fn step(&mut self) {
        let mut plan = self.plan();
        if plan.iter().all(|&n| n == 0) {
            // Nothing fits: make room, or fail a request that can never fit.
            if let Stuck::Fail(mut seq) = self.sched.unstick() {
                seq.end(
                    Ending::Failed("the KV cache cannot hold this request".into()),
                    Instant::now(),
                    &self.cfg.id,
                );
            }
            return;
        }
        let t0 = Instant::now();
        for (s, &n) in self.sched.running.iter_mut().zip(&plan) {
            if n == 0 {
                continue;
            }
            if !s.prefill_started {
                s.prefill_started = true;
                s.stamp(Mark::PrefillStart, t0);
            } else if s.is_decoding() && !s.decode_started {
                s.decode_started = true;
                s.stamp(Mark::DecodeStart, t0);
            }
        }
        let (mut prompt_tokens, mut decode_tokens, mut attn_pairs, mut decode_pairs) =
            (0u64, 0u64, 0u64, 0u64);
        let result = {
            let mut items = Vec::with_capacity(plan.len());
            for (s, &n) in self.sched.running.iter_mut().zip(&plan) {
                if n == 0 {
                    continue;
                }
                let pairs = StepRecord::pairs(s.fed, n);
                if s.is_decoding() {
                    decode_tokens += 1;
                    decode_pairs += pairs;
                } else {
                    prompt_tokens += n as u64;
                }
                attn_pairs += pairs;
                let SeqCore { table, tokens, fed, .. } = &mut s.core;
                items.push(BatchItem { table, tokens: &tokens[*fed..*fed + n], all_logits: false });
            }
            self.engine.model().forward(&mut self.sched.cache, &mut items)
        };
        let now = Instant::now();
        self.busy += now - t0;
        self.stats.steps += 1;
        self.stats.prompt_tokens_computed += prompt_tokens;
        self.stats.flops += (prompt_tokens + decode_tokens) as f64 * self.flops_per_token;
        if let Some(mut log) = self.step_log.take() {
            let rec = StepRecord {
                rows: plan.iter().filter(|&&n| n > 0).count(),
                prefill_tokens: prompt_tokens as usize,
                decode_tokens: decode_tokens as usize,
                attn_pairs,
                decode_pairs,
                running: self.sched.running.len(),
                waiting: self.sched.waiting.len(),
                free_blocks: self.sched.available(),
                ..StepRecord::default()
            };
            log.record(self.started, t0, now, rec);
            self.step_log = Some(log);
        }
        let mut out = match result {
            Ok(out) => out,
            Err(e) => {
                // All or nothing: no table grew. Fail every sequence of the step.
                tracing::error!("forward step failed: {e}");
                let message = e.to_string();
                let mut kept = Vec::new();
                for (mut s, n) in std::mem::take(&mut self.sched.running).into_iter().zip(plan) {
                    if n == 0 {
                        kept.push(s);
                    } else {
                        self.free(&mut s);
                        s.end(Ending::Failed(message.clone()), now, &self.cfg.id);
                    }
                }
                self.sched.running = kept;
                return;
            }
        };
        let mut logits = out.items_mut().into_iter();
        let n_ctx = self.engine.model().config().n_ctx;
        let mut endings: Vec<Option<Ending>> = Vec::with_capacity(plan.len());
        for (s, n) in self.sched.running.iter_mut().zip(plan.iter_mut()) {
            if *n == 0 {
                endings.push(None);
                continue;
            }
            s.fed += *n;
            let Some(row) = logits.next() else {
                endings.push(Some(Ending::Failed("the engine returned too few logits".into())));
                continue;
            };
            if s.unfed() > 0 {
                endings.push(None);
                continue;
            }
            let before = s.generated;
            endings.push(s.on_logits(&self.engine, row, now, n_ctx));
            self.stats.generated_tokens += (s.generated - before) as u64;
        }
        let running = std::mem::take(&mut self.sched.running);
        for (mut s, ending) in running.into_iter().zip(endings) {
            self.register_prefix(&mut s);
            match ending {
                None => {
                    self.export_kv(&mut s, false);
                    self.sched.running.push(s);
                }
                Some(ending) => {
                    if matches!(ending, Ending::Handoff) {
                        self.export_kv(&mut s, true);
                    }
                    self.free(&mut s);
                    s.end(ending, now, &self.cfg.id);
                }
            }
        }
    }

    /// Prefill mode: sends the blocks written since the last call (all of them, the partly
    /// filled last one included, when `last`), so the transfer overlaps the rest of the prefill.
    fn export_kv(&mut self, s: &mut Seq, last: bool) {
        if s.mode != WorkMode::Prefill {
            return;
        }
        let bs = self.cfg.block_size;
        let upto = if last { s.table.blocks().len() } else { (s.fed / bs).min(s.table.blocks().len()) };
        if upto <= s.exported_blocks {
            return;
        }
        // One KV frame's blocks at a time, each hashed right after its copy while it is still in
        // cache (a whole export of tens of MB would be out of it again by then).
        let bb = self.sched.cache.block_bytes();
        let per = crate::net::frame_blocks(bb);
        while s.exported_blocks < upto {
            let to = (s.exported_blocks + per).min(upto);
            let bytes = self.sched.cache.export_blocks(&s.table, s.exported_blocks, to);
            let first_block = u32::try_from(s.exported_blocks).unwrap_or(u32::MAX);
            s.exported_blocks = to;
            let sums = crate::FrameSums(crate::net::frame_sums(&bytes, bb));
            let _ = s.events.send(WorkEvent::Kv { first_block, bytes, sums });
        }
    }

    fn publish(&mut self) {
        let available = self.sched.available();
        self.stats.waiting = self.sched.waiting.len() + self.awaiting.len() + self.sched.parked.len();
        self.stats.running = self.sched.running.len();
        self.stats.kv_blocks_used = self.sched.cache.total_blocks() - available;
        self.stats.kv_blocks_free = available;
        self.stats.kv_blocks_cached = self.sched.cached_blocks();
        self.stats.preempted = self.sched.counters.preempted;
        if let Some(w) = &self.pool_writer {
            let pending = w.in_flight() as u64;
            if pending == 0 && self.stats.kv_pool_stores_pending > 0 {
                // Stores just ended: the pool's counts changed, ask now.
                self.pool_stats_at = None;
            }
            self.stats.kv_pool_stores_pending = pending;
            self.stats.kv_pool_stores_dropped =
                w.counters().dropped.load(std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(pool) = self.pool.as_mut() {
            if self.pool_stats_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                self.pool_stats_at = Some(Instant::now());
                self.stats.kv_pool = pool.stats().map(Box::new);
            }
        }
        self.stats.busy_seconds = self.busy.as_secs_f64();
        self.stats.uptime_seconds = self.started.elapsed().as_secs_f64();
        self.stats_tx.send_replace(self.stats.clone());
    }
}
