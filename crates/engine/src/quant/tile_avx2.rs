//! Register-tiled products of 32-block weights (Q4_0, Q4_1, Q8_0) with 8-bit activations: the one
//! kernel behind matvec (decode), batched decode and prefill for these types (x86_64, AVX2).
//!
//! A tile is `R` weight rows × `C` activations. Each weight block is unpacked once per tile and
//! met by `C` activation blocks; each activation block is loaded once and met by `R` weight
//! blocks, so the unpacking and the loads are amortized and the loop is bound by the integer
//! multiply-adds (`vpmaddubsw` + `vpmaddwd`), not by memory. On this CPU class that is about twice
//! the f32 FMA rate the dequantize-then-GEMM route reaches, and it keeps llama.cpp's numerics (8-bit
//! activations in every product, prefill included).
//!
//! Every (row, activation) pair follows the same sequence of operations whatever `R` and `C` are
//! — one 8-lane accumulator over the blocks in order, `fma(i32 dot as f32, d_w · d_a, acc)`, then a
//! horizontal sum, plus the Q4_1 minimum terms `m_w · s_a` added in block order — so a row's result
//! is bit-identical in a matvec, a batch of 16 or a 512-token prefill chunk. Batching, chunk size
//! and prefix-cache hits therefore never change a sequence's output.
//!
//! Safety contract: as in `dot_avx2` — the CPU supports avx2, fma and f16c, and every row pointer
//! addresses one weight block per activation block (checked by the entry points in `mod.rs`).

use std::arch::x86_64::*;

use super::activation::BlockQ8x32;
use super::dot_avx2::hsum;
use super::{GgmlType, Span};

pub(crate) const Q4_0: u8 = 0;
pub(crate) const Q4_1: u8 = 1;
pub(crate) const Q8_0: u8 = 2;

/// Weight rows per tile.
pub(crate) const R: usize = 2;
/// Activations per tile.
pub(crate) const C: usize = 4;
/// Activations whose blocks stay in L1/L2 while a task sweeps its rows.
const COL_CHUNK: usize = 64;

const fn block_bytes(kind: u8) -> usize {
    match kind {
        Q4_0 => 18,
        Q4_1 => 20,
        _ => 34,
    }
}

/// A weight block unpacked for `vpmaddubsw`.
#[derive(Clone, Copy)]
struct Unpacked {
    /// Unsigned operand: the nibbles (Q4_1) or |w| (Q4_0, Q8_0).
    x: __m256i,
    /// Signed weights whose signs move onto the activation (Q4_0, Q8_0).
    sign: __m256i,
    /// Weight scale, broadcast.
    d: __m256,
    /// Weight minimum (Q4_1).
    m: f32,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack<const KIND: u8>(b: *const u8) -> Unpacked {
    unsafe {
        // The block's f16 scale (and Q4_1's minimum) with one 32-bit load: `vmovd` zeroes the
        // rest of the register, so no false dependency serializes the loop.
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(b as *const i32)));
        let d = _mm256_broadcastss_ps(dm);
        let low4 = _mm256_set1_epi8(0x0F);
        match KIND {
            Q4_1 => {
                let q = _mm_loadu_si128(b.add(4) as *const __m128i);
                let x = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
                Unpacked { x, sign: _mm256_setzero_si256(), d, m: _mm_cvtss_f32(_mm_movehdup_ps(dm)) }
            }
            Q4_0 => {
                let q = _mm_loadu_si128(b.add(2) as *const __m128i);
                let n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
                let w = _mm256_sub_epi8(n, _mm256_set1_epi8(8));
                Unpacked { x: _mm256_sign_epi8(w, w), sign: w, d, m: 0.0 }
            }
            _ => {
                let w = _mm256_loadu_si256(b.add(2) as *const __m256i);
                Unpacked { x: _mm256_sign_epi8(w, w), sign: w, d, m: 0.0 }
            }
        }
    }
}

/// Q4_1's minimum terms for four activations at once: lane `c` of `add[r]` is pair (r, c)'s
/// running `Σ m_w · s_a`, in block order, with the same separate multiply and add as the scalar
/// path — so each lane is bit-identical to the one-pair computation.
type MinLanes = __m128;

/// The `RR × CC` tile whose first row starts at `w` (rows `row_bytes` apart). `s_t` holds the
/// activations' `s` block-major (`s_t[i * s_stride + c]`, Q4_1 only); with `CC == 4` the minimum
/// terms run four lanes wide from it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const KIND: u8, const RR: usize, const CC: usize>(
    w: *const u8,
    row_bytes: usize,
    ys: [&[BlockQ8x32]; CC],
    s_t: *const f32,
    s_stride: usize,
) -> [[f32; CC]; RR] {
    unsafe {
        let size = block_bytes(KIND);
        let nb = if CC == 0 { 0 } else { ys[0].len() };
        let ones = _mm256_set1_epi16(1);
        let wide_min = KIND == Q4_1 && CC == 4;
        let mut acc = [[_mm256_setzero_ps(); CC]; RR];
        let mut add = [[0f32; CC]; RR];
        let mut add4: [MinLanes; RR] = [_mm_setzero_ps(); RR];
        for i in 0..nb {
            let mut wb = [unpack::<KIND>(w.add(size * i)); RR];
            for (r, u) in wb.iter_mut().enumerate().skip(1) {
                *u = unpack::<KIND>(w.add(r * row_bytes + size * i));
            }
            for c in 0..CC {
                let yb = ys[c].get_unchecked(i);
                let yv = _mm256_loadu_si256(yb.qs.as_ptr() as *const __m256i);
                let yd = _mm256_set1_ps(yb.d);
                for r in 0..RR {
                    let u = &wb[r];
                    let y = if KIND == Q4_1 { yv } else { _mm256_sign_epi8(yv, u.sign) };
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u.x, y), ones);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(u.d, yd), acc[r][c]);
                    if KIND == Q4_1 && !wide_min {
                        add[r][c] += u.m * yb.s;
                    }
                }
            }
            if wide_min {
                let sv = _mm_loadu_ps(s_t.add(i * s_stride));
                for r in 0..RR {
                    add4[r] = _mm_add_ps(add4[r], _mm_mul_ps(_mm_set1_ps(wb[r].m), sv));
                }
            }
        }
        if wide_min {
            for r in 0..RR {
                let mut lanes = [0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), add4[r]);
                add[r][..CC].copy_from_slice(&lanes[..CC]);
            }
        }
        let mut out = [[0f32; CC]; RR];
        for r in 0..RR {
            for c in 0..CC {
                out[r][c] = hsum(acc[r][c]) + add[r][c];
            }
        }
        out
    }
}

