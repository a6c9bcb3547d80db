//! One request's state on a worker, and the events it sends.
//!
//! Every sequence is the same state machine: `tokens` (prompt, then each sampled token) and
//! `fed` (how many of them are in the KV cache). What differs by [`WorkMode`] is only where it
//! starts and where it stops: a `Full` sequence starts empty and ends at EOS/stop/length; a
//! `Prefill` sequence stops after its first token and hands off (its KV leaves as blocks fill);
//! a `Decode` sequence starts with imported KV and the first token already sampled elsewhere.

use crate::batcher::Submission;
use crate::{TokenUsage, WorkEvent, WorkMode, WorkRequest};
use std::time::Instant;
use tokenpath_engine::sampling::{Sampler, SamplerState};
use tokenpath_engine::stop::StopMatcher;
use tokenpath_engine::tokenizer::StreamDecoder;
use tokenpath_engine::Engine;
use tokenpath_kv::BlockHash;
use tokenpath_protocol::work::{Backlog, PAUSE_AT, RESUME_AT};
use tokenpath_scheduler::{SeqCore, Sequence};
use tokenpath_timeline::{FinishReason, Mark, Nanos, RequestId, ServerTimeline, WorkerId};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::OwnedSemaphorePermit;

/// How a sequence ended.
pub(crate) enum Ending {
    Finished(FinishReason),
    /// Prefill mode: the first token is sampled; hand the sequence to a decode worker.
    Handoff,
    Failed(String),
}

/// Where a decode-mode sequence's KV stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvState {
    /// Not complete yet.
    Pending,
    /// Every block arrived and verified.
    Done(Instant),
    /// Lost, truncated, corrupted or late: recompute the prompt here.
    Failed(Instant),
}

/// One request's state on the worker.
pub(crate) struct Seq {
    /// What the scheduler reads and changes: tokens, what is fed, the block table.
    pub(crate) core: SeqCore,
    pub(crate) id: RequestId,
    pub(crate) mode: WorkMode,
    pub(crate) sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    max_tokens: usize,
    ignore_eos: bool,
    pub(crate) generated: usize,
    /// Generated tokens whose text has not been sent yet (held back by UTF-8 or a stop prefix).
    unsent_tokens: u32,
    pub(crate) arrived: Instant,
    timeline: ServerTimeline,
    last_ns: Nanos,
    pub(crate) decode_started: bool,
    pub(crate) events: UnboundedSender<WorkEvent>,
    /// Text events sent and not yet read (what pauses this sequence).
    backlog: Backlog,
    /// The queue slot, held while waiting for the first prefill chunk.
    pub(crate) permit: Option<OwnedSemaphorePermit>,
    /// Of those, tokens loaded from the KV pool's SSD tier.
    pub(crate) cached_tokens_ssd: usize,
    /// Of those, tokens loaded from the KV pool's host-RAM tier.
    pub(crate) cached_tokens_host: usize,
    /// Of those, tokens loaded from the KV pool's remote tier.
    pub(crate) cached_tokens_remote: usize,
    /// Prefill mode: blocks already sent out.
    pub(crate) exported_blocks: usize,
    /// Decode mode: the KV transfer's progress and the handed-off first token.
    pub(crate) kv: KvState,
    /// Decode mode: the reserved blocks are lent to the task receiving the transfer (the table
    /// is empty until they come back).
    pub(crate) kv_lent: bool,
    pub(crate) handoff: Option<(u32, SamplerState, Instant)>,
    /// Decode mode: the transfer failed and the prompt was recomputed here.
    pub(crate) recomputed: bool,
    /// Charged with each generated token.
    meter: Option<std::sync::Arc<dyn crate::TokenMeter>>,
    /// Whose prefix-cache namespace the sequence's blocks belong to (a tenant), if scoped.
    pub(crate) cache_scope: Option<String>,
}

impl Seq {
    pub(crate) fn new(sub: Submission) -> Self {
        let Submission { req, max_tokens, sampler, events, backlog, permit } = sub;
        let WorkRequest { id, prompt, mode, stop, ignore_eos, arrived, admitted, meter, cache_scope, .. } =
            req;
        let mut seq = Seq {
            id,
            mode,
            core: SeqCore::new(prompt, BlockHash::namespace(&[])),
            sampler,
            decoder: StreamDecoder::new(false),
            stops: StopMatcher::new(stop),
            max_tokens,
            ignore_eos,
            generated: 0,
            unsent_tokens: 0,
            arrived,
            timeline: ServerTimeline::new(),
            last_ns: 0,
            decode_started: false,
            events,
            backlog,
            permit: Some(permit),
            cached_tokens_ssd: 0,
            cached_tokens_host: 0,
            cached_tokens_remote: 0,
            exported_blocks: 0,
            kv: KvState::Pending,
            kv_lent: false,
            handoff: None,
            recomputed: false,
            meter,
            cache_scope,
        };
        seq.stamp(Mark::Admitted, admitted);
        seq
    }

