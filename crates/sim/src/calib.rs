//! The calibration: how long a step takes on one machine, model file and numerics, fitted from a
//! real worker's step log (`--step-log`), and what happens between steps.
//!
//! A step's time is a few roofline-shaped terms — a constant (the weights read once per step),
//! per row, per prompt token, per decode token, per attention pair of prefill and of decode, and
//! the square of a step's prompt tokens (a longer chunk's activations spill out of cache) —
//! fitted with non-negative least absolute relative error (a 5 ms decode step counts as much as
//! a 900 ms prefill, and the point is the typical step, not a mean pulled up by a noisy tail:
//! iteratively reweighted non-negative least squares). The model's point prediction is then
//! multiplied by a residual drawn from the fit's own residuals (per kind of step), so a
//! simulated mean and P99 come from the measured spread rather than from an assumption. The gap between two busy steps (sampling, streaming,
//! planning: what simulators forget) is fitted and sampled the same way.

use crate::nnls::nnls;
use crate::SimError;
use rand_chacha::rand_core::RngCore;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tokenpath_protocol::work::StepRecord;

/// The step terms, in coefficient order. `prefill_tokens_sq_k` is (prompt tokens)² / 1000: a
/// prefill chunk's activations outgrow the core's cache as the chunk grows, so a prompt token
/// costs more in a longer chunk (pre-registered for the fourth validation round, docs/sim.md).
/// `rows_past_knee` is the rows beyond [`Calibration::knee_rows`]: a roofline's knee, where a
/// step stops being bound by reading the weights once and each further row adds its compute.
pub const STEP_TERMS: [&str; 8] = [
    "constant",
    "rows",
    "prefill_tokens",
    "decode_tokens",
    "prefill_pairs",
    "decode_pairs",
    "prefill_tokens_sq_k",
    "rows_past_knee",
];
/// The knees the fit tries (rows), keeping the one with the least median error.
const KNEES: [usize; 12] = [0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24];
/// The gap terms, in coefficient order.
pub const GAP_TERMS: [&str; 2] = ["constant", "rows"];
/// Quantiles kept of each residual distribution.
const QUANTILES: usize = 101;
/// Reweighting rounds of the least-absolute-error fit.
const IRLS_ROUNDS: usize = 30;
/// The calibration format's version.
pub const VERSION: u32 = 2;

/// What one step does: the model's inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// Sequences fed.
    pub rows: usize,
    /// Prompt tokens fed.
    pub prefill_tokens: usize,
    /// Decoding sequences fed.
    pub decode_tokens: usize,
    /// Attention pairs of the prompt tokens.
    pub prefill_pairs: u64,
    /// Attention pairs of the decode tokens.
    pub decode_pairs: u64,
}

impl StepShape {
    fn terms(&self, knee: usize) -> Vec<f64> {
        vec![
            1.0,
            self.rows as f64,
            self.prefill_tokens as f64,
            self.decode_tokens as f64,
            self.prefill_pairs as f64,
            self.decode_pairs as f64,
            (self.prefill_tokens as f64).powi(2) / 1000.0,
            self.rows.saturating_sub(knee) as f64,
        ]
    }

    /// The residual bin: steps with prompt tokens, and decode-only steps.
    fn bin(&self) -> usize {
        usize::from(self.prefill_tokens == 0)
    }

    /// The shape a logged step had.
    pub fn of(r: &StepRecord) -> Self {
        let decode_pairs = r.decode_pairs.min(r.attn_pairs);
        Self {
            rows: r.rows,
            prefill_tokens: r.prefill_tokens,
            decode_tokens: r.decode_tokens,
            prefill_pairs: r.attn_pairs - decode_pairs,
            decode_pairs,
        }
    }
}

/// A linear model in µs with its residual ratios (measured / predicted) per bin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Linear {
    /// Term names.
    pub terms: Vec<String>,
    /// µs per unit of each term.
    pub coef_us: Vec<f64>,
    /// Residual ratio quantiles (p0..p100) per bin; an empty bin predicts the point value.
    pub residuals: Vec<Vec<f64>>,
}

impl Linear {
    fn point(&self, x: &[f64]) -> f64 {
        dot(&self.coef_us, x).max(0.0)
    }

