//! Service-level objectives and goodput. An SLO spec is text such as `ttft:2s,tpot:100ms,e2e:30s`;
//! a request is *good* when it completed and met every target. Failed and timed-out requests
//! violate every SLO — leaving them out would make an overloaded server look better the more it
//! fails.

use crate::{ClientRecord, TimelineError, Window};
use serde::{Deserialize, Serialize};
use std::{fmt, str::FromStr};

/// A per-request metric an SLO can bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SloMetric {
    /// Client TTFT (`t_first − t_send`); for a non-streamed response E2E stands in (an upper bound).
    Ttft,
    /// TPOT; a request with N_out ≤ 1 has none and meets it.
    Tpot,
    /// E2E.
    E2e,
    /// The request's largest chunk gap (its worst stall).
    ChunkGap,
}

impl SloMetric {
    const NAMES: &'static str = "ttft, tpot, e2e, chunk_gap";

    /// The name used in specs and reports.
    pub fn name(self) -> &'static str {
        match self {
            SloMetric::Ttft => "ttft",
            SloMetric::Tpot => "tpot",
            SloMetric::E2e => "e2e",
            SloMetric::ChunkGap => "chunk_gap",
        }
    }

    /// The request's value of this metric in ms; `None` when the metric does not apply.
    fn value_ms(self, r: &ClientRecord) -> Option<f64> {
        let ms = |ns: u64| ns as f64 / 1e6;
        match self {
            SloMetric::Ttft => r.ttft_ns().or_else(|| r.e2e_ns()).map(ms),
            SloMetric::Tpot => r.tpot_ns().map(|v| v / 1e6),
            SloMetric::E2e => r.e2e_ns().map(ms),
            SloMetric::ChunkGap => r.max_chunk_gap_ns().map(ms),
        }
    }

    /// Whether `r` meets `max_ms` on this metric.
    fn met(self, r: &ClientRecord, max_ms: f64) -> bool {
        if !r.is_ok() {
            return false;
        }
        match self.value_ms(r) {
            Some(v) => v <= max_ms,
            // TPOT and chunk gap are undefined for single-token outputs: nothing to violate.
            None => matches!(self, SloMetric::Tpot | SloMetric::ChunkGap),
        }
    }
}