    /// Stamps `mark` at `at` on this process's clock, never before the previous mark (the
    /// clock is monotonic; the clamp only guards instants handed in by the caller).
    pub(crate) fn stamp(&mut self, mark: Mark, at: Instant) {
        let ns = Nanos::try_from(at.saturating_duration_since(self.arrived).as_nanos()).unwrap_or(Nanos::MAX);
        let ns = ns.max(self.last_ns);
        self.last_ns = ns;
        if let Err(e) = self.timeline.stamp(mark, ns) {
            tracing::debug!(request = %self.id, "timeline: {e}");
        }
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
        self.backlog.sent();
        let _ = self.events.send(WorkEvent::Text { delta, tokens });
    }

    /// Appends a sampled token and runs it through the text decoder and stop matcher; returns
    /// the text that became safe to send and whether a stop string completed.
    fn push_token(&mut self, engine: &Engine, tok: u32) -> Result<(String, bool), String> {
        self.generated += 1;
        self.unsent_tokens += 1;
        if let Some(m) = &self.meter {
            m.generated(1);
        }
        self.tokens.push(tok);
        let piece = self.decoder.push(engine.tokenizer(), tok).map_err(|e| e.to_string())?;
        let step = self.stops.push(&piece);
        Ok((step.emit, step.stopped))
    }

    /// Decode mode: takes over the first token the prefill worker sampled and sent, leaving the
    /// text decoder and stop matcher exactly where the prefill worker's were.
    pub(crate) fn replay_first(&mut self, engine: &Engine, tok: u32) -> Result<(), String> {
        let (emitted, _) = self.push_token(engine, tok)?;
        if !emitted.is_empty() {
            // The prefill worker already sent this text (it ran the same deterministic code).
            self.unsent_tokens = 0;
        }
        Ok(())
    }

    /// Samples from the logits of the last fed token; `Some` when the sequence is done here.
    pub(crate) fn on_logits(
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
        let (emit, stopped) = match self.push_token(engine, tok) {
            Ok(x) => x,
            Err(e) => return Some(Ending::Failed(e)),
        };
        self.send_text(emit, at);
        if stopped {
            return Some(Ending::Finished(FinishReason::Stop));
        }
        if self.generated >= self.max_tokens || self.fed + 1 >= n_ctx {
            return Some(Ending::Finished(FinishReason::Length));
        }
        if self.mode == WorkMode::Prefill {
            return Some(Ending::Handoff);
        }
        None
    }

    fn usage(&self) -> TokenUsage {
        TokenUsage {
            prompt_tokens: self.prompt_len as u64,
            completion_tokens: self.generated as u64,
            cached_tokens: self.cached_tokens as u64,
        }
    }

    /// Sends the closing event (`Finished`, `Handoff` or `Failed`).
    pub(crate) fn end(&mut self, ending: Ending, at: Instant, worker: &WorkerId) {
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
                timing.cached_tokens = self.cached_tokens as u64;
                timing.cached_tokens_ssd = self.cached_tokens_ssd as u64;
                timing.cached_tokens_host = self.cached_tokens_host as u64;
                timing.cached_tokens_remote = self.cached_tokens_remote as u64;
                timing.kv_recomputed = self.recomputed;
                timing.workers.insert(self.mode.role_name().into(), worker.clone());
                let usage = self.usage();
                let _ = self.events.send(WorkEvent::Finished { reason, usage, timing });
            }
            Ending::Handoff => {
                let mut timing = self.timeline.timing();
                timing.cached_tokens = self.cached_tokens as u64;
                timing.cached_tokens_ssd = self.cached_tokens_ssd as u64;
                timing.cached_tokens_host = self.cached_tokens_host as u64;
                timing.cached_tokens_remote = self.cached_tokens_remote as u64;
                timing.workers.insert("prefill".into(), worker.clone());
                let first_token = self.tokens[self.prompt_len];
                let sampler = self.sampler.state();
                let usage = self.usage();
                let _ = self.events.send(WorkEvent::Handoff { first_token, sampler, usage, timing, at });
            }
            Ending::Failed(message) => {
                self.stamp(Mark::Failed, at);
                tracing::warn!(request = %self.id, "generation failed: {message}");
                let _ = self.events.send(WorkEvent::Failed { message });
            }
        }
    }
}

impl std::ops::Deref for Seq {
    type Target = SeqCore;
    fn deref(&self) -> &SeqCore {
        &self.core
    }
}

impl std::ops::DerefMut for Seq {
    fn deref_mut(&mut self) -> &mut SeqCore {
        &mut self.core
    }
}

impl Sequence for Seq {
    /// Its reader fell [`PAUSE_AT`] text events behind: not stepped until it catches up.
    fn paused(&self) -> bool {
        self.backlog.get() >= PAUSE_AT
    }

    /// A parked (paused, KV given up) sequence may queue again.
    fn may_resume(&self) -> bool {
        self.backlog.get() <= RESUME_AT
    }

    /// Admitted: the queue slot it held while waiting is given back.
    fn admitted(&mut self) {
        self.permit = None;
    }
}
