//! Activation vectors prepared for the integer dot kernels.
//!
//! Decode is a matrix-vector product per weight matrix: the same activation vector meets every
//! row. Following llama.cpp, the vector is quantized once to 8-bit blocks, so each row's dot
//! product becomes an integer multiply-add over bytes (`vpmaddubsw`), which is what lets the
//! kernel keep up with memory bandwidth. Two block shapes exist because the weight formats
//! group differently: 32-element blocks for Q4_0/Q4_1/Q8_0 and 256-element super-blocks with
//! 16-element partial sums for the K-quants (the sums fold the K-quants' minimums and Q6_K's
//! -32 offset into one multiply per sub-block). F32/F16 weights take the vector as is.
//!
//! The 32-element blocks reproduce ggml's Q8_0/Q8_1 activation numerics exactly — scale rounded
//! to f16, `127 / amax` as the multiplier, round-half-to-even (what ggml's AVX2 path does), and
//! `s = d · Σq` from the unrounded `d`, rounded to f16 — because 8-bit activation noise is the largest numeric effect in a
//! quantized forward pass (about ±0.8 on the logits of the default model against an f32
//! reference), so this removes the one systematic difference from llama.cpp, the correctness
//! oracle. (Bit-identical logits would also need ggml's summation orders: with 8-bit
//! quantization between layers, a one-ulp change anywhere flips roundings and grows to the size
//! of the quantization noise — see the engine parity test.) Scales are f32 holding the f16 value. The quantization is symmetric in
//! [-127, 127] so the AVX2 sign trick can never meet -128.

use super::ActivationKind;
use crate::error::{EngineError, Result};

/// 32 activations as i8 with scale `d`; `s = d * sum(qs)` serves the Q4_1 minimum term.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[repr(C)]
pub struct BlockQ8x32 {
    /// Quantized values in [-127, 127].
    pub qs: [i8; 32],
    /// Scale: value ≈ qs · d.
    pub d: f32,
    /// `d * Σ qs`.
    pub s: f32,
    /// `Σ qs`, exact: the Q5_0 tiles multiply unsigned `q + 16` and take `16 · Σ qs` off (the
    /// AVX-512 Q8_0 tile: `w + 128`, `128 · Σ qs`).
    pub sum: i32,
    /// `Σ qs[..16]`, exact: the AVX-512 Q6_K tile's two halves each take `32 · Σ` of their own
    /// sixteen values off (it multiplies the unsigned `q6 = w + 32`).
    pub sum_lo: i32,
}

/// 256 activations as i8 with scale `d` and the sums of each 16-element group.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Quantized values in [-127, 127].
    pub qs: [i8; 256],
    /// `Σ qs[16 g .. 16 g + 16]` for g in 0..16.
    pub bsums: [i16; 16],
    /// Scale: value ≈ qs · d.
    pub d: f32,
}

/// An activation vector in the form one family of dot kernels consumes.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantizedActivation {
    /// Unquantized, for F32/F16 weights.
    F32(Vec<f32>),
    /// For Q4_0 / Q4_1 / Q8_0 weights.
    Q8x32(Vec<BlockQ8x32>),
    /// For Q4_K / Q6_K weights.
    Q8K(Vec<BlockQ8K>),
}

/// Symmetric i8 quantization of one block: returns (scale, inverse scale).
fn block_scale(x: &[f32]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 && d.is_finite() { 1.0 / d } else { 0.0 };
    (d, id)
}

#[inline]
fn q8(v: f32, id: f32) -> i8 {
    // Round half to even without a libm call: |v · id| ≤ 127 by construction, and adding then
    // subtracting 1.5·2^23 leaves exactly the nearest-even integer for |x| < 2^22 (Rust never
    // reassociates float arithmetic, so this is not folded away). `as` saturates and maps NaN to
    // 0, so no input can produce -128 or panic.
    const MAGIC: f32 = 12_582_912.0;
    (((v * id) + MAGIC) - MAGIC).clamp(-127.0, 127.0) as i8
}

/// ggml's 32-block activation scale: (`amax / 127` unrounded, `127 / amax`). The block stores
/// the scale rounded to f16, but `s` is computed from the unrounded one, as ggml does.
fn block_scale_32(x: &[f32]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let id = if amax > 0.0 && amax.is_finite() { 127.0 / amax } else { 0.0 };
    (amax / 127.0, id)
}