/// One row · one activation: the 1 × 1 tile.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot<const KIND: u8>(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    unsafe { tile::<KIND, 1, 1>(row.as_ptr(), row.len(), [y], std::ptr::null(), 0)[0][0] }
}

/// Activations packed once per product for the tiles: their block slices, and (Q4_1) their `s`
/// block-major so four activations' minimum terms load as one vector.
pub(crate) struct Pack<'a> {
    ys: Vec<&'a [BlockQ8x32]>,
    s_t: Vec<f32>,
}

impl<'a> Pack<'a> {
    /// Packs `ys` (all of the same block count) for weights of `ty`.
    pub(crate) fn new(ty: GgmlType, ys: Vec<&'a [BlockQ8x32]>) -> Self {
        let n = ys.len();
        let nb = ys.first().map_or(0, |y| y.len());
        let mut s_t = Vec::new();
        if ty == GgmlType::Q4_1 && n >= C {
            s_t = vec![0f32; nb * n];
            for (c, y) in ys.iter().enumerate() {
                for (i, b) in y.iter().enumerate() {
                    s_t[i * n + c] = b.s;
                }
            }
        }
        Pack { ys, s_t }
    }

    /// Number of activations.
    pub(crate) fn len(&self) -> usize {
        self.ys.len()
    }
}

/// The rows and activations of `span` of the matrix at `data` (`row_bytes` per row), written
/// into `out` as `span` says.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows_times_acts(
    ty: GgmlType,
    data: &[u8],
    row_bytes: usize,
    pack: &Pack<'_>,
    span: Span,
    out: &mut [f32],
) {
    unsafe {
        match ty {
            GgmlType::Q4_0 => sweep::<Q4_0>(data, row_bytes, pack, span, out),
            GgmlType::Q4_1 => sweep::<Q4_1>(data, row_bytes, pack, span, out),
            GgmlType::Q8_0 => sweep::<Q8_0>(data, row_bytes, pack, span, out),
            _ => out.iter_mut().for_each(|o| *o = f32::NAN),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sweep<const KIND: u8>(data: &[u8], row_bytes: usize, pack: &Pack<'_>, sp: Span, out: &mut [f32]) {
    unsafe {
        let n = pack.ys.len();
        let ys = &pack.ys;
        let st = |c: usize| if pack.s_t.is_empty() { std::ptr::null() } else { pack.s_t.as_ptr().add(c) };
        let base = data.as_ptr().add(sp.first_row * row_bytes);
        let (rs, cs) = (sp.row_stride, sp.col_stride);
        let mut put = |i: usize, j: usize, v: f32| out[i * rs + (j - sp.first_col) * cs] = v;
        let end = sp.first_col + sp.cols;
        for c0 in (sp.first_col..end).step_by(COL_CHUNK) {
            let c1 = (c0 + COL_CHUNK).min(end);
            let mut r = 0;
            while r < sp.rows {
                let w = base.add(r * row_bytes);
                // One activation: rows one at a time (a single sequential weight stream).
                let full_rows = n > 1 && r + R <= sp.rows;
                let mut c = c0;
                while c < c1 {
                    let full_cols = c + C <= c1;
                    match (full_rows, full_cols) {
                        (true, true) => {
                            let t = tile::<KIND, R, C>(w, row_bytes, super::first(&ys[c..]), st(c), n);
                            for (i, row) in t.iter().enumerate() {
                                for (j, &v) in row.iter().enumerate() {
                                    put(r + i, c + j, v);
                                }
                            }
                            c += C;
                        }
                        (true, false) => {
                            let t = tile::<KIND, R, 1>(w, row_bytes, [ys[c]], st(c), n);
                            for (i, row) in t.iter().enumerate() {
                                put(r + i, c, row[0]);
                            }
                            c += 1;
                        }
                        (false, true) => {
                            let t = tile::<KIND, 1, C>(w, row_bytes, super::first(&ys[c..]), st(c), n);
                            for (j, &v) in t[0].iter().enumerate() {
                                put(r, c + j, v);
                            }
                            c += C;
                        }
                        (false, false) => {
                            put(r, c, tile::<KIND, 1, 1>(w, row_bytes, [ys[c]], st(c), n)[0][0]);
                            c += 1;
                        }
                    }
                }
                r += if full_rows { R } else { 1 };
            }
        }
    }
}
