//! Decode attention on AVX2 + FMA + F16C, reading the cache's f16 rows in place.
//!
//! The portable path converts each block's K and V to f32 buffers and then scores them
//! (`attention.rs`); here the conversion happens in registers, inside the loops that use the
//! values (`vcvtph2ps` is exact), so a block is read once from the cache and never stored and
//! reloaded as f32. The arithmetic is the portable kernel's, operation for operation: scores as
//! eight-lane partial sums of fused multiply-adds over the head's eight-value chunks in order,
//! folded `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))` (two `vhaddps` and one add produce
//! exactly those sums for eight positions at once), times the scale; the shared online-softmax
//! step; then `acc = fma(p, v, acc)` per position in order. So both paths give the same bits
//! (`attention::tests`).
//!
//! Safety contract: the CPU supports avx2, fma and f16c; `k` and `v` address `n` rows of at least
//! `8 · NC` values, `stride` apart; `q` and `acc` hold `8 · NC` values and `scores` `n`.

use std::arch::x86_64::*;

use half::f16;

use super::attention::softmax_step_max;

/// [`super::attention::online_block`] for f16 rows in place.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn online_block_f16<const NC: usize>(
    q: &[f32],
    k: *const f16,
    v: *const f16,
    stride: usize,
    scores: &mut [f32],
    scale: f32,
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
) {
    unsafe {
        let n = scores.len();
        let row8 = |p: *const f16, s: usize, c: usize| {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(s * stride + 8 * c) as *const __m128i))
        };
        let qv: [__m256; NC] = std::array::from_fn(|c| _mm256_loadu_ps(q.as_ptr().add(8 * c)));
        let scale_v = _mm256_set1_ps(scale);
        let full = n / 8 * 8;
        let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
        for s0 in (0..full).step_by(8) {
            let mut part = [_mm256_setzero_ps(); 8];
            for (c, qc) in qv.iter().enumerate() {
                for (p, pp) in part.iter_mut().enumerate() {
                    *pp = _mm256_fmadd_ps(row8(k, s0 + p, c), *qc, *pp);
                }
            }
            // hadd pairs lanes (2i, 2i+1) of each operand: twice gives the four-lane halves'
            // sums `(p0 + p1) + (p2 + p3)` and `(p4 + p5) + (p6 + p7)` of every position.
            let lo = _mm256_hadd_ps(_mm256_hadd_ps(part[0], part[1]), _mm256_hadd_ps(part[2], part[3]));
            let hi = _mm256_hadd_ps(_mm256_hadd_ps(part[4], part[5]), _mm256_hadd_ps(part[6], part[7]));
            let lo4 = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps::<1>(lo));
            let hi4 = _mm_add_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps::<1>(hi));
            let sums = _mm256_mul_ps(_mm256_set_m128(hi4, lo4), scale_v);
            vmax = _mm256_max_ps(vmax, sums);
            _mm256_storeu_ps(scores.as_mut_ptr().add(s0), sums);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
        let mut bmax = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for (s, sc) in scores.iter_mut().enumerate().skip(full) {
            let mut part = [0f32; 8];
            let mut lanes = [0f32; 8];
            for (c, qc) in qv.iter().enumerate() {
                _mm256_storeu_ps(
                    lanes.as_mut_ptr(),
                    _mm256_fmadd_ps(row8(k, s, c), *qc, _mm256_loadu_ps(part.as_ptr())),
                );
                part = lanes;
            }
            *sc = (((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])))
                * scale;
            bmax = bmax.max(*sc);
        }
        let (sum, correction) = softmax_step_max(scores, bmax, m, l);
        let corr = _mm256_set1_ps(correction);
        let mut a: [__m256; NC] =
            std::array::from_fn(|c| _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(8 * c)), corr));
        for (s, &wt) in scores.iter().enumerate() {
            let w = _mm256_set1_ps(wt);
            for (c, ac) in a.iter_mut().enumerate() {
                *ac = _mm256_fmadd_ps(w, row8(v, s, c), *ac);
            }
        }
        for (c, ac) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.as_mut_ptr().add(8 * c), *ac);
        }
        *l = sum;
    }
}
