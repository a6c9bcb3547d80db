//! The candidates' weights `exp(logit / T − max)` over the whole vocabulary, and where a draw
//! lands among them: the part of a random draw that touches all 49k logits, once per generated
//! token.
//!
//! Written out rather than left to iterators because the sums must be the same numbers on every
//! machine ("same seed ⇒ same tokens" across machines): the exponential is the forward pass's
//! plain-arithmetic one ([`math::exp`], no libm, no FMA — Rust never contracts a multiply and an
//! add), and each block of [`BLOCK`] weights is summed in [`LANES`] independent `f64` lanes added
//! in a fixed order — which an eight-lane AVX2 loop (chosen at run time) does exactly as the
//! plain one does, so both give the same bits. The block sums let a draw find its block in a
//! few hundred additions and its candidate in at most [`BLOCK`] more. One weight after another
//! through libm's `expf`, then a selection over every candidate, this was most of the time
//! between two decode steps.

use crate::model::math;

/// Independent accumulators of a block's sum (and the width the loops are written for).
const LANES: usize = 8;
/// Weights per block sum.
pub(crate) const BLOCK: usize = 64;

/// What one pass over the logits leaves: every weight, every block's sum, the best scaled logit.
#[derive(Debug, Default)]
pub(crate) struct Weights {
    /// `exp(logits[i] / t − max)`.
    pub w: Vec<f32>,
    /// The sum of each [`BLOCK`] of `w` (lane `j` takes the block's elements `j mod LANES` in
    /// order; the lanes are added in order).
    pub blocks: Vec<f64>,
    /// The largest `logits[i] / t`.
    pub max: f32,
}

impl Weights {
    /// Every weight's sum: the blocks added in order.
    pub(crate) fn sum(&self) -> f64 {
        self.blocks.iter().fold(0.0, |s, &b| s + b)
    }

    /// The candidate where a walk in token-id order passes `r` (`0 ≤ r <` [`sum`](Self::sum)):
    /// the block whose running total passes it, then the candidate within it. Where rounding
    /// leaves `r` past a block's or the whole walk, the last candidate with a weight there.
    pub(crate) fn land(&self, r: f64) -> u32 {
        let last_weighted =
            |lo: usize, hi: usize| (lo..hi).rev().find(|&i| self.w[i] > 0.0).unwrap_or(hi - 1);
        let mut acc = 0.0f64;
        for (b, &s) in self.blocks.iter().enumerate() {
            if r < acc + s {
                let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(self.w.len()));
                let mut inner = acc;
                for i in lo..hi {
                    inner += f64::from(self.w[i]);
                    if r < inner {
                        return i as u32;
                    }
                }
                return last_weighted(lo, hi) as u32;
            }
            acc += s;
        }
        last_weighted(0, self.w.len()) as u32
    }

    /// Fills in the weights of `logits` at temperature `t > 0`. With `close`, every candidate
    /// `(i, logits[i] / t)` that [`is_close`] to the best within `near` is pushed to it, in
    /// token-id order.
    pub(crate) fn weigh(&mut self, logits: &[f32], t: f32, close: Option<(&mut Vec<(u32, f32)>, f32)>) {
        self.weigh_on(math::has_avx2(), logits, t, close);
    }

    /// [`weigh`](Self::weigh) on the AVX2 path or, with `avx2` false, element by element.
    fn weigh_on(&mut self, avx2: bool, logits: &[f32], t: f32, close: Option<(&mut Vec<(u32, f32)>, f32)>) {
        self.w.clear();
        self.w.resize(logits.len(), 0.0);
        self.blocks.clear();
        // Division by t > 0 rounds monotonically: the largest quotient is the largest logit's.
        self.max = math::max(logits) / t;
        let mut none = Vec::new();
        // Nothing is close to within a negative distance (`x − max ≤ 0`): no candidate is pushed.
        let (close, near) = close.unwrap_or((&mut none, -1.0));
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: `avx2` is only true where the CPU has the features the function is
            // compiled for (`math::has_avx2`).
            unsafe { self.weigh_avx2(logits, t, near, close) };
            return;
        }
        let _ = avx2; // read only on x86_64
        for (b, block) in logits.chunks(BLOCK).enumerate() {
            self.weigh_block(b, block, t, near, close);
        }
    }

    /// One block, element by element: the definition [`weigh_avx2`](Self::weigh_avx2) follows.
    fn weigh_block(&mut self, b: usize, block: &[f32], t: f32, near: f32, close: &mut Vec<(u32, f32)>) {
        let mut acc = [0f64; LANES];
        for (i, &l) in block.iter().enumerate() {
            let s = l / t;
            let x = s - self.max;
            let e = math::exp(x);
            self.w[b * BLOCK + i] = e;
            acc[i % LANES] += f64::from(e);
            if is_close(x, near) {
                close.push(((b * BLOCK + i) as u32, s));
            }
        }
        self.blocks.push(acc.iter().fold(0.0, |s, &a| s + a));
    }

    /// Whole blocks eight lanes at a time with the same operations lane by lane (the same
    /// division and subtraction, [`math::exp8`] is [`math::exp`] per lane, each lane widened
    /// and added in the same order); a last partial block element by element.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weigh_avx2(&mut self, logits: &[f32], t: f32, near: f32, close: &mut Vec<(u32, f32)>) {
        use std::arch::x86_64::*;
        let (tv, mv, floor) = (_mm256_set1_ps(t), _mm256_set1_ps(self.max), _mm256_set1_ps(-near));
        let unit = t == 1.0;
        for (b, block) in logits.chunks(BLOCK).enumerate() {
            if block.len() < BLOCK {
                self.weigh_block(b, block, t, near, close);
                continue;
            }
            let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
            // The block's scaled logits and which are close, gathered after the sums (no call
            // inside the loop: its accumulators stay in registers).
            let mut sv = [0f32; BLOCK];
            let mut mask = 0u64;
            for k in 0..BLOCK / LANES {
                // SAFETY: `block` holds BLOCK floats, `w` one per logit and `sv` BLOCK; exp8
                // needs the features this function is compiled for.
                unsafe {
                    let l = _mm256_loadu_ps(block.as_ptr().add(k * LANES));
                    // `l / 1` is `l` exactly: the default temperature skips the division.
                    let s = if unit { l } else { _mm256_div_ps(l, tv) };
                    let x = _mm256_sub_ps(s, mv);
                    let e = math::exp8(x);
                    _mm256_storeu_ps(self.w.as_mut_ptr().add(b * BLOCK + k * LANES), e);
                    _mm256_storeu_ps(sv.as_mut_ptr().add(k * LANES), s);
                    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
                    // `is_close` on eight lanes (an ordered ≥: false for NaN, as the scalar one).
                    let m = _mm256_movemask_ps(_mm256_cmp_ps(x, floor, _CMP_GE_OQ)) as u32;
                    mask |= u64::from(m) << (k * LANES);
                }
            }
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                close.push(((b * BLOCK + j) as u32, sv[j]));
                mask &= mask - 1;
            }
            let mut acc = [0f64; LANES];
            // SAFETY: `acc` holds 8 doubles, four per store.
            unsafe {
                _mm256_storeu_pd(acc.as_mut_ptr(), lo);
                _mm256_storeu_pd(acc.as_mut_ptr().add(4), hi);
            }
            self.blocks.push(acc.iter().fold(0.0, |s, &a| s + a));
        }
    }
}