/// `x` (a multiple of 32 long) as 32-element blocks: on AVX2 eight values per instruction,
/// with the portable path's operations per value, so the same bits (a tenth of a prefill's time
/// went to this loop written per value).
fn quantize_q8x32(x: &[f32]) -> Vec<BlockQ8x32> {
    let mut out = vec![BlockQ8x32::default(); x.len() / 32];
    quantize_q8x32_into(x, &mut out);
    out
}

/// [`quantize_q8x32`] into `out` (one block per 32 values of `x`).
pub(crate) fn quantize_q8x32_into(x: &[f32], out: &mut [BlockQ8x32]) {
    assert_eq!(x.len(), out.len() * 32, "32 values a block");
    #[cfg(target_arch = "x86_64")]
    if super::Kernel::best() >= super::Kernel::Avx512 {
        let whole = out.len() / 16 * 16;
        let (head, tail) = out.split_at_mut(whole);
        for (o, c) in head.chunks_exact_mut(16).zip(x.chunks_exact(512)) {
            // SAFETY: `Kernel::best` only picks a family this CPU runs; AVX-512's includes AVX-512
            // F/BW/VL, AVX2 and F16C.
            unsafe { super::activation_avx512::q8x32_blocks16(c, o) };
        }
        for (o, c) in tail.iter_mut().zip(x[32 * whole..].chunks_exact(32)) {
            // SAFETY: as above.
            *o = unsafe { q8x32_block_avx2(c) };
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::Kernel::best() >= super::Kernel::Avx2 {
        for (o, c) in out.iter_mut().zip(x.chunks_exact(32)) {
            // SAFETY: `Kernel::best` only picks a family this CPU runs, and AVX2's includes F16C.
            *o = unsafe { q8x32_block_avx2(c) };
        }
        return;
    }
    for (o, c) in out.iter_mut().zip(x.chunks_exact(32)) {
        *o = q8x32_block(c);
    }
}

/// One 32-element block, the portable way.
pub(super) fn q8x32_block(c: &[f32]) -> BlockQ8x32 {
    let (d, id) = block_scale_32(c);
    let mut qs = [0i8; 32];
    for (q, &v) in qs.iter_mut().zip(c) {
        *q = q8(v, id);
    }
    let sum: i32 = qs.iter().map(|&q| q as i32).sum();
    BlockQ8x32 {
        qs,
        d: half::f16::from_f32(d).to_f32(),
        s: half::f16::from_f32(d * sum as f32).to_f32(),
        sum,
        sum_lo: qs[..16].iter().map(|&q| q as i32).sum(),
    }
}

/// [`q8x32_block`] on AVX2 + F16C: the same multiply, add and subtract of the magic constant
/// per value (no fused operations), the same clamp, an exact integer sum and the same
/// round-to-nearest-even f16 conversions. A block holding a NaN or an infinity takes the
/// portable path (only there do the clamp's and the conversion's NaN rules differ).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn q8x32_block_avx2(c: &[f32]) -> BlockQ8x32 {
    use std::arch::x86_64::*;
    assert_eq!(c.len(), 32);
    // SAFETY: `c` holds 32 values (asserted); the stores write into `qs`'s 32 bytes.
    unsafe {
        let p = c.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (mut m, mut odd) = (_mm256_setzero_ps(), 0);
        for vi in v {
            m = _mm256_max_ps(_mm256_and_ps(vi, abs_mask), m);
            // NaN or ±∞: |x| compares unordered or not below +∞.
            let bad =
                _mm256_cmp_ps::<_CMP_NLT_UQ>(_mm256_and_ps(vi, abs_mask), _mm256_set1_ps(f32::INFINITY));
            odd |= _mm256_movemask_ps(bad);
        }
        if odd != 0 {
            return q8x32_block(c);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
        let (d, id) = (amax / 127.0, if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let (idv, magic) = (_mm256_set1_ps(id), _mm256_set1_ps(12_582_912.0));
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let round = |x: __m256| {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, idv), magic), magic);
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        };
        let q = [round(v[0]), round(v[1]), round(v[2]), round(v[3])];
        let hsum = |v: __m256i| {
            let t4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let t2 = _mm_add_epi32(t4, _mm_shuffle_epi32::<0b01_00_11_10>(t4));
            _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32::<0b10_11_00_01>(t2)))
        };
        let lo16 = _mm256_add_epi32(q[0], q[1]);
        let (sum, sum_lo) = (hsum(_mm256_add_epi32(lo16, _mm256_add_epi32(q[2], q[3]))), hsum(lo16));
        // packs work within 128-bit lanes: the dwords come out as elements 0-3, 8-11, 16-19,
        // 24-27, 4-7, 12-15, 20-23, 28-31; the permute puts them in order.
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        let mut qs = [0i8; 32];
        _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, bytes);
        let halves =
            _mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_setr_ps(d, d * sum as f32, 0.0, 0.0)));
        let mut ds = [0f32; 4];
        _mm_storeu_ps(ds.as_mut_ptr(), halves);
        BlockQ8x32 { qs, d: ds[0], s: ds[1], sum, sum_lo }
    }
}

