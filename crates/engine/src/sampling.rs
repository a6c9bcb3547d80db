//! Choosing the next token from logits: greedy, temperature, top-k, top-p, OpenAI's presence and
//! frequency penalties, and a seed that makes a run repeatable.
//!
//! The random stream is ChaCha8 seeded from the request's seed: it is specified independently of
//! platform and crate version, so "same seed ⇒ same tokens" holds across machines, which a
//! general-purpose fast RNG does not promise.

use crate::error::{EngineError, Result};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

mod weights;
use crate::model::math;

pub use tokenpath_protocol::sampling::{SamplerState, SamplingParams};

/// A sampler for one sequence: its parameters, its random stream and the counts of the tokens it
/// generated (for the penalties).
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: ChaCha8Rng,
    counts: HashMap<u32, u32>,
    scratch: Vec<(u32, f32)>,
    weights: weights::Weights,
}

impl Sampler {
    /// A sampler; the parameters must be valid.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate().map_err(|e| EngineError::InvalidArgument(e.to_string()))?;
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        Ok(Self {
            params,
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            counts: HashMap::new(),
            scratch: Vec::new(),
            weights: weights::Weights::default(),
        })
    }

    /// Where the random stream stands, so another process can continue it
    /// ([`Sampler::resume`]): the seed actually used and the position in its stream.
    pub fn state(&self) -> SamplerState {
        SamplerState { seed: self.seed, word_pos: self.rng.get_word_pos() }
    }

    /// Moves this sampler to where one with `state` stood after sampling `history` (same
    /// parameters): the decode worker's half of [`Sampler::resume`].
    pub fn continue_from(&mut self, state: SamplerState, history: &[u32]) {
        self.seed = state.seed;
        self.rng = ChaCha8Rng::seed_from_u64(state.seed);
        self.rng.set_word_pos(state.word_pos);
        self.counts.clear();
        for &t in history {
            *self.counts.entry(t).or_insert(0) += 1;
        }
    }

    /// A sampler that continues where one with `state` stopped after sampling `history`: the
    /// same random stream position and the same penalty counts. With it, a sequence whose first
    /// token was sampled by a prefill worker goes on in a decode worker exactly as it would have
    /// on one engine.
    pub fn resume(params: SamplingParams, state: SamplerState, history: &[u32]) -> Result<Self> {
        let mut s = Self::new(params)?;
        s.continue_from(state, history);
        Ok(s)
    }

    /// Picks the next token from `logits` (modified in place by the penalties) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(EngineError::InvalidArgument("no logits to sample from".into()));
        }
        let p = &self.params;
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&tok, &n) in &self.counts {
                if let Some(l) = logits.get_mut(tok as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        let tok = if p.temperature == 0.0 { argmax(logits) } else { self.sample_random(logits) };
        *self.counts.entry(tok).or_insert(0) += 1;
        Ok(tok)
    }

    /// Temperature, top-k and top-p. A plain draw (no top-k, no top-p) walks the candidates in
    /// token-id order — every order gives the same distribution, this one needs no sort — with
    /// [`weights::Weights::land`]. With top-k or top-p the candidates are walked in descending
    /// logit order (ties by token id), and only what the walk needs is ever ordered: the
    /// candidates within [`NEAR`] of the best are gathered in the weighing pass and sorted
    /// lazily; the rest (weights under `e^-NEAR` each: at most half a percent of the mass over
    /// 49k candidates) are gathered only when a walk reaches them.
    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        self.pick(logits, u)
    }

    /// The candidate a uniform draw `u` in `[0, 1)` lands on.
    fn pick(&mut self, logits: &[f32], u: f64) -> u32 {
        let p = &self.params;
        let t = p.temperature;
        let c = &mut self.scratch;
        c.clear();
        let (max, mut sum, complete) = if p.top_k > 0 && p.top_k < logits.len() {
            // The best k are among the close ones when there are k of those (they are a prefix
            // of the order); else among all.
            let w = &mut self.weights;
            w.weigh(logits, t, Some((c, NEAR)));
            if c.len() < p.top_k {
                c.clear();
                c.extend(candidates(logits, t));
            }
            c.select_nth_unstable_by(p.top_k - 1, order);
            c.truncate(p.top_k);
            // The best candidate is always among the k: the max is the weighing pass's.
            let max = w.max;
            let sum = c.iter().map(|x| weight(x, max)).sum();
            (max, sum, true)
        } else {
            let w = &mut self.weights;
            if p.top_p >= 1.0 {
                w.weigh(logits, t, None);
                return w.land(u * w.sum());
            }
            w.weigh(logits, t, Some((c, NEAR)));
            (w.max, w.sum(), false)
        };
        let mut walk = Walk { logits, t, max, near: c.len(), sorted: 0, complete };
        if p.top_p < 1.0 {
            let (mut acc, mut kept) = (0.0f64, 0.0f64);
            let mut i = 0;
            while let Some(x) = walk.reach(c, i) {
                let w = weight(&x, max);
                acc += w / sum;
                kept += w;
                i += 1;
                if acc >= f64::from(p.top_p) {
                    break;
                }
            }
            // The nucleus is all there is to draw from.
            c.truncate(i);
            walk.complete = true;
            sum = kept;
        }
        let r = u * sum;
        let mut acc = 0.0f64;
        let mut i = 0;
        while let Some(x) = walk.reach(c, i) {
            acc += weight(&x, max);
            if r < acc {
                return x.0;
            }
            i += 1;
        }
        // Rounding left the draw past the last candidate's cumulative weight: the last one.
        c.last().map_or(0, |x| x.0)
    }
}

