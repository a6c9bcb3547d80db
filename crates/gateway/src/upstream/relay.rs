//! Passing an upstream's answer back: its SSE chunks one by one (decoded with the protocol
//! crate's bounded decoder, read only while the client keeps up, given up after a silence), or
//! its whole body; the model name rewritten, the forced usage chunk dropped unless the client
//! asked for usage, tokens charged as they arrive, and one timeline per request.
//!
//! The timeline: the `gateway` stage is ours as always; `prefill` (admitted → first token) and
//! `decode` (first → last token) are measured here, on the gateway's clock, and marked
//! `gateway`; stages the engine reports — vLLM's per-request `metrics` (`queue_time_ms`,
//! `time_to_first_token_ms`, `generation_time_ms`), llama.cpp's `timings` (`prompt_ms`,
//! `predicted_ms`), a tokenpath upstream's `timing` — replace them, marked `engine`. Nothing
//! is invented: a stage nobody measured is absent (there is no `kv_transfer` for an engine that
//! does not report one, and a non-streamed answer has no first token to split at).

use futures_util::StreamExt as _;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_protocol::cluster::peer_message;
use tokenpath_protocol::work::{StreamSender, TokenMeter, TokenUsage, WorkEvent};
use tokenpath_protocol::{
    parse_stream_value, FinishReason as WireFinish, SseDecoder, StreamChunkView, Usage,
};
use tokenpath_timeline::{FinishReason, ServerTiming, Stage, StageSource};

/// What the relay needs of its upstream.
pub(super) trait Names: Send + Sync + std::fmt::Debug {
    /// Our model name, written into what goes back.
    fn served_model_name(&self) -> &str;
    /// For messages.
    fn url(&self) -> &str;
}

/// One request's relay.
#[derive(Debug)]
pub(super) struct Relay {
    pub(super) shared: Arc<dyn Names>,
    pub(super) arrived: Instant,
    pub(super) admitted: Instant,
    /// When the request went out (for logs of slow upstreams).
    pub(super) sent: Instant,
    /// The gateway's count, when the upstream reports no usage.
    pub(super) prompt_tokens: u64,
    pub(super) meter: Option<Arc<dyn TokenMeter>>,
    /// The client asked for `stream_options.include_usage`.
    pub(super) client_usage: bool,
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
}

