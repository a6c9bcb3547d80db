//! Server-side marks and stages. One clock per process: a process stamps marks on its own
//! monotonic clock ([`ServerTimeline`]) and only ever reports the durations it measured itself
//! ([`ServerTiming`]), so a request that crosses hosts needs no clock synchronisation — the gateway
//! just inserts each process's stage durations into one [`ServerTiming`].

use crate::{ms, Nanos, TimelineError, WorkerId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// A stage of the request path: the interval between two marks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// `arrived` → `admitted`: auth, validation, tokenization, rate limit.
    Gateway,
    /// `admitted` → `kv_load_start` (or `prefill_start`): waiting for a prefill slot.
    Queue,
    /// `kv_load_start` → `kv_load_end`: a prompt prefix's KV copied in from the KV pool; absent
    /// when nothing was loaded.
    KvLoad,
    /// `prefill_start` → `prefill_end` (first token computed), all chunks included.
    Prefill,
    /// `kv_transfer_start` → `kv_transfer_end`; absent when colocated.
    KvTransfer,
    /// `prefill_end` (or `kv_transfer_end`) → `decode_start`: waiting to join a decode batch.
    DecodeQueue,
    /// `decode_start` → `finished`/`failed`: the token-by-token loop.
    Decode,
}

impl Stage {
    /// Every stage in path order.
    pub const ALL: [Stage; 7] = [
        Stage::Gateway,
        Stage::Queue,
        Stage::KvLoad,
        Stage::Prefill,
        Stage::KvTransfer,
        Stage::DecodeQueue,
        Stage::Decode,
    ];

    /// The snake_case name used on the wire, in metrics labels and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Gateway => "gateway",
            Stage::Queue => "queue",
            Stage::KvLoad => "kv_load",
            Stage::Prefill => "prefill",
            Stage::KvTransfer => "kv_transfer",
            Stage::DecodeQueue => "decode_queue",
            Stage::Decode => "decode",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a request finished normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The client went away; the request was cancelled.
    Cancelled,
}

/// A server mark. `Arrived` is the origin (0 ns) of a request's server timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// Authenticated, validated, tokenized, rate limit passed.
    Admitted,
    /// A load of prompt KV from the KV pool began.
    KvLoadStart,
    /// It ended (with at least one block loaded).
    KvLoadEnd,
    /// First prefill chunk scheduled.
    PrefillStart,
    /// Prefill done and the first token computed.
    PrefillEnd,
    /// KV blocks start leaving the prefill worker.
    KvTransferStart,
    /// KV blocks are in the decode worker.
    KvTransferEnd,
    /// The request joined a decode batch.
    DecodeStart,
    /// One token emitted to the client.
    Token,
    /// Finished normally.
    Finished(FinishReason),
    /// Failed.
    Failed,
}

impl Mark {
    fn name(self) -> &'static str {
        match self {
            Mark::Admitted => "admitted",
            Mark::KvLoadStart => "kv_load_start",
            Mark::KvLoadEnd => "kv_load_end",
            Mark::PrefillStart => "prefill_start",
            Mark::PrefillEnd => "prefill_end",
            Mark::KvTransferStart => "kv_transfer_start",
            Mark::KvTransferEnd => "kv_transfer_end",
            Mark::DecodeStart => "decode_start",
            Mark::Token => "token",
            Mark::Finished(_) => "finished",
            Mark::Failed => "failed",
        }
    }
}

/// The marks of one request as stamped by one process, in nanoseconds since `arrived`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServerTimeline {
    admitted: Option<Nanos>,
    kv_load_start: Option<Nanos>,
    kv_load_end: Option<Nanos>,
    prefill_start: Option<Nanos>,
    prefill_end: Option<Nanos>,
    kv_transfer_start: Option<Nanos>,
    kv_transfer_end: Option<Nanos>,
    decode_start: Option<Nanos>,
    tokens: Vec<Nanos>,
    end: Option<(Nanos, Option<FinishReason>)>,
    last: (Nanos, &'static str),
}

impl ServerTimeline {
    /// A timeline whose `arrived` mark is now (0 ns).
    pub fn new() -> Self {
        Self { last: (0, "arrived"), ..Self::default() }
    }

