//! The stages an engine reports about one request, in each engine's own shape: vLLM's
//! per-request `metrics`, llama.cpp's `timings`, Dynamo's `nvext.timing`, a tokenpath upstream's
//! `timing`. One reader for all of them, so the relay of an answer and the record of a prefill
//! leg take the same stages from the same fields; what is malformed or negative is left out.

use serde_json::Value;
use std::collections::BTreeMap;
use tokenpath_timeline::Stage;

/// The stage durations an engine put in a chunk or body (see the module docs), in ms; finite,
/// non-negative numbers only.
pub(super) fn engine_stages(v: &Value, out: &mut BTreeMap<Stage, f64>) {
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
        let mut out = BTreeMap::new();
        engine_stages(
            &serde_json::json!({"nvext": {"timing": {"request_received_ms": 1_700_000_000_000u64,
                "prefill_wait_time_ms": 2.0, "prefill_time_ms": 30.0, "ttft_ms": 33.0, "total_time_ms": 133.5}}}),
            &mut out,
        );
        assert_eq!(
            out,
            BTreeMap::from([(Stage::Queue, 2.0), (Stage::Prefill, 30.0), (Stage::Decode, 100.5)])
        );
        let mut out = BTreeMap::new();
        engine_stages(&serde_json::json!({"nvext": {"timing": {"ttft_ms": 33.0}}}), &mut out);
        assert!(out.is_empty(), "no total: no decode stage invented");
    }
}
