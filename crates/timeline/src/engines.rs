//! What each engine reports about one request, mapped onto our stages: the one table of it.
//!
//! Engines report a request's stages in their own shapes — vLLM's per-request `metrics` object
//! and its `llm_request` span, SGLang's request slices, llama.cpp's `timings`, Dynamo's
//! `nvext.timing`, TGI's response headers, a tokenpath upstream's `timing` — in their own units. The gateway (relaying an
//! upstream's answer) and the bench (joining a client record to the engine's span) read them
//! here, so one engine field means one stage everywhere, and the table in
//! `docs/metrics.md#engine-stages` is this file. What is malformed, negative or not finite is
//! left out; a stage an engine does not report is absent, never derived from what it lacks.

use serde_json::Value;
use std::collections::BTreeMap;

use crate::{EngineSpan, ServerTiming, Stage, StageSource};

/// The stage durations an engine put in a chunk or body (see the module docs), in ms; finite,
/// non-negative numbers only.
pub fn body_stages(v: &Value, out: &mut BTreeMap<Stage, f64>) {
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
    // Dynamo's frontend, when the request asked `nvext.extra_fields: ["timing"]`: its queue
    // (`prefill_wait_time_ms`), prefill, and decode as total minus time to first token (both on
    // its one clock).
    if let Some(t) = v.get("nvext").and_then(|n| n.get("timing")) {
        take(Stage::Queue, t.get("prefill_wait_time_ms"));
        take(Stage::Prefill, t.get("prefill_time_ms"));
        let f = |k: &str| t.get(k).and_then(Value::as_f64);
        if let (Some(total), Some(ttft)) = (f("total_time_ms"), f("ttft_ms")) {
            take(Stage::Decode, Some(&Value::from(total - ttft)));
        }
    }
    if let Some(stages) = v.get("timing").and_then(|t| t.get("stages_ms")).and_then(Value::as_object) {
        // A tokenpath upstream's own gateway stage is not ours: ours is measured here.
        for stage in Stage::ALL.into_iter().filter(|s| *s != Stage::Gateway) {
            take(stage, stages.get(stage.name()));
        }
    }
}

/// The name of vLLM's per-request span.
pub const VLLM_REQUEST_SPAN: &str = "llm_request";

/// vLLM's `llm_request` span attributes (seconds, as doubles) → stages. `time_to_first_token`
/// and `e2e` are from the API server's arrival, so what TTFT leaves after `time_in_queue` and
/// `time_in_model_prefill` is the wait before the engine core's scheduler saw the request: the
/// frontend's own work (tokenization, the hop to the engine core) and — most of it under load —
/// the running step the engine core's busy loop finishes before it calls `add_request`, which
/// is where vLLM starts `time_in_queue` (measured against vLLM 0.32 on CPU: 255–373 ms behind a
/// running prefill, ~14 ms at an idle engine). That is waiting for a prefill slot, so it is
/// counted as `queue` with `time_in_queue`; the raw attributes stay in the record.
pub const VLLM_SPAN_ATTRIBUTES: [(&str, Stage); 3] = [
    ("gen_ai.latency.time_in_queue", Stage::Queue),
    ("gen_ai.latency.time_in_model_prefill", Stage::Prefill),
    ("gen_ai.latency.time_in_model_decode", Stage::Decode),
];
/// vLLM: first token − frontend arrival, s.
pub const VLLM_TTFT: &str = "gen_ai.latency.time_to_first_token";
/// vLLM: last iteration − frontend arrival, s.
pub const VLLM_E2E: &str = "gen_ai.latency.e2e";

fn seconds_ms(v: Option<&Value>) -> Option<f64> {
    v.and_then(Value::as_f64).filter(|s| s.is_finite() && *s >= 0.0).map(|s| s * 1e3)
}

