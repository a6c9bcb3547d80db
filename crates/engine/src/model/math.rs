//! Element-wise math of the forward pass: `exp` for the attention softmax and for SiLU.
//!
//! A long prefill evaluates hundreds of millions of exponentials (every causal score of every head
//! of every layer); through libm's scalar `expf` that was a tenth of the whole prefill. Here `exp`
//! is plain arithmetic — Cody–Waite range reduction, the Cephes single-precision polynomial and an
//! exponent built from bits — so loops over it vectorize, and the loops are compiled again with
//! AVX2 + FMA and with AVX-512, the path chosen at run time as the attention's is
//! ([`Path::best`], capped by `TOKENPATH_KERNEL`), each vector lane doing the scalar operations,
//! and the softmax's sum in one fixed order ([`exp_shift_sum16`]): every CPU path gives the same
//! bits. Accuracy is about 1 ulp over the range the softmax and SiLU use (checked against
//! `f32::exp` in the tests). SiLU and the softmax's maximum on AVX-512 rather than AVX2 made
//! 512- and 2,048-token prefills 3% and 6.5% faster (with the KV write and the logits' hand-over
//! of the same commit; four alternating rounds).

use super::attention::Path;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

const C5: f32 = 1.987_569_1e-4;
const C4: f32 = 1.398_199_9e-3;
const C3: f32 = 8.333_452e-3;
const C2: f32 = 4.166_579_6e-2;
const C1: f32 = 1.666_666_5e-1;
const C0: f32 = 0.5;
/// Round-to-nearest without a libm call: adding 1.5 · 2^23 leaves the integer in the low bits.
const MAGIC: f32 = 12_582_912.0;
const LO: f32 = -87.3;
const HI: f32 = 88.3;

/// `e^x`, within about 1 ulp; 0 below -87.3 (and for -inf), clamped (finite) above 88.3.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = (((((C5 * r + C4) * r + C3) * r + C2) * r + C1) * r + C0) * r * r + r + 1.0;
    let k = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let scale = f32::from_bits((k.wrapping_add(127) << 23) as u32);
    if x < LO {
        0.0
    } else {
        p * scale
    }
}

/// [`exp`] on eight lanes (the same operations, so the same results lane by lane).
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let s = _mm256_set1_ps;
    let xc = _mm256_min_ps(_mm256_max_ps(x, s(LO)), s(HI));
    let t = _mm256_add_ps(_mm256_mul_ps(xc, s(LOG2E)), s(MAGIC));
    let n = _mm256_sub_ps(t, s(MAGIC));
    let r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, s(LN2_HI))), _mm256_mul_ps(n, s(LN2_LO)));
    let mut p = _mm256_add_ps(_mm256_mul_ps(s(C5), r), s(C4));
    for c in [C3, C2, C1, C0] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), s(c));
    }
    let e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), s(1.0));
    let k = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(MAGIC.to_bits() as i32));
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
    let keep = _mm256_cmp_ps(x, s(LO), _CMP_GE_OQ);
    _mm256_and_ps(_mm256_mul_ps(e, scale), keep)
}

/// `h[i] = silu(g[i]) · u[i]` with `silu(g) = g / (1 + e^-g)`.
#[inline(always)]
fn silu_mul_body(g: &[f32], u: &[f32], h: &mut [f32]) {
    for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
        *h = g / (1.0 + exp(-g)) * u;
    }
}

/// `h = silu(g) · u` ([`silu_mul_into`]) eight lanes at a time.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], h: &mut [f32]) {
    use std::arch::x86_64::*;
    unsafe {
        let n = h.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let uv = _mm256_loadu_ps(u.as_ptr().add(i));
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let v = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv);
            _mm256_storeu_ps(h.as_mut_ptr().add(i), v);
        }
        silu_mul_body(&g[n..h.len()], &u[n..h.len()], &mut h[n..]);
    }
}

/// [`silu_mul_avx2`] sixteen lanes at a time, the tail masked: the same operations per value.
///
/// # Safety
/// The CPU supports AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], h: &mut [f32]) {
    use std::arch::x86_64::*;
    let one = _mm512_set1_ps(1.0);
    for i in (0..h.len()).step_by(16) {
        let left = h.len() - i;
        let mask: __mmask16 = if left >= 16 { 0xffff } else { (1u16 << left) - 1 };
        // SAFETY: the loads and the store are masked to lanes `< h.len()`, which `g` and `u`
        // hold too (the caller cut all three to one length).
        unsafe {
            let gv = _mm512_maskz_loadu_ps(mask, g.as_ptr().add(i));
            let uv = _mm512_maskz_loadu_ps(mask, u.as_ptr().add(i));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let v = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv);
            _mm512_mask_storeu_ps(h.as_mut_ptr().add(i), mask, v);
        }
    }
}

pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The largest element (`-inf` for an empty slice), on the widest path this CPU runs.
pub(crate) fn max(xs: &[f32]) -> f32 {
    max_on(Path::best(), xs)
}

/// [`max`] on `path` (a maximum is the same whatever the order it is taken in).
fn max_on(path: Path, xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: the path was picked from the detected CPU (`Path::best`, or a test that
        // checked it).
        Path::Avx512 => return unsafe { max_avx512(xs) },
        Path::Avx2 => return unsafe { max_avx2(xs) },
        Path::Portable => {}
    }
    let _ = path;
    xs.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// The largest of `xs` eight lanes at a time.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn max_avx2(xs: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let chunks = xs.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            m = _mm256_max_ps(m, _mm256_loadu_ps(c.as_ptr()));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |a, &b| a.max(b))
    }
}

/// [`max`] sixteen lanes at a time, the tail masked (masked-off lanes read as `-inf`).
///
/// # Safety
/// The CPU supports AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_avx512(xs: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in xs.chunks(16) {
        let mask: __mmask16 = if c.len() == 16 { 0xffff } else { (1u16 << c.len()) - 1 };
        // SAFETY: the load is masked to the chunk's lanes, all inside `xs`.
        m = _mm512_mask_max_ps(m, mask, m, unsafe { _mm512_maskz_loadu_ps(mask, c.as_ptr()) });
    }
    _mm512_reduce_max_ps(m)
}

/// `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`.
#[inline(always)]
pub(crate) fn fold8(p: &[f32; 8]) -> f32 {
    ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
}

/// [`fold8`] of lanes 0–7 plus [`fold8`] of lanes 8–15.
#[inline(always)]
pub(crate) fn fold16(p: &[f32; 16]) -> f32 {
    let (lo, hi) = p.split_at(8);
    fold8(lo.try_into().expect("8 lanes")) + fold8(hi.try_into().expect("8 lanes"))
}

/// Replaces each `x` by `e^(x - max)` and returns their sum in sixteen lanes — lane `i` adds the
/// values at `i`, `i + 16`, `i + 32`, … in order — folded by [`fold16`]. The decode attention's
/// softmax: one defined order of additions that a 16-lane AVX-512 loop, a two-register AVX2
/// loop and this plain loop all follow, so every path gives the same bits
/// ([`exp_shift_sum16_avx2`], [`exp_shift_sum16_avx512`]).
pub(crate) fn exp_shift_sum16(xs: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0f32; 16];
    for (i, x) in xs.iter_mut().enumerate() {
        *x = exp(*x - max);
        lanes[i % 16] += *x;
    }
    fold16(&lanes)
}

/// [`exp_shift_sum16`] on AVX2: lanes 0–7 and 8–15 in two registers.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_shift_sum16_avx2(xs: &mut [f32], max: f32) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm256_set1_ps(max);
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut chunks = xs.chunks_exact_mut(16);
    // SAFETY: every load and store is of eight values inside a 16-value chunk.
    unsafe {
        for c in &mut chunks {
            let el = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            let eh = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr().add(8)), m));
            _mm256_storeu_ps(c.as_mut_ptr(), el);
            _mm256_storeu_ps(c.as_mut_ptr().add(8), eh);
            lo = _mm256_add_ps(lo, el);
            hi = _mm256_add_ps(hi, eh);
        }
        let mut lanes = [0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
        for (i, x) in chunks.into_remainder().iter_mut().enumerate() {
            *x = exp(*x - max);
            lanes[i] += *x;
        }
        fold16(&lanes)
    }
}

/// [`exp_shift_sum16`] on AVX-512: one register of sixteen lanes, the tail masked.
///
/// # Safety
/// The CPU supports AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn exp_shift_sum16_avx512(xs: &mut [f32], max: f32) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm512_set1_ps(max);
    let mut acc = _mm512_setzero_ps();
    // SAFETY: the masked loads and stores touch only `xs[i..i + 16]`'s lanes inside `xs`.
    unsafe {
        for i in (0..xs.len()).step_by(16) {
            let left = xs.len() - i;
            let mask: __mmask16 = if left >= 16 { 0xffff } else { (1u16 << left) - 1 };
            let p = xs.as_mut_ptr().add(i);
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p), m));
            _mm512_mask_storeu_ps(p, mask, e);
            acc = _mm512_mask_add_ps(acc, mask, acc, e);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        fold16(&lanes)
    }
}