impl QuantizedActivation {
    /// Prepares `x` for weights whose kernels take `kind`. `x.len()` must be a multiple of the
    /// block size (32 or 256) for the quantized kinds.
    pub fn new(kind: ActivationKind, x: &[f32]) -> Result<Self> {
        let block = kind.block_size();
        if x.len().checked_rem(block) != Some(0) {
            return Err(EngineError::shape(
                format!("activation quantization ({kind:?})"),
                format!("a length that is a multiple of {block}"),
                x.len(),
            ));
        }
        Ok(match kind {
            ActivationKind::F32 => Self::F32(x.to_vec()),
            ActivationKind::Q8x32 => Self::Q8x32(quantize_q8x32(x)),
            ActivationKind::Q8K => Self::Q8K(
                x.chunks_exact(256)
                    .map(|c| {
                        let (d, id) = block_scale(c);
                        let mut qs = [0i8; 256];
                        for (q, &v) in qs.iter_mut().zip(c) {
                            *q = q8(v, id);
                        }
                        let mut bsums = [0i16; 16];
                        for (s, g) in bsums.iter_mut().zip(qs.chunks_exact(16)) {
                            *s = g.iter().map(|&q| q as i16).sum();
                        }
                        BlockQ8K { qs, bsums, d }
                    })
                    .collect(),
            ),
        })
    }

    /// Which kernel family this activation feeds.
    pub fn kind(&self) -> ActivationKind {
        match self {
            Self::F32(_) => ActivationKind::F32,
            Self::Q8x32(_) => ActivationKind::Q8x32,
            Self::Q8K(_) => ActivationKind::Q8K,
        }
    }

    /// Number of activation elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Q8x32(v) => v.len() * 32,
            Self::Q8K(v) => v.len() * 256,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values this activation stands for (dequantized), for tests and error analysis.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Self::F32(v) => v.clone(),
            Self::Q8x32(v) => v.iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d)).collect(),
            Self::Q8K(v) => v.iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d)).collect(),
        }
    }
}

impl ActivationKind {
    /// Elements per activation block (1 for F32).
    pub fn block_size(self) -> usize {
        match self {
            ActivationKind::F32 => 1,
            ActivationKind::Q8x32 => 32,
            ActivationKind::Q8K => 256,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_blocks_are_symmetric_and_sums_match() {
        let x: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) * 0.01).collect();
        let QuantizedActivation::Q8K(b) = QuantizedActivation::new(ActivationKind::Q8K, &x).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!(b[0].qs[0], -127);
        for g in 0..16 {
            let s: i16 = b[0].qs[16 * g..16 * g + 16].iter().map(|&q| q as i16).sum();
            assert_eq!(s, b[0].bsums[g]);
        }
        let a = QuantizedActivation::new(ActivationKind::Q8x32, &x).unwrap();
        for (u, v) in a.to_f32().iter().zip(&x) {
            assert!((u - v).abs() <= 1.28 / 127.0 / 2.0 + 1e-6);
        }
    }

    #[test]
    fn bad_length_and_non_finite_input_do_not_panic() {
        assert!(QuantizedActivation::new(ActivationKind::Q8x32, &[1.0; 33]).is_err());
        let mut x = vec![0f32; 32];
        x[3] = f32::NAN;
        x[4] = f32::INFINITY;
        let a = QuantizedActivation::new(ActivationKind::Q8x32, &x).unwrap();
        assert_eq!(a.len(), 32);
        let zeros = QuantizedActivation::new(ActivationKind::Q8x32, &[0.0; 32]).unwrap();
        assert!(zeros.to_f32().iter().all(|v| *v == 0.0));
    }

