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

use crate::handle::{TokenUsage, WorkEvent, WorkRequest, WorkerConfig, WorkerStats};
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_engine::kv_cache::{BlockTable, KvCache};
use tokenpath_engine::model::BatchItem;
use tokenpath_engine::sampling::Sampler;
use tokenpath_engine::stop::StopMatcher;
use tokenpath_engine::tokenizer::StreamDecoder;
use tokenpath_engine::Engine;
use tokenpath_timeline::{FinishReason, Mark, Nanos, RequestId, ServerTimeline};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{watch, OwnedSemaphorePermit};

/// Messages to the batcher thread.
pub(crate) enum Command {
    /// A validated request.
    Submit(Box<Submission>),
}

/// A request that passed validation and holds a queue slot.
pub(crate) struct Submission {
    pub(crate) req: WorkRequest,
    pub(crate) max_tokens: usize,
    pub(crate) sampler: Sampler,
    pub(crate) events: UnboundedSender<WorkEvent>,
    pub(crate) permit: OwnedSemaphorePermit,
}

/// How a sequence ended.
enum Ending {
    Finished(FinishReason),
    Failed(String),
}

/// One request's state on the worker.
struct Seq {
    id: RequestId,
    tokens: Vec<u32>,
    prompt_len: usize,
    fed: usize,
    table: BlockTable,
    sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    max_tokens: usize,
    ignore_eos: bool,
    generated: usize,
    /// Generated tokens whose text has not been sent yet (held back by UTF-8 or a stop prefix).
    unsent_tokens: u32,
    arrived: Instant,
    timeline: ServerTimeline,
    last_ns: Nanos,
    prefill_started: bool,
    first_token_done: bool,
    decode_started: bool,
    events: UnboundedSender<WorkEvent>,
    /// The queue slot, held while waiting for the first prefill chunk.
    permit: Option<OwnedSemaphorePermit>,
}

impl Seq {
    fn new(sub: Submission) -> Self {
        let Submission { req, max_tokens, sampler, events, permit } = sub;
        let mut seq = Seq {
            id: req.id,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            fed: 0,
            table: BlockTable::default(),
            sampler,
            decoder: StreamDecoder::new(false),
            stops: StopMatcher::new(req.stop),
            max_tokens,
            ignore_eos: req.ignore_eos,
            generated: 0,
            unsent_tokens: 0,
            arrived: req.arrived,
            timeline: ServerTimeline::new(),
            last_ns: 0,
            prefill_started: false,
            first_token_done: false,
            decode_started: false,
            events,
            permit: Some(permit),
        };
        seq.stamp(Mark::Admitted, req.admitted);
        seq
    }

    /// Stamps `mark` at `at` on this process's clock, never before the previous mark (the
    /// clock is monotonic; the clamp only guards instants handed in by the caller).
    fn stamp(&mut self, mark: Mark, at: Instant) {
        let ns = Nanos::try_from(at.saturating_duration_since(self.arrived).as_nanos()).unwrap_or(Nanos::MAX);
        let ns = ns.max(self.last_ns);
        self.last_ns = ns;
        if let Err(e) = self.timeline.stamp(mark, ns) {
            tracing::debug!(request = %self.id, "timeline: {e}");
        }
    }

    fn unfed(&self) -> usize {
        self.tokens.len() - self.fed
    }

    /// A decoding sequence feeds exactly its last sampled token.
    fn is_decoding(&self) -> bool {
        self.first_token_done && self.unfed() == 1
    }

    fn send_text(&mut self, delta: String, at: Instant) {
        if delta.is_empty() || self.unsent_tokens == 0 {
            return;
        }
        let tokens = std::mem::take(&mut self.unsent_tokens);
        for _ in 0..tokens {
            self.stamp(Mark::Token, at);
        }
        // A dropped receiver is noticed (and the sequence cancelled) at the next step.
        let _ = self.events.send(WorkEvent::Text { delta, tokens });
    }

    /// Samples from the logits of the last fed token; `Some` when the sequence is done.
    fn on_logits(
        &mut self,
        engine: &Engine,
        logits: &mut [f32],
        at: Instant,
        n_ctx: usize,
    ) -> Option<Ending> {
        if !self.first_token_done {
            self.first_token_done = true;
            self.stamp(Mark::PrefillEnd, at);
        }
        let tok = match self.sampler.sample(logits) {
            Ok(t) => t,
            Err(e) => return Some(Ending::Failed(e.to_string())),
        };
        if engine.is_end(tok) && !self.ignore_eos {
            return Some(Ending::Finished(FinishReason::Stop));
        }
        self.generated += 1;
        self.unsent_tokens += 1;
        self.tokens.push(tok);
        let piece = match self.decoder.push(engine.tokenizer(), tok) {
            Ok(p) => p,
            Err(e) => return Some(Ending::Failed(e.to_string())),
        };
        let step = self.stops.push(&piece);
        self.send_text(step.emit, at);
        if step.stopped {
            return Some(Ending::Finished(FinishReason::Stop));
        }
        if self.generated >= self.max_tokens || self.fed + 1 >= n_ctx {
            return Some(Ending::Finished(FinishReason::Length));
        }
        None
    }

