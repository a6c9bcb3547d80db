//! Decode attention on AVX-512: `attention_avx2.rs`'s kernel sixteen positions per vector, and
//! `NH` query heads of one KV group per call, so each key and value vector is loaded and
//! converted once for all of them (at 64 values per head and three heads per group: 24 score
//! accumulators while scoring, 12 output accumulators held in registers across the whole
//! sequence). The operations per (position, head) are the portable kernel's in the same order,
//! so the bits are the same on every path (`attention::tests`); positions past a block's last
//! sixteen are masked lanes, not a scalar loop.
//!
//! Safety contract: as `attention_avx2.rs`'s, plus AVX-512 F/BW/VL; `q` holds `NH` heads of
//! `8 · NC` values, `scores` `NH` runs of `n` and `out` `NH` heads.

use std::arch::x86_64::*;

use super::attention::{
    ahead, assert_operands, prefetch_blocks, prefetch_line, prefetch_lines, Blocks, AHEAD,
};
use crate::model::math;

/// Attention of `NH` heads of `8 · NC` values over the first `n` positions of `blocks`: the
/// scores of every position, one softmax over them all, then `out = Σ p · V / Σ p`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn attend_f16<const NC: usize, const NH: usize>(
    q: &[f32],
    blocks: &Blocks<'_>,
    bs: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = 8 * NC;
    assert_operands((hd, NH, bs, n), q, blocks, scores, out);
    // SAFETY (every pointer below): key reads are masked to slots `< bs` of rows `e < hd` of a
    // block; value reads are rows `s < bs`, `16c + 16 <= hd`; score reads and writes stay in
    // head `j`'s run of `n` (masked past it), output writes in `out` (asserted above).
    unsafe {
        let scale_v = _mm512_set1_ps(scale);
        let mut vmax = [_mm512_set1_ps(f32::NEG_INFINITY); NH];
        prefetch_blocks(blocks, 1..AHEAD, true);
        for (bi, (k, _)) in blocks.iter().enumerate() {
            let next = ahead(blocks, bi, true);
            let (p0, slots) = (bi * bs, bs.min(n - bi * bs));
            for s0 in (0..slots).step_by(16) {
                let left = slots - s0;
                let mask: __mmask16 = if left >= 16 { 0xffff } else { (1u16 << left) - 1 };
                let mut part = [[_mm512_setzero_ps(); 8]; NH];
                for c in 0..NC {
                    for i in 0..8 {
                        let e = 8 * c + i;
                        // The next block's keys of this dimension: at the cache's block size of
                        // 16 two dimensions make a line. (The same lines as `prefetch_lines`
                        // asks for, without its arithmetic per dimension: through it the kernel
                        // ran 12% slower from memory and 22% from the caches,
                        // `decode_attention_throughput`, alternating.)
                        match (next, s0) {
                            (Some(nk), 0) if bs == 16 && i % 2 == 0 => prefetch_line(nk, e * bs),
                            (Some(_), 0) if bs == 16 => {}
                            (_, 0) => prefetch_lines(next, e * bs, bs),
                            _ => {}
                        }
                        let src = k.as_ptr().add(e * bs + s0) as *const i16;
                        let kz = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src));
                        for (j, pj) in part.iter_mut().enumerate() {
                            pj[i] = _mm512_fmadd_ps(kz, _mm512_set1_ps(*q.get_unchecked(j * hd + e)), pj[i]);
                        }
                    }
                }
                for (j, p) in part.iter().enumerate() {
                    let lo = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
                    let hi = _mm512_add_ps(_mm512_add_ps(p[4], p[5]), _mm512_add_ps(p[6], p[7]));
                    let sums = _mm512_mul_ps(_mm512_add_ps(lo, hi), scale_v);
                    vmax[j] = _mm512_mask_max_ps(vmax[j], mask, vmax[j], sums);
                    _mm512_mask_storeu_ps(scores.as_mut_ptr().add(j * n + p0 + s0), mask, sums);
                }
            }
        }
        prefetch_blocks(blocks, 0..AHEAD, false);
        let mut sum = [0f32; NH];
        for (j, sj) in sum.iter_mut().enumerate() {
            *sj =
                math::exp_shift_sum16_avx512(&mut scores[j * n..(j + 1) * n], _mm512_reduce_max_ps(vmax[j]));
        }
        let mut a = [[_mm512_setzero_ps(); 8]; NH];
        for (bi, (_, v)) in blocks.iter().enumerate() {
            let next = ahead(blocks, bi, false);
            let (p0, slots) = (bi * bs, bs.min(n - bi * bs));
            for s in 0..slots {
                // The next block's values of this slot.
                if let Some(nv) = next {
                    for at in (s * hd..(s + 1) * hd).step_by(32) {
                        prefetch_line(nv, at);
                    }
                }
                let mut vz = [_mm512_setzero_ps(); 8];
                for (c, x) in vz.iter_mut().take(NC / 2).enumerate() {
                    *x = _mm512_cvtph_ps(_mm256_loadu_si256(
                        v.as_ptr().add(s * hd + 16 * c) as *const __m256i
                    ));
                }
                for (j, aj) in a.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*scores.get_unchecked(j * n + p0 + s));
                    for (ac, x) in aj.iter_mut().zip(&vz).take(NC / 2) {
                        *ac = _mm512_fmadd_ps(w, *x, *ac);
                    }
                }
            }
        }
        for (j, aj) in a.iter().enumerate() {
            let inv = _mm512_set1_ps(1.0 / sum[j]);
            for (c, ac) in aj.iter().take(NC / 2).enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(j * hd + 16 * c), _mm512_mul_ps(*ac, inv));
            }
        }
    }
}
