//! Decode attention on AVX-512: `attention_avx2.rs`'s kernel sixteen positions per vector, and
//! `NH` query heads of one KV group per call, so each key and value vector is loaded and
//! converted once for all of them (at 64 values per head and three heads per group: 24 score
//! accumulators and 12 output accumulators, all in registers). The operations per (position,
//! head) are the portable kernel's in the same order, so the bits are the same on every path
//! (`attention::tests`); positions past the last sixteen are masked lanes, not a scalar loop.
//!
//! Safety contract: as `attention_avx2.rs`'s, plus AVX-512 F/BW/VL; `q` holds `NH` heads of
//! `8 · NC` values, `scores` `NH` runs of `bs`, `m`, `l` `NH` values and `acc` `NH` heads.

use std::arch::x86_64::*;

use half::f16;

use super::attention::softmax_step_max;

/// One block of `NH` heads of `8 · NC` values over a dimension-major key block and a
/// slot-major value block, `n <= bs` positions valid.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn online_block_f16<const NC: usize, const NH: usize>(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    bs: usize,
    n: usize,
    scores: &mut [f32],
    scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let hd = 8 * NC;
    assert!(
        n <= bs
            && k.len() >= hd * bs
            && v.len() >= n * hd
            && q.len() >= NH * hd
            && scores.len() >= NH * bs
            && m.len() >= NH
            && l.len() >= NH
            && acc.len() >= NH * hd
    );
    // SAFETY (every pointer below): key reads are masked to positions `< n <= bs` of rows
    // `e < hd`; value reads are rows `s < n`, `16c + 16 <= hd`; writes stay in `scores` (masked
    // to `n` per head) and `acc` (asserted above).
    unsafe {
        let scale_v = _mm512_set1_ps(scale);
        let mut vmax = [_mm512_set1_ps(f32::NEG_INFINITY); NH];
        for s0 in (0..n).step_by(16) {
            let mask: __mmask16 = if n - s0 >= 16 { 0xffff } else { (1u16 << (n - s0)) - 1 };
            let mut part = [[_mm512_setzero_ps(); 8]; NH];
            for c in 0..NC {
                for i in 0..8 {
                    let e = 8 * c + i;
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
                _mm512_mask_storeu_ps(scores.as_mut_ptr().add(j * bs + s0), mask, sums);
            }
        }
        let mut a = [[_mm512_setzero_ps(); 8]; NH];
        for j in 0..NH {
            let (sc, bmax) = (&mut scores[j * bs..j * bs + n], _mm512_reduce_max_ps(vmax[j]));
            let (sum, correction) = softmax_step_max(sc, bmax, &mut m[j], &l[j]);
            l[j] = sum;
            let corr = _mm512_set1_ps(correction);
            for (c, ac) in a[j].iter_mut().take(NC / 2).enumerate() {
                *ac = _mm512_mul_ps(_mm512_loadu_ps(acc.as_ptr().add(j * hd + 16 * c)), corr);
            }
        }
        for s in 0..n {
            let mut vz = [_mm512_setzero_ps(); 8];
            for (c, x) in vz.iter_mut().take(NC / 2).enumerate() {
                *x = _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(s * hd + 16 * c) as *const __m256i));
            }
            for (j, aj) in a.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*scores.get_unchecked(j * bs + s));
                for (ac, x) in aj.iter_mut().zip(&vz).take(NC / 2) {
                    *ac = _mm512_fmadd_ps(w, *x, *ac);
                }
            }
        }
        for (j, aj) in a.iter().enumerate() {
            for (c, ac) in aj.iter().take(NC / 2).enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add(j * hd + 16 * c), *ac);
            }
        }
    }
}
