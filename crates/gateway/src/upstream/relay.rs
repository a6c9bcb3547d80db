//! Passing an upstream's answer back: its SSE chunks one by one (decoded with the protocol
//! crate's bounded decoder, read only while the client keeps up, given up after a silence), or
//! its whole body; the model name rewritten, the forced usage chunk dropped unless the client
//! asked for usage, tokens charged as they arrive, and one timeline per request.
//!
//! The timeline: the `gateway` stage is ours as always. Colocated, `prefill` (admitted → first
//! token) and `decode` (first → last token) are measured here, on the gateway's clock, and
//! marked `gateway`; stages the engine reports — vLLM's per-request `metrics` (`queue_time_ms`,
//! `time_to_first_token_ms`, `generation_time_ms`), llama.cpp's `timings` (`prompt_ms`,
//! `predicted_ms`), Dynamo's `nvext.timing`, a tokenpath upstream's `timing` — replace them,
//! marked `engine`. In PD the
//! prefill leg is `prefill` (admitted → its answer; its engine's queue and prefill replace it
//! when reported), `decode_queue` is the prefill's end → the decode leg's first token (KV
//! transfer, the decode engine's queue and first step: one stage, since no engine reports the
//! split per request), and the decode leg gives `decode` (the decode engine's own
//! `generation_time_ms`/`predicted_ms` replaces ours). Nothing is invented: a stage nobody
//! measured is absent — there is no `kv_transfer` for an engine that does not report one, and a
//! non-streamed answer has no first token to split at.

use futures_util::StreamExt as _;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_protocol::cluster::peer_message;
use tokenpath_protocol::work::{StreamSender, TokenMeter, TokenUsage, WorkEvent};
use tokenpath_protocol::{
    parse_stream_parts, parse_stream_value, FinishReason as WireFinish, SseDecoder, SseEvent,
    StreamChunkView, Usage,
};
use tokenpath_timeline::{FinishReason, ServerTiming, Stage, StageSource};
use tokio::sync::oneshot;

use super::chunk::Chunk;
use tokenpath_timeline::engines::body_stages as engine_stages;

/// One request's relay.
#[derive(Debug)]
pub(super) struct Relay {
    /// Our model name, written into what goes back.
    pub(super) served_model_name: Arc<str>,
    /// The answering upstream, for messages.
    pub(super) url: String,
    pub(super) arrived: Instant,
    pub(super) admitted: Instant,
    /// When the request went out (for logs of slow upstreams).
    pub(super) sent: Instant,
    /// The gateway's count, when the upstream reports no usage.
    pub(super) prompt_tokens: u64,
    pub(super) meter: Option<Arc<dyn TokenMeter>>,
    /// The client asked for `stream_options.include_usage`.
    pub(super) client_usage: bool,
    /// We forced usage on every chunk (vLLM's `continuous_usage_stats`) and the client did not
    /// ask for it: counted, then taken off every chunk but the usage chunk.
    pub(super) strip_chunk_usage: bool,
    /// PD: the prefill leg.
    pub(super) prefill: Prefill,
}

/// The prefill leg of a PD request, as the relay of its decode leg knows it.
#[derive(Debug)]
pub(super) enum Prefill {
    /// Colocated: the upstream runs it all.
    None,
    /// Ended before the decode leg went out (vLLM, TensorRT-LLM).
    Done(PrefillLeg),
    /// Running beside the decode leg (SGLang): its end, or why it failed — which fails the
    /// decode leg too. Dropping the receiver cancels it.
    Concurrent(PrefillEnd),
    /// The concurrent prefill leg, still running (the relay holds its receiver).
    Pending,
    /// The concurrent prefill leg had not ended [`PREFILL_GRACE`] after the decode leg's
    /// answer: the answer stands, the prefill's counts are unknown (and not replaced by the
    /// decode engine's).
    Unknown,
}

/// How long a finished decode answer waits for a concurrent prefill leg still running. Its
/// HTTP answer ends when the prompt is computed — before the decode engine can even start —
/// so one still running then is stuck, and a complete answer is not held for it.
pub(super) const PREFILL_GRACE: Duration = Duration::from_secs(2);

/// Where a concurrent prefill leg's end arrives.
pub(super) type PrefillEnd = oneshot::Receiver<Result<PrefillLeg, String>>;

