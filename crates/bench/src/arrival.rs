//! Arrival processes. Send times are precomputed absolute offsets from the run's start, so a slow
//! client never drifts its schedule: lateness shows up as schedule lag (`t_send − t_sched`), and
//! TTFT from the schedule keeps the requests a late client would otherwise hide.

use crate::BenchError;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Duration;

/// When requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Exponential gaps at `rate` requests/s.
    Poisson {
        /// Mean rate, requests/s.
        rate: f64,
    },
    /// Evenly spaced at `rate` requests/s.
    Constant {
        /// Rate, requests/s.
        rate: f64,
    },
    /// Gamma-distributed gaps at mean `rate` requests/s; `cv` is the gaps' coefficient of
    /// variation (1 = Poisson, > 1 = bursty, < 1 = smoother).
    Gamma {
        /// Mean rate, requests/s.
        rate: f64,
        /// Coefficient of variation of the gaps.
        cv: f64,
    },
}

impl Arrival {
    /// Checks the rate.
    pub fn validate(&self) -> Result<(), BenchError> {
        let (Arrival::Poisson { rate } | Arrival::Constant { rate } | Arrival::Gamma { rate, .. }) = *self;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(BenchError::BadArrival(format!(
                "rate {rate} must be a positive number of requests/s"
            )));
        }
        if let Arrival::Gamma { cv, .. } = *self {
            if !(cv.is_finite() && cv > 0.0) {
                return Err(BenchError::BadArrival(format!(
                    "burstiness (cv) {cv} must be a positive number"
                )));
            }
        }
        Ok(())
    }

    /// Offsets from the start of the run for `n` requests; the first is at 0. The rate must be
    /// valid ([`Arrival::validate`]).
    pub fn schedule(&self, n: usize, seed: u64) -> Vec<Duration> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0a77_17a1);
        // shape k = 1/cv², scale θ = 1/(rate·k): mean gap 1/rate, CV cv.
        let gamma = match *self {
            Arrival::Gamma { rate, cv } => {
                let k = 1.0 / (cv * cv);
                rand_distr::Gamma::new(k, 1.0 / (rate * k)).ok()
            }
            _ => None,
        };
        let mut t = 0.0f64;
        (0..n)
            .map(|i| {
                if i > 0 {
                    t += match *self {
                        Arrival::Constant { rate } => 1.0 / rate,
                        Arrival::Poisson { rate } => {
                            // Inverse-CDF of the exponential; u in (0, 1] so ln is finite.
                            let u = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
                            -u.ln() / rate
                        }
                        Arrival::Gamma { rate, .. } => gamma
                            .as_ref()
                            .map_or(1.0 / rate, |g| rand_distr::Distribution::sample(g, &mut rng)),
                    };
                }
                Duration::from_secs_f64(t)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_mean_rate_and_constant_spacing() {
        let s = Arrival::Poisson { rate: 20.0 }.schedule(4001, 3);
        let rate = 4000.0 / s[4000].as_secs_f64();
        assert!((18.0..22.0).contains(&rate), "{rate}");
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        let c = Arrival::Constant { rate: 4.0 }.schedule(3, 0);
        assert_eq!(c, vec![Duration::ZERO, Duration::from_millis(250), Duration::from_millis(500)]);
        assert!(Arrival::Poisson { rate: 0.0 }.validate().is_err());
        assert!(Arrival::Gamma { rate: 1.0, cv: 0.0 }.validate().is_err());
    }

    #[test]
    fn gamma_keeps_the_rate_and_sets_the_burstiness() {
        for cv in [0.5, 1.0, 3.0] {
            let s = Arrival::Gamma { rate: 10.0, cv }.schedule(20_001, 5);
            let gaps: Vec<f64> = s.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
            assert!((mean - 0.1).abs() < 0.01, "cv {cv}: mean gap {mean}");
            assert!((sd / mean - cv).abs() < 0.15 * cv, "cv {cv}: measured {}", sd / mean);
        }
    }
}
