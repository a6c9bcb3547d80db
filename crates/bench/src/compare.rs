//! `tokenpath compare`: two runs, metric by metric and stage by stage, with a bootstrap 95%
//! confidence interval on each change, so "prefill p99 +40% [+31%, +52%]" can be told from noise;
//! and regression gates (`ttft.p99>+10%`) for CI pipelines.

use crate::report::Metric;
use crate::BenchError;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;
use std::str::FromStr;
use tokenpath_timeline::{percentile, ClientRecord};

/// Bootstrap resamples per interval.
pub const RESAMPLES: usize = 1000;

/// One metric's statistic in both runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// Metric name (`ttft`, `prefill`, ...).
    pub metric: &'static str,
    /// `p50` or `p99`.
    pub stat: &'static str,
    /// Value in run A, ms.
    pub a: f64,
    /// Value in run B, ms.
    pub b: f64,
    /// (B − A) / A, %.
    pub change_pct: f64,
    /// Bootstrap 95% interval of the change, %.
    pub ci_pct: (f64, f64),
}

impl Change {
    /// The interval excludes zero.
    pub fn significant(&self) -> bool {
        self.ci_pct.0 > 0.0 || self.ci_pct.1 < 0.0
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<16}{:<5}{:>11.1}{:>11.1}  {:>+7.1}% [{:+.1}%, {:+.1}%]{}",
            self.metric,
            self.stat,
            self.a,
            self.b,
            self.change_pct,
            self.ci_pct.0,
            self.ci_pct.1,
            if self.significant() { "  *" } else { "" }
        )
    }
}

fn pct(samples: &[f64], p: f64) -> Option<f64> {
    percentile(samples, p).ok().flatten()
}

fn resample(rng: &mut ChaCha8Rng, v: &[f64], out: &mut Vec<f64>) {
    out.clear();
    out.extend((0..v.len()).map(|_| v[(rng.next_u64() % v.len() as u64) as usize]));
}

/// Every metric present in both runs, at p50 and p99, over completed requests.
pub fn compare(a: &[ClientRecord], b: &[ClientRecord], seed: u64) -> Vec<Change> {
    let oa: Vec<&ClientRecord> = a.iter().filter(|x| x.is_ok()).collect();
    let ob: Vec<&ClientRecord> = b.iter().filter(|x| x.is_ok()).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    let (mut ra, mut rb) = (Vec::new(), Vec::new());
    for m in Metric::all() {
        let (sa, sb) = (m.samples(&oa), m.samples(&ob));
        if sa.is_empty() || sb.is_empty() {
            continue;
        }
        for (stat, p) in [("p50", 50.0), ("p99", 99.0)] {
            let (Some(va), Some(vb)) = (pct(&sa, p), pct(&sb, p)) else { continue };
            if va <= 0.0 {
                continue;
            }
            let mut boots = Vec::with_capacity(RESAMPLES);
            for _ in 0..RESAMPLES {
                resample(&mut rng, &sa, &mut ra);
                resample(&mut rng, &sb, &mut rb);
                if let (Some(x), Some(y)) = (pct(&ra, p), pct(&rb, p)) {
                    if x > 0.0 {
                        boots.push((y - x) / x * 100.0);
                    }
                }
            }
            let lo = pct(&boots, 2.5).unwrap_or(f64::NAN);
            let hi = pct(&boots, 97.5).unwrap_or(f64::NAN);
            out.push(Change {
                metric: m.name(),
                stat,
                a: va,
                b: vb,
                change_pct: (vb - va) / va * 100.0,
                ci_pct: (lo, hi),
            });
        }
    }
    out
}

/// A regression gate: `metric.stat>+X%` fails when B's statistic is more than X% above A's.
#[derive(Debug, Clone, PartialEq)]
pub struct Gate {
    /// Metric name.
    pub metric: String,
    /// `p50` or `p99`.
    pub stat: String,
    /// Largest allowed increase, %.
    pub max_increase_pct: f64,
}

