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
use super::GgmlType;

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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Σ x·y over 32 byte pairs, x unsigned, y signed, as 8 i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// Loads 16 bytes of packed nibbles as 32 bytes: low nibbles first, then high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    unsafe {
        let q = _mm_loadu_si128(p as *const __m128i);
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F))
    }
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

/// One 32-block's contribution: (scale product broadcast, i32 dot as f32, additive term).
type BlockTerms = (__m256, __m256, f32);

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// A 32-element weight block unpacked once, then combined with any number of activations.
#[derive(Clone, Copy)]
struct WeightBlock {
    /// Bytes fed to `vpmaddubsw` as the unsigned operand: the nibbles (Q4_1) or |w| (Q4_0, Q8_0).
    x: __m256i,
    /// The signed weights, whose signs are moved onto the activation (Q4_0, Q8_0).
    sign: __m256i,
    /// Weight scale.
    d: f32,
    /// Weight minimum (Q4_1), else 0.
    m: f32,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack<const KIND: u8>(b: *const u8) -> WeightBlock {
    unsafe {
        match KIND {
            Q4_0 => {
                let w = _mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8));
                WeightBlock { x: _mm256_sign_epi8(w, w), sign: w, d: f16x2(b).0, m: 0.0 }
            }
            Q4_1 => {
                let (d, m) = f16x2(b);
                WeightBlock { x: nibbles(b.add(4)), sign: _mm256_setzero_si256(), d, m }
            }
            _ => {
                let w = _mm256_loadu_si256(b.add(2) as *const __m256i);
                WeightBlock { x: _mm256_sign_epi8(w, w), sign: w, d: f16x2(b).0, m: 0.0 }
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn combine<const KIND: u8>(w: &WeightBlock, yb: &BlockQ8x32) -> BlockTerms {
    unsafe {
        let yv = _mm256_loadu_si256(yb.qs.as_ptr() as *const __m256i);
        let d = _mm256_set1_ps(w.d * yb.d);
        match KIND {
            Q4_1 => (d, _mm256_cvtepi32_ps(dot_u8_i8(w.x, yv)), w.m * yb.s),
            _ => (d, _mm256_cvtepi32_ps(dot_u8_i8(w.x, _mm256_sign_epi8(yv, w.sign))), 0.0),
        }
    }
}

/// Dots one row with `N` activations. Each weight block is unpacked once and reused for every
/// activation; per activation there are two accumulator chains (even / odd blocks) so FMA
/// latency overlaps. The per-activation arithmetic does not depend on `N`, so a row's result is
/// bit-identical whether it is computed alone (matvec) or in a batch (matmul): batching never
/// changes a sequence's output.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_multi<const KIND: u8, const N: usize>(row: &[u8], ys: [&[BlockQ8x32]; N]) -> [f32; N] {
    unsafe {
        let size = match KIND {
            Q4_0 => 18,
            Q4_1 => 20,
            _ => 34,
        };
        let p = row.as_ptr();
        let nb = if N == 0 { 0 } else { ys[0].len() };
        let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
        let (mut add0, mut add1) = ([0f32; N], [0f32; N]);
        let mut i = 0;
        while i + 2 <= nb {
            let w0 = unpack::<KIND>(p.add(size * i));
            let w1 = unpack::<KIND>(p.add(size * (i + 1)));
            for b in 0..N {
                let (d0, p0, a0) = combine::<KIND>(&w0, &ys[b][i]);
                let (d1, p1, a1) = combine::<KIND>(&w1, &ys[b][i + 1]);
                acc0[b] = _mm256_fmadd_ps(d0, p0, acc0[b]);
                acc1[b] = _mm256_fmadd_ps(d1, p1, acc1[b]);
                add0[b] += a0;
                add1[b] += a1;
            }
            i += 2;
        }
        if i < nb {
            let w0 = unpack::<KIND>(p.add(size * i));
            for b in 0..N {
                let (d0, p0, a0) = combine::<KIND>(&w0, &ys[b][i]);
                acc0[b] = _mm256_fmadd_ps(d0, p0, acc0[b]);
                add0[b] += a0;
            }
        }
        let mut out = [0f32; N];
        for b in 0..N {
            out[b] = hsum(_mm256_add_ps(acc0[b], acc1[b])) + (add0[b] + add1[b]);
        }
        out
    }
}

/// Q4_0 / Q4_1 / Q8_0 row against `N` activations (each with one block per weight block).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q32_multi<const N: usize>(
    ty: GgmlType,
    row: &[u8],
    ys: [&[BlockQ8x32]; N],
) -> [f32; N] {
    unsafe {
        match ty {
            GgmlType::Q4_0 => run_multi::<Q4_0, N>(row, ys),
            GgmlType::Q4_1 => run_multi::<Q4_1, N>(row, ys),
            GgmlType::Q8_0 => run_multi::<Q8_0, N>(row, ys),
            _ => [f32::NAN; N],
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_0(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    unsafe { run_multi::<Q4_0, 1>(row, [y])[0] }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    unsafe { run_multi::<Q4_1, 1>(row, [y])[0] }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    unsafe { run_multi::<Q8_0, 1>(row, [y])[0] }
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
