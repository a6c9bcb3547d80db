//! Engines' spans joined to the bench's records: a fresh W3C trace context per request, and
//! after the run, each record's spans (by trace id) read into stages through the one engines
//! table (`timeline::engines`). A record the server already timed keeps the stages a tokenpath
//! process or the engine's body measured; a span adds the stages it lacks and replaces the ones
//! our gateway could only see from outside the engine.

use serde::{Deserialize, Serialize};
use tokenpath_otlp::Collected;
use tokenpath_timeline::engines::spans_timing;
use tokenpath_timeline::{ClientRecord, ServerTiming, StageSource};

/// How the join went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpanJoin {
    /// Requests sent with a trace context.
    pub sent: u64,
    /// Of which got at least one span.
    pub joined: u64,
    /// Of which got a span whose shape gave stages.
    pub timed: u64,
    /// Spans that arrived for traces this run did not send (an engine's start-up spans).
    #[serde(default)]
    pub unexpected: u64,
}

impl SpanJoin {
    /// The join as the records show it (`unexpected` is not on them: 0); `None` when no
    /// request carried a trace context.
    pub fn of(records: &[&ClientRecord]) -> Option<Self> {
        let traced: Vec<&ClientRecord> = records.iter().copied().filter(|r| r.trace_id.is_some()).collect();
        if traced.is_empty() {
            return None;
        }
        // As `join` counts them: spans of a shape the mapping table knows (their stages may
        // then give way to what the server's own timing says).
        let timed = |r: &ClientRecord| !r.spans.is_empty() && spans_timing(&r.spans).is_some();
        Some(Self {
            sent: traced.len() as u64,
            joined: traced.iter().filter(|r| !r.spans.is_empty()).count() as u64,
            timed: traced.iter().filter(|r| timed(r)).count() as u64,
            unexpected: 0,
        })
    }
}

/// Puts each record's spans on it and the stages they give into its `server` timing.
pub fn join(records: &mut [ClientRecord], mut collected: Collected) -> SpanJoin {
    let mut out = SpanJoin { unexpected: collected.unexpected, ..SpanJoin::default() };
    for rec in records.iter_mut() {
        let Some(trace) = rec.trace_id else { continue };
        out.sent += 1;
        let Some(mut spans) = collected.spans.remove(&trace) else { continue };
        out.joined += 1;
        spans.sort_by_key(|s| s.start_unix_ns);
        if let Some(timing) = spans_timing(&spans) {
            out.timed += 1;
            merge(&mut rec.server, timing);
        }
        rec.spans = spans;
    }
    out
}