impl Relay {
    /// Relays an SSE response until `[DONE]`, an error, a silence of `idle` or the client's
    /// going away (which drops the response: the upstream sees its connection close).
    pub(super) async fn stream(self, resp: reqwest::Response, tx: &StreamSender, idle: Duration) {
        let mut bytes = resp.bytes_stream();
        let mut sse = SseDecoder::new();
        let mut events = Vec::new();
        let mut seen = Seen::default();
        loop {
            // Read the upstream only while the client keeps up (its socket then fills, and an
            // engine that pauses slow readers does).
            tokio::select! {
                () = tx.closed() => return,
                () = tx.room() => {}
            }
            let next = tokio::select! {
                () = tx.closed() => return,
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
            for ev in events.drain(..) {
                match self.event(&ev.data, &mut seen, tx) {
                    Flow::More => {}
                    Flow::Gone => return,
                    Flow::Done => return self.finish(tx, &seen, Instant::now()),
                    Flow::Failed(m) => return self.fail(tx, m),
                }
            }
        }
        if seen.reason.is_some() {
            self.finish(tx, &seen, Instant::now());
        } else {
            self.fail(tx, "it closed the stream before the request finished".into());
        }
    }

    fn event(&self, data: &str, seen: &mut Seen, tx: &StreamSender) -> Flow {
        if data.trim() == "[DONE]" {
            return Flow::Done;
        }
        let Ok(mut v) = serde_json::from_str::<Value>(data) else {
            return Flow::Failed("it sent a chunk that is not JSON".into());
        };
        let view = match parse_stream_value(&v) {
            Ok(view) => view,
            Err(e) => return Flow::Failed(format!("it sent a chunk we cannot read: {e}")),
        };
        if let Some(err) = &view.error {
            return Flow::Failed(format!("it sent an error: {}", peer_message(&err.message)));
        }
        engine_stages(&v, &mut seen.engine);
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
        let usage_only = view.usage.is_some() && no_choices(&v);
        if let Some(u) = view.usage {
            seen.usage = Some(u);
        }
        if let Some(r) = view.finish_reason.clone() {
            seen.reason = Some(r);
        }
        if usage_only && !self.client_usage {
            // The usage chunk we forced on: counted, not passed on.
            return Flow::More;
        }
        self.rewrite(&mut v);
        // Ours goes on the last chunk the client gets: the usage chunk when it asked for usage,
        // else the finishing one. (An engine's own `timing` was absorbed above.)
        let last = if self.client_usage { usage_only } else { view.finish_reason.is_some() };
        if last && !seen.timed {
            seen.timed = true;
            if let Ok(t) = serde_json::to_value(self.timing(seen, now)) {
                v["timing"] = t;
            }
        }
        if tx.send(WorkEvent::Chunk { json: v.to_string(), tokens }) {
            Flow::More
        } else {
            Flow::Gone
        }
    }

    /// Relays a non-streamed body (read up to [`super::MAX_BODY_BYTES`]).
    pub(super) async fn body(self, resp: reqwest::Response, tx: &StreamSender) {
        let mut bytes = resp.bytes_stream();
        let mut body = Vec::new();
        loop {
            let next = tokio::select! {
                () = tx.closed() => return,
                n = bytes.next() => n,
            };
            match next {
                None => break,
                Some(Err(e)) => return self.fail(tx, format!("reading the body: {e}")),
                Some(Ok(b)) if body.len() + b.len() > super::MAX_BODY_BYTES => {
                    return self.fail(tx, format!("its body is over {} bytes", super::MAX_BODY_BYTES))
                }
                Some(Ok(b)) => body.extend_from_slice(&b),
            }
        }
        let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
            return self.fail(tx, "its body is not JSON".into());
        };
        let view: StreamChunkView = match parse_stream_value(&v) {
            Ok(view) => view,
            Err(e) => return self.fail(tx, format!("its body cannot be read: {e}")),
        };
        if let Some(err) = &view.error {
            return self.fail(tx, format!("it answered with an error: {}", peer_message(&err.message)));
        }
        let mut seen = Seen { usage: view.usage, reason: view.finish_reason.clone(), ..Seen::default() };
        engine_stages(&v, &mut seen.engine);
        let now = Instant::now();
        self.rewrite(&mut v);
        if let Ok(t) = serde_json::to_value(self.timing(&seen, now)) {
            v["timing"] = t;
        }
        if tx.send(WorkEvent::Body { json: v.to_string() }) {
            self.finish(tx, &seen, now);
        }
    }

    /// Our model name, and no `timing` but ours.
    fn rewrite(&self, v: &mut Value) {
        if let Some(o) = v.as_object_mut() {
            o.remove("timing");
            if let Some(m) = o.get_mut("model") {
                *m = Value::String(self.shared.served_model_name().to_owned());
            }
        }
    }