    fn sample(&self, x: &[f64], bin: usize, rng: &mut ChaCha8Rng) -> f64 {
        let p = self.point(x);
        match self.residuals.get(bin).filter(|q| q.len() >= 2) {
            Some(q) => p * draw(q, rng),
            None => p,
        }
    }
}

/// A quantile table sampled by inverse transform (linear between quantiles).
fn draw(q: &[f64], rng: &mut ChaCha8Rng) -> f64 {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let pos = u * (q.len() - 1) as f64;
    let i = (pos.floor() as usize).min(q.len() - 2);
    let f = pos - i as f64;
    q[i] + (q[i + 1] - q[i]) * f
}

/// The `pct`-th percentile of a [`quantiles`] table (0 when it is empty).
fn pct(q: &[f64], pct: usize) -> f64 {
    q.get(pct * (QUANTILES - 1) / 100).copied().unwrap_or(0.0)
}

fn quantiles(mut v: Vec<f64>) -> Vec<f64> {
    if v.is_empty() {
        return Vec::new();
    }
    v.sort_by(f64::total_cmp);
    (0..QUANTILES)
        .map(|k| {
            let pos = k as f64 / (QUANTILES - 1) as f64 * (v.len() - 1) as f64;
            let i = pos.floor() as usize;
            let j = (i + 1).min(v.len() - 1);
            v[i] + (v[j] - v[i]) * (pos - i as f64)
        })
        .collect()
}

/// The KV transfer between a prefill and a decode worker: a latency plus bytes over a link that
/// transfers to one decode worker share.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Fixed cost of a transfer's last chunk, µs.
    pub latency_us: f64,
    /// Bytes per second of the link into a decode worker.
    pub bytes_per_s: f64,
}

/// Where a calibration came from: it is valid for this machine, model file and numerics only.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// The CPU (or accelerator) it was measured on.
    pub machine: String,
    /// The model file.
    pub model: String,
    /// Anything else the reader should know (kernel path, numerics, threads).
    pub notes: Vec<String>,
}

/// How well the step model fits the steps it was fitted on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FitQuality {
    /// Steps fitted.
    pub steps: usize,
    /// Busy gaps fitted.
    pub gaps: usize,
    /// Median absolute percentage error of the point prediction, %.
    pub median_ape: f64,
    /// 90th percentile of it, %.
    pub p90_ape: f64,
    /// How much steps of one shape scatter on the same log ([`noise_floor`]).
    #[serde(default)]
    pub noise: Noise,
}

/// A fit whose error on its own steps passes this many times their noise floor is not trusted.
pub const DISTRUST_RATIO: f64 = 2.0;

impl FitQuality {
    /// Why this fit should not be used, if it should not: its error on the very steps it was
    /// fitted on is more than [`DISTRUST_RATIO`] times their noise floor, which happens when the
    /// machine's speed moved while the log was written (a neighbour on a shared host, a build) so
    /// that one part of the log ran slower than another doing the same work. Such a calibration
    /// predicts neither part: measured here, one whose training log ran 2× slow in its second half
    /// (16.8% against a 7.3% floor) was 22–26% off on every held-out cell; the healthy fits on this
    /// machine sit at 1.0–1.5× their floor.
    pub fn distrust(&self) -> Option<String> {
        let floor = self.noise.median_ape;
        (floor > 0.0 && self.median_ape > DISTRUST_RATIO * floor).then(|| {
            format!(
                "the step model's median error on its own steps ({:.1}%) is {:.1}× their noise floor ({:.1}%): \
                 the machine's speed probably changed while the log was written; measure again on a quiet machine",
                self.median_ape,
                self.median_ape / floor,
                floor
            )
        })
    }
}

/// The scatter of steps that did the same work: each step's absolute percentage distance from
/// the median of the steps of its shape (same rows, prompt tokens within 32, decode rows,
/// context within 64 tokens per row; shapes seen at least 3 times). No point prediction of a
/// step's time does better than this on the same steps, so a model's error is read against it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Noise {
    /// Steps in shapes seen at least 3 times.
    pub steps: usize,
    /// Median of the distances, %.
    pub median_ape: f64,
    /// 90th percentile of them, %.
    pub p90_ape: f64,
}

