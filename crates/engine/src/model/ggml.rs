//! [`Numerics::Ggml`](super::Numerics::Ggml): the forward pass computed exactly as llama.cpp's
//! CPU backend computes it (ggml, x86 AVX2 + FMA + F16C build, non-flash attention), rounding for
//! rounding, so a greedy continuation is token-for-token llama.cpp's.
//!
//! Why a second arithmetic exists: between every layer the activations are quantized to 8 bits,
//! which makes the pass chaotic — a one-ulp difference flips a rounding and grows to the size of
//! the quantization noise within a few tokens. llama.cpp's own flash-attention path (a correct
//! implementation that only rounds differently) agrees with its default path on 5 of the 20
//! parity prompts. Identical output is therefore only reachable by doing exactly what ggml does,
//! in ggml's order, which costs the fast kernels' tiling (≈ 20 tok/s decode on two cores instead
//! of ≈ 170): a validation mode, not the serving default.
//!
//! What ggml does, as read in llama.cpp's sources (ggml-cpu `arch/x86/quants.c`, `vec.h`,
//! `vec.cpp`, `ops.cpp`, `llamafile/sgemm.cpp`) and checked bit for bit against its intermediate
//! tensors:
//! - activations are quantized per 32 exactly as [`QuantizedActivation`] does;
//! - a Q4_1·Q8_1 or Q8_0·Q8_0 row dot keeps eight f32 lanes: lane `l` of each block adds the exact
//!   integer sum of elements `4l..4l+4` times `d_w·d_a` (rounded) with one FMA; Q4_1's minimum
//!   term is a scalar FMA chain (GCC contracts `summs += m·s`); lanes fold as
//!   `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`, then `+ summs`;
//! - attention products are f16·f16 (Q and the softmax output rounded to f16). With two or more
//!   tokens in the forward call they go through llamafile's tinyBLAS (one eight-lane FMA
//!   accumulator over the row, the same fold); with one token through `ggml_vec_dot_f16` (four
//!   eight-lane accumulators over 32-element steps folded `(a0+a2)+(a1+a3)`, then a `hadd` fold);
//! - softmax: `x·scale`, max, ggml's vector `expf` of `x − max`, each group of eight summed by
//!   the eight-lane fold and accumulated in f64, then `· f32(1/sum)`;
//! - RMSNorm sums the f32 squares in f64; RoPE angles by the recurrence `θ ← θ·base^(−2/d)`, the
//!   rotation contracted to FMAs; SwiGLU `x / (1 + expf(−x)) · up` with ggml's `expf`.

use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockTable, KvCache};
use crate::quant::{ActivationKind, BlockQ8x32, GgmlType, QMatrix, QuantizedActivation};
use half::f16;
use rayon::prelude::*;

use super::BatchItem;

/// Refuses matrix types whose ggml kernels are not reproduced here.
pub(super) fn check_type(name: &str, ty: GgmlType) -> Result<()> {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q8_0 => Ok(()),
        other => Err(EngineError::InvalidArgument(format!(
            "ggml numerics reproduce Q4_1 and Q8_0 matrices only; `{name}` is {other:?}"
        ))),
    }
}

/// ggml's `rms_norm` then `mul`: squares summed in f64, `x · scale · w`.
pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().fold(0f64, |s, &v| s + (v * v) as f64);
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// `(sin, cos)` per rotated pair and position, with ggml's angle recurrence.
pub(super) fn rope_table(
    positions: impl Iterator<Item = usize>,
    rope_dims: usize,
    base: f32,
) -> Vec<(f32, f32)> {
    let theta_scale = base.powf(-2.0 / rope_dims as f32);
    let mut out = Vec::new();
    for pos in positions {
        let mut theta = pos as f32;
        for _ in 0..rope_dims / 2 {
            out.push((theta.sin(), theta.cos()));
            theta *= theta_scale;
        }
    }
    out
}

/// Rotates adjacent pairs as GCC compiles ggml's `x0·cos − x1·sin`, `x0·sin + x1·cos`.
pub(super) fn rope(x: &mut [f32], head_dim: usize, table: &[(f32, f32)]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, &(s, c)) in head.chunks_exact_mut(2).zip(table) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a.mul_add(c, -(b * s));
            pair[1] = a.mul_add(s, b * c);
        }
    }
}