/// What the prefill leg gave.
#[derive(Clone, Debug)]
pub(super) struct PrefillLeg {
    /// When its answer ended, on our clock.
    pub(super) done: Instant,
    /// Its cached prompt tokens (the decode engine counts every transferred token as cached;
    /// the client is told the prefill's count).
    pub(super) cached_tokens: Option<u64>,
    /// The stages its engine reported.
    pub(super) engine: BTreeMap<Stage, f64>,
}

/// How a relay ended, for the pool's record of the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// The answer went through.
    Finished,
    /// The client left (not the upstream's fault).
    Gone,
    /// The upstream broke its answer.
    Failed,
    /// The concurrent prefill leg failed (its upstream is blamed where it failed).
    PrefillFailed,
}

/// A streamed answer whose first event has arrived: until then, nothing reached the client and
/// another upstream may be tried.
pub(super) struct Opened {
    bytes: futures_util::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    sse: SseDecoder,
    pending: Vec<SseEvent>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Opened")
    }
}

/// Reads `resp` until its first SSE event (or its end, or `idle` of silence).
pub(super) async fn open(resp: reqwest::Response, idle: Duration) -> Result<Opened, String> {
    let mut opened =
        Opened { bytes: resp.bytes_stream().boxed(), sse: SseDecoder::new(), pending: Vec::new() };
    while opened.pending.is_empty() {
        match tokio::time::timeout(idle, opened.bytes.next()).await {
            Err(_) => return Err(format!("no first chunk for {} s", idle.as_secs())),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(format!("reading the stream: {e}")),
            Ok(Some(Ok(b))) => opened
                .sse
                .feed(&b, &mut opened.pending)
                .map_err(|e| format!("its stream broke the SSE framing: {e}"))?,
        }
    }
    Ok(opened)
}

/// How the upstream said its answer ended (`length`, else a stop).
fn reason(seen: &Seen) -> FinishReason {
    match seen.reason {
        Some(WireFinish::Length) => FinishReason::Length,
        _ => FinishReason::Stop,
    }
}

/// What a stream has shown so far.
#[derive(Debug, Default)]
struct Seen {
    first: Option<Instant>,
    last: Option<Instant>,
    /// Generated tokens charged so far.
    counted: u64,
    usage: Option<Usage>,
    reason: Option<WireFinish>,
    engine: BTreeMap<Stage, f64>,
    /// Our timing went out on a chunk already.
    timed: bool,
}

enum Flow {
    More,
    Done,
    Gone,
    Failed(String),
    /// The event carries usage or ends the answer while the concurrent prefill leg still runs:
    /// its end is awaited first (its cached tokens and timing go on this event).
    Settle,
}

impl Relay {
    /// Relays an opened SSE answer until `[DONE]`, an error, a silence of `idle`, the prefill
    /// leg's failure or the client's going away (which drops the response: the upstream sees its
    /// connection close, and a concurrent prefill leg is cancelled).
    pub(super) async fn stream(mut self, opened: Opened, tx: &StreamSender, idle: Duration) -> Ended {
        let Opened { mut bytes, mut sse, pending } = opened;
        let mut events = pending;
        let mut seen = Seen::default();
        let mut concurrent = match std::mem::replace(&mut self.prefill, Prefill::Pending) {
            Prefill::Concurrent(rx) => Some(rx),
            other => {
                self.prefill = other;
                None
            }
        };
        loop {
            for ev in std::mem::take(&mut events) {
                let mut flow = self.event(&ev.data, &mut seen, tx);
                if matches!(flow, Flow::Settle) {
                    let Some(rx) = concurrent.take() else {
                        return self.fail(tx, "the prefill leg was lost".into());
                    };
                    if let Err(end) = self.settle(rx, idle, tx).await {
                        return end;
                    }
                    flow = self.event(&ev.data, &mut seen, tx);
                }
                match flow {
                    Flow::More => {}
                    Flow::Gone => return Ended::Gone,
                    Flow::Done => return self.finish(tx, &seen, Instant::now()),
                    Flow::Failed(m) => return self.fail(tx, m),
                    Flow::Settle => return self.fail(tx, "the prefill leg was lost".into()),
                }
            }
            // Read the upstream only while the client keeps up (its socket then fills, and an
            // engine that pauses slow readers does).
            tokio::select! {
                () = tx.closed() => return Ended::Gone,
                () = tx.room() => {}
            }
            let next = tokio::select! {
                () = tx.closed() => return Ended::Gone,
                p = async { concurrent.as_mut().expect("guarded").await }, if concurrent.is_some() => {
                    concurrent = None;
                    if let Err(end) = self.prefill_ended(p, tx) {
                        return end;
                    }
                    continue;
                }
                n = tokio::time::timeout(idle, bytes.next()) => n,
            };
            let chunk = match next {
                Err(_) => return self.fail(tx, format!("no chunk for {} s", idle.as_secs())),
                Ok(None) => break,
                Ok(Some(Err(e))) => return self.fail(tx, format!("reading the stream: {e}")),
                Ok(Some(Ok(b))) => b,
            };
            if let Err(e) = sse.feed(&chunk, &mut events) {
                return self.fail(tx, format!("its stream broke the SSE framing: {e}"));
            }
        }
        if seen.reason.is_some() {
            self.finish(tx, &seen, Instant::now())
        } else {
            self.fail(tx, "it closed the stream before the request finished".into())
        }
    }