/// SGLang's request slices (span names, v3 `RequestStage`) → stages. Each slice is one span on
/// one process's clock; nested ones (`chunked_prefill`, `decode_loop`) are inside these and are
/// not counted again. Its root span's `time_in_model_prefill` includes the queue wait, so the
/// root's latencies are not read as stages (only its TTFT and E2E are).
pub const SGLANG_SLICES: [(&str, Stage); 8] = [
    ("tokenize", Stage::Gateway),
    ("dispatch", Stage::Gateway),
    ("api_server_dispatch", Stage::Gateway),
    ("prefill_waiting", Stage::Queue),
    ("prefill_forward", Stage::Prefill),
    // The decode side's wait for the KV to arrive: the transfer as the request sees it.
    ("decode_transferred", Stage::KvTransfer),
    ("decode_waiting", Stage::DecodeQueue),
    ("decode_forward", Stage::Decode),
];

/// The timing the spans of one trace carry, when their shape is one we know: vLLM's
/// `llm_request` span (its attributes), or SGLang's request slices (their durations). Every
/// stage it gives is marked as the span's.
pub fn spans_timing(spans: &[EngineSpan]) -> Option<ServerTiming> {
    let mut t = ServerTiming::default();
    let vllm: Vec<&EngineSpan> = spans.iter().filter(|s| s.name == VLLM_REQUEST_SPAN).collect();
    if let (Some(first), Some(last)) =
        (vllm.iter().min_by_key(|s| s.start_unix_ns), vllm.iter().max_by_key(|s| s.end_unix_ns))
    {
        // In PD both legs export one: queue, prefill and TTFT are the prefill leg's (it starts
        // first), decode and E2E the decode leg's (it ends last); colocated, both are one span.
        for (key, stage) in VLLM_SPAN_ATTRIBUTES {
            let from = if stage == Stage::Decode { last } else { first };
            if let Some(ms) = seconds_ms(from.attributes.get(key)) {
                t.stages_ms.insert(stage, ms);
            }
        }
        t.ttft_ms = seconds_ms(first.attributes.get(VLLM_TTFT));
        t.e2e_ms = seconds_ms(last.attributes.get(VLLM_E2E));
        if let (Some(ttft), Some(q), Some(p)) =
            (t.ttft_ms, t.stages_ms.get(&Stage::Queue).copied(), t.stages_ms.get(&Stage::Prefill).copied())
        {
            // TTFT is the API server's wall-clock interval, queue and prefill the engine core's
            // monotonic ones: two clocks on one host, so the difference can dip below zero by
            // their drift and rounding only.
            t.stages_ms.insert(Stage::Queue, q + (ttft - q - p).max(0.0));
        }
    } else {
        let mut any = false;
        for s in spans {
            if let Some((_, stage)) = SGLANG_SLICES.iter().find(|(n, _)| *n == s.name) {
                let ms = s.end_unix_ns.saturating_sub(s.start_unix_ns) as f64 / 1e6;
                *t.stages_ms.entry(*stage).or_insert(0.0) += ms;
                any = true;
            }
            if s.attributes.contains_key("rid") {
                t.ttft_ms = t.ttft_ms.or_else(|| seconds_ms(s.attributes.get(VLLM_TTFT)));
                t.e2e_ms = t.e2e_ms.or_else(|| seconds_ms(s.attributes.get(VLLM_E2E)));
            }
        }
        if !any {
            return None;
        }
    }
    if let Some(n) = spans.iter().find_map(|s| s.attributes.get("gen_ai.usage.cached_tokens")?.as_u64()) {
        t.cached_tokens = n;
    }
    t.sources = t.stages_ms.keys().map(|s| (*s, StageSource::Span)).collect();
    Some(t)
}

/// TGI's per-request timing headers (whole milliseconds, on whole responses only) → stages.
/// `x-inference-time` is prefill and decode together, so it is no stage.
pub const TGI_HEADERS: [(&str, Stage); 2] =
    [("x-validation-time", Stage::Gateway), ("x-queue-time", Stage::Queue)];

