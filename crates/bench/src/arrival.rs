//! Arrival processes. Send times are precomputed absolute offsets from the run's start, so a slow
//! client never drifts its schedule: lateness shows up as schedule lag (`t_send − t_sched`), and
//! TTFT from the schedule keeps the requests a late client would otherwise hide.
//!
//! A ramp (`--ramp FROM:TO:DURATION`) is a time warp rather than a fourth process: the chosen
//! process (Poisson, constant or gamma) is drawn at unit rate, i.e. in units of expected
//! arrivals, and each point `y` is mapped to the instant `Λ⁻¹(y)` where the ramp's cumulative rate
//! `Λ(t) = FROM·t + (TO − FROM)·t²/(2·DURATION)` reaches it. So burstiness and the rate profile
//! combine freely, the offsets stay absolute, and the ramp's end bounds the run.

use crate::BenchError;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::str::FromStr;
use std::time::Duration;

/// A linear rate ramp from `from` to `to` requests/s over `duration_s` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ramp {
    /// Rate at the start, requests/s (may be 0).
    pub from: f64,
    /// Rate at the end, requests/s.
    pub to: f64,
    /// Length of the ramp, seconds; no request is scheduled after it.
    pub duration_s: f64,
}

impl FromStr for Ramp {
    type Err = BenchError;
    /// `FROM:TO:DURATION`, rates in requests/s, duration in seconds (a trailing `s` allowed).
    fn from_str(s: &str) -> Result<Self, BenchError> {
        let bad = |why: &str| BenchError::BadArrival(format!("ramp {s:?}: {why} (expected FROM:TO:SECONDS)"));
        let parts: Vec<&str> = s.split(':').collect();
        let [from, to, dur] = parts.as_slice() else {
            return Err(bad("three fields needed"));
        };
        let num = |x: &str| {
            x.trim().trim_end_matches('s').parse::<f64>().map_err(|_| bad(&format!("{x:?} is not a number")))
        };
        let ramp = Ramp { from: num(from)?, to: num(to)?, duration_s: num(dur)? };
        ramp.validate()?;
        Ok(ramp)
    }
}

impl Ramp {
    /// Checks the rates and the duration.
    pub fn validate(&self) -> Result<(), BenchError> {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !(ok(self.from) && ok(self.to) && self.from + self.to > 0.0) {
            return Err(BenchError::BadArrival(format!(
                "ramp rates {} → {} must be ≥ 0 and not both 0",
                self.from, self.to
            )));
        }
        if !(self.duration_s.is_finite() && self.duration_s > 0.0) {
            return Err(BenchError::BadArrival(format!(
                "ramp duration {} s must be positive",
                self.duration_s
            )));
        }
        Ok(())
    }

    /// Expected arrivals by `t` seconds: `Λ(t)`, for `0 ≤ t ≤ duration`.
    pub fn cumulative(&self, t: f64) -> f64 {
        let t = t.clamp(0.0, self.duration_s);
        self.from * t + (self.to - self.from) * t * t / (2.0 * self.duration_s)
    }

    /// The instant at which `y` arrivals are expected: `Λ⁻¹(y)`; `None` past the ramp's end.
    pub fn time_of(&self, y: f64) -> Option<f64> {
        if !(0.0..=self.cumulative(self.duration_s)).contains(&y) {
            return None;
        }
        // Root of (to − from)/(2D)·t² + from·t − y = 0 in the form without cancellation:
        // t = 2y / (from + sqrt(from² + 2(to − from)·y/D)); the discriminant is ≥ to² ≥ 0 here.
        let disc = self.from * self.from + 2.0 * (self.to - self.from) * y / self.duration_s;
        let den = self.from + disc.max(0.0).sqrt();
        Some(if den > 0.0 { (2.0 * y / den).min(self.duration_s) } else { 0.0 })
    }
}

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

    /// The same process with another mean rate.
    pub fn with_rate(self, rate: f64) -> Arrival {
        match self {
            Arrival::Poisson { .. } => Arrival::Poisson { rate },
            Arrival::Constant { .. } => Arrival::Constant { rate },
            Arrival::Gamma { cv, .. } => Arrival::Gamma { rate, cv },
        }
    }

    /// The mean rate, requests/s.
    pub fn rate(&self) -> f64 {
        let (Arrival::Poisson { rate } | Arrival::Constant { rate } | Arrival::Gamma { rate, .. }) = *self;
        rate
    }

    /// Offsets from the start of the run for `n` requests; the first is at 0. The rate must be
    /// valid ([`Arrival::validate`]).
    pub fn schedule(&self, n: usize, seed: u64) -> Vec<Duration> {
        let mut gaps = Gaps::new(*self, seed);
        let mut t = 0.0f64;
        (0..n)
            .map(|i| {
                if i > 0 {
                    t += gaps.next_gap();
                }
                Duration::from_secs_f64(t)
            })
            .collect()
    }

    /// Offsets bounded by both `max` requests and, when given, `duration` (offsets `< duration`);
    /// with a `ramp` the process is drawn at unit rate and warped through the ramp (its own rate
    /// is ignored) and the ramp's end bounds the schedule too. Non-decreasing, the first at 0.
    pub fn plan(
        &self,
        ramp: Option<&Ramp>,
        max: usize,
        duration: Option<Duration>,
        seed: u64,
    ) -> Result<Vec<Duration>, BenchError> {
        let mut out = Vec::new();
        let limit = duration.map_or(f64::INFINITY, |d| d.as_secs_f64());
        match ramp {
            None => {
                self.validate()?;
                if duration.is_none() {
                    return Ok(self.schedule(max, seed));
                }
                let mut gaps = Gaps::new(*self, seed);
                let mut t = 0.0f64;
                while out.len() < max && t < limit {
                    out.push(Duration::from_secs_f64(t));
                    t += gaps.next_gap();
                }
            }
            Some(r) => {
                r.validate()?;
                let unit = self.with_rate(1.0);
                unit.validate()?;
                let mut gaps = Gaps::new(unit, seed);
                // A ramp starting at 0 req/s: the first arrival is one expected arrival in.
                let mut y = if r.from > 0.0 { 0.0 } else { gaps.next_gap() };
                while out.len() < max {
                    let Some(t) = r.time_of(y) else { break };
                    if t >= limit {
                        break;
                    }
                    out.push(Duration::from_secs_f64(t));
                    y += gaps.next_gap();
                }
            }
        }
        Ok(out)
    }
}

