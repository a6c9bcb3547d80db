//! Summary statistics, one definition for every report: count, mean, population std, p50, p90,
//! p95, p99, p99.9 and max. Percentiles interpolate linearly between the closest ranks (numpy's
//! default), so exact summaries agree with what most analysis notebooks compute.

use crate::TimelineError;
use serde::{Deserialize, Serialize};

/// Below this many samples p99.9 is flagged as unreliable: it is then just one of the few largest
/// values, not a tail estimate.
pub const P999_MIN_SAMPLES: u64 = 1000;

/// The summary of one distribution.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Number of samples.
    pub count: u64,
    /// Arithmetic mean.
    pub mean: f64,
    /// Population standard deviation.
    pub std: f64,
    /// Smallest sample.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    #[serde(rename = "p99_9")]
    pub p999: f64,
    /// Largest sample.
    pub max: f64,
    /// True when `count` < [`P999_MIN_SAMPLES`]: p99.9 should not be trusted.
    #[serde(rename = "p99_9_low_samples")]
    pub p999_low_samples: bool,
}

impl Summary {
    /// Exact summary of `samples` (non-finite values are ignored). `None` when there is nothing.
    pub fn from_samples(samples: &[f64]) -> Option<Summary> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        let p = |q: f64| sorted_percentile(&v, q);
        Some(Summary {
            count: v.len() as u64,
            mean,
            std: var.sqrt(),
            min: v[0],
            p50: p(50.0),
            p90: p(90.0),
            p95: p(95.0),
            p99: p(99.0),
            p999: p(99.9),
            max: v[v.len() - 1],
            p999_low_samples: (v.len() as u64) < P999_MIN_SAMPLES,
        })
    }

    /// The value of a named statistic (`count`, `mean`, `std`, `min`, `p50`, `p90`, `p95`, `p99`,
    /// `p99_9`, `max`), for reports and regression gates.
    pub fn get(&self, stat: &str) -> Option<f64> {
        Some(match stat {
            "count" => self.count as f64,
            "mean" => self.mean,
            "std" => self.std,
            "min" => self.min,
            "p50" => self.p50,
            "p90" => self.p90,
            "p95" => self.p95,
            "p99" => self.p99,
            "p99_9" | "p999" => self.p999,
            "max" => self.max,
            _ => return None,
        })
    }
}

/// Percentile `p` (0..=100) of `samples` with linear interpolation between closest ranks.
pub fn percentile(samples: &[f64], p: f64) -> Result<Option<f64>, TimelineError> {
    if !(0.0..=100.0).contains(&p) {
        return Err(TimelineError::BadPercentile(p));
    }
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Ok(None);
    }
    v.sort_by(f64::total_cmp);
    Ok(Some(sorted_percentile(&v, p)))
}

fn sorted_percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    sorted[lo] + (sorted[hi] - sorted[lo]) * frac
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hand_computed_summary() {
        // 1..=10: mean 5.5, population variance 8.25.
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = Summary::from_samples(&v).unwrap();
        assert_eq!(s.count, 10);
        assert_eq!(s.mean, 5.5);
        assert!((s.std - 8.25f64.sqrt()).abs() < 1e-12);
        assert_eq!(s.p50, 5.5); // rank 4.5 between 5 and 6
        assert!((s.p90 - 9.1).abs() < 1e-12); // rank 8.1
        assert!((s.p99 - 9.91).abs() < 1e-12); // rank 8.91
        assert_eq!(s.max, 10.0);
        assert_eq!(s.min, 1.0);
        assert!(s.p999_low_samples);
        assert_eq!(s.get("p99_9"), Some(s.p999));
        assert_eq!(s.get("bogus"), None);
    }

    #[test]
    fn single_sample_and_empty() {
        let s = Summary::from_samples(&[7.0]).unwrap();
        assert_eq!((s.p50, s.p99, s.max, s.std), (7.0, 7.0, 7.0, 0.0));
        assert!(Summary::from_samples(&[]).is_none());
        assert!(Summary::from_samples(&[f64::NAN]).is_none());
    }

    #[test]
    fn p999_is_trusted_from_1000_samples() {
        let v: Vec<f64> = (0..1000).map(f64::from).collect();
        assert!(!Summary::from_samples(&v).unwrap().p999_low_samples);
    }

    #[test]
    fn bad_percentile_is_a_typed_error() {
        assert_eq!(percentile(&[1.0], 101.0), Err(TimelineError::BadPercentile(101.0)));
        assert_eq!(percentile(&[], 50.0), Ok(None));
    }

    proptest! {
        #[test]
        fn percentiles_are_monotone_in_p(
            v in proptest::collection::vec(-1e6f64..1e6, 1..200),
            a in 0.0f64..=100.0, b in 0.0f64..=100.0,
        ) {
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            let pl = percentile(&v, lo).unwrap().unwrap();
            let ph = percentile(&v, hi).unwrap().unwrap();
            prop_assert!(pl <= ph, "p{lo}={pl} > p{hi}={ph}");
            let s = Summary::from_samples(&v).unwrap();
            prop_assert!(s.min <= s.p50 && s.p50 <= s.p90 && s.p90 <= s.p95);
            prop_assert!(s.p95 <= s.p99 && s.p99 <= s.p999 && s.p999 <= s.max);
        }
    }
}
