//! Tail attribution: for the requests above a metric's percentile (p99 by default), the share of
//! each server stage in their latency, so a report can say "TTFT p99 tail: 71% queue, 25% prefill,
//! 4% gateway" instead of "the model is a bit slow". The part of the client-observed latency that
//! no server stage accounts for (network, client, HTTP framing) is reported as
//! [`OTHER_COMPONENT`], so the shares always add up to 100%.

use crate::{percentile, ClientRecord, Stage};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Name of the component no server stage accounts for.
pub const OTHER_COMPONENT: &str = "other";

/// A client metric whose tail can be split into stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TailMetric {
    /// Client TTFT: made of gateway, queue and prefill (the first token leaves when prefill ends).
    Ttft,
    /// Client E2E: made of every stage.
    E2e,
}

impl TailMetric {
    /// The stages that make up this metric.
    pub fn stages(self) -> &'static [Stage] {
        match self {
            TailMetric::Ttft => &[Stage::Gateway, Stage::Queue, Stage::Prefill],
            TailMetric::E2e => &Stage::ALL,
        }
    }

    fn value_ms(self, r: &ClientRecord) -> Option<f64> {
        let ns = match self {
            TailMetric::Ttft => r.ttft_ns()?,
            TailMetric::E2e => r.e2e_ns()?,
        };
        Some(ns as f64 / 1e6)
    }

    /// Report name.
    pub fn name(self) -> &'static str {
        match self {
            TailMetric::Ttft => "TTFT",
            TailMetric::E2e => "E2E",
        }
    }
}

/// Where a tail's latency went.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TailAttribution {
    /// The metric.
    pub metric: TailMetric,
    /// The percentile that defines the tail (e.g. 99).
    pub percentile: f64,
    /// The metric's value at that percentile, ms.
    pub threshold_ms: f64,
    /// Requests in the tail.
    pub requests: usize,
    /// (component, share 0..=1), largest first; components are stage names and `other`.
    pub shares: Vec<(String, f64)>,
}

impl fmt::Display for TailAttribution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.shares.iter().map(|(c, s)| format!("{:.0}% {c}", s * 100.0)).collect();
        write!(f, "{} p{} tail: {}", self.metric.name(), self.percentile, parts.join(", "))
    }
}

/// Splits the tail of `metric` above percentile `pct` into stages, over completed requests that
/// carry a server `timing`. The tail is the requests strictly above the percentile value (or at
/// it, when none is strictly above, as with few samples). `None` when no request qualifies.
pub fn tail_attribution(records: &[ClientRecord], metric: TailMetric, pct: f64) -> Option<TailAttribution> {
    let rows: Vec<(f64, &ClientRecord)> = records
        .iter()
        .filter(|r| r.is_ok() && r.server.is_some())
        .filter_map(|r| Some((metric.value_ms(r)?, r)))
        .collect();
    let values: Vec<f64> = rows.iter().map(|(v, _)| *v).collect();
    let threshold = percentile(&values, pct).ok()??;
    let mut tail: Vec<&(f64, &ClientRecord)> = rows.iter().filter(|(v, _)| *v > threshold).collect();
    if tail.is_empty() {
        tail = rows.iter().filter(|(v, _)| *v >= threshold).collect();
    }
    let stages = metric.stages();
    let mut sums = vec![0.0f64; stages.len() + 1];
    for (value, r) in &tail {
        let timing = r.server.as_ref()?;
        let mut accounted = 0.0;
        for (i, s) in stages.iter().enumerate() {
            let v = timing.stage_ms(*s).unwrap_or(0.0);
            sums[i] += v;
            accounted += v;
        }
        sums[stages.len()] += (value - accounted).max(0.0);
    }
    let total: f64 = sums.iter().sum();
    let names = stages.iter().map(|s| s.name()).chain([OTHER_COMPONENT]);
    let mut shares: Vec<(String, f64)> = names
        .zip(&sums)
        .filter(|(_, v)| **v > 0.0)
        .map(|(n, v)| (n.to_owned(), if total > 0.0 { v / total } else { 0.0 }))
        .collect();
    shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    Some(TailAttribution { metric, percentile: pct, threshold_ms: threshold, requests: tail.len(), shares })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RequestId, ServerTiming, StreamEvent};

    const MS: u64 = 1_000_000;

    /// A request with client TTFT `ttft` ms and the given server stage durations.
    fn with_stages(id: u64, ttft: u64, gateway: f64, queue: f64, prefill: f64) -> ClientRecord {
        let mut r = ClientRecord::new(RequestId(id), 0, 0, true);
        r.events.push(StreamEvent { at_ns: ttft * MS, tokens: 1 });
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Gateway, gateway);
        t.stages_ms.insert(Stage::Queue, queue);
        t.stages_ms.insert(Stage::Prefill, prefill);
        r.server = Some(t);
        r
    }

    #[test]
    fn ttft_tail_is_split_into_stages_and_other() {
        // 99 fast requests (10 ms, all prefill) and one slow one: 100 ms = 2 gw + 71 queue + 25
        // prefill + 2 unaccounted.
        let mut records: Vec<ClientRecord> = (0..99).map(|i| with_stages(i, 10, 0.0, 0.0, 10.0)).collect();
        records.push(with_stages(99, 100, 2.0, 71.0, 25.0));
        let a = tail_attribution(&records, TailMetric::Ttft, 99.0).unwrap();
        assert_eq!(a.requests, 1);
        let got: Vec<(&str, i64)> =
            a.shares.iter().map(|(c, s)| (c.as_str(), (s * 100.0).round() as i64)).collect();
        assert_eq!(got, vec![("queue", 71), ("prefill", 25), ("gateway", 2), ("other", 2)]);
        assert_eq!(a.to_string(), "TTFT p99 tail: 71% queue, 25% prefill, 2% gateway, 2% other");
        let total: f64 = a.shares.iter().map(|s| s.1).sum();
        assert!((total - 1.0).abs() < 1e-9);
    }

    #[test]
    fn requests_without_timing_or_failed_are_ignored() {
        let mut r = with_stages(1, 10, 0.0, 0.0, 10.0);
        r.server = None;
        assert!(tail_attribution(&[r], TailMetric::Ttft, 99.0).is_none());
        assert!(tail_attribution(&[], TailMetric::E2e, 99.0).is_none());
    }
}