    /// Stamps `mark` at `at` ns since `arrived`. Marks must not go back in time; a mark stamped
    /// twice keeps its first time (a retried stage is still one stage), except `Token`.
    pub fn stamp(&mut self, mark: Mark, at: Nanos) -> Result<(), TimelineError> {
        if at < self.last.0 {
            return Err(TimelineError::MarksOutOfOrder {
                earlier: self.last.1,
                earlier_ns: self.last.0,
                later: mark.name(),
                later_ns: at,
            });
        }
        self.last = (at, mark.name());
        let slot = match mark {
            Mark::Admitted => &mut self.admitted,
            Mark::KvLoadStart => &mut self.kv_load_start,
            Mark::KvLoadEnd => &mut self.kv_load_end,
            Mark::PrefillStart => &mut self.prefill_start,
            Mark::PrefillEnd => &mut self.prefill_end,
            Mark::KvTransferStart => &mut self.kv_transfer_start,
            Mark::KvTransferEnd => &mut self.kv_transfer_end,
            Mark::DecodeStart => &mut self.decode_start,
            Mark::Token => {
                self.tokens.push(at);
                return Ok(());
            }
            Mark::Finished(reason) => {
                self.end.get_or_insert((at, Some(reason)));
                return Ok(());
            }
            Mark::Failed => {
                self.end.get_or_insert((at, None));
                return Ok(());
            }
        };
        slot.get_or_insert(at);
        Ok(())
    }

    /// Duration of `stage` in ns, when both of its marks were stamped by this process.
    pub fn stage_ns(&self, stage: Stage) -> Option<Nanos> {
        let (from, to) = match stage {
            Stage::Gateway => (Some(0), self.admitted),
            Stage::Queue => (self.admitted, self.kv_load_start.or(self.prefill_start)),
            Stage::KvLoad => (self.kv_load_start, self.kv_load_end),
            Stage::Prefill => (self.prefill_start, self.prefill_end),
            Stage::KvTransfer => (self.kv_transfer_start, self.kv_transfer_end),
            Stage::DecodeQueue => (self.kv_transfer_end.or(self.prefill_end), self.decode_start),
            Stage::Decode => (self.decode_start, self.end.map(|e| e.0)),
        };
        Some(to?.saturating_sub(from?))
    }

    /// Server-observed TTFT: first token emitted − `arrived`.
    pub fn ttft_ns(&self) -> Option<Nanos> {
        self.tokens.first().copied()
    }

    /// Token emission times.
    pub fn tokens(&self) -> &[Nanos] {
        &self.tokens
    }

    /// `Some(reason)` when finished normally, `None` while running or after a failure.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.end.and_then(|e| e.1)
    }

    /// The durations this process measured, ready for the wire.
    pub fn timing(&self) -> ServerTiming {
        let mut t = ServerTiming::default();
        for stage in Stage::ALL {
            if let Some(ns) = self.stage_ns(stage) {
                t.stages_ms.insert(stage, ms(ns));
            }
        }
        t.ttft_ms = self.ttft_ns().map(ms);
        t.e2e_ms = self.end.map(|e| ms(e.0));
        t
    }
}

/// The `timing` object a server attaches to a response: stage durations in milliseconds, each
/// measured by the process that ran the stage, plus what the client cannot see.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerTiming {
    /// Stage durations, ms. Stages a request did not go through are absent, not zero.
    #[serde(default)]
    pub stages_ms: BTreeMap<Stage, f64>,
    /// First token sent − `arrived`, ms, on the gateway's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// `finished` − `arrived`, ms, on the gateway's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: u64,
    /// Of those, the tokens loaded from the KV pool's SSD tier (verified) rather than found in
    /// the worker's arena; absent when none were.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_tokens_ssd: u64,
    /// Of those, the tokens loaded from the KV pool's host-RAM tier; absent when none were.
    /// (`cached_tokens` less the three pool tiers' were in the worker's arena.)
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_tokens_host: u64,
    /// Of those, the tokens loaded from the KV pool's remote tier; absent when none were.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_tokens_remote: u64,
    /// Bytes of KV moved between processes (PD only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_bytes: Option<u64>,
    /// Which worker ran which role (`prefill`, `decode`, `both`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub workers: BTreeMap<String, WorkerId>,
    /// The KV transfer failed (lost, truncated or corrupted) and the decode worker recomputed
    /// the prompt itself; its recomputation is inside `decode_queue`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kv_recomputed: bool,
    /// Where each stage of a request served by an external engine was measured. Absent for a
    /// stage: the tokenpath process that ran it measured it (every stage of our own engine).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<Stage, StageSource>,
    /// Stages whose span the worker that ran them already exported (OTLP), so the gateway's
    /// export leaves them out. The gateway's own bookkeeping: never on the wire (a worker says
    /// so in its message, `FromWorker`'s `spans` flag).
    #[serde(skip)]
    pub exported: BTreeSet<Stage>,
}

