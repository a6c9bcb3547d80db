//! A mergeable latency histogram for long runs and for combining per-worker or per-thread
//! distributions: HDR histogram (3 significant digits) over microseconds. Exact summaries
//! ([`crate::Summary::from_samples`]) stay the reference; this trades exactness for O(1) memory
//! with a bounded relative error of 0.1%.

use crate::{Summary, TimelineError, P999_MIN_SAMPLES};
use hdrhistogram::Histogram;

/// Latency histogram in milliseconds (stored as whole microseconds).
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    h: Histogram<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    /// An empty histogram that grows to any range, at 3 significant digits.
    pub fn new() -> Self {
        // 3 significant figures is a valid constant configuration; the constructor only fails on
        // sigfig > 5.
        Self { h: Histogram::new(3).expect("3 significant figures is a valid HDR configuration") }
    }

    /// Records one latency in ms; negative and non-finite values are ignored.
    pub fn record_ms(&mut self, value_ms: f64) {
        if value_ms.is_finite() && value_ms >= 0.0 {
            let us = (value_ms * 1000.0).round() as u64;
            // An auto-resizing histogram only fails to record when it cannot grow (values near
            // u64::MAX µs); clamping those to the largest trackable value is the honest fallback.
            if self.h.record(us).is_err() {
                self.h.saturating_record(us);
            }
        }
    }

    /// Adds every sample of `other`.
    pub fn merge(&mut self, other: &LatencyHistogram) -> Result<(), TimelineError> {
        self.h.add(&other.h).map_err(|e| TimelineError::Histogram(format!("{e:?}")))
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.h.len()
    }

    /// Whether no sample was recorded.
    pub fn is_empty(&self) -> bool {
        self.h.is_empty()
    }

    /// Value at percentile `p` (0..=100), ms.
    pub fn percentile_ms(&self, p: f64) -> f64 {
        self.h.value_at_percentile(p) as f64 / 1000.0
    }

    /// Summary with the same fields as the exact one (percentiles are HDR's nearest-rank values,
    /// within 0.1%).
    pub fn summary(&self) -> Option<Summary> {
        if self.h.is_empty() {
            return None;
        }
        let p = |q: f64| self.percentile_ms(q);
        Some(Summary {
            count: self.h.len(),
            mean: self.h.mean() / 1000.0,
            std: self.h.stdev() / 1000.0,
            min: self.h.min() as f64 / 1000.0,
            p50: p(50.0),
            p90: p(90.0),
            p95: p(95.0),
            p99: p(99.0),
            p999: p(99.9),
            max: self.h.max() as f64 / 1000.0,
            p999_low_samples: self.h.len() < P999_MIN_SAMPLES,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn from(v: &[f64]) -> LatencyHistogram {
        let mut h = LatencyHistogram::new();
        v.iter().for_each(|x| h.record_ms(*x));
        h
    }

    #[test]
    fn summary_matches_exact_within_precision() {
        let v: Vec<f64> = (1..=1000).map(|i| f64::from(i) * 1.7).collect();
        let exact = Summary::from_samples(&v).unwrap();
        let approx = from(&v).summary().unwrap();
        assert_eq!(approx.count, 1000);
        for (a, e) in [(approx.p50, exact.p50), (approx.p99, exact.p99), (approx.max, exact.max)] {
            assert!((a - e).abs() <= e * 0.002 + 0.002, "{a} vs {e}");
        }
        assert!(LatencyHistogram::new().summary().is_none());
    }

    proptest! {
        #[test]
        fn merge_equals_histogram_of_union(
            a in proptest::collection::vec(0.0f64..60_000.0, 0..300),
            b in proptest::collection::vec(0.0f64..60_000.0, 0..300),
        ) {
            let mut merged = from(&a);
            merged.merge(&from(&b)).unwrap();
            let union: Vec<f64> = a.iter().chain(&b).copied().collect();
            let whole = from(&union);
            prop_assert_eq!(merged.len(), whole.len());
            for p in [0.0, 50.0, 90.0, 99.0, 99.9, 100.0] {
                prop_assert_eq!(merged.percentile_ms(p), whole.percentile_ms(p));
            }
            if let Some(exact) = Summary::from_samples(&union) {
                // HDR max is the bucket's highest equivalent value: within 0.1% (+ 1 µs rounding).
                let m = merged.summary().unwrap();
                prop_assert!((m.max - exact.max).abs() <= exact.max * 0.001 + 0.002);
            }
        }
    }
}