/// A walk over the candidates in [`order`]: `c[..near]` (the close ones, or every candidate
/// when `complete`) sorted as far as the walk has gone, the others gathered when it reaches them.
struct Walk<'a> {
    logits: &'a [f32],
    t: f32,
    max: f32,
    near: usize,
    sorted: usize,
    /// Every candidate that may be drawn is in the list.
    complete: bool,
}

impl Walk<'_> {
    /// The candidate at `i` in order (`None` past the last).
    fn reach(&mut self, c: &mut Vec<(u32, f32)>, i: usize) -> Option<(u32, f32)> {
        if i == c.len() && !self.complete {
            self.complete = true;
            let max = self.max;
            c.extend(candidates(self.logits, self.t).filter(|x| !weights::is_close(x.1 - max, NEAR)));
        }
        if i >= c.len() {
            return None;
        }
        sort_through(c, i, &mut self.sorted, self.near);
        Some(c[i])
    }
}

/// Every candidate: its token id and its logit at temperature `t`.
fn candidates(logits: &[f32], t: f32) -> impl Iterator<Item = (u32, f32)> + '_ {
    logits.iter().enumerate().map(move |(i, &l)| (i as u32, l / t))
}

/// How far under the best candidate's (temperature-scaled) logit a candidate is gathered before
/// any draw: weights under `e^-16` ≈ 1.1e-7 each are left out until a walk reaches them.
const NEAR: f32 = 16.0;

/// A candidate's weight: `exp(logit − max)` (the forward pass's [`math::exp`]), as
/// [`weights::Weights::weigh`] computes it.
fn weight(x: &(u32, f32), max: f32) -> f64 {
    f64::from(math::exp(x.1 - max))
}

/// Candidate order: larger logit first, ties by token id, so the order is fully determined.
fn order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Makes `c[..=i]` the first `i + 1` candidates in [`order`], given `c[..*sorted]` already is
/// and every candidate of `c[..near]` comes before every one after it: the sorted prefix grows
/// fourfold (at least 64) by a selection and a sort of the new part, within `c[..near]` first.
fn sort_through(c: &mut [(u32, f32)], i: usize, sorted: &mut usize, near: usize) {
    while i >= *sorted {
        let end = if *sorted < near { near.min(c.len()) } else { c.len() };
        let next = (*sorted * 4).max(64).max(i + 1).min(end);
        if next < end {
            c[*sorted..end].select_nth_unstable_by(next - *sorted - 1, order);
        }
        c[*sorted..next].sort_unstable_by(order);
        *sorted = next;
    }
}

