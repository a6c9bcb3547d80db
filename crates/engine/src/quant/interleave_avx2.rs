//! The repacked products on AVX2 + FMA + F16C: one group of eight rows, one row per 32-bit lane,
//! one `vpmaddubsw` advancing the eight rows by four products against four broadcast activation
//! bytes (see `interleave_pack.rs` for the layouts and `interleave.rs` for the numerics).
//!
//! Safety contract: the CPU supports avx2, fma and f16c, and `w` holds one group unit per
//! activation unit (checked by `matmul_group_interleaved`).

use std::arch::x86_64::*;

use super::activation::BlockQ8x32;
use super::interleave::{tile_for, GROUP};
use super::interleave_pack::{
    min_bytes_at, quants_at, scale_bytes_at, unit_of, Q4_1_KIND as Q4_1, Q4_K_KIND as Q4_K, Q5_0_HIGH,
    Q5_0_KIND as Q5_0, Q6_K_KIND as Q6_K, Q8_0_KIND as Q8_0,
};

/// Eight rows (one group) × `ys.len()` (1 to 4) activations of kind `kind`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_any(kind: u8, w: &[u8], ys: &[&[BlockQ8x32]], out: &mut [[f32; GROUP]]) {
    unsafe { tile_for!(tile, kind, ys, (w), out) }
}

/// Steps (four products per row each) whose `vpmaddubsw` results add up in 16 bits before they
/// are widened: each result is at most 2 · |w|max · 127 (activations are within ±127), so
/// Q8_0 (|w| ≤ 127) widens every step, Q6_K (|w| ≤ 32) and Q5_0 (`q + 16` ≤ 31) every four,
/// the nibbles (≤ 15) every eight. The integer dot is exact either way: every path gives the
/// same bits.
const fn steps_in_16_bits(kind: u8) -> usize {
    match kind {
        Q8_0 => 1,
        Q6_K | Q5_0 => 4,
        _ => 8,
    }
}