/// [`exp`] on sixteen lanes (the same operations, so the same results lane by lane).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let s = _mm512_set1_ps;
    let xc = _mm512_min_ps(_mm512_max_ps(x, s(LO)), s(HI));
    let t = _mm512_add_ps(_mm512_mul_ps(xc, s(LOG2E)), s(MAGIC));
    let n = _mm512_sub_ps(t, s(MAGIC));
    let r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, s(LN2_HI))), _mm512_mul_ps(n, s(LN2_LO)));
    let mut p = _mm512_add_ps(_mm512_mul_ps(s(C5), r), s(C4));
    for c in [C3, C2, C1, C0] {
        p = _mm512_add_ps(_mm512_mul_ps(p, r), s(c));
    }
    let e = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), s(1.0));
    let k = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(MAGIC.to_bits() as i32));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(k, _mm512_set1_epi32(127))));
    let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, s(LO));
    _mm512_maskz_mov_ps(keep, _mm512_mul_ps(e, scale))
}

/// SwiGLU: `silu(g) · u`, element-wise.
/// `h[i] = silu(g[i]) · u[i]` (as long as the shortest of the three), in chunks on every thread:
/// each value's arithmetic is the same whichever chunk it falls in (the chunks are whole vectors).
pub(crate) fn silu_mul_into(g: &[f32], u: &[f32], h: &mut [f32]) {
    silu_mul_on(Path::best(), g, u, h)
}

/// [`silu_mul_into`] on `path`.
fn silu_mul_on(path: Path, g: &[f32], u: &[f32], h: &mut [f32]) {
    use rayon::prelude::*;
    const CHUNK: usize = 4096;
    let n = h.len().min(g.len()).min(u.len());
    let chunk = |(i, hc): (usize, &mut [f32])| {
        let (g, u) = (&g[i * CHUNK..][..hc.len()], &u[i * CHUNK..][..hc.len()]);
        #[cfg(target_arch = "x86_64")]
        match path {
            // SAFETY: the path was picked from the detected CPU (`Path::best`, or a test that
            // checked it); the three slices have one length.
            Path::Avx512 => return unsafe { silu_mul_avx512(g, u, hc) },
            Path::Avx2 => return unsafe { silu_mul_avx2(g, u, hc) },
            Path::Portable => {}
        }
        silu_mul_body(g, u, hc);
    };
    // One chunk (a decode step's few rows): no parallel region, which would cost more.
    if n <= CHUNK {
        chunk((0, &mut h[..n]));
    } else {
        h[..n].par_chunks_mut(CHUNK).enumerate().for_each(chunk);
    }
}

/// Where [`f16_rows_to_f32`] reads: `count` runs of `len` values, `stride` apart from `first`;
/// and where it writes them: `out_stride` apart from the start of the output.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows {
    pub first: usize,
    pub stride: usize,
    pub len: usize,
    pub count: usize,
    pub out_stride: usize,
}