/// Who measured a stage of a request that an external engine served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageSource {
    /// The engine reported it (vLLM's per-request `metrics`, llama.cpp's `timings`, a tokenpath
    /// upstream's `timing`).
    Engine,
    /// The gateway measured it on its own clock at the boundaries it sees (bytes sent, first
    /// and last token received), so it includes the network and whatever the engine did not
    /// split out.
    Gateway,
    /// The engine's exported span (OTLP) said so; the span was joined to the request by its
    /// trace id.
    Span,
}

impl ServerTiming {
    /// What a gateway measures of a request it hands to others: its own stage (`gateway`), TTFT
    /// and E2E, from its marks in ns since `arrived`, through [`ServerTimeline`] — the one
    /// definition of each (invariant 1). Marks out of order are clamped to the one before (a
    /// gateway's marks are in order by construction; nothing here may fail a response).
    pub fn gateway_part(
        admitted: Nanos,
        first_token: Option<Nanos>,
        end: Nanos,
        reason: FinishReason,
    ) -> Self {
        let first_token = first_token.map(|f| f.max(admitted));
        let end = end.max(first_token.unwrap_or(admitted));
        let mut own = ServerTimeline::new();
        let marks = [
            (Mark::Admitted, Some(admitted)),
            (Mark::Token, first_token),
            (Mark::Finished(reason), Some(end)),
        ];
        for (mark, at) in marks {
            if let Some(at) = at {
                // In order after the clamps above: `stamp` cannot refuse them.
                let _ = own.stamp(mark, at);
            }
        }
        own.timing()
    }

    /// Duration of a stage, ms.
    pub fn stage_ms(&self, stage: Stage) -> Option<f64> {
        self.stages_ms.get(&stage).copied()
    }