    fn event(&self, data: &str, seen: &mut Seen, tx: &StreamSender) -> Flow {
        let pending = matches!(self.prefill, Prefill::Pending);
        if data.trim() == "[DONE]" {
            return if pending { Flow::Settle } else { Flow::Done };
        }
        let Ok(mut chunk) = Chunk::parse(data) else {
            return Flow::Failed("it sent a chunk that is not a JSON object".into());
        };
        let (view, any_choice) = match parse_stream_parts(&chunk.value, chunk.choices()) {
            Ok(read) => read,
            Err(e) => return Flow::Failed(format!("it sent a chunk we cannot read: {e}")),
        };
        let v = &mut chunk.value;
        if pending && (view.usage.is_some() || view.finish_reason.is_some()) {
            return Flow::Settle;
        }
        if let Some(err) = &view.error {
            return Flow::Failed(format!("it sent an error: {}", peer_message(&err.message)));
        }
        self.engine_stages(v, &mut seen.engine);
        let now = Instant::now();
        let mut tokens = 0u32;
        if view.carries_tokens() {
            // Cumulative usage on every chunk (vLLM's `continuous_usage_stats`) says how many
            // tokens this one carries; otherwise one per content chunk, settled at the end.
            tokens = match &view.usage {
                Some(u) if u.completion_tokens > seen.counted => {
                    u32::try_from(u.completion_tokens - seen.counted).unwrap_or(u32::MAX)
                }
                _ => 1,
            };
            seen.counted = seen.counted.saturating_add(u64::from(tokens));
            seen.first.get_or_insert(now);
            seen.last = Some(now);
            if let Some(m) = &self.meter {
                m.generated(tokens);
            }
        }
        let usage_only = view.usage.is_some() && !any_choice;
        if let Some(r) = view.finish_reason.clone() {
            seen.reason = Some(r);
        }
        let has_usage = view.usage.is_some();
        if let Some(u) = view.usage {
            seen.usage = Some(u);
        }
        if usage_only && !self.client_usage {
            // The usage chunk we forced on: counted, not passed on.
            return Flow::More;
        }
        if self.strip_chunk_usage && !usage_only {
            // Counted, and taken off before the client sees it: nothing to rewrite.
            if let Some(o) = v.as_object_mut() {
                o.remove("usage");
            }
        } else if has_usage {
            self.rewrite_cached(v);
        }
        // Ours goes on the last chunk the client gets: the usage chunk when it asked for usage,
        // else the finishing one. (An engine's own `timing` was absorbed above; `render` drops
        // it and sets our model name.)
        let last = if self.client_usage { usage_only } else { view.finish_reason.is_some() };
        let mut timing = None;
        if last && !seen.timed {
            seen.timed = true;
            timing = serde_json::to_value(self.timing(seen, now)).ok();
        }
        let json = chunk.render(&self.served_model_name, timing.as_ref());
        if tx.send(WorkEvent::Chunk { json, tokens }) {
            Flow::More
        } else {
            Flow::Gone
        }
    }

    /// Relays chunks that did not come as SSE (a PD answer that ended in its prefill leg, sent
    /// to a client that asked for a stream), then ends.
    pub(super) fn replay(self, chunks: Vec<Value>, tx: &StreamSender) -> Ended {
        let mut seen = Seen::default();
        for c in chunks {
            match self.event(&c.to_string(), &mut seen, tx) {
                Flow::More | Flow::Done => {}
                Flow::Gone => return Ended::Gone,
                Flow::Failed(m) => return self.fail(tx, m),
                // Settled before (`settled`): never pending here.
                Flow::Settle => return self.fail(tx, "the prefill leg was lost".into()),
            }
        }
        self.finish(tx, &seen, Instant::now())
    }