/// Eight bytes at `p` as f32 lanes, unsigned (`SIGNED == false`) or signed.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_ps<const SIGNED: bool>(p: *const u8) -> __m256 {
    unsafe {
        let v = _mm_loadl_epi64(p as *const __m128i);
        _mm256_cvtepi32_ps(if SIGNED { _mm256_cvtepi8_epi32(v) } else { _mm256_cvtepu8_epi32(v) })
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const KIND: u8, const CC: usize>(w: &[u8], ys: [&[BlockQ8x32]; CC], out: &mut [[f32; GROUP]]) {
    unsafe {
        let signed = KIND == Q8_0 || KIND == Q6_K;
        let per16 = steps_in_16_bits(KIND);
        let nb = ys[0].len();
        let low4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); CC];
        let mut accm = [_mm256_setzero_ps(); CC];
        let p = w.as_ptr();
        for b in 0..nb {
            let (base, sub) = unit_of(KIND, b);
            let unit = p.add(base);
            let blk = unit.add(quants_at(KIND, sub));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(unit as *const __m128i));
            // Per-row weight scales (Q6_K: one per 16-element half) and minimum terms.
            let (dw, dw_hi) = match KIND {
                Q4_K => (_mm256_mul_ps(d, bytes_ps::<false>(unit.add(scale_bytes_at(KIND, sub, 0)))), d),
                Q6_K => (
                    _mm256_mul_ps(d, bytes_ps::<true>(unit.add(scale_bytes_at(KIND, sub, 0)))),
                    _mm256_mul_ps(d, bytes_ps::<true>(unit.add(scale_bytes_at(KIND, sub, 1)))),
                ),
                _ => (d, d),
            };
            let mw = match KIND {
                Q4_1 => _mm256_cvtph_ps(_mm_loadu_si128(unit.add(16) as *const __m128i)),
                Q4_K => _mm256_mul_ps(
                    _mm256_cvtph_ps(_mm_loadu_si128(unit.add(16) as *const __m128i)),
                    bytes_ps::<false>(unit.add(min_bytes_at(sub))),
                ),
                _ => _mm256_setzero_ps(),
            };
            // Unsigned operands for `vpmaddubsw` (nibbles, or |w| for the signed kinds) and the
            // signed kinds' signs.
            let mut q = [_mm256_setzero_si256(); 8];
            let mut sg = [_mm256_setzero_si256(); 8];
            if signed {
                for (st, (qv, sv)) in q.iter_mut().zip(sg.iter_mut()).enumerate() {
                    let v = _mm256_loadu_si256(blk.add(32 * st) as *const __m256i);
                    *qv = _mm256_sign_epi8(v, v);
                    *sv = v;
                }
            } else {
                for c in 0..4 {
                    let v = _mm256_loadu_si256(blk.add(32 * c) as *const __m256i);
                    q[2 * c] = _mm256_and_si256(v, low4);
                    q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                }
                if KIND == Q5_0 {
                    // Bit `st` of each byte is step `st`'s fifth bit (see the AVX-512 tile).
                    let h = _mm256_loadu_si256(blk.add(Q5_0_HIGH) as *const __m256i);
                    let at4 = [
                        _mm256_slli_epi16(h, 4),
                        _mm256_slli_epi16(h, 3),
                        _mm256_slli_epi16(h, 2),
                        _mm256_slli_epi16(h, 1),
                        h,
                        _mm256_srli_epi16(h, 1),
                        _mm256_srli_epi16(h, 2),
                        _mm256_srli_epi16(h, 3),
                    ];
                    let bit4 = _mm256_set1_epi8(0x10);
                    for (qv, hv) in q.iter_mut().zip(at4) {
                        *qv = _mm256_or_si256(*qv, _mm256_and_si256(hv, bit4));
                    }
                }
            }
            for k in 0..CC {
                let yb = ys[k].get_unchecked(b);
                let a = yb.qs.as_ptr() as *const i32;
                let step = |st: usize| {
                    let y = _mm256_set1_epi32(std::ptr::read_unaligned(a.add(st)));
                    if signed {
                        _mm256_maddubs_epi16(q[st], _mm256_sign_epi8(y, sg[st]))
                    } else {
                        _mm256_maddubs_epi16(q[st], y)
                    }
                };
                // The exact integer dot of steps `from..to`: runs of `per16` steps added in 16
                // bits, each run widened once.
                let dot = |from: usize, to: usize| {
                    let run = |at: usize| {
                        let mut s = step(at);
                        for st in at + 1..(at + per16).min(to) {
                            s = _mm256_add_epi16(s, step(st));
                        }
                        _mm256_madd_epi16(s, ones)
                    };
                    let mut s = run(from);
                    let mut at = from + per16;
                    while at < to {
                        s = _mm256_add_epi32(s, run(at));
                        at += per16;
                    }
                    if KIND == Q5_0 {
                        // Σ (q + 16) · a − 16 · Σ a: the signed values' exact dot.
                        s = _mm256_sub_epi32(s, _mm256_set1_epi32(16 * yb.sum));
                    }
                    _mm256_cvtepi32_ps(s)
                };
                let yd = _mm256_set1_ps(yb.d);
                if KIND == Q6_K {
                    acc[k] = _mm256_fmadd_ps(dot(0, 4), _mm256_mul_ps(dw, yd), acc[k]);
                    acc[k] = _mm256_fmadd_ps(dot(4, 8), _mm256_mul_ps(dw_hi, yd), acc[k]);
                } else {
                    acc[k] = _mm256_fmadd_ps(dot(0, 8), _mm256_mul_ps(dw, yd), acc[k]);
                }
                if KIND == Q4_1 {
                    accm[k] = _mm256_fmadd_ps(mw, _mm256_set1_ps(yb.s), accm[k]);
                } else if KIND == Q4_K {
                    // `acc_m - dmin·m · s_a`, one rounding: the portable `fma(-(dmin·m), s_a, acc_m)`.
                    accm[k] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(yb.s), accm[k]);
                }
            }
        }
        for k in 0..CC {
            _mm256_storeu_ps(out[k].as_mut_ptr(), _mm256_add_ps(acc[k], accm[k]));
        }
    }
}
