//! An upstream's load, from its own Prometheus `/metrics`: requests waiting and running and the
//! KV-cache usage fraction, under whichever names the engine uses (the same table llm-d's
//! endpoint picker reads). Summed over label sets (a vLLM with several data-parallel engines
//! exports one series per engine).
//!
//! Read by hand rather than with a Prometheus parsing crate: only a handful of gauge lines are
//! wanted, the text format's sample line is `name{labels} value [timestamp]`, and anything that
//! does not parse is skipped — an upstream's odd line must never stop the gateway. Bounded: at
//! most [`MAX_METRICS_BYTES`] are read.

/// Largest `/metrics` body read from an upstream.
pub(super) const MAX_METRICS_BYTES: usize = 4 << 20;

/// Queue depth names, per engine.
const WAITING: [&str; 4] = [
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "llamacpp:requests_deferred",
    "tokenpath_num_requests_waiting",
];
/// Running-request names.
const RUNNING: [&str; 4] = [
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "llamacpp:requests_processing",
    "tokenpath_num_requests_running",
];
/// KV-usage fraction (0..1) names.
const KV_USAGE: [&str; 4] = [
    "vllm:kv_cache_usage_perc",
    "sglang:token_usage",
    "trtllm_kv_cache_utilization",
    "tokenpath_kv_cache_usage_perc",
];

/// What an upstream's `/metrics` says of its load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Load {
    /// Requests waiting, summed.
    pub(super) waiting: Option<f64>,
    /// Requests running, summed.
    pub(super) running: Option<f64>,
    /// KV usage, 0..=1 (the largest over series: the fullest engine bounds what fits).
    pub(super) kv_usage: Option<f64>,
}

/// Reads the gauges of [`Load`] out of a Prometheus text exposition.
pub(super) fn parse(text: &str) -> Load {
    let mut load = Load::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        // The value follows the labels (which may hold spaces inside quotes).
        let after = if rest.starts_with('{') { rest.rfind('}').map_or("", |i| &rest[i + 1..]) } else { rest };
        let Some(v) = after.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        if !v.is_finite() || v < 0.0 {
            continue;
        }
        if WAITING.contains(&name) {
            *load.waiting.get_or_insert(0.0) += v;
        } else if RUNNING.contains(&name) {
            *load.running.get_or_insert(0.0) += v;
        } else if KV_USAGE.contains(&name) {
            let v = v.min(1.0);
            load.kv_usage = Some(load.kv_usage.map_or(v, |k: f64| k.max(v)));
        }
    }
    load
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_engines_names_are_read_and_garbage_is_skipped() {
        let vllm = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"a b}\"} 2\n\
            vllm:num_requests_running{engine=\"0\"} 5\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} 0.75 1700000000\nvllm:other 9\n";
        assert_eq!(parse(vllm), Load { waiting: Some(5.0), running: Some(5.0), kv_usage: Some(0.75) });
        let sglang =
            "sglang:num_queue_reqs{model_name=\"m\"} 1\nsglang:num_running_reqs 4\nsglang:token_usage 0.5\n";
        assert_eq!(parse(sglang), Load { waiting: Some(1.0), running: Some(4.0), kv_usage: Some(0.5) });
        let junk = "vllm:num_requests_waiting NaN\nvllm:num_requests_running -3\nvllm:kv_cache_usage_perc 7\n{}\n}{ 1\nnovalue\n";
        assert_eq!(parse(junk), Load { waiting: None, running: None, kv_usage: Some(1.0) });
        assert_eq!(parse(""), Load::default());
    }
}