impl fmt::Display for SloMetric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One bound: `metric ≤ max_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SloTarget {
    /// The bounded metric.
    pub metric: SloMetric,
    /// The bound, ms.
    pub max_ms: f64,
}

/// A set of SLO targets, at most one per metric.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SloSpec {
    /// The targets, in the order given.
    pub targets: Vec<SloTarget>,
}

impl FromStr for SloSpec {
    type Err = TimelineError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |entry: &str, reason: String| TimelineError::BadSlo { entry: entry.to_owned(), reason };
        let mut targets: Vec<SloTarget> = Vec::new();
        for entry in s.split(',').map(str::trim) {
            if entry.is_empty() {
                return Err(bad(
                    s,
                    "empty entry; expected metric:value pairs like ttft:2s,tpot:100ms".into(),
                ));
            }
            let (name, value) = entry
                .split_once(':')
                .ok_or_else(|| bad(entry, "expected metric:value, e.g. ttft:2s".into()))?;
            let metric = match name.trim() {
                "ttft" => SloMetric::Ttft,
                "tpot" => SloMetric::Tpot,
                "e2e" => SloMetric::E2e,
                "chunk_gap" | "itl" => SloMetric::ChunkGap,
                other => {
                    return Err(bad(entry, format!("unknown metric {other:?}; known: {}", SloMetric::NAMES)))
                }
            };
            if targets.iter().any(|t| t.metric == metric) {
                return Err(bad(entry, format!("{metric} is given twice")));
            }
            let max_ms = parse_duration_ms(value.trim()).map_err(|reason| bad(entry, reason))?;
            targets.push(SloTarget { metric, max_ms });
        }
        Ok(SloSpec { targets })
    }
}

impl fmt::Display for SloSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> =
            self.targets.iter().map(|t| format!("{}:{}ms", t.metric, t.max_ms)).collect();
        f.write_str(&parts.join(","))
    }
}

/// `250ms`, `2s`, `1.5s`, `500us`, `1m` → milliseconds. Positive and finite only.
fn parse_duration_ms(v: &str) -> Result<f64, String> {
    let num = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &v[num.len()..];
    if unit.is_empty() {
        return Err(format!("{v:?} has no unit; use us, ms, s or m"));
    }
    let x: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{:?} is not a number", if num.is_empty() { v } else { num }))?;
    let scale = match unit {
        "us" => 1e-3,
        "ms" => 1.0,
        "s" => 1e3,
        "m" | "min" => 60e3,
        other => return Err(format!("unknown unit {other:?}; use us, ms, s or m")),
    };
    if !x.is_finite() {
        return Err(format!("{num:?} is not a finite number"));
    }
    if x <= 0.0 {
        return Err(format!("{v} must be positive"));
    }
    Ok(x * scale)
}

/// Goodput over a window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    /// Requests that ended in the window, failed ones included.
    pub requests: u64,
    /// Requests that completed and met every target.
    pub good: u64,
    /// Good requests per second.
    pub goodput_rps: f64,
    /// Output tokens of good requests per second.
    pub token_goodput_per_s: f64,
    /// Fraction of requests meeting every target (0..=1).
    pub attainment: f64,
    /// Fraction meeting each target, in spec order.
    pub per_slo: Vec<(SloMetric, f64)>,
}

/// Goodput of `records` over `window` under `spec`.
pub fn goodput(records: &[ClientRecord], window: Window, spec: &SloSpec) -> Goodput {
    let in_window: Vec<&ClientRecord> = window.ended_in(records).collect();
    let mut met_per = vec![0u64; spec.targets.len()];
    let (mut good, mut good_tokens) = (0u64, 0u64);
    for r in &in_window {
        let mut all = r.is_ok();
        for (i, t) in spec.targets.iter().enumerate() {
            if t.metric.met(r, t.max_ms) {
                met_per[i] += 1;
            } else {
                all = false;
            }
        }
        if all {
            good += 1;
            good_tokens += r.n_out().map_or(0, |(n, _)| n);
        }
    }
    let n = in_window.len() as u64;
    let frac = |k: u64| if n == 0 { 0.0 } else { k as f64 / n as f64 };
    Goodput {
        requests: n,
        good,
        goodput_rps: good as f64 / window.seconds(),
        token_goodput_per_s: good_tokens as f64 / window.seconds(),
        attainment: frac(good),
        per_slo: spec.targets.iter().zip(met_per).map(|(t, k)| (t.metric, frac(k))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::tests::{req, S};
    use crate::{throughput, Outcome, Usage};
    use proptest::prelude::*;

    #[test]
    fn parses_units_and_round_trips() {
        let spec: SloSpec = "ttft:2s, tpot:100ms,e2e:0.5m,chunk_gap:500us".parse().unwrap();
        let got: Vec<(SloMetric, f64)> = spec.targets.iter().map(|t| (t.metric, t.max_ms)).collect();
        assert_eq!(
            got,
            vec![
                (SloMetric::Ttft, 2000.0),
                (SloMetric::Tpot, 100.0),
                (SloMetric::E2e, 30_000.0),
                (SloMetric::ChunkGap, 0.5)
            ]
        );
        assert_eq!(spec.to_string().parse::<SloSpec>().unwrap(), spec);
        let sci: SloSpec = "tpot:1e-1s".parse().unwrap();
        assert_eq!(sci.targets[0].max_ms, 100.0);
    }

    #[test]
    fn bad_specs_name_the_problem() {
        for (spec, needle) in [
            ("ttft:abc", "not a number"),
            ("latency:2s", "unknown metric \"latency\""),
            ("ttft:-2s", "must be positive"),
            ("ttft:0ms", "must be positive"),
            ("ttft:2", "no unit"),
            ("ttft:2h", "unknown unit"),
            ("ttft", "expected metric:value"),
            ("", "empty entry"),
            ("ttft:1s,ttft:2s", "given twice"),
            ("ttft:1e999ms", "not a finite"),
        ] {
            let err = spec.parse::<SloSpec>().unwrap_err();
            assert!(matches!(err, TimelineError::BadSlo { .. }));
            assert!(err.to_string().contains(needle), "{spec:?}: {err}");
        }
    }

    #[test]
    fn failed_request_inside_window_violates_every_slo() {
        // req(id, sched, first, n tokens 100 ms apart, prompt); sent at sched.
        let ok_fast = req(1, 1.0, 1.2, 3, 10); // ttft 200 ms, tpot 100 ms
        let ok_slow = req(2, 1.0, 2.5, 3, 10); // ttft 1500 ms
        let mut failed = req(3, 1.0, 1.1, 3, 10);
        failed.outcome = Outcome::Failed { kind: "timeout".into(), message: String::new() };
        let one_token = req(4, 1.0, 1.3, 1, 10); // no TPOT: meets it
        let records = [ok_fast, ok_slow, failed, one_token];
        let spec: SloSpec = "ttft:1s,tpot:150ms".parse().unwrap();
        let g = goodput(&records, Window::new(S, 4 * S).unwrap(), &spec);
        assert_eq!((g.requests, g.good), (4, 2));
        assert_eq!(g.goodput_rps, 2.0 / 3.0);
        assert_eq!(g.token_goodput_per_s, 4.0 / 3.0);
        assert_eq!(g.attainment, 0.5);
        assert_eq!(g.per_slo, vec![(SloMetric::Ttft, 0.5), (SloMetric::Tpot, 0.75)]);
    }

    #[test]
    fn empty_window_has_zero_goodput() {
        let spec: SloSpec = "e2e:1s".parse().unwrap();
        let g = goodput(&[], Window::new(0, S).unwrap(), &spec);
        assert_eq!((g.requests, g.good, g.attainment, g.goodput_rps), (0, 0, 0.0, 0.0));
    }

    proptest! {
        #[test]
        fn goodput_never_exceeds_throughput(
            reqs in proptest::collection::vec((0.0f64..10.0, 0.0f64..3.0, 0u32..20, any::<bool>()), 0..60),
            ttft_ms in 1.0f64..3000.0,
        ) {
            let records: Vec<ClientRecord> = reqs.iter().enumerate().map(|(i, &(s, d, n, fail))| {
                let mut r = req(i as u64, s, s + d, n, 5);
                if fail { r.outcome = Outcome::Failed { kind: "x".into(), message: String::new() }; }
                if n == 0 { r.usage = Some(Usage { prompt_tokens: 5, completion_tokens: 0, cached_tokens: None }); }
                r
            }).collect();
            let w = Window::new(S, 12 * S).unwrap();
            let spec = SloSpec { targets: vec![SloTarget { metric: SloMetric::Ttft, max_ms: ttft_ms }] };
            let g = goodput(&records, w, &spec);
            let t = throughput(&records, w);
            prop_assert!(g.goodput_rps <= t.requests_per_s + 1e-12);
            prop_assert!(g.token_goodput_per_s <= t.output_tokens_per_s + 1e-12);
            prop_assert!(g.attainment <= 1.0);
        }
    }
}