    #[test]
    fn q8x32_blocks_have_the_same_bits_on_every_path() {
        use rand_chacha::rand_core::{RngCore, SeedableRng};
        if !crate::quant::Kernel::Avx2.is_available() {
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let specials =
            [0.0, -0.0, 0.5, -0.5, 1.5, 2.5, 1e-40, -1e-38, 65504.0, 1e30, -3e38, f32::MIN_POSITIVE];
        // Blocks that may hold a NaN or an infinity, and blocks that cannot.
        let mut groups: [Vec<(Vec<f32>, BlockQ8x32)>; 2] = [Vec::new(), Vec::new()];
        for n in 0..20_000 {
            let c: Vec<f32> = (0..32)
                .map(|i| match (n % 6, rng.next_u32()) {
                    // Arbitrary bit patterns: NaN, infinities, subnormals and all.
                    (0, r) => f32::from_bits(r),
                    (1, r) => specials[r as usize % specials.len()],
                    // Ties: multiples of amax / 254 (amax = 127 here) land halfway.
                    (2, r) => {
                        if i == 0 {
                            127.0
                        } else {
                            (r % 255) as f32 * 0.5 - 63.5
                        }
                    }
                    // Near-ties at any scale: `v · id` within an ulp or two of `k + 0.5`.
                    (3, r) => {
                        let amax = 0.01 + (n % 997) as f32 * 0.37;
                        if i == 0 {
                            amax
                        } else {
                            amax * ((r % 254) as f32 - 126.5) / 127.0
                        }
                    }
                    (_, r) => ((r >> 8) as f32 / (1 << 23) as f32 - 1.0) * 10f32.powi(n % 13 - 6),
                })
                .collect();
            let want = q8x32_block(&c);
            // SAFETY: AVX2 (with F16C) detected above.
            let got = unsafe { q8x32_block_avx2(&c) };
            assert_eq!(bits(&got), bits(&want), "block {n}: {c:?}");
            // Sixteen at a time on AVX-512: the kinds that may hold a NaN or an infinity (most
            // of their groups of sixteen take the per-block fallback), and the finite kinds (the
            // vector path).
            groups[usize::from(n % 6 > 1)].push((c, want));
        }
        if !crate::quant::Kernel::Avx512.is_available() {
            return;
        }
        for blocks in groups.iter().flat_map(|g| g.chunks_exact(16)) {
            let c: Vec<f32> = blocks.iter().flat_map(|(c, _)| c.iter().copied()).collect();
            let mut got = [BlockQ8x32::default(); 16];
            // SAFETY: AVX-512 (with AVX2 and F16C) detected above.
            unsafe { crate::quant::activation_avx512::q8x32_blocks16(&c, &mut got) };
            for (j, (g, (_, want))) in got.iter().zip(blocks).enumerate() {
                assert_eq!(bits(g), bits(want), "block {j} of sixteen: {c:?}");
            }
        }
    }

    fn bits(b: &BlockQ8x32) -> ([i8; 32], u32, u32, i32, i32) {
        (b.qs, b.d.to_bits(), b.s.to_bits(), b.sum, b.sum_lo)
    }

    /// Regression: `s` used the f16-rounded scale; ggml's `quantize_row_q8_1` multiplies the sum
    /// by the unrounded `amax / 127` (the two differ in about a third of random blocks).
    #[test]
    fn q8x32_sum_term_uses_the_unrounded_scale() {
        use rand_chacha::rand_core::{RngCore, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let x: Vec<f32> =
            (0..32 * 256).map(|_| (rng.next_u32() >> 8) as f32 / (1 << 23) as f32 - 1.0).collect();
        let QuantizedActivation::Q8x32(blocks) = QuantizedActivation::new(ActivationKind::Q8x32, &x).unwrap()
        else {
            panic!("wrong kind")
        };
        for (b, c) in blocks.iter().zip(x.chunks_exact(32)) {
            let amax = c.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
            assert_eq!(b.d, half::f16::from_f32(amax / 127.0).to_f32());
            assert_eq!(b.s, half::f16::from_f32(amax / 127.0 * sum as f32).to_f32());
            assert_eq!((b.sum, b.sum_lo), (sum, b.qs[..16].iter().map(|&q| q as i32).sum()));
        }
    }
}