/// [`Noise`] of a log's steps.
pub fn noise_floor(steps: &[&StepRecord]) -> Noise {
    let mut shapes: std::collections::BTreeMap<(usize, usize, usize, u64), Vec<f64>> = Default::default();
    for r in steps.iter().filter(|r| r.rows > 0) {
        let s = StepShape::of(r);
        let key = (s.rows, s.prefill_tokens / 32, s.decode_tokens, s.decode_pairs / (64 * s.rows as u64));
        shapes.entry(key).or_default().push(r.dur_us as f64);
    }
    let mut ape = Vec::new();
    for v in shapes.values_mut().filter(|v| v.len() >= 3) {
        v.sort_by(f64::total_cmp);
        let m = v[v.len() / 2].max(1.0);
        ape.extend(v.iter().map(|x| 100.0 * (x - m).abs() / m));
    }
    let n = ape.len();
    let q = quantiles(ape);
    Noise { steps: n, median_ape: pct(&q, 50), p90_ape: pct(&q, 90) }
}

/// How a calibration predicts steps it was not fitted on: its error next to those steps' own
/// noise floor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Steps scored.
    pub steps: usize,
    /// Median absolute percentage error of the point prediction, %.
    pub median_ape: f64,
    /// 90th percentile of it, %.
    pub p90_ape: f64,
    /// Median signed error ((predicted − measured) / measured), %: a model too fast is negative.
    pub median_signed: f64,
    /// The same steps' scatter among themselves.
    pub noise: Noise,
}

/// The coefficients minimising Σ |aᵢ·x − yᵢ| / yᵢ with x ≥ 0: non-negative least squares on
/// relative error, reweighted by each step's last error.
fn least_relative_error(x: &[Vec<f64>], y: &[f64]) -> Result<Vec<f64>, SimError> {
    let fail = || SimError::Calibration("the step fit failed".into());
    let w: Vec<f64> = y.iter().map(|v| 1.0 / v.max(100.0).powi(2)).collect();
    let mut coef = nnls(x, y, &w).ok_or_else(fail)?;
    for _ in 0..IRLS_ROUNDS {
        let w: Vec<f64> = x
            .iter()
            .zip(y)
            .map(|(xi, yi)| {
                let p = dot(&coef, xi);
                let yi = yi.max(100.0);
                1.0 / (yi * yi * ((p - yi).abs() / yi).max(0.005))
            })
            .collect();
        coef = nnls(x, y, &w).ok_or_else(fail)?;
    }
    Ok(coef)
}

/// A machine's calibration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Format version ([`VERSION`]).
    pub version: u32,
    /// What it is valid for.
    pub provenance: Provenance,
    /// Step duration.
    pub step: Linear,
    /// Gap between busy steps, by the rows of the step before.
    pub gap: Linear,
    /// Time from a request's arrival to its admission (gateway: parse, tokenize), µs.
    pub gateway_us: f64,
    /// KV bytes per token (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// The KV transfer.
    pub link: LinkModel,
    /// The fit's quality on its own steps.
    pub fit: FitQuality,
    /// Rows up to which a step costs one read of the weights (see [`STEP_TERMS`]).
    #[serde(default)]
    pub knee_rows: usize,
}