/// Successive gaps of an arrival process, seconds.
struct Gaps {
    arrival: Arrival,
    rng: ChaCha8Rng,
    gamma: Option<rand_distr::Gamma<f64>>,
}

impl Gaps {
    fn new(arrival: Arrival, seed: u64) -> Gaps {
        // shape k = 1/cv², scale θ = 1/(rate·k): mean gap 1/rate, CV cv.
        let gamma = match arrival {
            Arrival::Gamma { rate, cv } => {
                let k = 1.0 / (cv * cv);
                rand_distr::Gamma::new(k, 1.0 / (rate * k)).ok()
            }
            _ => None,
        };
        Gaps { arrival, rng: ChaCha8Rng::seed_from_u64(seed ^ 0x0a77_17a1), gamma }
    }

    fn next_gap(&mut self) -> f64 {
        match self.arrival {
            Arrival::Constant { rate } => 1.0 / rate,
            Arrival::Poisson { rate } => {
                // Inverse-CDF of the exponential; u in (0, 1] so ln is finite.
                let u = ((self.rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
                -u.ln() / rate
            }
            Arrival::Gamma { rate, .. } => {
                self.gamma.as_ref().map_or(1.0 / rate, |g| rand_distr::Distribution::sample(g, &mut self.rng))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ramp_inverts_its_cumulative_rate() {
        let r: Ramp = "2:10:8s".parse().unwrap();
        assert_eq!(r, Ramp { from: 2.0, to: 10.0, duration_s: 8.0 });
        for t in [0.0, 0.5, 3.0, 7.99, 8.0] {
            let back = r.time_of(r.cumulative(t)).unwrap();
            assert!((back - t).abs() < 1e-9, "{t} -> {back}");
        }
        assert!(r.time_of(r.cumulative(8.0) + 0.1).is_none());
        // Constant arrivals through the ramp: exactly floor(Λ(D)) + 1 points, the rate climbing.
        let s = Arrival::Constant { rate: 99.0 }.plan(Some(&r), 10_000, None, 0).unwrap();
        assert_eq!(s.len(), 49, "Λ(8) = 48 expected arrivals");
        let first: f64 = (s[1] - s[0]).as_secs_f64();
        let last: f64 = (s[48] - s[47]).as_secs_f64();
        assert!(first > 0.3 && last < 0.11, "gaps {first} then {last}");
        // Down-ramps and ramps from zero work too.
        let down =
            Arrival::Poisson { rate: 1.0 }.plan(Some(&"10:0:5".parse().unwrap()), 10_000, None, 1).unwrap();
        assert!(down.last().unwrap().as_secs_f64() <= 5.0);
        assert!(
            Arrival::Poisson { rate: 1.0 }.plan(Some(&"0:20:3".parse().unwrap()), 10, None, 1).unwrap().len()
                == 10
        );
        for bad in ["1:2", "0:0:5", "1:2:0", "-1:2:3", "a:2:3"] {
            assert!(bad.parse::<Ramp>().is_err(), "{bad}");
        }
    }

    #[test]
    fn duration_bounds_the_schedule() {
        let s = Arrival::Constant { rate: 10.0 }.plan(None, 1000, Some(Duration::from_secs(2)), 0).unwrap();
        assert_eq!(s.len(), 20);
        assert!(s.iter().all(|t| *t < Duration::from_secs(2)));
        let capped = Arrival::Constant { rate: 10.0 }.plan(None, 5, Some(Duration::from_secs(2)), 0).unwrap();
        assert_eq!(capped.len(), 5);
        // Without a duration the plan is exactly the count-bounded schedule.
        let p = Arrival::Poisson { rate: 7.0 };
        assert_eq!(p.plan(None, 50, None, 9).unwrap(), p.schedule(50, 9));
    }

    proptest! {
        #[test]
        fn plans_are_monotone_bounded_and_seeded(
            kind in 0u8..3, rate in 0.1f64..500.0, cv in 0.2f64..4.0, max in 0usize..300,
            dur in proptest::option::of(0.01f64..20.0), ramp in proptest::option::of((0.0f64..50.0, 0.0f64..50.0, 0.1f64..20.0)),
            seed in any::<u64>(),
        ) {
            let a = match kind { 0 => Arrival::Poisson { rate }, 1 => Arrival::Constant { rate }, _ => Arrival::Gamma { rate, cv } };
            let ramp = ramp.map(|(from, to, duration_s)| Ramp { from, to: to + 0.01, duration_s });
            let d = dur.map(Duration::from_secs_f64);
            let s = a.plan(ramp.as_ref(), max, d, seed).unwrap();
            prop_assert!(s.len() <= max);
            prop_assert!(s.windows(2).all(|w| w[0] <= w[1]));
            if let Some(d) = d { prop_assert!(s.iter().all(|t| *t < d)); }
            if let Some(r) = ramp { prop_assert!(s.iter().all(|t| t.as_secs_f64() <= r.duration_s + 1e-9)); }
            prop_assert_eq!(&s, &a.plan(ramp.as_ref(), max, d, seed).unwrap());
        }
    }

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