    /// Relays a non-streamed answer (read whole by [`read_json`]).
    pub(super) fn body(self, mut v: Value, tx: &StreamSender) -> Ended {
        let view: StreamChunkView = match parse_stream_value(&v) {
            Ok(view) => view,
            Err(e) => return self.fail(tx, format!("its body cannot be read: {e}")),
        };
        if let Some(err) = &view.error {
            return self.fail(tx, format!("it answered with an error: {}", peer_message(&err.message)));
        }
        let mut seen = Seen { usage: view.usage, reason: view.finish_reason.clone(), ..Seen::default() };
        self.engine_stages(&v, &mut seen.engine);
        let now = Instant::now();
        self.rewrite(&mut v);
        self.rewrite_cached(&mut v);
        if let Ok(t) = serde_json::to_value(self.timing(&seen, now)) {
            v["timing"] = t;
        }
        if tx.send(WorkEvent::Body { json: v.to_string() }) {
            self.finish(tx, &seen, now)
        } else {
            Ended::Gone
        }
    }

    /// In PD the client is told the prefill leg's cached tokens (the decode engine counts every
    /// transferred token as cached): set, or removed when the prefill reported none.
    fn rewrite_cached(&self, v: &mut Value) {
        let known = match &self.prefill {
            Prefill::Done(leg) => leg.cached_tokens,
            Prefill::Unknown => None,
            _ => return,
        };
        let Some(usage) = v.get_mut("usage").and_then(Value::as_object_mut) else { return };
        match known {
            Some(n) => {
                let details = usage.entry("prompt_tokens_details").or_insert_with(|| serde_json::json!({}));
                if !details.is_object() {
                    *details = serde_json::json!({});
                }
                details["cached_tokens"] = n.into();
            }
            None => {
                if let Some(d) = usage.get_mut("prompt_tokens_details").and_then(Value::as_object_mut) {
                    d.remove("cached_tokens");
                }
            }
        }
    }

    /// The engine's stages in a chunk or body; of a PD decode leg only its decode time (its
    /// queue and first token are not the request's: the prefill leg had those).
    fn engine_stages(&self, v: &Value, out: &mut BTreeMap<Stage, f64>) {
        if matches!(self.prefill, Prefill::None) {
            engine_stages(v, out);
        } else {
            let mut all = BTreeMap::new();
            engine_stages(v, &mut all);
            if let Some(d) = all.remove(&Stage::Decode) {
                out.insert(Stage::Decode, d);
            }
        }
    }

    /// Our model name, and no `timing` but ours.
    fn rewrite(&self, v: &mut Value) {
        if let Some(o) = v.as_object_mut() {
            o.remove("timing");
            if let Some(m) = o.get_mut("model") {
                *m = Value::String(self.served_model_name.to_string());
            }
        }
    }

    /// The request's timeline at `now` (see the module docs).
    fn timing(&self, seen: &Seen, now: Instant) -> ServerTiming {
        let since = |i: Instant| i.saturating_duration_since(self.arrived).as_nanos() as u64;
        let mut t =
            ServerTiming::gateway_part(since(self.admitted), seen.first.map(since), since(now), reason(seen));
        let mut gateway = |stage: Stage, d: Duration| {
            t.stages_ms.insert(stage, ms(d));
            t.sources.insert(stage, StageSource::Gateway);
        };
        let prefill = match &self.prefill {
            Prefill::Done(leg) => Some(leg),
            _ => None,
        };
        if let Some(leg) = prefill {
            gateway(Stage::Prefill, leg.done.saturating_duration_since(self.admitted));
        }
        if let Some(first) = seen.first {
            let last = seen.last.unwrap_or(first);
            match prefill {
                None => gateway(Stage::Prefill, first.saturating_duration_since(self.admitted)),
                // Legs that overlap (SGLang) have no handoff to measure when the decode's
                // first token came before the prefill's answer ended.
                Some(leg) if first > leg.done => gateway(Stage::DecodeQueue, first - leg.done),
                Some(_) => {}
            }
            gateway(Stage::Decode, last.saturating_duration_since(first));
        }
        let engine = prefill.map(|l| &l.engine).into_iter().flatten().chain(&seen.engine);
        for (stage, v) in engine {
            t.stages_ms.insert(*stage, *v);
            t.sources.insert(*stage, StageSource::Engine);
        }
        t.cached_tokens = self.cached_tokens(seen);
        t
    }