    /// Sends the last text and the closing event.
    fn end(&mut self, ending: Ending, at: Instant, worker: &tokenpath_timeline::WorkerId) {
        match ending {
            Ending::Finished(reason) => {
                if !self.stops.is_stopped() {
                    let rest = self.stops.push(&self.decoder.finish());
                    let tail = rest.emit + &self.stops.finish();
                    self.send_text(tail, at);
                }
                if !self.decode_started {
                    self.decode_started = true;
                    self.stamp(Mark::DecodeStart, at);
                }
                self.stamp(Mark::Finished(reason), at);
                let mut timing = self.timeline.timing();
                timing.workers.insert("both".into(), worker.clone());
                let usage = TokenUsage {
                    prompt_tokens: self.prompt_len as u64,
                    completion_tokens: self.generated as u64,
                    cached_tokens: 0,
                };
                let _ = self.events.send(WorkEvent::Finished { reason, usage, timing });
            }
            Ending::Failed(message) => {
                self.stamp(Mark::Failed, at);
                tracing::warn!(request = %self.id, "generation failed: {message}");
                let _ = self.events.send(WorkEvent::Failed { message });
            }
        }
    }
}

/// The thread's state.
pub(crate) struct Batcher {
    engine: Arc<Engine>,
    cache: KvCache,
    cfg: WorkerConfig,
    rx: mpsc::Receiver<Command>,
    stats_tx: watch::Sender<WorkerStats>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    started: Instant,
    busy: Duration,
    stats: WorkerStats,
    flops_per_token: f64,
    closed: bool,
}

impl Batcher {
    pub(crate) fn new(
        engine: Arc<Engine>,
        cache: KvCache,
        cfg: WorkerConfig,
        rx: mpsc::Receiver<Command>,
        stats_tx: watch::Sender<WorkerStats>,
    ) -> Self {
        let flops_per_token = engine.model().config().flops_per_token() as f64;
        Self {
            engine,
            cache,
            cfg,
            rx,
            stats_tx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            started: Instant::now(),
            busy: Duration::ZERO,
            stats: WorkerStats::default(),
            flops_per_token,
            closed: false,
        }
    }

    /// Runs until every handle is dropped and every accepted request has ended.
    pub(crate) fn run(mut self) {
        tracing::info!(worker = %self.cfg.id, "worker started");
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.closed {
                    break;
                }
                // Idle: block until there is work or every handle is gone.
                match self.rx.recv() {
                    Ok(cmd) => self.accept(cmd),
                    Err(_) => {
                        self.closed = true;
                        continue;
                    }
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
            self.reap_cancelled();
            self.step();
            self.publish();
        }
        tracing::info!(worker = %self.cfg.id, "worker stopped");
    }