    /// The request's timeline at `now` (see the module docs).
    fn timing(&self, seen: &Seen, now: Instant) -> ServerTiming {
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Gateway, ms(self.admitted.saturating_duration_since(self.arrived)));
        if let Some(first) = seen.first {
            let last = seen.last.unwrap_or(first);
            for (stage, d) in [
                (Stage::Prefill, first.saturating_duration_since(self.admitted)),
                (Stage::Decode, last.saturating_duration_since(first)),
            ] {
                t.stages_ms.insert(stage, ms(d));
                t.sources.insert(stage, StageSource::Gateway);
            }
            t.ttft_ms = Some(ms(first.saturating_duration_since(self.arrived)));
        }
        for (stage, v) in &seen.engine {
            t.stages_ms.insert(*stage, *v);
            t.sources.insert(*stage, StageSource::Engine);
        }
        t.e2e_ms = Some(ms(now.saturating_duration_since(self.arrived)));
        t.cached_tokens = seen.usage.as_ref().map_or(0, cached);
        t
    }

    fn finish(&self, tx: &StreamSender, seen: &Seen, now: Instant) {
        let usage = match &seen.usage {
            Some(u) => TokenUsage {
                prompt_tokens: u.prompt_tokens,
                completion_tokens: u.completion_tokens,
                cached_tokens: cached(u),
            },
            None => TokenUsage {
                prompt_tokens: self.prompt_tokens,
                completion_tokens: seen.counted,
                cached_tokens: 0,
            },
        };
        let reason = match seen.reason {
            Some(WireFinish::Length) => FinishReason::Length,
            _ => FinishReason::Stop,
        };
        tracing::debug!(
            upstream = self.shared.url(),
            upstream_ms = ms(now.saturating_duration_since(self.sent)),
            "upstream request finished"
        );
        tx.send(WorkEvent::Finished { reason, usage, timing: self.timing(seen, now) });
    }

    fn fail(&self, tx: &StreamSender, why: String) {
        let message = format!("upstream {}: {why}", self.shared.url());
        tracing::warn!("{message}");
        tx.send(WorkEvent::Failed { message });
    }
}

/// Milliseconds of a duration.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Cached prompt tokens of a usage object (absent: none).
fn cached(u: &Usage) -> u64 {
    u.prompt_tokens_details.as_ref().map_or(0, |d| d.cached_tokens)
}

fn no_choices(v: &Value) -> bool {
    v.get("choices").and_then(Value::as_array).is_none_or(Vec::is_empty)
}

/// The stage durations an engine put in a chunk or body (see the module docs), in ms; finite,
/// non-negative numbers only.
fn engine_stages(v: &Value, out: &mut BTreeMap<Stage, f64>) {
    let mut take = |stage: Stage, x: Option<&Value>| {
        if let Some(ms) = x.and_then(Value::as_f64).filter(|m| m.is_finite() && *m >= 0.0) {
            out.insert(stage, ms);
        }
    };
    if let Some(m) = v.get("metrics") {
        take(Stage::Queue, m.get("queue_time_ms"));
        take(Stage::Prefill, m.get("time_to_first_token_ms"));
        take(Stage::Decode, m.get("generation_time_ms"));
    }
    if let Some(t) = v.get("timings") {
        take(Stage::Prefill, t.get("prompt_ms"));
        take(Stage::Decode, t.get("predicted_ms"));
    }
    if let Some(stages) = v.pointer("/timing/stages_ms").and_then(Value::as_object) {
        // A tokenpath upstream's own gateway stage is not ours: ours is measured here.
        for stage in Stage::ALL.into_iter().filter(|s| *s != Stage::Gateway) {
            take(stage, stages.get(stage.name()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_stages_are_read_from_each_engines_shape() {
        let mut out = BTreeMap::new();
        engine_stages(
            &serde_json::json!({"metrics": {"queue_time_ms": 3.0, "time_to_first_token_ms": 20.5,
            "generation_time_ms": "x"}}),
            &mut out,
        );
        assert_eq!(out, BTreeMap::from([(Stage::Queue, 3.0), (Stage::Prefill, 20.5)]));
        let mut out = BTreeMap::new();
        engine_stages(&serde_json::json!({"timings": {"prompt_ms": 7.0, "predicted_ms": -1.0}}), &mut out);
        assert_eq!(out, BTreeMap::from([(Stage::Prefill, 7.0)]));
        let mut out = BTreeMap::new();
        engine_stages(
            &serde_json::json!({"timing": {"stages_ms": {"queue": 1.0, "kv_transfer": 2.0}}}),
            &mut out,
        );
        assert_eq!(out, BTreeMap::from([(Stage::Queue, 1.0), (Stage::KvTransfer, 2.0)]));
    }
}