impl FromStr for Gate {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, BenchError> {
        let bad = |why: &str| BenchError::BadGate(format!("{s:?}: {why}; expected e.g. ttft.p99>+10%"));
        let (lhs, rhs) = s.split_once('>').ok_or_else(|| bad("no '>'"))?;
        let (metric, stat) = lhs.trim().split_once('.').ok_or_else(|| bad("no metric.stat"))?;
        if !Metric::all().iter().any(|m| m.name() == metric) {
            return Err(bad(&format!("unknown metric {metric:?}")));
        }
        if stat != "p50" && stat != "p99" {
            return Err(bad("stat must be p50 or p99"));
        }
        let num = rhs.trim().strip_suffix('%').ok_or_else(|| bad("threshold must end with %"))?;
        let max_increase_pct: f64 =
            num.trim_start_matches('+').parse().map_err(|_| bad("threshold is not a number"))?;
        Ok(Gate { metric: metric.to_owned(), stat: stat.to_owned(), max_increase_pct })
    }
}

/// The gates that `changes` violate, as messages. A gate on a metric absent from the runs fails
/// too: a gate that cannot be checked must not pass silently.
pub fn violations(changes: &[Change], gates: &[Gate]) -> Vec<String> {
    gates
        .iter()
        .filter_map(|g| match changes.iter().find(|c| c.metric == g.metric && c.stat == g.stat) {
            None => Some(format!("{}.{}: not present in both runs", g.metric, g.stat)),
            Some(c) if c.change_pct > g.max_increase_pct => Some(format!(
                "{}.{} {:+.1}% exceeds +{}%",
                g.metric, g.stat, c.change_pct, g.max_increase_pct
            )),
            Some(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_timeline::{RequestId, StreamEvent};

    fn run(ttfts_ms: impl Iterator<Item = u64>) -> Vec<ClientRecord> {
        ttfts_ms
            .enumerate()
            .map(|(i, t)| {
                let mut r = ClientRecord::new(RequestId(i as u64), 0, 0, true);
                r.events.push(StreamEvent { at_ns: t * 1_000_000, tokens: 1 });
                r
            })
            .collect()
    }

    #[test]
    fn a_real_shift_is_significant_and_noise_is_not() {
        let a = run((0..400).map(|i| 100 + i % 50));
        let slower = run((0..400).map(|i| 140 + i % 50));
        let same = run((0..400).map(|i| 100 + (i * 7) % 50));
        let c = compare(&a, &slower, 1);
        let ttft = c.iter().find(|c| c.metric == "ttft" && c.stat == "p50").unwrap();
        assert!(ttft.significant() && ttft.change_pct > 25.0, "{ttft}");
        let c = compare(&a, &same, 1);
        let ttft = c.iter().find(|c| c.metric == "ttft" && c.stat == "p50").unwrap();
        assert!(!ttft.significant(), "{ttft}");
    }

    #[test]
    fn gates_parse_and_fire() {
        let g: Gate = "ttft.p99>+10%".parse().unwrap();
        assert_eq!(g.max_increase_pct, 10.0);
        for bad in ["ttft.p99>10", "latency.p99>+1%", "ttft.p95>+1%", "ttft>+1%"] {
            assert!(bad.parse::<Gate>().is_err(), "{bad}");
        }
        let a = run((0..100).map(|_| 100));
        let b = run((0..100).map(|_| 125));
        let changes = compare(&a, &b, 0);
        assert_eq!(violations(&changes, &[g]).len(), 1);
        let loose: Gate = "ttft.p99>+30%".parse().unwrap();
        assert!(violations(&changes, &[loose]).is_empty());
        let absent: Gate = "prefill.p99>+30%".parse().unwrap();
        assert_eq!(violations(&changes, &[absent]).len(), 1);
    }
}
