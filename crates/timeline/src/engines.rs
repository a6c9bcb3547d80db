//! What each engine reports about one request, mapped onto our stages: the one table of it.
//!
//! Engines report a request's stages in their own shapes — vLLM's per-request `metrics` object
//! and its `llm_request` span, llama.cpp's `timings`, Dynamo's `nvext.timing`, TGI's response
//! headers, a tokenpath upstream's `timing` — in their own units. The gateway (relaying an
//! upstream's answer) and the bench (joining a client record to the engine's span) read them
//! here, so one engine field means one stage everywhere, and the table in
//! `docs/metrics.md#engine-stages` is this file. What is malformed, negative or not finite is
//! left out; a stage an engine does not report is absent, never derived from what it lacks.

use serde_json::{Map, Value};
use std::collections::BTreeMap;

use crate::{ServerTiming, Stage, StageSource};

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
    if let Some(t) = v.pointer("/nvext/timing") {
        take(Stage::Queue, t.get("prefill_wait_time_ms"));
        take(Stage::Prefill, t.get("prefill_time_ms"));
        let f = |k: &str| t.get(k).and_then(Value::as_f64);
        if let (Some(total), Some(ttft)) = (f("total_time_ms"), f("ttft_ms")) {
            take(Stage::Decode, Some(&Value::from(total - ttft)));
        }
    }
    if let Some(stages) = v.pointer("/timing/stages_ms").and_then(Value::as_object) {
        // A tokenpath upstream's own gateway stage is not ours: ours is measured here.
        for stage in Stage::ALL.into_iter().filter(|s| *s != Stage::Gateway) {
            take(stage, stages.get(stage.name()));
        }
    }
}

/// The name of vLLM's per-request span.
pub const VLLM_REQUEST_SPAN: &str = "llm_request";

/// vLLM's `llm_request` span attributes (seconds, as doubles) → stages. `time_to_first_token`
/// and `e2e` are from the frontend's arrival, so the frontend's own part (tokenization, the
/// hop to the engine core, detokenizing the first token) is what TTFT leaves after queue and
/// prefill: that is the `gateway` stage of a vLLM server.
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

/// The timing one engine span carries, when the span is one whose shape we know (today:
/// vLLM's `llm_request`); every stage it gives is marked as the engine's.
pub fn span_timing(name: &str, attributes: &Map<String, Value>) -> Option<ServerTiming> {
    if name != VLLM_REQUEST_SPAN {
        return None;
    }
    let mut t = ServerTiming::default();
    for (key, stage) in VLLM_SPAN_ATTRIBUTES {
        if let Some(ms) = seconds_ms(attributes.get(key)) {
            t.stages_ms.insert(stage, ms);
        }
    }
    t.ttft_ms = seconds_ms(attributes.get(VLLM_TTFT));
    t.e2e_ms = seconds_ms(attributes.get(VLLM_E2E));
    if let (Some(ttft), Some(q), Some(p)) =
        (t.ttft_ms, t.stages_ms.get(&Stage::Queue), t.stages_ms.get(&Stage::Prefill))
    {
        // Measured on one clock (vLLM's), so the difference is a measurement, not a guess;
        // it can dip below zero by rounding only.
        t.stages_ms.insert(Stage::Gateway, (ttft - q - p).max(0.0));
    }
    if let Some(n) = attributes.get("gen_ai.usage.cached_tokens").and_then(Value::as_u64) {
        t.cached_tokens = n;
    }
    t.sources = t.stages_ms.keys().map(|s| (*s, StageSource::Engine)).collect();
    Some(t)
}

/// TGI's per-request timing headers (milliseconds) → stages.
pub const TGI_HEADERS: [(&str, Stage); 3] = [
    ("x-validation-time", Stage::Gateway),
    ("x-queue-time", Stage::Queue),
    ("x-inference-time", Stage::Decode),
];

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

    #[test]
    fn a_vllm_span_gives_queue_prefill_decode_and_the_frontends_remainder() {
        let attrs = serde_json::json!({
            "gen_ai.latency.time_in_queue": 0.002, "gen_ai.latency.time_to_first_token": 0.2485,
            "gen_ai.latency.time_in_model_prefill": 0.2117, "gen_ai.latency.time_in_model_decode": 0.4509,
            "gen_ai.latency.e2e": 0.6973, "gen_ai.request.id": "chatcmpl-1", "gen_ai.usage.prompt_tokens": 37
        });
        let t = span_timing(VLLM_REQUEST_SPAN, attrs.as_object().unwrap()).unwrap();
        let ms = |s: Stage| t.stages_ms[&s];
        assert!((ms(Stage::Queue) - 2.0).abs() < 1e-9);
        assert!((ms(Stage::Prefill) - 211.7).abs() < 1e-9);
        assert!((ms(Stage::Decode) - 450.9).abs() < 1e-9);
        assert!((ms(Stage::Gateway) - 34.8).abs() < 1e-9);
        assert!((t.ttft_ms.unwrap() - 248.5).abs() < 1e-9 && (t.e2e_ms.unwrap() - 697.3).abs() < 1e-9);
        assert!(t.sources.values().all(|s| *s == StageSource::Engine) && t.sources.len() == 4);
        assert!(!t.stages_ms.contains_key(&Stage::KvTransfer), "never invented");
    }

    #[test]
    fn other_spans_and_bad_attribute_values_give_nothing() {
        let attrs = serde_json::json!({"gen_ai.latency.time_in_queue": -1.0, "gen_ai.latency.time_in_model_prefill": "x"});
        assert!(span_timing("Load weights", attrs.as_object().unwrap()).is_none());
        let t = span_timing(VLLM_REQUEST_SPAN, attrs.as_object().unwrap()).unwrap();
        assert!(t.stages_ms.is_empty() && t.ttft_ms.is_none());
    }
}
