//! AVX2 + FMA + F16C dot kernels (x86_64 only), selected at run time.
//!
//! Each function mirrors its twin in `dot_scalar.rs`: unpack a block's 4/6/8-bit weights to
//! bytes, multiply them with the i8 activations using `vpmaddubsw` (u8 × i8 → i16 pairs) and
//! `vpmaddwd` (→ i32, applying sub-block scales on the way), convert one i32 vector per block to
//! f32 and fold it in with one FMA. Per-block float work is the same as the scalar path, so the
//! two agree up to summation order. The activation quantization never produces -128, which keeps
//! the `vpsignb` trick for signed weights exact.
//!
//! Safety contract for every function here: the CPU supports avx2, fma and f16c (checked by the
//! dispatcher with `is_x86_feature_detected!`), and `row` holds exactly one weight block per
//! activation block (checked by the public entry points). All loads are unaligned loads inside
//! those bounds.

use std::arch::x86_64::*;

use super::activation::{BlockQ8K, BlockQ8x32};
use super::reference::q4k_scale_min;
use super::tile_avx2;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_load(p: *const u8) -> f32 {
    unsafe {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
}

/// Converts the two f16 values at `p[0..4]`. A full 32-bit load (`vmovd`, which zeroes the rest
/// of the register) avoids the false dependency a 16-bit insert would put on whatever register
/// the compiler picks, which otherwise serializes the block loop on the accumulator.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x2(p: *const u8) -> (f32, f32) {
    unsafe {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }
}

/// Sum of the eight lanes (the one horizontal sum every AVX2 kernel ends with).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    unsafe {
        let n = x.len();
        let w = row.as_ptr() as *const f32;
        let (mut a0, mut a1, mut a2, mut a3) =
            (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            let xp = x.as_ptr().add(i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(i)), _mm256_loadu_ps(xp), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(i + 8)), _mm256_loadu_ps(xp.add(8)), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(i + 16)), _mm256_loadu_ps(xp.add(16)), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(i + 24)), _mm256_loadu_ps(xp.add(24)), a3);
            i += 32;
        }
        while i + 8 <= n {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(i)), _mm256_loadu_ps(x.as_ptr().add(i)), a0);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        while i < n {
            s += std::ptr::read_unaligned(w.add(i)) * x[i];
            i += 1;
        }
        s
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    unsafe {
        let n = x.len();
        let w = row.as_ptr();
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            let w0 = _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i) as *const __m128i));
            let w1 = _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i + 16) as *const __m128i));
            a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x.as_ptr().add(i)), a0);
            a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.as_ptr().add(i + 8)), a1);
            i += 16;
        }
        let mut s = hsum(_mm256_add_ps(a0, a1));
        while i < n {
            s += f16_load(w.add(2 * i)) * x[i];
            i += 1;
        }
        s
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_0(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    unsafe { tile_avx2::dot::<{ tile_avx2::Q4_0 }>(row, y) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    unsafe { tile_avx2::dot::<{ tile_avx2::Q4_1 }>(row, y) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    unsafe { tile_avx2::dot::<{ tile_avx2::Q8_0 }>(row, y) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    unsafe {
        let mask = _mm256_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = 0f32;
        for (b, yb) in row.chunks_exact(144).zip(y) {
            let p = b.as_ptr();
            let (d, dmin) = f16x2(p);
            let (d, dmin) = (d * yb.d, dmin * yb.d);
            let scales = &b[4..16];
            let mut sumi = _mm256_setzero_si256();
            let mut summ = 0i32;
            for c in 0..4 {
                let (sc1, m1) = q4k_scale_min(2 * c, scales);
                let (sc2, m2) = q4k_scale_min(2 * c + 1, scales);
                summ += m1 as i32 * (yb.bsums[4 * c] as i32 + yb.bsums[4 * c + 1] as i32);
                summ += m2 as i32 * (yb.bsums[4 * c + 2] as i32 + yb.bsums[4 * c + 3] as i32);
                let q = _mm256_loadu_si256(p.add(16 + 32 * c) as *const __m256i);
                let lo = _mm256_and_si256(q, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                let y0 = _mm256_loadu_si256(yb.qs.as_ptr().add(64 * c) as *const __m256i);
                let y1 = _mm256_loadu_si256(yb.qs.as_ptr().add(64 * c + 32) as *const __m256i);
                let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), _mm256_set1_epi16(sc1 as i16));
                let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), _mm256_set1_epi16(sc2 as i16));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            acc_m += dmin * summ as f32;
        }
        hsum(acc) - acc_m
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q6_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut acc_off = 0f32;
        for (b, yb) in row.chunks_exact(210).zip(y) {
            let p = b.as_ptr();
            // `d` is the last field; read it with the two scale bytes before it to stay in bounds.
            let d = f16x2(p.add(206)).1 * yb.d;
            let sc = &b[192..208];
            // The stored 6-bit values are q + 32: subtract 32·Σ sc_g·Σ y_g once per block.
            let off: i32 = sc.iter().zip(&yb.bsums).map(|(&s, &bs)| s as i8 as i32 * bs as i32).sum();
            let mut sumi = _mm256_setzero_si256();
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
                let ql1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0xC0u8 as i8)), 2),
                    ),
                ];
                for (k, &qk) in q.iter().enumerate() {
                    let yv = _mm256_loadu_si256(yb.qs.as_ptr().add(128 * h + 32 * k) as *const __m256i);
                    let s_lo = sc[8 * h + 2 * k] as i8 as i16;
                    let s_hi = sc[8 * h + 2 * k + 1] as i8 as i16;
                    let s = _mm256_set_m128i(_mm_set1_epi16(s_hi), _mm_set1_epi16(s_lo));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(qk, yv), s));
                }
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            acc_off += d * (32 * off) as f32;
        }
        hsum(acc) - acc_off
    }
}
