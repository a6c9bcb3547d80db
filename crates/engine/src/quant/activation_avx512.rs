//! Sixteen 32-value activation blocks quantized at once on AVX-512, with the bits of
//! [`super::activation`]'s portable and AVX2 blocks.
//!
//! Why sixteen at a time: one block on AVX2 is a horizontal maximum, two divisions, two
//! horizontal sums and two f16 conversions around eight vector operations of real work, and a
//! prefill quantizes every layer's inputs (~50 M values for 512 tokens: 4–7% of its time went
//! there). Here the per-block steps run once per sixteen blocks, a block per lane: the sixteen
//! blocks' absolute values are folded to one vector of maxima by a transposing tree of shuffles
//! (maxima and integer sums do not depend on the order they are taken in), then one division
//! for all the scales, one for the multipliers, one conversion to f16 and back for each of `d`
//! and `s`. The values themselves go through the same operations as on the other paths —
//! `((v · id) + 1.5·2²³) − 1.5·2²³` (no fused multiply-add), the clamp to ±127, the conversion
//! — so every block has the same bits (`activation::tests`). Sixteen blocks holding a NaN or an
//! infinity anywhere go block by block through the AVX2 path, which hands such a block to the
//! portable one.

use std::arch::x86_64::*;

use super::activation::BlockQ8x32;

/// Where the transposing tree leaves block `j`'s value: lane `PERM[j]` (the permutation is its
/// own inverse).
const PERM: [i32; 16] = [0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15];

/// Lane `j` of the result is `op` folded over all sixteen lanes of `v[j]`. `op` must be
/// commutative and associative for the values given (a maximum, an exact integer sum).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold_each(v: [__m512; 16], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    // Each step halves the vectors: two vectors' halves (then quarters, pairs, single lanes)
    // are interleaved and the two interleavings combined, so each vector holds the partial
    // results of twice as many blocks.
    let n: [__m512; 8] = std::array::from_fn(|j| {
        let (x, y) = (v[j], v[j + 8]);
        op(_mm512_shuffle_f32x4::<0b01_00_01_00>(x, y), _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y))
    });
    let p: [__m512; 4] = std::array::from_fn(|j| {
        let (x, y) = (n[j], n[j + 4]);
        op(_mm512_shuffle_f32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y))
    });
    let q: [__m512; 2] = std::array::from_fn(|j| {
        let (x, y) = (p[j], p[j + 2]);
        op(_mm512_shuffle_ps::<0b01_00_01_00>(x, y), _mm512_shuffle_ps::<0b11_10_11_10>(x, y))
    });
    let r =
        op(_mm512_shuffle_ps::<0b10_00_10_00>(q[0], q[1]), _mm512_shuffle_ps::<0b11_01_11_01>(q[0], q[1]));
    // SAFETY: PERM is sixteen i32s, read unaligned.
    _mm512_permutexvar_ps(unsafe { _mm512_loadu_si512(PERM.as_ptr() as *const __m512i) }, r)
}

/// Blocks `out` (sixteen) of `c` (512 values), as [`super::activation`]'s portable
/// `q8x32_block` makes each.
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2 and F16C are present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
pub(super) unsafe fn q8x32_blocks16(c: &[f32], out: &mut [BlockQ8x32]) {
    assert!(c.len() == 512 && out.len() == 16, "sixteen 32-value blocks");
    let p = c.as_ptr();
    let inf = _mm512_set1_ps(f32::INFINITY);
    let mut bad: __mmask16 = 0;
    // SAFETY: every load reads within `c`'s 512 values (asserted).
    let amax: [__m512; 16] = std::array::from_fn(|j| unsafe {
        let a0 = _mm512_abs_ps(_mm512_loadu_ps(p.add(32 * j)));
        let a1 = _mm512_abs_ps(_mm512_loadu_ps(p.add(32 * j + 16)));
        // NaN or ±∞: |x| compares unordered or not below +∞.
        bad |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a0, inf) | _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a1, inf);
        _mm512_max_ps(a0, a1)
    });
    if bad != 0 {
        for (o, b) in out.iter_mut().zip(c.chunks_exact(32)) {
            // SAFETY: AVX2 and F16C are present (this function's contract).
            *o = unsafe { super::activation::q8x32_block_avx2(b) };
        }
        return;
    }
    // Every block's `amax`, then `d = amax / 127` and `id = 127 / amax` (0 for an all-zero block).
    let am = fold_each(amax, |x, y| _mm512_max_ps(x, y));
    let c127 = _mm512_set1_ps(127.0);
    let d = _mm512_div_ps(am, c127);
    let id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(am, _mm512_setzero_ps()), c127, am);
    let mut ids = [0f32; 16];
    // SAFETY: sixteen f32s.
    unsafe { _mm512_storeu_ps(ids.as_mut_ptr(), id) };
    let (magic, lo, hi) = (_mm512_set1_ps(12_582_912.0), _mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let (mut sums, mut lows) = ([_mm512_setzero_ps(); 16], [_mm512_setzero_ps(); 16]);
    for (j, o) in out.iter_mut().enumerate() {
        let idv = _mm512_set1_ps(ids[j]);
        let round = |x: __m512| {
            let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, idv), magic), magic);
            _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi))
        };
        // SAFETY: within `c` (asserted); each store writes sixteen of the block's 32 bytes.
        unsafe {
            let q0 = round(_mm512_loadu_ps(p.add(32 * j)));
            let q1 = round(_mm512_loadu_ps(p.add(32 * j + 16)));
            _mm_storeu_si128(o.qs.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(o.qs.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
            sums[j] = _mm512_castsi512_ps(_mm512_add_epi32(q0, q1));
            lows[j] = _mm512_castsi512_ps(q0);
        }
    }
    let add = |x: __m512, y: __m512| {
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)))
    };
    let (sum, sum_lo) =
        (_mm512_castps_si512(fold_each(sums, add)), _mm512_castps_si512(fold_each(lows, add)));
    // `d` and `s = d · Σq` (from the unrounded `d`), each rounded to f16 (to nearest, even).
    let s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum));
    let f16 =
        |x: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x));
    let (mut ds, mut ss, mut sums, mut lows) = ([0f32; 16], [0f32; 16], [0i32; 16], [0i32; 16]);
    // SAFETY: sixteen lanes into sixteen-element arrays.
    unsafe {
        _mm512_storeu_ps(ds.as_mut_ptr(), f16(d));
        _mm512_storeu_ps(ss.as_mut_ptr(), f16(s));
        _mm512_storeu_si512(sums.as_mut_ptr() as *mut __m512i, sum);
        _mm512_storeu_si512(lows.as_mut_ptr() as *mut __m512i, sum_lo);
    }
    for (j, o) in out.iter_mut().enumerate() {
        (o.d, o.s, o.sum, o.sum_lo) = (ds[j], ss[j], sums[j], lows[j]);
    }
}