/// The stages TGI's response headers give (`headers`: lowercase name, value).
pub fn header_stages<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
    out: &mut BTreeMap<Stage, f64>,
) {
    for (name, value) in headers {
        if let Some((_, stage)) = TGI_HEADERS.iter().find(|(h, _)| *h == name) {
            if let Some(ms) = value.trim().parse::<f64>().ok().filter(|m| m.is_finite() && *m >= 0.0) {
                out.insert(*stage, ms);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_stages_are_read_from_each_engines_shape() {
        let mut out = BTreeMap::new();
        body_stages(
            &serde_json::json!({"metrics": {"queue_time_ms": 3.0, "time_to_first_token_ms": 20.5,
            "generation_time_ms": "x"}}),
            &mut out,
        );
        assert_eq!(out, BTreeMap::from([(Stage::Queue, 3.0), (Stage::Prefill, 20.5)]));
        let mut out = BTreeMap::new();
        body_stages(&serde_json::json!({"timings": {"prompt_ms": 7.0, "predicted_ms": -1.0}}), &mut out);
        assert_eq!(out, BTreeMap::from([(Stage::Prefill, 7.0)]));
        let mut out = BTreeMap::new();
        body_stages(
            &serde_json::json!({"timing": {"stages_ms": {"queue": 1.0, "kv_transfer": 2.0}}}),
            &mut out,
        );
        assert_eq!(out, BTreeMap::from([(Stage::Queue, 1.0), (Stage::KvTransfer, 2.0)]));
        let mut out = BTreeMap::new();
        body_stages(
            &serde_json::json!({"nvext": {"timing": {"request_received_ms": 1_700_000_000_000u64,
                "prefill_wait_time_ms": 2.0, "prefill_time_ms": 30.0, "ttft_ms": 33.0, "total_time_ms": 133.5}}}),
            &mut out,
        );
        assert_eq!(
            out,
            BTreeMap::from([(Stage::Queue, 2.0), (Stage::Prefill, 30.0), (Stage::Decode, 100.5)])
        );
        let mut out = BTreeMap::new();
        body_stages(&serde_json::json!({"nvext": {"timing": {"ttft_ms": 33.0}}}), &mut out);
        assert!(out.is_empty(), "no total: no decode stage invented");
    }

    fn span(name: &str, start_ms: u64, end_ms: u64, attrs: Value) -> EngineSpan {
        EngineSpan {
            trace_id: crate::TraceId([1; 16]),
            span_id: crate::SpanId([2; 8]),
            parent: Some(crate::SpanId([3; 8])),
            name: name.into(),
            service: None,
            start_unix_ns: start_ms * 1_000_000,
            end_unix_ns: end_ms * 1_000_000,
            attributes: attrs.as_object().cloned().unwrap_or_default(),
        }
    }

    #[test]
    fn a_vllm_span_gives_queue_with_the_wait_before_the_scheduler_saw_it_prefill_and_decode() {
        let attrs = serde_json::json!({
            "gen_ai.latency.time_in_queue": 0.002, "gen_ai.latency.time_to_first_token": 0.2485,
            "gen_ai.latency.time_in_model_prefill": 0.2117, "gen_ai.latency.time_in_model_decode": 0.4509,
            "gen_ai.latency.e2e": 0.6973, "gen_ai.request.id": "chatcmpl-1", "gen_ai.usage.prompt_tokens": 37
        });
        let t =
            spans_timing(&[span("Load weights", 0, 9, Value::Null), span(VLLM_REQUEST_SPAN, 0, 1, attrs)])
                .unwrap();
        let ms = |s: Stage| t.stages_ms[&s];
        // Queue: time_in_queue (2 ms) plus TTFT − time_in_queue − prefill (34.8 ms).
        assert!((ms(Stage::Queue) - 36.8).abs() < 1e-9);
        assert!((ms(Stage::Prefill) - 211.7).abs() < 1e-9);
        assert!((ms(Stage::Decode) - 450.9).abs() < 1e-9);
        assert!(!t.stages_ms.contains_key(&Stage::Gateway), "a vLLM span says nothing of a gateway");
        assert!((t.ttft_ms.unwrap() - 248.5).abs() < 1e-9 && (t.e2e_ms.unwrap() - 697.3).abs() < 1e-9);
        assert!(t.sources.values().all(|s| *s == StageSource::Span) && t.sources.len() == 3);
        assert!(!t.stages_ms.contains_key(&Stage::KvTransfer), "never invented");
    }

    #[test]
    fn two_vllm_spans_in_pd_give_prefill_from_the_first_and_decode_from_the_last() {
        let prefill = serde_json::json!({"gen_ai.latency.time_in_queue": 0.001, "gen_ai.latency.time_in_model_prefill": 0.2,
            "gen_ai.latency.time_in_model_decode": 0.0, "gen_ai.latency.time_to_first_token": 0.25});
        let decode = serde_json::json!({"gen_ai.latency.time_in_queue": 0.005, "gen_ai.latency.time_in_model_prefill": 0.01,
            "gen_ai.latency.time_in_model_decode": 0.9, "gen_ai.latency.e2e": 1.3});
        let t = spans_timing(&[
            span(VLLM_REQUEST_SPAN, 300, 1300, decode),
            span(VLLM_REQUEST_SPAN, 0, 260, prefill),
        ])
        .unwrap();
        assert!(
            (t.stages_ms[&Stage::Prefill] - 200.0).abs() < 1e-9
                && (t.stages_ms[&Stage::Queue] - 50.0).abs() < 1e-9
        );
        assert!((t.stages_ms[&Stage::Decode] - 900.0).abs() < 1e-9);
        assert!((t.ttft_ms.unwrap() - 250.0).abs() < 1e-9 && (t.e2e_ms.unwrap() - 1300.0).abs() < 1e-9);
    }

    #[test]
    fn sglang_slices_give_stages_by_duration_and_nested_slices_are_not_counted_twice() {
        let root = serde_json::json!({"rid": "1a2b", "gen_ai.latency.time_to_first_token": 0.05,
            "gen_ai.latency.time_in_model_prefill": 0.04});
        let t = spans_timing(&[
            span(" Req 1a2b3c4d", 0, 100, root),
            span("tokenize", 0, 2, Value::Null),
            span("dispatch", 2, 3, Value::Null),
            span("prefill_waiting", 3, 10, Value::Null),
            span("prefill_forward", 10, 40, Value::Null),
            span("chunked_prefill", 10, 25, Value::Null),
            span("chunked_prefill", 25, 40, Value::Null),
            span("decode_waiting", 40, 41, Value::Null),
            span("decode_forward", 41, 100, Value::Null),
            span("decode_loop", 41, 50, Value::Null),
        ])
        .unwrap();
        let want = [
            (Stage::Gateway, 3.0),
            (Stage::Queue, 7.0),
            (Stage::Prefill, 30.0),
            (Stage::DecodeQueue, 1.0),
            (Stage::Decode, 59.0),
        ];
        assert_eq!(t.stages_ms, want.into_iter().collect::<BTreeMap<_, _>>());
        assert!((t.ttft_ms.unwrap() - 50.0).abs() < 1e-9);
        assert!(spans_timing(&[span("something", 0, 1, Value::Null)]).is_none());
    }

    #[test]
    fn tgi_headers_give_validation_and_queue_only() {
        let mut out = BTreeMap::new();
        header_stages(
            [
                ("x-validation-time", "3"),
                ("x-queue-time", "12"),
                ("x-inference-time", "400"),
                ("x-total-time", "x"),
            ],
            &mut out,
        );
        assert_eq!(out, BTreeMap::from([(Stage::Gateway, 3.0), (Stage::Queue, 12.0)]));
    }

    #[test]
    fn bad_attribute_values_give_no_stage() {
        let attrs = serde_json::json!({"gen_ai.latency.time_in_queue": -1.0, "gen_ai.latency.time_in_model_prefill": "x"});
        let t = spans_timing(&[span(VLLM_REQUEST_SPAN, 0, 1, attrs)]).unwrap();
        assert!(t.stages_ms.is_empty() && t.ttft_ms.is_none());
    }
}