impl Calibration {
    /// Fits a calibration to the steps of one or more step logs (each log's steps in order).
    pub fn fit(
        logs: &[Vec<StepRecord>],
        provenance: Provenance,
        kv_bytes_per_token: u64,
        link: LinkModel,
    ) -> Result<Self, SimError> {
        let steps: Vec<&StepRecord> = logs.iter().flatten().filter(|r| r.rows > 0).collect();
        if steps.len() < STEP_TERMS.len() * 4 {
            return Err(SimError::Calibration(format!(
                "{} steps are too few to fit {} terms (run more load with --step-log)",
                steps.len(),
                STEP_TERMS.len()
            )));
        }
        let shapes: Vec<StepShape> = steps.iter().map(|r| StepShape::of(r)).collect();
        let y: Vec<f64> = steps.iter().map(|r| r.dur_us as f64).collect();
        // The knee: each candidate fitted, the least median relative error kept (ties: the
        // lower knee).
        let mut best: Option<(f64, usize, Vec<f64>)> = None;
        for knee in KNEES {
            let x: Vec<Vec<f64>> = shapes.iter().map(|s| s.terms(knee)).collect();
            let coef = least_relative_error(&x, &y)?;
            let ape = x.iter().zip(&y).map(|(xi, yi)| (dot(&coef, xi) - yi).abs() / yi.max(1.0)).collect();
            let median = pct(&quantiles(ape), 50);
            if best.as_ref().is_none_or(|b| median < b.0) {
                best = Some((median, knee, coef));
            }
        }
        let Some((_, knee_rows, coef)) = best else {
            return Err(SimError::Calibration("no knee could be fitted".into()));
        };
        let x: Vec<Vec<f64>> = shapes.iter().map(|s| s.terms(knee_rows)).collect();
        let mut step = Linear { terms: names(&STEP_TERMS), coef_us: coef, residuals: Vec::new() };
        let mut bins = vec![Vec::new(), Vec::new()];
        for ((xi, yi), s) in x.iter().zip(&y).zip(&shapes) {
            let p = step.point(xi);
            if p > 0.0 {
                bins[s.bin()].push(yi / p);
            }
        }
        step.residuals = bins.into_iter().map(quantiles).collect();
        // Busy gaps: the previous step left sequences running, and the gap is not idle time.
        let mut gx = Vec::new();
        let mut gy = Vec::new();
        for log in logs {
            for pair in log.windows(2) {
                let (prev, cur) = (&pair[0], &pair[1]);
                if let Some(g) = cur.gap_us.filter(|_| prev.running > 0 && prev.rows > 0 && cur.rows > 0) {
                    gx.push(vec![1.0, prev.rows as f64]);
                    gy.push(g as f64);
                }
            }
        }
        // Gaps far past the typical one are idle waits (every sequence paused or finished).
        let median = pct(&quantiles(gy.clone()), 50);
        let keep: Vec<usize> = (0..gy.len()).filter(|&i| gy[i] <= (median * 20.0).max(20_000.0)).collect();
        let gx: Vec<Vec<f64>> = keep.iter().map(|&i| gx[i].clone()).collect();
        let gy: Vec<f64> = keep.iter().map(|&i| gy[i]).collect();
        let mut gap =
            Linear { terms: names(&GAP_TERMS), coef_us: vec![0.0; GAP_TERMS.len()], residuals: Vec::new() };
        if gx.len() >= 8 {
            let gw: Vec<f64> = gy.iter().map(|v| 1.0 / v.max(10.0).powi(2)).collect();
            gap.coef_us = nnls(&gx, &gy, &gw).unwrap_or(gap.coef_us);
            let ratios: Vec<f64> = gx
                .iter()
                .zip(&gy)
                .filter_map(|(x, y)| Some(y / Some(gap.point(x)).filter(|p| *p > 0.0)?))
                .collect();
            gap.residuals = vec![quantiles(ratios)];
        }
        let mut calib = Self {
            version: VERSION,
            provenance,
            step,
            gap,
            gateway_us: 300.0,
            kv_bytes_per_token,
            link,
            fit: FitQuality::default(),
            knee_rows,
        };
        // The fit's quality is its score on its own steps.
        let own = calib.score_of(&steps);
        calib.fit = FitQuality {
            steps: own.steps,
            gaps: gy.len(),
            median_ape: own.median_ape,
            p90_ape: own.p90_ape,
            noise: own.noise,
        };
        Ok(calib)
    }

