//! `--find-max-rate`: the highest offered rate whose SLO attainment meets a target. Each probe is
//! an ordinary open-loop run (the same [`run`] and [`Report`] code as a single bench, so a probe
//! means exactly what a run at that rate means), bounded by the base config's count and duration.
//! The search grows the rate geometrically (×2) from the start until a probe fails (or shrinks it
//! ÷2 until one passes), then bisects between the best pass and the lowest fail until they are
//! within a relative tolerance or the probe budget is spent; the answer is the best rate that
//! passed, never an interpolation. Attainment is noisy near the knee, so the answer is a bracket
//! reported with every probe, not a precise capacity figure.

use crate::report::{Report, ReportOptions};
use crate::run::{run, Progress, RunConfig};
use crate::BenchError;
use serde::{Deserialize, Serialize};
use tokenpath_timeline::{ClientRecord, SloSpec};

/// How to search.
#[derive(Debug, Clone)]
pub struct SearchConfig {
    /// First rate tried, requests/s.
    pub start_rate: f64,
    /// Fraction of requests (0..=1) that must meet every SLO.
    pub attainment: f64,
    /// The SLOs.
    pub slo: SloSpec,
    /// Most probes (runs) in the whole search.
    pub max_probes: usize,
    /// Stop bisecting when the failing rate is within this fraction above the passing one.
    pub tolerance: f64,
    /// Warm-up and cool-down of each probe's report (its SLO is replaced by `slo`).
    pub report: ReportOptions,
}

/// One probe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// Offered rate, requests/s.
    pub rate: f64,
    /// Fraction meeting every SLO.
    pub attainment: f64,
    /// Good requests/s.
    pub goodput_rps: f64,
    /// Achieved send rate, requests/s.
    pub achieved_send_rps: f64,
    /// Requests in the probe's window.
    pub requests: u64,
    /// Of which failed.
    pub failed: u64,
    /// Whether the attainment met the target.
    pub passed: bool,
}

/// What the search found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// The SLOs, as written.
    pub slo: String,
    /// The attainment target.
    pub target_attainment: f64,
    /// Every probe, in the order run.
    pub probes: Vec<Probe>,
    /// The highest rate that passed (`None`: none did).
    pub max_rate: Option<f64>,
    /// The lowest rate that failed above it (`None`: none did; the answer is a lower bound).
    pub first_failing_rate: Option<f64>,
}

/// Lowest rate the search goes down to before giving up, requests/s.
pub const MIN_RATE: f64 = 1e-3;
/// Highest rate the search goes up to, requests/s.
pub const MAX_RATE: f64 = 1e6;

impl SearchConfig {
    fn validate(&self) -> Result<(), BenchError> {
        let bad = |s: &str| Err(BenchError::BadSearch(s.to_owned()));
        if !(self.start_rate.is_finite() && (MIN_RATE..=MAX_RATE).contains(&self.start_rate)) {
            return bad("the start rate must be within 0.001..=1e6 requests/s");
        }
        if !(0.0..=1.0).contains(&self.attainment) || self.attainment.is_nan() {
            return bad("the attainment target must be within 0..=1");
        }
        if self.max_probes == 0 || self.max_probes > 64 {
            return bad("the probe budget must be within 1..=64");
        }
        if !(self.tolerance.is_finite() && self.tolerance > 0.0) {
            return bad("the tolerance must be positive");
        }
        Ok(())
    }

    /// The search sets the offered rate: a run whose rate is set otherwise cannot be searched.
    pub fn check_base(base: &RunConfig) -> Result<(), BenchError> {
        if base.concurrency.is_some() || base.ramp.is_some() || base.workload.schedule().is_some() {
            return Err(BenchError::BadSearch(
                "the search sets the offered rate: not with --concurrency, --ramp or a trace workload".into(),
            ));
        }
        Ok(())
    }
}

/// The next rate to probe, or `None` when the search is done. `pass` is the highest passing rate
/// so far, `fail` the lowest failing one above it.
fn next_rate(last: f64, pass: Option<f64>, fail: Option<f64>, tolerance: f64) -> Option<f64> {
    match (pass, fail) {
        (_, None) => (last < MAX_RATE).then(|| (last * 2.0).min(MAX_RATE)),
        (None, Some(_)) => (last > MIN_RATE).then(|| (last / 2.0).max(MIN_RATE)),
        (Some(p), Some(f)) => (f > p * (1.0 + tolerance)).then(|| (p + f) / 2.0),
    }
}