    /// Adds the stages another process measured (the gateway assembling one timeline from its
    /// workers). Stages already present are kept: each stage has exactly one owner.
    pub fn absorb(&mut self, other: &ServerTiming) {
        for (stage, v) in &other.stages_ms {
            self.stages_ms.entry(*stage).or_insert(*v);
        }
        if other.cached_tokens > self.cached_tokens {
            // The tier split goes with the count it splits.
            self.cached_tokens = other.cached_tokens;
            self.cached_tokens_ssd = other.cached_tokens_ssd;
            self.cached_tokens_host = other.cached_tokens_host;
            self.cached_tokens_remote = other.cached_tokens_remote;
        }
        if self.kv_transfer_bytes.is_none() {
            self.kv_transfer_bytes = other.kv_transfer_bytes;
        }
        self.kv_recomputed |= other.kv_recomputed;
        for (role, w) in &other.workers {
            self.workers.entry(role.clone()).or_insert_with(|| w.clone());
        }
        for (stage, src) in &other.sources {
            self.sources.entry(*stage).or_insert(*src);
        }
        self.exported.extend(other.exported.iter().copied());
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn colocated() -> ServerTimeline {
        let mut t = ServerTimeline::new();
        t.stamp(Mark::Admitted, 2 * MS).unwrap();
        t.stamp(Mark::PrefillStart, 12 * MS).unwrap();
        t.stamp(Mark::PrefillEnd, 52 * MS).unwrap();
        t.stamp(Mark::Token, 53 * MS).unwrap();
        t.stamp(Mark::DecodeStart, 55 * MS).unwrap();
        t.stamp(Mark::Token, 75 * MS).unwrap();
        t.stamp(Mark::Finished(FinishReason::Length), 80 * MS).unwrap();
        t
    }

    #[test]
    fn a_gateway_s_part_is_its_stage_ttft_and_e2e_and_nothing_else() {
        let t = ServerTiming::gateway_part(2 * MS, Some(53 * MS), 80 * MS, FinishReason::Stop);
        assert_eq!(t.stages_ms.into_iter().collect::<Vec<_>>(), [(Stage::Gateway, 2.0)]);
        assert_eq!((t.ttft_ms, t.e2e_ms), (Some(53.0), Some(80.0)));
        // The same numbers the full timeline gives for those marks.
        let full = colocated().timing();
        assert_eq!(
            (full.ttft_ms, full.e2e_ms, full.stage_ms(Stage::Gateway)),
            (Some(53.0), Some(80.0), Some(2.0))
        );
        // No first token: no TTFT; marks out of order are clamped, never refused.
        let none = ServerTiming::gateway_part(5 * MS, None, 3 * MS, FinishReason::Length);
        assert_eq!((none.ttft_ms, none.e2e_ms, none.stage_ms(Stage::Gateway)), (None, Some(5.0), Some(5.0)));
    }

    #[test]
    fn colocated_stages_are_the_intervals_between_marks() {
        let timing = colocated().timing();
        assert_eq!(timing.stage_ms(Stage::Gateway), Some(2.0));
        assert_eq!(timing.stage_ms(Stage::Queue), Some(10.0));
        assert_eq!(timing.stage_ms(Stage::Prefill), Some(40.0));
        assert_eq!(timing.stage_ms(Stage::KvTransfer), None, "no transfer when colocated");
        assert_eq!(timing.stage_ms(Stage::DecodeQueue), Some(3.0));
        assert_eq!(timing.stage_ms(Stage::Decode), Some(25.0));
        assert_eq!(timing.ttft_ms, Some(53.0));
        assert_eq!(timing.e2e_ms, Some(80.0));
    }

    #[test]
    fn decode_queue_starts_at_transfer_end_in_pd() {
        let mut t = ServerTimeline::new();
        t.stamp(Mark::PrefillEnd, 10 * MS).unwrap();
        t.stamp(Mark::KvTransferStart, 11 * MS).unwrap();
        t.stamp(Mark::KvTransferEnd, 15 * MS).unwrap();
        t.stamp(Mark::DecodeStart, 18 * MS).unwrap();
        assert_eq!(t.stage_ns(Stage::KvTransfer), Some(4 * MS));
        assert_eq!(t.stage_ns(Stage::DecodeQueue), Some(3 * MS));
    }

    #[test]
    fn marks_going_back_in_time_are_rejected() {
        let mut t = ServerTimeline::new();
        t.stamp(Mark::PrefillStart, 5 * MS).unwrap();
        let err = t.stamp(Mark::PrefillEnd, 4 * MS).unwrap_err();
        assert!(err.to_string().contains("prefill_end"), "{err}");
    }

    #[test]
    fn failed_request_has_no_finish_reason_but_ends_decode() {
        let mut t = ServerTimeline::new();
        t.stamp(Mark::DecodeStart, MS).unwrap();
        t.stamp(Mark::Failed, 3 * MS).unwrap();
        assert_eq!(t.finish_reason(), None);
        assert_eq!(t.stage_ns(Stage::Decode), Some(2 * MS));
    }

    #[test]
    fn gateway_absorbs_worker_stages_without_overwriting() {
        let mut gw = ServerTiming::default();
        gw.stages_ms.insert(Stage::Gateway, 1.0);
        let mut prefill = ServerTiming::default();
        prefill.stages_ms.insert(Stage::Prefill, 40.0);
        prefill.stages_ms.insert(Stage::Gateway, 99.0);
        prefill.workers.insert("prefill".into(), WorkerId("p0".into()));
        let mut decode = ServerTiming { cached_tokens: 16, ..Default::default() };
        decode.stages_ms.insert(Stage::Decode, 200.0);
        gw.absorb(&prefill);
        gw.absorb(&decode);
        assert_eq!(gw.stage_ms(Stage::Gateway), Some(1.0));
        assert_eq!(gw.stage_ms(Stage::Prefill), Some(40.0));
        assert_eq!(gw.stage_ms(Stage::Decode), Some(200.0));
        assert_eq!(gw.cached_tokens, 16);
        assert_eq!(gw.workers["prefill"], WorkerId("p0".into()));
    }

    #[test]
    fn timing_wire_form_uses_stage_names() {
        let json = serde_json::to_value(colocated().timing()).unwrap();
        assert_eq!(json["stages_ms"]["decode_queue"], 3.0);
        assert!(json["stages_ms"].get("kv_transfer").is_none());
        let back: ServerTiming = serde_json::from_value(json).unwrap();
        assert_eq!(back, colocated().timing());
    }
}