    /// The request's cached prompt tokens: the prefill leg's in PD, else the upstream's.
    fn cached_tokens(&self, seen: &Seen) -> u64 {
        match &self.prefill {
            Prefill::Done(leg) => leg.cached_tokens.unwrap_or(0),
            Prefill::Unknown => 0,
            _ => seen.usage.as_ref().map_or(0, cached),
        }
    }

    fn finish(&self, tx: &StreamSender, seen: &Seen, now: Instant) -> Ended {
        let usage = match &seen.usage {
            Some(u) => TokenUsage {
                prompt_tokens: u.prompt_tokens,
                completion_tokens: u.completion_tokens,
                cached_tokens: self.cached_tokens(seen),
            },
            None => TokenUsage {
                prompt_tokens: self.prompt_tokens,
                completion_tokens: seen.counted,
                cached_tokens: self.cached_tokens(seen),
            },
        };
        let reason = reason(seen);
        tracing::debug!(
            upstream = %self.url,
            upstream_ms = ms(now.saturating_duration_since(self.sent)),
            "upstream request finished"
        );
        tx.send(WorkEvent::Finished { reason, usage, timing: self.timing(seen, now) });
        Ended::Finished
    }

    /// Waits (at most [`PREFILL_GRACE`], or `idle` when shorter) for the concurrent prefill leg
    /// to end; past it the prefill is dropped (which cancels it) and its counts are unknown.
    async fn settle(&mut self, rx: PrefillEnd, idle: Duration, tx: &StreamSender) -> Result<(), Ended> {
        match tokio::time::timeout(PREFILL_GRACE.min(idle), rx).await {
            Ok(p) => self.prefill_ended(p, tx),
            Err(_) => {
                tracing::warn!(upstream = %self.url, "the prefill leg outlived its decode answer; dropped");
                self.prefill = Prefill::Unknown;
                Ok(())
            }
        }
    }

    /// Takes the concurrent prefill leg's end: its record, or the failure that fails this
    /// request too.
    fn prefill_ended(
        &mut self,
        p: Result<Result<PrefillLeg, String>, oneshot::error::RecvError>,
        tx: &StreamSender,
    ) -> Result<(), Ended> {
        let why = match p {
            Ok(Ok(leg)) => {
                self.prefill = Prefill::Done(leg);
                return Ok(());
            }
            Ok(Err(why)) => format!("the prefill leg failed: {why}"),
            Err(_) => "the prefill leg was lost".into(),
        };
        self.fail(tx, why);
        Err(Ended::PrefillFailed)
    }

    /// Before a whole answer is relayed (a body, replayed chunks), the concurrent prefill
    /// leg's end.
    pub(super) async fn settled(mut self, idle: Duration, tx: &StreamSender) -> Result<Self, Ended> {
        match std::mem::replace(&mut self.prefill, Prefill::Pending) {
            Prefill::Concurrent(rx) => self.settle(rx, idle, tx).await?,
            other => self.prefill = other,
        }
        Ok(self)
    }

    fn fail(&self, tx: &StreamSender, why: String) -> Ended {
        let message = format!("upstream {}: {why}", self.url);
        tracing::warn!("{message}");
        tx.send(WorkEvent::Failed { message });
        Ended::Failed
    }
}

/// Reads a whole JSON answer (at most [`super::MAX_BODY_BYTES`], no silence over `idle`).
pub(super) async fn read_json(resp: reqwest::Response, idle: Duration) -> Result<Value, String> {
    let mut bytes = resp.bytes_stream();
    let mut body = Vec::new();
    loop {
        match tokio::time::timeout(idle, bytes.next()).await {
            Err(_) => return Err(format!("no byte of its body for {} s", idle.as_secs())),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(format!("reading the body: {e}")),
            Ok(Some(Ok(b))) if body.len() + b.len() > super::MAX_BODY_BYTES => {
                return Err(format!("its body is over {} bytes", super::MAX_BODY_BYTES))
            }
            Ok(Some(Ok(b))) => body.extend_from_slice(&b),
        }
    }
    serde_json::from_slice::<Value>(&body).map_err(|_| "its body is not JSON".to_owned())
}

/// Milliseconds of a duration.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Cached prompt tokens of a usage object (absent: none).
fn cached(u: &Usage) -> u64 {
    u.prompt_tokens_details.as_ref().map_or(0, |d| d.cached_tokens)
}

#[cfg(test)]
#[path = "relay_tests.rs"]
mod tests;