/// Index of the largest logit (the first one on ties), as llama.cpp's greedy sampler picks.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 3.0, -1.0, 0.5]
    }

    #[test]
    fn greedy_takes_first_max() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&mut logits()).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_greedy() {
        let params = SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() };
        let run = |p: SamplingParams| {
            let mut s = Sampler::new(p).unwrap();
            (0..50).map(|_| s.sample(&mut logits()).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(params.clone()), run(params.clone()));
        assert_ne!(run(params.clone()), run(SamplingParams { seed: Some(43), ..params.clone() }));
        let top1 = run(SamplingParams { top_k: 1, ..params.clone() });
        assert!(top1.iter().all(|&t| t == 1));
        let top2 = run(SamplingParams { top_k: 2, ..params.clone() });
        assert!(top2.iter().all(|&t| t == 1 || t == 3), "{top2:?}");
        let nucleus = run(SamplingParams { top_p: 0.1, ..params });
        assert!(nucleus.iter().all(|&t| t == 1), "{nucleus:?}");
    }

    /// The draw as defined, plainly: a plain draw walks every candidate in token-id order;
    /// with top-k or top-p every candidate is sorted, then walked.
    fn full_sort_pick(logits: &[f32], p: &SamplingParams, u: f64) -> u32 {
        let mut c: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
        let top_k = p.top_k > 0 && p.top_k < c.len();
        if !top_k && p.top_p >= 1.0 {
            let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
            let w: Vec<f64> = c.iter().map(|x| weight(x, max)).collect();
            let r = u * w.iter().sum::<f64>();
            let mut acc = 0.0;
            return w
                .iter()
                .position(|x| {
                    acc += x;
                    r < acc
                })
                .map_or(c.len() as u32 - 1, |i| i as u32);
        }
        if top_k {
            c.select_nth_unstable_by(p.top_k - 1, order);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(order);
        let w: Vec<f64> = c.iter().map(|x| weight(x, c[0].1)).collect();
        let mut n = c.len();
        let total: f64 = w.iter().sum();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, x) in w.iter().enumerate() {
                acc += x / total;
                if acc >= f64::from(p.top_p) {
                    n = i + 1;
                    break;
                }
            }
        }
        let r = u * w[..n].iter().sum::<f64>();
        let mut acc = 0.0;
        for i in 0..n {
            acc += w[i];
            if r < acc {
                return c[i].0;
            }
        }
        c[n - 1].0
    }

    proptest::proptest! {
        #[test]
        fn every_draw_picks_what_the_plain_definition_picks(
            raw in proptest::collection::vec(-40i32..40, 1..400),
            temperature in 0.2f32..2.0,
            top_k in 0usize..80,
            top_p in 0.05f32..1.0,
            seed: u64,
        ) {
            // Coarse logits: many ties, which the order breaks by token id.
            let logits: Vec<f32> = raw.iter().map(|&x| x as f32 / 4.0).collect();
            for top_p in [top_p, 1.0] {
                let params = SamplingParams { temperature, top_k, top_p, seed: Some(seed), ..Default::default() };
                let mut s = Sampler::new(params.clone()).unwrap();
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                for _ in 0..4 {
                    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                    let want = full_sort_pick(&logits, &params, u);
                    proptest::prop_assert_eq!(s.sample(&mut logits.clone()).unwrap(), want);
                }
            }
        }
    }

    #[test]
    fn a_walk_past_the_gathered_candidates_picks_what_a_full_sort_picks() {
        // Two candidates within reach of the best, the rest far under it (some tied): a nucleus
        // of almost everything, and draws that land in the tail, walk into the candidates
        // gathered late.
        let mut logits = vec![-40.0f32; 300];
        logits[17] = 0.0;
        logits[3] = -1.0;
        for (i, l) in logits.iter_mut().enumerate().skip(100).step_by(7) {
            *l = -17.0 - (i % 5) as f32;
        }
        let mut tail = 0;
        for top_p in [0.999_999_99f32, 0.999_9, 1.0] {
            let params = SamplingParams { temperature: 1.0, top_p, seed: Some(1), ..Default::default() };
            for k in 0..400 {
                // Draws spread over [0, 1), the last ones packed against 1.
                let u = if k < 200 { k as f64 / 200.0 } else { 1.0 - 1e-9 * f64::from(400 - k) * 3.0 };
                let got = Sampler::new(params.clone()).unwrap().pick(&logits, u);
                assert_eq!(got, full_sort_pick(&logits, &params, u), "top_p {top_p}, u {u}");
                tail += usize::from(logits[got as usize] < -16.0);
            }
        }
        assert!(tail > 100, "the tail was reached {tail} times");
    }

    #[test]
    fn resumed_sampler_continues_the_same_stream() {
        let params =
            SamplingParams { temperature: 1.0, frequency_penalty: 0.5, seed: None, ..Default::default() };
        let mut whole = Sampler::new(params.clone()).unwrap();
        let first = whole.sample(&mut logits()).unwrap();
        let state = whole.state();
        let rest: Vec<u32> = (0..40).map(|_| whole.sample(&mut logits()).unwrap()).collect();
        let mut resumed = Sampler::resume(params, state, &[first]).unwrap();
        let again: Vec<u32> = (0..40).map(|_| resumed.sample(&mut logits()).unwrap()).collect();
        assert_eq!(rest, again);
    }

    #[test]
    fn penalties_push_away_repeats() {
        let mut s =
            Sampler::new(SamplingParams { frequency_penalty: 2.0, ..SamplingParams::greedy() }).unwrap();
        let picks: Vec<u32> = (0..3).map(|_| s.sample(&mut logits()).unwrap()).collect();
        assert_eq!(picks, vec![1, 3, 2], "after 1 and 3 were used once, 2 (logit 2.0) wins over 3.0 − 2");
    }

    #[test]
    fn out_of_range_params_are_typed_errors() {
        for p in [
            SamplingParams { temperature: -0.5, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { presence_penalty: 3.0, ..Default::default() },
        ] {
            assert!(matches!(Sampler::new(p), Err(EngineError::InvalidArgument(_))));
        }
    }
}