fn merge(server: &mut Option<ServerTiming>, from_span: ServerTiming) {
    let Some(s) = server else {
        *server = Some(from_span);
        return;
    };
    for (stage, ms) in from_span.stages_ms {
        // What the engine's span says beats what our gateway saw at its boundaries (which holds
        // the network and everything the engine did not split out) and what the engine's body
        // said (the same measurement, read with less: vLLM's body has no frontend TTFT, so its
        // queue misses the wait before the scheduler saw the request); a tokenpath process's
        // own marks stay.
        let replace = match s.sources.get(&stage) {
            None => !s.stages_ms.contains_key(&stage),
            Some(src) => matches!(src, StageSource::Gateway | StageSource::Engine),
        };
        if replace {
            s.stages_ms.insert(stage, ms);
            s.sources.insert(stage, StageSource::Span);
        }
    }
    s.ttft_ms = s.ttft_ms.or(from_span.ttft_ms);
    s.e2e_ms = s.e2e_ms.or(from_span.e2e_ms);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_otlp::fresh_context;
    use tokenpath_timeline::{EngineSpan, RequestId, SpanId, Stage, TraceId};

    fn span(trace: TraceId, name: &str, queue_s: f64) -> EngineSpan {
        let attrs = serde_json::json!({"gen_ai.latency.time_in_queue": queue_s, "gen_ai.latency.time_in_model_prefill": 0.1,
            "vllm.custom": "kept"});
        EngineSpan {
            trace_id: trace,
            span_id: SpanId([1; 8]),
            parent: None,
            name: name.into(),
            service: Some("vllm".into()),
            start_unix_ns: 5,
            end_unix_ns: 6,
            attributes: attrs.as_object().unwrap().clone(),
        }
    }

    #[test]
    fn spans_join_by_trace_id_and_only_fill_stages_the_server_did_not_give() {
        let ids: Vec<TraceId> = (0..4).map(|_| fresh_context().trace_id).collect();
        let mut recs: Vec<ClientRecord> = (0..5)
            .map(|i| {
                let mut r = ClientRecord::new(RequestId(i), 0, 0, true);
                r.trace_id = ids.get(i as usize).copied();
                r
            })
            .collect();
        // Record 1 was timed by a tokenpath server already: its queue stays; the prefill our
        // gateway measured around the engine gives way to the engine's own.
        let mut ours = ServerTiming::default();
        ours.stages_ms.insert(Stage::Queue, 7.0);
        ours.stages_ms.insert(Stage::Prefill, 900.0);
        ours.sources.insert(Stage::Prefill, StageSource::Gateway);
        recs[1].server = Some(ours);
        let mut collected = Collected::default();
        collected.spans.insert(ids[0], vec![span(ids[0], "llm_request", 0.25)]);
        collected.spans.insert(ids[1], vec![span(ids[1], "llm_request", 0.5)]);
        collected.spans.insert(ids[2], vec![span(ids[2], "something else", 0.5)]);
        collected.unexpected = 3;
        let j = join(&mut recs, collected);
        assert_eq!(j, SpanJoin { sent: 4, joined: 3, timed: 2, unexpected: 3 });
        let s0 = recs[0].server.as_ref().unwrap();
        assert_eq!(s0.stages_ms[&Stage::Queue], 250.0);
        assert_eq!(s0.sources[&Stage::Queue], StageSource::Span);
        let s1 = recs[1].server.as_ref().unwrap();
        assert_eq!(s1.stages_ms[&Stage::Queue], 7.0, "the server's own measurement stays");
        assert!(!s1.sources.contains_key(&Stage::Queue));
        assert_eq!(s1.sources[&Stage::Prefill], StageSource::Span);
        assert_eq!(s1.stages_ms[&Stage::Prefill], 100.0);
        assert!(recs[2].server.is_none() && recs[2].spans.len() == 1);
        assert_eq!(recs[0].spans[0].attributes["vllm.custom"], "kept");
        assert!(recs[3].spans.is_empty() && recs[4].trace_id.is_none());
        // Regression (check-vllm-spans): the report recounts from the records and said 0 with
        // stages where the join said 2, when the server's timing kept every stage.
        let mut kept = ServerTiming::default();
        kept.stages_ms.insert(Stage::Queue, 7.0);
        kept.stages_ms.insert(Stage::Prefill, 8.0);
        recs[0].server = Some(kept);
        let refs: Vec<&ClientRecord> = recs.iter().collect();
        assert_eq!(SpanJoin::of(&refs), Some(SpanJoin { sent: 4, joined: 3, timed: 2, unexpected: 0 }));
    }

    /// Regression (check-vllm-spans, through the gateway): vLLM's body `metrics` gave queue 0
    /// (no frontend TTFT to take the wait before its scheduler from) and kept the span's queue
    /// out; a stage the engine's body gave now gives way to its span, one the engine's body
    /// gave and the span does not stays.
    #[test]
    fn a_span_beats_the_engines_body_for_the_stages_it_gives() {
        let id = fresh_context().trace_id;
        let mut rec = ClientRecord::new(RequestId(0), 0, 0, true);
        rec.trace_id = Some(id);
        let mut body = ServerTiming::default();
        for (stage, ms) in [(Stage::Queue, 0.0), (Stage::Decode, 50.0)] {
            body.stages_ms.insert(stage, ms);
            body.sources.insert(stage, StageSource::Engine);
        }
        rec.server = Some(body);
        let mut collected = Collected::default();
        collected.spans.insert(id, vec![span(id, "llm_request", 0.25)]);
        let mut recs = vec![rec];
        join(&mut recs, collected);
        let s = recs[0].server.as_ref().unwrap();
        assert_eq!((s.stages_ms[&Stage::Queue], s.sources[&Stage::Queue]), (250.0, StageSource::Span));
        assert_eq!((s.stages_ms[&Stage::Decode], s.sources[&Stage::Decode]), (50.0, StageSource::Engine));
    }

    #[test]
    fn fresh_contexts_differ() {
        assert_ne!(fresh_context().trace_id, fresh_context().trace_id);
    }
}
