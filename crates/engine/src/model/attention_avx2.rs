//! Decode attention on AVX2 + FMA + F16C, reading a KV head's f16 blocks in place.
//!
//! The portable path converts each block's K and V to f32 buffers and then scores them
//! (`attention.rs`); here the conversion happens in registers, inside the loops that use the
//! values (`vcvtph2ps` is exact), so a block is read once from the cache and never stored and
//! reloaded as f32. The cache keeps a head's keys dimension by dimension (`kv_cache.rs`), so one
//! vector holds one dimension of eight consecutive positions and the scores of eight positions
//! come out of eight accumulators with no horizontal sums. The arithmetic is the portable
//! kernel's, operation for operation: per position, lane `i` of the partial sums is the fused
//! multiply-adds of dimensions `8c + i` for `c` in order, folded
//! `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`, times the scale; the largest score;
//! `e^(s - max)` summed in sixteen lanes (`math::exp_shift_sum16`); `acc = fma(p, v, acc)` per
//! position in order; `acc · (1 / sum)`. So every path gives the same bits (`attention::tests`).
//!
//! Safety contract of the kernels here and in `attention_avx512.rs`: the CPU supports the
//! features they are compiled for; each of `blocks` holds `8 · NC` key rows of `bs` values and
//! `bs` value rows of `8 · NC` values, and they cover `n` positions; `q` and `out` hold
//! `8 · NC` values per head, `scores` `n` per head.

use std::arch::x86_64::*;

use half::f16;

use super::attention::{assert_operands, prefetch_blocks, Blocks, AHEAD};
use crate::model::math;

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
    math::fold8(&part) * scale
}

/// Attention of one head of `8 · NC` values over the first `n` positions of `blocks` (keys
/// dimension-major, `k[e · bs + s]`; values slot-major, `v[s · 8NC + e]`): the scores of every
/// position, one softmax over them all ([`math::exp_shift_sum16_avx2`]), then `out = Σ p · V / Σ
/// p` with the output held in registers across the whole sequence.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_f16<const NC: usize>(
    q: &[f32],
    blocks: &Blocks<'_>,
    bs: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = 8 * NC;
    assert_operands((hd, 1, bs, n), q, blocks, scores, out);
    // SAFETY (every pointer below): key reads stay in a block (`e < hd`, `s0 + 8 <= slots <=
    // bs`), value reads too (`s < slots`, `8c + 8 <= hd`); score writes in `scores[..n]`, output
    // writes in `out[..hd]` (asserted above).
    unsafe {
        let scale_v = _mm256_set1_ps(scale);
        let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut tail_max = f32::NEG_INFINITY;
        prefetch_blocks(blocks, 1..AHEAD, true);
        for (bi, (k, _)) in blocks.iter().enumerate() {
            prefetch_blocks(blocks, bi + AHEAD..bi + AHEAD + 1, true);
            let (p0, slots) = (bi * bs, bs.min(n - bi * bs));
            let full = slots / 8 * 8;
            for s0 in (0..full).step_by(8) {
                let mut part = [_mm256_setzero_ps(); 8];
                for c in 0..NC {
                    for (i, pp) in part.iter_mut().enumerate() {
                        let e = 8 * c + i;
                        let kv =
                            _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(e * bs + s0) as *const __m128i));
                        *pp = _mm256_fmadd_ps(kv, _mm256_set1_ps(*q.get_unchecked(e)), *pp);
                    }
                }
                let sums = fold8_scaled(&part, scale_v);
                vmax = _mm256_max_ps(vmax, sums);
                _mm256_storeu_ps(scores.as_mut_ptr().add(p0 + s0), sums);
            }
            for s in full..slots {
                let sc = score_one(&q[..hd], k, bs, s, scale);
                scores[p0 + s] = sc;
                tail_max = tail_max.max(sc);
            }
        }
        prefetch_blocks(blocks, 0..AHEAD, false);
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
        let max = lanes.iter().fold(tail_max, |a, &b| a.max(b));
        let sum = math::exp_shift_sum16_avx2(&mut scores[..n], max);
        let mut a = [_mm256_setzero_ps(); NC];
        for (bi, (_, v)) in blocks.iter().enumerate() {
            prefetch_blocks(blocks, bi + AHEAD..bi + AHEAD + 1, false);
            let (p0, slots) = (bi * bs, bs.min(n - bi * bs));
            for s in 0..slots {
                let w = _mm256_set1_ps(*scores.get_unchecked(p0 + s));
                for (c, ac) in a.iter_mut().enumerate() {
                    let vv =
                        _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(s * hd + 8 * c) as *const __m128i));
                    *ac = _mm256_fmadd_ps(w, vv, *ac);
                }
            }
        }
        let inv = _mm256_set1_ps(1.0 / sum);
        for (c, ac) in a.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), _mm256_mul_ps(*ac, inv));
        }
    }
}
