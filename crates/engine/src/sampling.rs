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

    /// Temperature, top-k and top-p over the candidates in descending logit order (ties by
    /// token id), walked until the draw lands. Only the walked prefix is ever sorted: most draws
    /// land among the first few dozen of the 49k candidates, and a full sort per token was a
    /// measurable part of a decode step.
    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let c = &mut self.scratch;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, order);
            c.truncate(p.top_k);
        }
        let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
        let weight = |x: &(u32, f32)| f64::from((x.1 - max).exp());
        let mut sorted = 0;
        let mut sum: f64 = c.iter().map(weight).sum();
        if p.top_p < 1.0 {
            let (mut acc, mut kept) = (0.0f64, 0.0f64);
            let mut keep = c.len();
            for i in 0..c.len() {
                sort_through(c, i, &mut sorted);
                let w = weight(&c[i]);
                acc += w / sum;
                kept += w;
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            sum = kept;
        }
        let r = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * sum;
        let mut acc = 0.0f64;
        for i in 0..c.len() {
            sort_through(c, i, &mut sorted);
            acc += weight(&c[i]);
            if r < acc {
                return c[i].0;
            }
        }
        let last = c.len() - 1;
        sort_through(c, last, &mut sorted);
        c[last].0
    }
}

/// Candidate order: larger logit first, ties by token id, so the order is fully determined.
fn order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Makes `c[..=i]` the first `i + 1` candidates in [`order`], given `c[..*sorted]` already is:
/// the sorted prefix grows fourfold (at least 64) by a selection and a sort of the new part.
fn sort_through(c: &mut [(u32, f32)], i: usize, sorted: &mut usize) {
    if i < *sorted {
        return;
    }
    let (n, next) = (c.len(), (*sorted * 4).max(64).max(i + 1).min(c.len()));
    if next < n {
        c[*sorted..].select_nth_unstable_by(next - *sorted - 1, order);
    }
    c[*sorted..next].sort_unstable_by(order);
    *sorted = next;
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

    /// The sampler before the lazy sort: every candidate sorted, then walked.
    fn full_sort_pick(logits: &[f32], p: &SamplingParams, u: f64) -> u32 {
        let mut c: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, order);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(order);
        let w: Vec<f64> = c.iter().map(|x| f64::from((x.1 - c[0].1).exp())).collect();
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
        fn the_lazy_walk_picks_what_a_full_sort_picks(
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