    /// Reads and checks a calibration file.
    pub fn load(path: &std::path::Path) -> Result<Self, SimError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| SimError::Calibration(format!("cannot read {}: {e}", path.display())))?;
        let c: Calibration = serde_json::from_str(&text)
            .map_err(|e| SimError::Calibration(format!("{}: {e}", path.display())))?;
        c.check()?;
        Ok(c)
    }

    /// Refuses a calibration the simulator cannot use.
    pub fn check(&self) -> Result<(), SimError> {
        let bad = |m: String| Err(SimError::Calibration(m));
        if self.version != VERSION {
            return bad(format!("calibration version {} (this build reads {VERSION})", self.version));
        }
        if self.step.coef_us.len() != STEP_TERMS.len() || self.gap.coef_us.len() != GAP_TERMS.len() {
            return bad("calibration terms do not match this build's step model".into());
        }
        let all =
            self.step.coef_us.iter().chain(&self.gap.coef_us).chain(self.step.residuals.iter().flatten());
        if all.chain(self.gap.residuals.iter().flatten()).any(|v| !v.is_finite() || *v < 0.0) {
            return bad("calibration has a negative or non-finite coefficient".into());
        }
        if !(self.link.bytes_per_s.is_finite() && self.link.bytes_per_s > 0.0 && self.link.latency_us >= 0.0)
        {
            return bad("calibration link needs a positive bandwidth".into());
        }
        if !(self.gateway_us.is_finite() && self.gateway_us >= 0.0) {
            return bad("calibration gateway time must be non-negative".into());
        }
        Ok(())
    }

    /// This calibration's step model on another log's steps.
    pub fn score(&self, steps: &[StepRecord]) -> Score {
        self.score_of(&steps.iter().collect::<Vec<_>>())
    }

    fn score_of(&self, steps: &[&StepRecord]) -> Score {
        let steps: Vec<&StepRecord> = steps.iter().copied().filter(|r| r.rows > 0).collect();
        let (mut ape, mut signed) = (Vec::new(), Vec::new());
        for r in &steps {
            let (p, y) = (self.step_point_us(&StepShape::of(r)), (r.dur_us as f64).max(1.0));
            ape.push(100.0 * (p - y).abs() / y);
            signed.push(100.0 * (p - y) / y);
        }
        let (ape, signed) = (quantiles(ape), quantiles(signed));
        Score {
            steps: steps.len(),
            median_ape: pct(&ape, 50),
            p90_ape: pct(&ape, 90),
            median_signed: pct(&signed, 50),
            noise: noise_floor(&steps),
        }
    }

    /// This calibration on a machine `factor` times as slow (every step and gap price times
    /// `factor`; the residual ratios, being ratios, unchanged): the same machine measured at
    /// another minute by a fixed probe (`scripts/validate-sim --probe`). Errors unless `factor`
    /// is positive and finite.
    pub fn scaled(mut self, factor: f64) -> Result<Self, SimError> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(SimError::Calibration(format!("a step scale must be positive, not {factor}")));
        }
        self.step.coef_us.iter_mut().chain(self.gap.coef_us.iter_mut()).for_each(|c| *c *= factor);
        Ok(self)
    }

    /// A step's point prediction, µs.
    pub fn step_point_us(&self, s: &StepShape) -> f64 {
        self.step.point(&s.terms(self.knee_rows))
    }

    /// A step's duration drawn with its residual, µs.
    pub fn step_us(&self, s: &StepShape, rng: &mut ChaCha8Rng) -> f64 {
        self.step.sample(&s.terms(self.knee_rows), s.bin(), rng)
    }

    /// The gap after a busy step of `rows` rows, µs.
    pub fn gap_us(&self, rows: usize, rng: &mut ChaCha8Rng) -> f64 {
        self.gap.sample(&[1.0, rows as f64], 0, rng)
    }

    /// A digest of the model's numbers (a changed calibration is a changed simulator).
    pub fn digest(&self) -> String {
        let mut h = blake3::Hasher::new();
        let nums =
            self.step.coef_us.iter().chain(&self.gap.coef_us).chain(self.step.residuals.iter().flatten());
        for v in nums.chain(self.gap.residuals.iter().flatten()) {
            h.update(&v.to_le_bytes());
        }
        for v in [self.gateway_us, self.link.latency_us, self.link.bytes_per_s] {
            h.update(&v.to_le_bytes());
        }
        h.update(&self.kv_bytes_per_token.to_le_bytes());
        h.update(&(self.knee_rows as u64).to_le_bytes());
        h.finalize().to_hex()[..16].to_owned()
    }
}

/// `Σ coef · x`: a linear model's value.
fn dot(coef: &[f64], x: &[f64]) -> f64 {
    coef.iter().zip(x).map(|(c, v)| c * v).sum()
}

fn names(terms: &[&str]) -> Vec<String> {
    terms.iter().map(|s| (*s).to_owned()).collect()
}

#[cfg(test)]
mod tests;
