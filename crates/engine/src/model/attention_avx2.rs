//! Decode attention on AVX2 + FMA + F16C, reading a KV head's f16 block in place.
//!
//! The portable path converts each block's K and V to f32 buffers and then scores them
//! (`attention.rs`); here the conversion happens in registers, inside the loops that use the
//! values (`vcvtph2ps` is exact), so a block is read once from the cache and never stored and
//! reloaded as f32. The cache keeps a head's keys dimension by dimension (`kv_cache.rs`), so one
//! vector holds one dimension of eight consecutive positions and the scores of eight positions
//! come out of eight accumulators with no horizontal sums. The arithmetic is the portable
//! kernel's, operation for operation: per position, lane `i` of the partial sums is the fused
//! multiply-adds of dimensions `8c + i` for `c` in order, folded
//! `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`, times the scale; the shared
//! online-softmax step; then `acc = fma(p, v, acc)` per position in order. So every path gives the
//! same bits (`attention::tests`).
//!
//! Safety contract of both kernels here and in `attention_avx512.rs`: the CPU supports the
//! features they are compiled for; `k` holds `8 · NC` rows of `bs` values and `v` `scores.len()`
//! rows of `8 · NC` values; `scores.len() <= bs`; `q` and `acc` hold `8 · NC` values per head.

use std::arch::x86_64::*;

use half::f16;

use super::attention::softmax_step_max;

/// `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))` of eight vectors of partial sums, times
/// `scale`: the scores of eight positions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fold8_scaled(p: &[__m256; 8], scale: __m256) -> __m256 {
    let lo = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
    let hi = _mm256_add_ps(_mm256_add_ps(p[4], p[5]), _mm256_add_ps(p[6], p[7]));
    _mm256_mul_ps(_mm256_add_ps(lo, hi), scale)
}

/// The score of one position `s` of a dimension-major block, with scalar operations in the
/// vector kernels' order (the positions past the last whole vector).
#[inline(always)]
pub(super) fn score_one(q: &[f32], k: &[f16], bs: usize, s: usize, scale: f32) -> f32 {
    let mut part = [0f32; 8];
    for (e, &qx) in q.iter().enumerate() {
        part[e % 8] = k[e * bs + s].to_f32().mul_add(qx, part[e % 8]);
    }
    (((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]))) * scale
}

/// [`super::attention::online_block`] for one head of `8 · NC` values over a dimension-major f16
/// key block (`k[e · bs + s]`) and a slot-major value block (`v[s · 8NC + e]`).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn online_block_f16<const NC: usize>(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    bs: usize,
    scores: &mut [f32],
    scale: f32,
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
) {
    let (n, hd) = (scores.len(), 8 * NC);
    assert!(n <= bs && k.len() >= hd * bs && v.len() >= n * hd && q.len() >= hd && acc.len() >= hd);
    // SAFETY (every pointer below): reads stay inside `k` (`e < hd`, `s0 + 8 <= n <= bs`) and
    // `v` (`s < n`, `8c + 8 <= hd`), writes inside `scores` and `acc` (asserted above).
    unsafe {
        let scale_v = _mm256_set1_ps(scale);
        let full = n / 8 * 8;
        let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
        for s0 in (0..full).step_by(8) {
            let mut part = [_mm256_setzero_ps(); 8];
            for c in 0..NC {
                for (i, pp) in part.iter_mut().enumerate() {
                    let e = 8 * c + i;
                    let kv = _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(e * bs + s0) as *const __m128i));
                    *pp = _mm256_fmadd_ps(kv, _mm256_set1_ps(*q.get_unchecked(e)), *pp);
                }
            }
            let sums = fold8_scaled(&part, scale_v);
            vmax = _mm256_max_ps(vmax, sums);
            _mm256_storeu_ps(scores.as_mut_ptr().add(s0), sums);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
        let mut bmax = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for (s, sc) in scores.iter_mut().enumerate().skip(full) {
            *sc = score_one(&q[..hd], k, bs, s, scale);
            bmax = bmax.max(*sc);
        }
        let (sum, correction) = softmax_step_max(scores, bmax, m, l);
        let corr = _mm256_set1_ps(correction);
        let mut a: [__m256; NC] =
            std::array::from_fn(|c| _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(8 * c)), corr));
        for (s, &wt) in scores.iter().enumerate() {
            let w = _mm256_set1_ps(wt);
            for (c, ac) in a.iter_mut().enumerate() {
                let vv = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(s * hd + 8 * c) as *const __m128i));
                *ac = _mm256_fmadd_ps(w, vv, *ac);
            }
        }
        for (c, ac) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.as_mut_ptr().add(8 * c), *ac);
        }
        *l = sum;
    }
}