/// `rows` runs of `hd` f16 values, `stride` apart in `src` from `first`, into `dst` (run `r` at
/// `r · out_stride`) as f32 — exact on every path. The attention's one read of the cache: `half`'s slice
/// conversion checks the CPU on every call, and at a 64-value row per call that check and the
/// call cost more than the conversion (a tenth of a decode step at 600 tokens of context); here
/// the check is made once per block and F16C converts eight values per instruction.
pub(crate) fn f16_rows_to_f32(src: &[half::f16], at: Rows, dst: &mut [f32]) {
    let Rows { first, stride, len: hd, count: rows, out_stride } = at;
    if rows == 0 {
        return;
    }
    assert!(
        first + (rows - 1) * stride + hd <= src.len() && (rows - 1) * out_stride + hd <= dst.len(),
        "f16 rows out of bounds"
    );
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx") {
        // SAFETY: features detected; the assert above bounds every read and write.
        unsafe { f16_rows_f16c(src, at, dst) };
        return;
    }
    for r in 0..rows {
        let s = &src[first + r * stride..][..hd];
        for (d, x) in dst[r * out_stride..][..hd].iter_mut().zip(s) {
            *d = x.to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_rows_f16c(src: &[half::f16], at: Rows, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let Rows { first, stride, len: hd, count: rows, out_stride } = at;
    unsafe {
        let wide = hd / 8 * 8;
        for r in 0..rows {
            let s = src.as_ptr().add(first + r * stride);
            let d = dst.as_mut_ptr().add(r * out_stride);
            for i in (0..wide).step_by(8) {
                _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(_mm_loadu_si128(s.add(i) as *const __m128i)));
            }
            for i in wide..hd {
                *d.add(i) = (*s.add(i)).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn f16_rows_convert_exactly_on_every_path() {
        let src: Vec<half::f16> = (0..700).map(|i| half::f16::from_f32((i as f32 - 350.0) * 0.37)).collect();
        for (first, stride, hd, rows, out) in
            [(0, 64, 64, 10, 64), (5, 70, 13, 7, 13), (3, 9, 9, 1, 9), (0, 1, 1, 0, 1), (2, 16, 11, 9, 40)]
        {
            let mut got = vec![0f32; rows * out];
            f16_rows_to_f32(&src, Rows { first, stride, len: hd, count: rows, out_stride: out }, &mut got);
            for r in 0..rows {
                for i in 0..hd {
                    assert_eq!(got[r * out + i].to_bits(), src[first + r * stride + i].to_f32().to_bits());
                }
            }
        }
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    proptest! {
        #[test]
        fn exp_is_within_two_ulps_of_libm(x in -87.0f32..88.0) {
            let (ours, libm) = (exp(x), x.exp());
            prop_assert!(ulps(ours, libm) <= 2, "exp({x}) = {ours} vs {libm}");
        }
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(100.0).is_finite());
        for x in [-30.0f32, -1.0, -1e-6, 1e-6, 0.5, 10.0] {
            assert!(ulps(exp(x), x.exp()) <= 2, "{x}");
        }
    }

    #[test]
    fn the_sixteen_lane_softmax_sum_gives_the_same_bits_on_every_path() {
        // Lengths below, at and past a vector, with tails of every size.
        for n in [0, 1, 7, 8, 15, 16, 17, 31, 33, 100, 577] {
            let xs: Vec<f32> = (0..n).map(|i| (i as f32 * 0.61).sin() * 30.0 - 5.0).collect();
            let max = xs.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut plain = xs.clone();
            let sum = exp_shift_sum16(&mut plain, max);
            let libm: f32 = xs.iter().map(|x| (x - max).exp()).sum();
            assert!((sum - libm).abs() <= 1e-5 * libm.max(1.0), "{n}: {sum} vs {libm}");
            #[cfg(target_arch = "x86_64")]
            {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                if has_avx2() {
                    let mut v = xs.clone();
                    // SAFETY: AVX2 and FMA detected.
                    let s = unsafe { exp_shift_sum16_avx2(&mut v, max) };
                    assert_eq!((s.to_bits(), bits(&v)), (sum.to_bits(), bits(&plain)), "avx2, {n}");
                }
                if is_x86_feature_detected!("avx512f") {
                    let mut v = xs.clone();
                    // SAFETY: AVX-512 F detected.
                    let s = unsafe { exp_shift_sum16_avx512(&mut v, max) };
                    assert_eq!((s.to_bits(), bits(&v)), (sum.to_bits(), bits(&plain)), "avx512, {n}");
                }
            }
        }
    }

    #[test]
    fn max_and_silu_give_the_same_bits_on_every_path() {
        let xs: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin() * 20.0).collect();
        let plain_max = |xs: &[f32]| xs.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Long enough for several chunks, with a tail that is no whole vector; with the
        // infinities and the large values `exp` clamps.
        let mut g: Vec<f32> = (0..10_007).map(|i| (i as f32 * 0.37).sin() * 20.0).collect();
        g[..4].copy_from_slice(&[f32::INFINITY, f32::NEG_INFINITY, 95.0, -95.0]);
        let u: Vec<f32> = g.iter().map(|x| x * 0.5 - 1.0).collect();
        let mut one = vec![0f32; g.len()];
        silu_mul_body(&g, &u, &mut one);
        for path in crate::model::attention::available_paths() {
            // The largest value in every lane of every vector and of the tail.
            for n in 0..=xs.len() {
                assert_eq!(max_on(path, &xs[..n]), plain_max(&xs[..n]), "{path:?}, {n}");
                for at in 0..n {
                    let mut ys = xs[..n].to_vec();
                    ys[at] = 100.0;
                    assert_eq!(max_on(path, &ys), 100.0, "{path:?}, {n}, largest at {at}");
                }
            }
            for n in [g.len(), 4096, 29, 3] {
                let mut h = vec![0f32; n];
                silu_mul_on(path, &g[..n], &u[..n], &mut h);
                assert_eq!(
                    bits(&h),
                    bits(&one[..n]),
                    "{path:?}: chunked and vectorized against the plain loop, {n}"
                );
            }
        }
        for ((h, g), u) in one.iter().zip(&g).zip(&u).skip(4) {
            let want = g / (1.0 + (-g).exp()) * u;
            assert!((h - want).abs() <= 1e-5 * (1.0 + want.abs()), "{h} vs {want}");
        }
    }
}