    fn accept(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => self.waiting.push_back(Seq::new(*sub)),
        }
    }

    fn free(&mut self, seq: &mut Seq) {
        if let Err(e) = self.cache.free_table(&mut seq.table) {
            tracing::error!(request = %seq.id, "freeing KV blocks failed: {e}");
        }
        seq.fed = 0;
    }

    /// Drops sequences whose client went away, returning their blocks.
    fn reap_cancelled(&mut self) {
        let mut gone = Vec::new();
        self.running.retain_mut(|s| {
            let closed = s.events.is_closed();
            if closed {
                gone.push(std::mem::take(&mut s.table));
            }
            !closed
        });
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.events.is_closed());
        let n = gone.len() + before - self.waiting.len();
        for mut table in gone {
            if let Err(e) = self.cache.free_table(&mut table) {
                tracing::error!("freeing KV blocks of a cancelled request failed: {e}");
            }
        }
        if n > 0 {
            tracing::debug!(cancelled = n, "requests cancelled by their clients");
            self.stats.cancelled += n as u64;
        }
    }

    /// Moves the youngest running sequence back to the front of the waiting queue.
    fn preempt_youngest(&mut self) -> bool {
        let Some(mut seq) = self.running.pop() else { return false };
        self.free(&mut seq);
        tracing::debug!(request = %seq.id, "preempted: KV cache full");
        self.stats.preempted += 1;
        self.waiting.push_front(seq);
        true
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Decides how many tokens each running sequence feeds this step, admitting waiting ones.
    /// `plan[i]` belongs to `running[i]`; 0 means "not this step".
    fn plan(&mut self) -> Vec<usize> {
        // Decodes first: they may preempt the youngest sequences to get their next block.
        loop {
            let need: usize = self
                .running
                .iter()
                .filter(|s| s.is_decoding())
                .map(|s| self.blocks_for(s.fed + 1).saturating_sub(s.table.blocks().len()))
                .sum();
            if need <= self.cache.free_blocks() || self.running.len() <= 1 {
                break;
            }
            self.preempt_youngest();
        }
        let bs = self.cfg.block_size;
        let mut free = self.cache.free_blocks();
        let mut budget = self.cfg.prefill_chunk;
        let mut plan = vec![0; self.running.len()];
        for (i, s) in self.running.iter().enumerate() {
            if s.is_decoding() {
                let need = self.blocks_for(s.fed + 1).saturating_sub(s.table.blocks().len());
                if need <= free {
                    free -= need;
                    plan[i] = 1;
                }
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.is_decoding() || budget == 0 {
                continue;
            }
            let fits = (s.table.blocks().len() + free) * bs - s.fed;
            let n = s.unfed().min(budget).min(fits);
            if n == 0 {
                continue;
            }
            free -= self.blocks_for(s.fed + n).saturating_sub(s.table.blocks().len());
            budget -= n;
            plan[i] = n;
        }
        // Admission: FIFO, whole prompt must fit, one block of headroom per decoding sequence.
        let headroom = self.running.iter().filter(|s| s.is_decoding()).count();
        while budget > 0 && self.running.len() < self.cfg.max_batch {
            let Some(front) = self.waiting.front() else { break };
            if self.blocks_for(front.tokens.len()) + headroom > free {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else { break };
            seq.permit = None;
            let n = seq.unfed().min(budget);
            free -= self.blocks_for(n);
            budget -= n;
            self.running.push(seq);
            plan.push(n);
        }
        plan
    }

    /// Runs one forward step over the planned batch and handles its outputs.
    fn step(&mut self) {
        let mut plan = self.plan();
        if plan.iter().all(|&n| n == 0) {
            // Nothing fits: make room, or fail a request that can never fit.
            if self.running.len() > 1 {
                self.preempt_youngest();
            } else if let Some(mut seq) = self.running.pop().or_else(|| {
                self.waiting.front().filter(|_| self.running.is_empty() && self.cache.used_blocks() == 0)?;
                self.waiting.pop_front()
            }) {
                self.free(&mut seq);
                seq.end(
                    Ending::Failed("the KV cache cannot hold this request".into()),
                    Instant::now(),
                    &self.cfg.id,
                );
            }
            return;
        }
        let t0 = Instant::now();
        for (s, &n) in self.running.iter_mut().zip(&plan) {
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
        let (mut prompt_tokens, mut decode_tokens) = (0u64, 0u64);
        let result = {
            let mut items = Vec::with_capacity(plan.len());
            for (s, &n) in self.running.iter_mut().zip(&plan) {
                if n == 0 {
                    continue;
                }
                if s.is_decoding() {
                    decode_tokens += 1;
                } else {
                    prompt_tokens += n as u64;
                }
                let Seq { table, tokens, fed, .. } = s;
                items.push(BatchItem { table, tokens: &tokens[*fed..*fed + n], all_logits: false });
            }
            self.engine.model().forward(&mut self.cache, &mut items)
        };
        let now = Instant::now();
        self.busy += now - t0;
        self.stats.steps += 1;
        self.stats.prompt_tokens_computed += prompt_tokens;
        self.stats.flops += (prompt_tokens + decode_tokens) as f64 * self.flops_per_token;
        let mut logits = match result {
            Ok(out) => out.logits.into_iter(),
            Err(e) => {
                // All or nothing: no table grew. Fail every sequence of the step.
                tracing::error!("forward step failed: {e}");
                let message = e.to_string();
                let mut kept = Vec::new();
                for (mut s, n) in std::mem::take(&mut self.running).into_iter().zip(plan) {
                    if n == 0 {
                        kept.push(s);
                    } else {
                        self.free(&mut s);
                        s.end(Ending::Failed(message.clone()), now, &self.cfg.id);
                    }
                }
                self.running = kept;
                return;
            }
        };
        let n_ctx = self.engine.model().config().n_ctx;
        let mut endings: Vec<Option<Ending>> = Vec::with_capacity(plan.len());
        for (s, n) in self.running.iter_mut().zip(plan.iter_mut()) {
            if *n == 0 {
                endings.push(None);
                continue;
            }
            s.fed += *n;
            let Some(mut row) = logits.next() else {
                endings.push(Some(Ending::Failed("the engine returned too few logits".into())));
                continue;
            };
            if s.unfed() > 0 {
                endings.push(None);
                continue;
            }
            let before = s.generated;
            endings.push(s.on_logits(&self.engine, &mut row, now, n_ctx));
            self.stats.generated_tokens += (s.generated - before) as u64;
        }
        let running = std::mem::take(&mut self.running);
        for (mut s, ending) in running.into_iter().zip(endings) {
            match ending {
                None => self.running.push(s),
                Some(ending) => {
                    self.free(&mut s);
                    s.end(ending, now, &self.cfg.id);
                }
            }
        }
    }

    fn publish(&mut self) {
        self.stats.waiting = self.waiting.len();
        self.stats.running = self.running.len();
        self.stats.kv_blocks_used = self.cache.used_blocks();
        self.stats.kv_blocks_free = self.cache.free_blocks();
        self.stats.busy_seconds = self.busy.as_secs_f64();
        self.stats.uptime_seconds = self.started.elapsed().as_secs_f64();
        self.stats_tx.send_replace(self.stats.clone());
    }
}