/// `y[t × rows] = W · x[t × cols]` with ggml's row dots, parallel over rows.
pub(super) fn linear(m: &QMatrix<'_>, x: &[f32], t: usize) -> Result<Vec<f32>> {
    let cols = m.cols();
    if x.len() != t * cols {
        return Err(EngineError::shape("ggml linear input", t * cols, x.len()));
    }
    let acts = x
        .chunks_exact(cols.max(1))
        .map(|r| match QuantizedActivation::new(ActivationKind::Q8x32, r)? {
            QuantizedActivation::Q8x32(b) => Ok(b),
            _ => Err(EngineError::InvalidArgument("activation kind".into())),
        })
        .collect::<Result<Vec<_>>>()?;
    let (ty, rows) = (m.ty(), m.rows());
    // Tasks of whole rows (every token), computed transposed, then laid out `[t × rows]`.
    const ROWS_PER_TASK: usize = 64;
    let mut yt = vec![0f32; rows * t];
    yt.par_chunks_mut(ROWS_PER_TASK * t.max(1)).enumerate().for_each(|(task, out)| {
        for (i, o) in out.chunks_exact_mut(t.max(1)).enumerate() {
            let row = m.row(task * ROWS_PER_TASK + i).unwrap_or(&[]);
            for (v, a) in o.iter_mut().zip(&acts) {
                *v = row_dot(ty, row, a);
            }
        }
    });
    let mut y = vec![0f32; t * rows];
    for (r, col) in yt.chunks_exact(t.max(1)).enumerate() {
        for (ti, &v) in col.iter().enumerate() {
            y[ti * rows + r] = v;
        }
    }
    Ok(y)
}

fn row_dot(ty: GgmlType, row: &[u8], a: &[BlockQ8x32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { avx2::row_dot(ty, row, a) };
    }
    row_dot_body(ty, row, a)
}

/// The same dot with ggml's own instructions (identical integers, identical float operations in
/// the same order, so bit-identical to [`row_dot_body`]; about ten times faster).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{h16, BlockQ8x32, GgmlType};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn row_dot(ty: GgmlType, row: &[u8], a: &[BlockQ8x32]) -> f32 {
        let q41 = ty == GgmlType::Q4_1;
        let bsz = if q41 { 20 } else { 34 };
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        let ones = _mm256_set1_epi16(1);
        for (blk, y) in row.chunks_exact(bsz).zip(a) {
            // SAFETY: `blk` has `bsz` bytes (chunks_exact) and `y.qs` 32: every load below
            // reads inside them (16 bytes at 4 for Q4_1, 32 at 2 for Q8_0).
            let (xy, dd) = unsafe {
                let qy = _mm256_loadu_si256(y.qs.as_ptr().cast());
                if q41 {
                    let raw = _mm_loadu_si128(blk[4..].as_ptr().cast());
                    let both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
                    let qx = _mm256_and_si256(both, _mm256_set1_epi8(0xF));
                    summs = h16(blk, 2).mul_add(y.s, summs);
                    (_mm256_madd_epi16(ones, _mm256_maddubs_epi16(qx, qy)), h16(blk, 0) * y.d)
                } else {
                    let qx = _mm256_loadu_si256(blk[2..].as_ptr().cast());
                    let ax = _mm256_sign_epi8(qx, qx);
                    let sy = _mm256_sign_epi8(qy, qx);
                    (_mm256_madd_epi16(ones, _mm256_maddubs_epi16(ax, sy)), h16(blk, 0) * y.d)
                }
            };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(xy), acc);
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds exactly one vector.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let s = super::hsum8(lanes);
        if q41 {
            s + summs
        } else {
            s
        }
    }
}

/// One row · one activation vector in ggml's lane order. `mul_add` is an exact fused
/// multiply-add on every target (the FMA instruction where the caller enabled it).
#[inline(always)]
fn row_dot_body(ty: GgmlType, row: &[u8], a: &[BlockQ8x32]) -> f32 {
    let (bsz, q41) = if ty == GgmlType::Q4_1 { (20, true) } else { (34, false) };
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (blk, y) in row.chunks_exact(bsz).zip(a) {
        let mut xq = [0i32; 32];
        let dd = if q41 {
            for j in 0..16 {
                xq[j] = (blk[4 + j] & 0xF) as i32;
                xq[j + 16] = (blk[4 + j] >> 4) as i32;
            }
            summs = h16(blk, 2).mul_add(y.s, summs);
            h16(blk, 0) * y.d
        } else {
            for j in 0..32 {
                xq[j] = (blk[2 + j] as i8) as i32;
            }
            h16(blk, 0) * y.d
        };
        for (l, lane) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * l..4 * l + 4).map(|e| xq[e] * y.qs[e] as i32).sum();
            *lane = dd.mul_add(s as f32, *lane);
        }
    }
    if q41 {
        hsum8(acc) + summs
    } else {
        hsum8(acc)
    }
}