/// The workload seed of probe `index` (from 0) of a search whose run has seed `base`: the first
/// probe is the run itself, every later one sends other prompts. (Regression: every probe once
/// sent the same prompts, so a server's prefix cache served each probe after the first from
/// cache and a 2-core CPU server "passed" 4.8 req/s where its cold capacity is ~0.2.)
pub fn probe_seed(base: u64, index: usize) -> u64 {
    base.wrapping_add((index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// The search itself, without the runs: the rate to probe next, each probe's records in, the
/// bracket out. The bench drives it with real runs ([`find_max_rate`]) and the simulator with
/// simulated ones, so "capacity" means the same search on both.
#[derive(Debug)]
pub struct Search {
    cfg: SearchConfig,
    opts: ReportOptions,
    probes: Vec<Probe>,
    pass: Option<f64>,
    fail: Option<f64>,
    next: Option<f64>,
}

impl Search {
    /// A search starting at `cfg.start_rate`.
    pub fn new(cfg: SearchConfig) -> Result<Self, BenchError> {
        cfg.validate()?;
        let opts = ReportOptions { slo: Some(cfg.slo.clone()), ..cfg.report.clone() };
        let next = Some(cfg.start_rate);
        Ok(Self { cfg, opts, probes: Vec::new(), pass: None, fail: None, next })
    }

    /// The rate to probe next; `None` when the bracket is tight or the probe budget is spent.
    pub fn next_rate(&self) -> Option<f64> {
        self.next.filter(|_| self.probes.len() < self.cfg.max_probes)
    }

    /// The workload seed of the next probe, for a run whose seed is `base` ([`probe_seed`]).
    pub fn next_seed(&self, base: u64) -> u64 {
        probe_seed(base, self.probes.len())
    }

    /// The records of a probe at [`Search::next_rate`].
    pub fn record(&mut self, records: &[ClientRecord]) -> Result<&Probe, BenchError> {
        let rate = self.next.ok_or_else(|| BenchError::BadSearch("the search is over".into()))?;
        let report = Report::build(records, &self.opts)?;
        let good = report.goodput.as_ref();
        let attainment = good.map_or(0.0, |g| g.attainment);
        let probe = Probe {
            rate,
            attainment,
            goodput_rps: good.map_or(0.0, |g| g.goodput_rps),
            achieved_send_rps: report.summary.throughput.achieved_send_rps,
            requests: report.summary.requests,
            failed: report.summary.failed,
            passed: attainment >= self.cfg.attainment,
        };
        if probe.passed {
            self.pass = Some(self.pass.map_or(rate, |p: f64| p.max(rate)));
            // A noisy pass above a known fail moves the fail up: keep the bracket ordered.
            if self.fail.is_some_and(|f| f <= rate) {
                self.fail = None;
            }
        } else if self.fail.is_none_or(|f| rate < f) && self.pass.is_none_or(|p| rate > p) {
            self.fail = Some(rate);
        }
        self.next = next_rate(rate, self.pass, self.fail, self.cfg.tolerance);
        self.probes.push(probe);
        Ok(self.probes.last().expect("just pushed"))
    }

    /// The search's answer.
    pub fn finish(self) -> SearchResult {
        SearchResult {
            slo: self.cfg.slo.to_string(),
            target_attainment: self.cfg.attainment,
            probes: self.probes,
            max_rate: self.pass,
            first_failing_rate: self.fail,
        }
    }
}

/// Probes rates with `base` (its arrival process's shape, workload, count and duration), calling
/// `on_probe` after each; `progress` sees every request of every probe.
pub async fn find_max_rate(
    base: &RunConfig,
    cfg: &SearchConfig,
    progress: Progress<'_>,
    on_probe: &mut (dyn FnMut(&Probe) + Send),
) -> Result<SearchResult, BenchError> {
    SearchConfig::check_base(base)?;
    let mut search = Search::new(cfg.clone())?;
    while let Some(rate) = search.next_rate() {
        let seed = search.next_seed(base.seed);
        let probe_cfg = RunConfig { arrival: base.arrival.with_rate(rate), seed, ..base.clone() };
        let records: Vec<ClientRecord> = run(&probe_cfg, &mut *progress).await?;
        on_probe(search.record(&records)?);
    }
    Ok(search.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search's steps against a server whose capacity is a known threshold.
    fn simulate(capacity: f64, start: f64, budget: usize) -> (Option<f64>, Option<f64>, usize) {
        let (mut pass, mut fail, mut rate, mut n) = (None, None, start, 0);
        while n < budget {
            n += 1;
            if rate <= capacity {
                pass = Some(pass.map_or(rate, |p: f64| p.max(rate)));
            } else {
                fail = Some(rate);
            }
            match next_rate(rate, pass, fail, 0.1) {
                Some(r) => rate = r,
                None => break,
            }
        }
        (pass, fail, n)
    }

    /// Regression (see [`probe_seed`]): probes after the first send other prompts, so a
    /// server's prefix cache cannot carry one probe into the next.
    #[test]
    fn each_probe_sends_other_prompts() {
        let w: crate::workload::Workload = "agent-longtail".parse().unwrap();
        let prompts = |i: usize| -> Vec<String> {
            w.requests_with(8, probe_seed(7, i), None).into_iter().map(|r| r.prompt).collect()
        };
        assert_eq!(probe_seed(7, 0), 7, "the first probe is the run itself");
        let (a, b, c) = (prompts(0), prompts(1), prompts(2));
        assert!(a.iter().all(|p| !b.contains(p)) && b.iter().all(|p| !c.contains(p)), "{a:?}\n{b:?}");
    }

    #[test]
    fn brackets_the_capacity_within_the_budget() {
        for (cap, start) in [(37.0, 1.0), (37.0, 1000.0), (0.5, 4.0), (5.0, 5.0)] {
            let (pass, fail, n) = simulate(cap, start, 20);
            let (p, f) = (pass.unwrap_or(0.0), fail.unwrap_or(f64::INFINITY));
            assert!(p <= cap && cap < f, "cap {cap} from {start}: [{p}, {f}]");
            assert!(f <= p * 1.1 + 1e-12, "cap {cap} from {start}: [{p}, {f}] after {n}");
            assert!(n <= 20);
        }
        // A tiny budget stops early, with whatever bracket it has.
        assert_eq!(simulate(37.0, 1.0, 2).2, 2);
        // Always-passing servers stop at the ceiling; never-passing ones at the floor.
        assert!(simulate(f64::INFINITY, 1.0, 64).1.is_none());
        assert!(simulate(0.0, 1.0, 64).0.is_none());
    }
}