/// Whether a candidate whose weight's exponent is `shifted` (`logit / t − max`) is within
/// `near` of the best. Its complement picks the others, and both keep the candidates' order:
/// `x − max` is monotonic in `x` under rounding.
pub(crate) fn is_close(shifted: f32, near: f32) -> bool {
    shifted >= -near
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The element-by-element definition, whatever the CPU.
    fn portable(logits: &[f32], t: f32, near: f32) -> (Weights, Vec<(u32, f32)>) {
        let (mut w, mut close) = (Weights::default(), Vec::new());
        w.weigh_on(false, logits, t, Some((&mut close, near)));
        (w, close)
    }

    #[test]
    fn every_build_weighs_to_the_same_bits() {
        let logits: Vec<f32> = (0..49_157u32).map(|i| ((i * 7919) % 2000) as f32 / 97.0 - 8.0).collect();
        for t in [0.3f32, 1.0, 1.7] {
            for n in [1, 7, 64, 65, 1000, logits.len()] {
                let l = &logits[..n];
                let (want, want_close) = portable(l, t, 3.0);
                assert_eq!(want.max, l.iter().map(|&x| x / t).fold(f32::NEG_INFINITY, f32::max));
                let libm: f64 = l.iter().map(|&x| f64::from(x / t - want.max).exp()).sum();
                assert!((want.sum() / libm - 1.0).abs() < 1e-6, "{} vs {libm}", want.sum());
                let close: Vec<(u32, f32)> = (0..n as u32)
                    .map(|i| (i, l[i as usize] / t))
                    .filter(|x| x.1 - want.max >= -3.0)
                    .collect();
                assert_eq!(want_close, close);
                let (mut got, mut got_close) = (Weights::default(), Vec::new());
                got.weigh(l, t, Some((&mut got_close, 3.0)));
                assert_eq!(got.max.to_bits(), want.max.to_bits(), "the dispatched build");
                assert_eq!(got.w, want.w, "the dispatched build");
                let bits = |b: &[f64]| b.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.blocks), bits(&want.blocks), "the dispatched build");
                assert_eq!(got_close, close, "the dispatched build");
            }
        }
    }

    #[test]
    fn a_draw_lands_where_the_running_total_passes_it() {
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 11) as f32 * 0.5).collect();
        let (w, _) = portable(&logits, 1.0, 16.0);
        let total = w.sum();
        let mut prev = 0;
        for k in 0..2000 {
            let r = total * f64::from(k) / 2000.0;
            let mut acc = 0.0;
            let want = w.w.iter().position(|&x| {
                acc += f64::from(x);
                r < acc
            });
            let got = w.land(r);
            // Summed in another order, the walk may differ by one candidate at a boundary only.
            if let Some(want) = want {
                assert!(got.abs_diff(want as u32) <= 1, "r {r}: {got} vs {want}");
            }
            assert!(got >= prev, "the landing moves forward with r");
            prev = got;
        }
        assert_eq!(w.land(0.0), 0);
        assert_eq!(w.land(total * 2.0), 299, "past the end: the last weighted candidate");
    }
}