#[inline(always)]
fn h16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// ggml's eight-lane fold: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
#[inline(always)]
fn hsum8(a: [f32; 8]) -> f32 {
    let r = [a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// tinyBLAS's f16 dot; llamafile refuses lengths that are not a multiple of 8 and ggml then
/// takes `ggml_vec_dot_f16`.
#[inline(always)]
fn dot_f16_tiny(a: &[f16], b: &[f16]) -> f32 {
    if !a.len().is_multiple_of(8) {
        return dot_f16_vec(a, b);
    }
    let mut acc = [0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = ca[l].to_f32().mul_add(cb[l].to_f32(), acc[l]);
        }
    }
    hsum8(acc)
}

/// `ggml_vec_dot_f16`: whole 32-element steps in four eight-lane accumulators, the rest added
/// one product at a time in f64.
#[inline(always)]
fn dot_f16_vec(a: &[f16], b: &[f16]) -> f32 {
    let mut sum = [[0f32; 8]; 4];
    let (ca, cb) = (a.chunks_exact(32), b.chunks_exact(32));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (ca, cb) in ca.zip(cb) {
        for (j, s) in sum.iter_mut().enumerate() {
            for l in 0..8 {
                s[l] = ca[8 * j + l].to_f32().mul_add(cb[8 * j + l].to_f32(), s[l]);
            }
        }
    }
    let mut s0 = [0f32; 8];
    for l in 0..8 {
        s0[l] = (sum[0][l] + sum[2][l]) + (sum[1][l] + sum[3][l]);
    }
    let t0 = [s0[0] + s0[4], s0[1] + s0[5], s0[2] + s0[6], s0[3] + s0[7]];
    let mut total = ((t0[0] + t0[1]) + (t0[2] + t0[3])) as f64;
    for (x, y) in ra.iter().zip(rb) {
        total += (x.to_f32() * y.to_f32()) as f64;
    }
    total as f32
}

/// ggml's AVX2 `expf` (`ggml_v_expf`), one lane.
#[inline(always)]
fn expf(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = c(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = c(g.wrapping_add(0x7f00_0000));
    let s2 = c(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `silu(gate) · up` with ggml's `expf`.
pub(super) fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter().zip(up).map(|(&x, &u)| (x / (1.0 + expf(0.0 - x))) * u).collect()
}

/// ggml's `soft_max_ext` of one row (no mask entries: the row holds the visible positions).
#[inline(always)]
fn softmax(row: &mut [f32], scale: f32) {
    row.iter_mut().for_each(|v| *v *= scale);
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0f64;
    for g in row.chunks_mut(8) {
        let mut lanes = [0f32; 8];
        for (l, v) in lanes.iter_mut().zip(g.iter_mut()) {
            *v = expf(*v - max);
            *l = *v;
        }
        sum += hsum8(lanes) as f64;
    }
    let inv = (1.0 / sum) as f32;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Causal attention for every stacked row and head, ggml's way; returns `[T × n_head·hd]`.
/// One task per (row, KV head): the group's query heads share one gather of K and V.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    cache: &KvCache,
    batch: &[BatchItem<'_>],
    rows: &[(usize, usize)],
    q: &[f32],
    layer: usize,
    n_head: usize,
    group: usize,
    hd: usize,
) -> Vec<f32> {
    let d = n_head * hd;
    let width = group * hd; // the group's heads are contiguous in Q and in the output
    let tasks: Vec<(usize, usize)> =
        (0..rows.len()).flat_map(|r| (0..n_head / group).map(move |kvh| (r, kvh))).collect();
    let run = |&(r, kvh): &(usize, usize)| {
        let (item, pos) = rows[r];
        let query = Query {
            cache,
            table: batch[item].table,
            layer,
            kvh,
            hd,
            pos,
            q: &q[r * d + kvh * width..][..width],
            // llamafile takes the products of a forward call with two or more tokens.
            batched: rows.len() >= 2,
        };
        attend(&query)
    };
    let outs: Vec<Vec<f32>> = tasks.par_iter().map(run).collect();
    let mut out = vec![0f32; rows.len() * d];
    for (&(r, kvh), o) in tasks.iter().zip(&outs) {
        out[r * d + kvh * width..][..width].copy_from_slice(o);
    }
    out
}

/// One query row's heads of one KV head group, over positions `0..=pos`.
struct Query<'a> {
    cache: &'a KvCache,
    table: &'a BlockTable,
    layer: usize,
    kvh: usize,
    hd: usize,
    pos: usize,
    /// The group's query heads, `hd` each.
    q: &'a [f32],
    batched: bool,
}

fn attend(query: &Query<'_>) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked just above).
        return unsafe { attend_fma(query) };
    }
    attend_body(query)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn attend_fma(query: &Query<'_>) -> Vec<f32> {
    attend_body(query)
}

/// f16 Q·K, softmax, f16 P·V for each head of the group, K and V gathered once.
#[inline(always)]
fn attend_body(query: &Query<'_>) -> Vec<f32> {
    let Query { cache, table, layer, kvh, hd, pos, q, batched } = *query;
    let bs = cache.layout().block_size;
    let n = pos + 1;
    // Zero padding to whole 32-element steps adds exact zeros to either dot's lanes.
    let padded = n.div_ceil(32) * 32;
    let mut k = vec![f16::ZERO; n * hd];
    let mut vt = vec![f16::ZERO; hd * padded]; // V transposed, as llama.cpp caches it
    for (bi, block) in table.blocks().iter().enumerate().take(n.div_ceil(bs)) {
        let (kh, vh) = (cache.k_head(*block, layer, kvh), cache.v_head(*block, layer, kvh));
        for s in 0..bs.min(n - bi * bs) {
            let p = bi * bs + s;
            for dd in 0..hd {
                k[p * hd + dd] = kh[dd * bs + s];
                vt[dd * padded + p] = vh[s * hd + dd];
            }
        }
    }
    let dot = |a: &[f16], b: &[f16]| if batched { dot_f16_tiny(a, b) } else { dot_f16_vec(a, b) };
    let mut out = Vec::with_capacity(q.len());
    let mut p16 = vec![f16::ZERO; padded];
    for qh in q.chunks_exact(hd) {
        let q16: Vec<f16> = qh.iter().map(|&v| f16::from_f32(v)).collect();
        let mut scores: Vec<f32> = k.chunks_exact(hd).map(|kr| dot(kr, &q16)).collect();
        softmax(&mut scores, 1.0 / (hd as f32).sqrt());
        for (o, &s) in p16.iter_mut().zip(&scores) {
            *o = f16::from_f32(s);
        }
        out.extend(vt.chunks_exact(padded).map(|vr| dot(vr, &p16)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_tracks_libm_and_handles_the_extremes() {
        // Normal results (subnormal ones lose relative precision in any expf).
        for i in -1740..=1760 {
            let x = i as f32 * 0.05;
            let (got, want) = (expf(x), x.exp());
            assert!((got - want).abs() <= want * 4e-7, "{x}: {got} vs {want}");
        }
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(-200.0), 0.0);
        assert!(expf(100.0).is_infinite());
    }

    #[test]
    fn the_two_f16_dot_orders_agree_to_rounding_but_not_bitwise() {
        let a: Vec<f16> = (0..64).map(|i| f16::from_f32(((i * 37 % 17) as f32 - 8.0) * 0.37)).collect();
        let b: Vec<f16> = (0..64).map(|i| f16::from_f32(((i * 11 % 13) as f32 - 6.0) * 0.71)).collect();
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| x.to_f64() * y.to_f64()).sum();
        for v in [dot_f16_tiny(&a, &b), dot_f16_vec(&a, &b)] {
            assert!((v as f64 - exact).abs() < 1e-3, "{v} vs {exact}");
        }
        // Regression: lengths off the 32-element step (heads of 16, say) kept only whole steps.
        for n in [16, 40, 44] {
            let exact: f64 = a[..n].iter().zip(&b[..n]).map(|(x, y)| x.to_f64() * y.to_f64()).sum();
            for v in [dot_f16_tiny(&a[..n], &b[..n]), dot_f16_vec(&a[..n], &b[..n])] {
                assert!((v as f64 - exact).abs() < 1e-3, "{n}: {v} vs {exact}");
            }
        }
    }

    #[test]
    fn avx2_row_dot_is_bit_identical_to_the_portable_one() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let x: Vec<f32> = (0..256).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
            let row_f: Vec<f32> = (0..256).map(|_| (next() % 2001) as f32 / 700.0 - 1.4).collect();
            let row = crate::quant::quantize(ty, &row_f).unwrap();
            let QuantizedActivation::Q8x32(a) = QuantizedActivation::new(ActivationKind::Q8x32, &x).unwrap()
            else {
                panic!("kind")
            };
            let portable = row_dot_body(ty, &row, &a);
            assert_eq!(row_dot(ty, &row, &a).to_bits(), portable.to_bits(), "{ty:?}");
        }
    }

    #[test]
    fn rows_dot_in_lane_order() {
        // One Q8_0 block of ones against activations 0..32: the lanes hold 4-element sums.
        let mut blk = vec![0u8; 34];
        blk[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        blk[2..].iter_mut().for_each(|b| *b = 1);
        let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let QuantizedActivation::Q8x32(a) = QuantizedActivation::new(ActivationKind::Q8x32, &x).unwrap()
        else {
            panic!("kind")
        };
        let want: f32 = a[0].qs.iter().map(|&q| q as f32).sum::<f32>() * a[0].d;
        assert!((row_dot(GgmlType::Q8_0, &blk, &a) - want).abs() <= want * 1e-6);
    }
}
