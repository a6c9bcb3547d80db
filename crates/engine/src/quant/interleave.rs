//! Q4_1 and Q8_0 weights repacked eight rows at a time, for decode (one to a few dozen
//! activations).
//!
//! In ggml's row layout a 32-element block's dot product ends in an 8-lane vector per (row,
//! activation) pair that must be converted, scaled and folded in on its own: six float and integer
//! operations per 32 products, which makes decode compute-bound on this CPU class. Interleaving
//! eight rows puts one row in each 32-bit lane instead: four consecutive nibbles of row `j` sit in
//! lane `j`, so one `vpmaddubsw` against four activation bytes broadcast to every lane advances
//! eight rows at once, eight of them (summed in 16 bits, which cannot overflow: 8 × 2 × 15 × 127 <
//! 2^15) cover the block, and a single `vpmaddwd` + convert + FMA finishes eight pairs. That is
//! about 2.5 vector operations per pair instead of about 9.
//!
//! Layout, per group of 8 rows and per block: Q4_1 — 160 bytes: the 8 scales (f16), the 8 minimums
//! (f16), then 4 chunks of 32 bytes; byte `i` of lane `j` in chunk `c` holds element `8c + i` of
//! row `j` in its low nibble and element `8c + 4 + i` in its high nibble. Q8_0 — 272 bytes: the 8
//! scales, then 8 chunks of 32 bytes, lane `j` of chunk `s` holding elements `4s..4s + 4` of row
//! `j` (signed, so the sign moves onto the activation and each step widens to 32 bits at once:
//! two products of 127 · 127 already fill 16 bits).
//!
//! Numerics: each block's integer dot product is exact, then `acc = fma(dot, d_w · d_a, acc)` and
//! `acc_m = fma(m_w, s_a, acc_m)` per row in block order, and the result is `acc + acc_m`. Every
//! row sees the same operations whatever the number of activations, so a sequence's output does
//! not depend on its batch. The portable path computes exactly the same thing.

use rayon::prelude::*;

use super::activation::BlockQ8x32;
use super::{check_dot, GgmlType, Kernel, QMatrix, QuantizedActivation};
use crate::error::{EngineError, Result};

/// Rows interleaved together.
pub const GROUP: usize = 8;
/// The weight kinds the tiles of each path are instantiated for (const generic parameters).
pub(super) const Q4_1_KIND: u8 = 1;
pub(super) const Q8_0_KIND: u8 = 8;

/// `$tile::<KIND, N>($w.., [ys[0], .., ys[N - 1]], $out)` for `$ty`'s kind and `N = $ys.len()`
/// (1 to 4): the one dispatch from a run-time type and width to each path's const-generic tiles.
macro_rules! tile_for {
    ($tile:ident, $ty:expr, $ys:expr, ($($w:expr),*), $out:expr) => {{
        use $crate::quant::interleave::{Q4_1_KIND, Q8_0_KIND};
        let (q8, ys) = ($ty == GgmlType::Q8_0, $ys);
        match (q8, ys.len()) {
            (true, 4) => $tile::<Q8_0_KIND, 4>($($w,)* std::array::from_fn(|i| ys[i]), $out),
            (true, 3) => $tile::<Q8_0_KIND, 3>($($w,)* std::array::from_fn(|i| ys[i]), $out),
            (true, 2) => $tile::<Q8_0_KIND, 2>($($w,)* std::array::from_fn(|i| ys[i]), $out),
            (true, _) => $tile::<Q8_0_KIND, 1>($($w,)* std::array::from_fn(|i| ys[i]), $out),
            (false, 4) => $tile::<Q4_1_KIND, 4>($($w,)* std::array::from_fn(|i| ys[i]), $out),
            (false, 3) => $tile::<Q4_1_KIND, 3>($($w,)* std::array::from_fn(|i| ys[i]), $out),
            (false, 2) => $tile::<Q4_1_KIND, 2>($($w,)* std::array::from_fn(|i| ys[i]), $out),
            (false, _) => $tile::<Q4_1_KIND, 1>($($w,)* std::array::from_fn(|i| ys[i]), $out),
        }
    }};
}
pub(super) use tile_for;
/// Bytes of one group's block, by weight type.
pub(super) const fn group_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 272,
        _ => 160,
    }
}
/// Activations per tile.
const C: usize = 4;
/// Row groups per parallel task.
const GROUPS_PER_TASK: usize = 8;

/// A Q4_1 or Q8_0 matrix repacked eight rows at a time (an owned copy).
#[derive(Clone)]
pub struct Interleaved {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for Interleaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Interleaved({} x {} {}, {} bytes)", self.rows, self.cols, self.ty, self.data.len())
    }
}

impl Interleaved {
    /// Repacks `m`; `None` unless it is Q4_1 or Q8_0 with a whole number of 8-row groups.
    pub fn from_matrix(m: &QMatrix<'_>) -> Option<Self> {
        let ty = m.ty();
        if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0) || !m.rows().is_multiple_of(GROUP) || m.rows() == 0
        {
            return None;
        }
        let nb = m.cols() / 32;
        let (gb, sb) = (group_block(ty), ty.type_size());
        let mut data = vec![0u8; m.rows() / GROUP * nb * gb];
        data.par_chunks_mut(nb * gb).enumerate().for_each(|(g, out)| {
            for b in 0..nb {
                let dst = &mut out[b * gb..(b + 1) * gb];
                for j in 0..GROUP {
                    let row = m.row(g * GROUP + j).unwrap_or(&[]);
                    let Some(src) = row.get(b * sb..(b + 1) * sb) else { return };
                    dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
                    if ty == GgmlType::Q8_0 {
                        for st in 0..8 {
                            dst[16 + 32 * st + 4 * j..][..4].copy_from_slice(&src[2 + 4 * st..][..4]);
                        }
                        continue;
                    }
                    dst[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&src[2..4]);
                    let q = |e: usize| if e < 16 { src[4 + e] & 0x0F } else { src[4 + e - 16] >> 4 };
                    for c in 0..4 {
                        for i in 0..4 {
                            dst[32 + 32 * c + 4 * j + i] = q(8 * c + i) | (q(8 * c + 4 + i) << 4);
                        }
                    }
                }
            }
        });
        Some(Self { ty, rows: m.rows(), cols: m.cols(), data })
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Dequantizes the whole matrix into `out` (`rows × cols`, row-major), with exactly the
    /// arithmetic of the row layout's dequantization, so a GEMM over it gives the same result
    /// whichever copy it came from.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        super::check_matrix_len(self.rows, self.cols, out.len())?;
        let (nb, gb, q8) = (self.cols / 32, group_block(self.ty), self.ty == GgmlType::Q8_0);
        out.par_chunks_mut(GROUP * self.cols).enumerate().for_each(|(g, o)| {
            let w = self.group(g);
            for b in 0..nb {
                let blk = &w[b * gb..(b + 1) * gb];
                for j in 0..GROUP {
                    let row = &mut o[j * self.cols + 32 * b..][..32];
                    let d = f16(blk, j);
                    if q8 {
                        for st in 0..8 {
                            for i in 0..4 {
                                row[4 * st + i] = blk[16 + 32 * st + 4 * j + i] as i8 as f32 * d;
                            }
                        }
                        continue;
                    }
                    let m = f16(&blk[16..], j);
                    for c in 0..4 {
                        for i in 0..4 {
                            let byte = blk[32 + 32 * c + 4 * j + i];
                            row[8 * c + i] = (byte & 0x0F) as f32 * d + m;
                            row[8 * c + 4 + i] = (byte >> 4) as f32 * d + m;
                        }
                    }
                }
            }
        });
        Ok(())
    }

    fn group(&self, g: usize) -> &[u8] {
        let len = self.cols / 32 * group_block(self.ty);
        &self.data[g * len..(g + 1) * len]
    }
}

/// `outs[i][b * rows_i + r] = mats[i].row(r) · acts[b]` for several repacked matrices reading the
/// same activations, as one parallel region (see [`super::matmul_group`]).
pub fn matmul_group_interleaved(
    mats: &[&Interleaved],
    acts: &[QuantizedActivation],
    outs: &mut [&mut [f32]],
) -> Result<()> {
    matmul_group_interleaved_with(Kernel::best(), mats, acts, outs)
}

/// [`matmul_group_interleaved`] on `kernel`'s path (a path this CPU lacks falls back to the best
/// below it); every path gives bit-identical results.
pub fn matmul_group_interleaved_with(
    kernel: Kernel,
    mats: &[&Interleaved],
    acts: &[QuantizedActivation],
    outs: &mut [&mut [f32]],
) -> Result<()> {
    let n = acts.len();
    if mats.len() != outs.len() {
        return Err(EngineError::shape("matmul group outputs", mats.len(), outs.len()));
    }
    let mut ys: Vec<&[BlockQ8x32]> = Vec::with_capacity(n);
    for a in acts {
        match a {
            QuantizedActivation::Q8x32(v) => ys.push(v),
            _ => {
                return Err(EngineError::InvalidArgument("Q4_1 / Q8_0 weights need Q8x32 activations".into()))
            }
        }
    }
    for (m, out) in mats.iter().zip(outs.iter()) {
        for a in acts {
            check_dot(m.ty, m.cols / 32 * m.ty.type_size(), a)?;
        }
        if Some(out.len()) != m.rows.checked_mul(n) {
            return Err(EngineError::shape("matmul output length", format!("{} x {n}", m.rows), out.len()));
        }
    }
    if n == 0 {
        return Ok(());
    }
    // Resolved once per product: the AVX-512 tiles take two groups at a time, AVX2 one.
    let wide = kernel == Kernel::Avx512 && Kernel::Avx512.is_available();
    let avx2 = kernel >= Kernel::Avx2 && Kernel::Avx2.is_available();
    // Tasks own runs of row groups and write `[activation][row]` into their own buffer, copied
    // into place afterwards (a few KB per task).
    let mut tasks: Vec<(usize, usize, usize, Vec<f32>)> = Vec::new();
    for (i, m) in mats.iter().enumerate() {
        let groups = m.rows / GROUP;
        for g0 in (0..groups).step_by(GROUPS_PER_TASK) {
            let g1 = (g0 + GROUPS_PER_TASK).min(groups);
            tasks.push((i, g0, g1, vec![0f32; (g1 - g0) * GROUP * n]));
        }
    }
    let run = |(i, g0, g1, buf): &mut (usize, usize, usize, Vec<f32>)| {
        let m = mats[*i];
        let rows = (*g1 - *g0) * GROUP;
        let mut g = *g0;
        while g < *g1 {
            let two = wide && g + 1 < *g1;
            let at = (g - *g0) * GROUP;
            let mut c = 0;
            while c < n {
                let k = (n - c).min(if two { super::interleave_avx512::ACTS } else { C });
                if two {
                    let mut res = [[0f32; 2 * GROUP]; 8];
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C detected (`wide`); both
                    // groups hold one group block per activation block (`check_dot` above).
                    unsafe {
                        super::interleave_avx512::tile_any(
                            m.ty,
                            m.group(g),
                            m.group(g + 1),
                            &ys[c..c + k],
                            &mut res,
                        );
                    }
                    for (kk, r) in res.iter().enumerate().take(k) {
                        buf[(c + kk) * rows + at..][..2 * GROUP].copy_from_slice(r);
                    }
                } else {
                    let mut res = [[0f32; GROUP]; C];
                    one_group(avx2, m.ty, m.group(g), &ys[c..c + k], &mut res);
                    for (kk, r) in res.iter().enumerate().take(k) {
                        buf[(c + kk) * rows + at..][..GROUP].copy_from_slice(r);
                    }
                }
                c += k;
            }
            g += if two { 2 } else { 1 };
        }
    };
    let work: usize = mats.iter().map(|m| m.data.len()).sum::<usize>() * n;
    if work < 64 * 1024 {
        tasks.iter_mut().for_each(run);
    } else {
        tasks.par_iter_mut().for_each(run);
    }
    for (i, g0, g1, buf) in &tasks {
        let rows = mats[*i].rows;
        let len = (g1 - g0) * GROUP;
        for b in 0..n {
            outs[*i][b * rows + g0 * GROUP..][..len].copy_from_slice(&buf[b * len..(b + 1) * len]);
        }
    }
    Ok(())
}

/// One group's eight rows × `ys.len()` (1 to 4) activations, on AVX2 when `avx2` (detected).
fn one_group(avx2: bool, ty: GgmlType, w: &[u8], ys: &[&[BlockQ8x32]], res: &mut [[f32; GROUP]]) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2/FMA/F16C detected by the caller; `w` holds one group block per
        // activation block (`check_dot`).
        unsafe { avx2_impl::tile_any(ty, w, ys, res) };
        return;
    }
    let _ = avx2;
    for (r, y) in res.iter_mut().zip(ys) {
        *r = portable_group(ty, w, y);
    }
}

fn f16(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// One group's eight rows · one activation, with the operations the AVX2 tile performs.
fn portable_group(ty: GgmlType, w: &[u8], y: &[BlockQ8x32]) -> [f32; GROUP] {
    let gb = group_block(ty);
    let mut acc = [0f32; GROUP];
    let mut accm = [0f32; GROUP];
    for (b, yb) in y.iter().enumerate() {
        let blk = &w[b * gb..(b + 1) * gb];
        for j in 0..GROUP {
            let mut dot = 0i32;
            if ty == GgmlType::Q8_0 {
                for st in 0..8 {
                    for i in 0..4 {
                        dot += blk[16 + 32 * st + 4 * j + i] as i8 as i32 * yb.qs[4 * st + i] as i32;
                    }
                }
            } else {
                for c in 0..4 {
                    for i in 0..4 {
                        let byte = blk[32 + 32 * c + 4 * j + i];
                        dot += (byte & 0x0F) as i32 * yb.qs[8 * c + i] as i32;
                        dot += (byte >> 4) as i32 * yb.qs[8 * c + 4 + i] as i32;
                    }
                }
                accm[j] = f16(&blk[16..], j).mul_add(yb.s, accm[j]);
            }
            acc[j] = (dot as f32).mul_add(f16(blk, j) * yb.d, acc[j]);
        }
    }
    std::array::from_fn(|j| acc[j] + accm[j])
}

#[cfg(target_arch = "x86_64")]
mod avx2_impl {
    use super::{group_block, BlockQ8x32, GgmlType, GROUP};
    use std::arch::x86_64::*;

    use crate::quant::interleave::{Q4_1_KIND as Q4_1, Q8_0_KIND as Q8_0};

    /// Eight rows (one group) × `ys.len()` (1 to 4) activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_any(ty: GgmlType, w: &[u8], ys: &[&[BlockQ8x32]], out: &mut [[f32; GROUP]]) {
        unsafe { tile_for!(tile, ty, ys, (w), out) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const KIND: u8, const CC: usize>(
        w: &[u8],
        ys: [&[BlockQ8x32]; CC],
        out: &mut [[f32; GROUP]],
    ) {
        unsafe {
            let gb = group_block(if KIND == Q8_0 { GgmlType::Q8_0 } else { GgmlType::Q4_1 });
            let nb = ys[0].len();
            let low4 = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); CC];
            let mut accm = [_mm256_setzero_ps(); CC];
            let p = w.as_ptr();
            for b in 0..nb {
                let blk = p.add(b * gb);
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
                // Unsigned operands for `vpmaddubsw` (nibbles, or |w| for Q8_0) and Q8_0's signs.
                let mut q = [_mm256_setzero_si256(); 8];
                let mut sg = [_mm256_setzero_si256(); 8];
                if KIND == Q8_0 {
                    for (st, (qv, sv)) in q.iter_mut().zip(sg.iter_mut()).enumerate() {
                        let v = _mm256_loadu_si256(blk.add(16 + 32 * st) as *const __m256i);
                        *qv = _mm256_sign_epi8(v, v);
                        *sv = v;
                    }
                } else {
                    for c in 0..4 {
                        let v = _mm256_loadu_si256(blk.add(32 + 32 * c) as *const __m256i);
                        q[2 * c] = _mm256_and_si256(v, low4);
                        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    }
                }
                for k in 0..CC {
                    let yb = ys[k].get_unchecked(b);
                    let a = yb.qs.as_ptr() as *const i32;
                    let step = |st: usize| {
                        let y = _mm256_set1_epi32(std::ptr::read_unaligned(a.add(st)));
                        if KIND == Q8_0 {
                            _mm256_maddubs_epi16(q[st], _mm256_sign_epi8(y, sg[st]))
                        } else {
                            _mm256_maddubs_epi16(q[st], y)
                        }
                    };
                    let dot = if KIND == Q8_0 {
                        // Two products of up to 127 · 127 fill 16 bits: widen every step.
                        let mut s = _mm256_madd_epi16(step(0), ones);
                        for st in 1..8 {
                            s = _mm256_add_epi32(s, _mm256_madd_epi16(step(st), ones));
                        }
                        s
                    } else {
                        // Nibbles: eight steps sum to at most 8 · 2 · 15 · 127 < 2^15.
                        let mut s = step(0);
                        for st in 1..8 {
                            s = _mm256_add_epi16(s, step(st));
                        }
                        _mm256_madd_epi16(s, ones)
                    };
                    let dot = _mm256_cvtepi32_ps(dot);
                    acc[k] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(yb.d)), acc[k]);
                    if KIND == Q4_1 {
                        let mw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
                        accm[k] = _mm256_fmadd_ps(mw, _mm256_set1_ps(yb.s), accm[k]);
                    }
                }
            }
            for k in 0..CC {
                _mm256_storeu_ps(out[k].as_mut_ptr(), _mm256_add_ps(acc[k], accm[k]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize, vec_dot};

    fn matrix_of(ty: GgmlType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((((i as u32) ^ seed).wrapping_mul(2_654_435_761) >> 8) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        quantize(ty, &x).unwrap()
    }

    fn matrix(rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        matrix_of(GgmlType::Q4_1, rows, cols, seed)
    }

    fn acts(n: usize, cols: usize, seed: usize) -> Vec<QuantizedActivation> {
        (0..n)
            .map(|b| {
                let x: Vec<f32> = (0..cols)
                    .map(|i| (((i * 31 + b * 977 + seed) % 2001) as f32 / 400.0 - 2.5).sin() * 3.0)
                    .collect();
                QuantizedActivation::new(crate::quant::ActivationKind::Q8x32, &x).unwrap()
            })
            .collect()
    }

    #[test]
    fn repacked_products_match_row_dots_and_do_not_depend_on_the_batch() {
        let shapes = [(8, 32, 1), (16, 64, 3), (72, 576, 5), (200, 96, 16), (8, 1536, 2), (24, 64, 7)];
        for (ty, (rows, cols, n)) in
            [GgmlType::Q4_1, GgmlType::Q8_0].into_iter().flat_map(|t| shapes.map(|s| (t, s)))
        {
            let data = matrix_of(ty, rows, cols, rows as u32);
            let m = QMatrix::new(ty, rows, cols, &data).unwrap();
            let il = Interleaved::from_matrix(&m).unwrap();
            let a = acts(n, cols, cols);
            let mut out = vec![0f32; rows * n];
            matmul_group_interleaved(&[&il], &a, &mut [&mut out]).unwrap();
            for (b, act) in a.iter().enumerate() {
                let mut solo = vec![0f32; rows];
                matmul_group_interleaved(&[&il], std::slice::from_ref(act), &mut [&mut solo]).unwrap();
                assert_eq!(&out[b * rows..(b + 1) * rows], &solo[..], "batch of {n} vs alone");
                let QuantizedActivation::Q8x32(ys) = act else { unreachable!() };
                for r in 0..rows {
                    let want = vec_dot(ty, m.row(r).unwrap(), act).unwrap();
                    let got = out[b * rows + r];
                    assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {r}: {got} vs {want}");
                    let g = r / GROUP;
                    assert_eq!(
                        portable_group(ty, il.group(g), ys)[r % GROUP].to_bits(),
                        got.to_bits(),
                        "portable"
                    );
                }
            }
        }
    }

    #[test]
    fn every_kernel_path_gives_the_same_bits() {
        // Odd group counts (a lone group after the AVX-512 pairs), one to sixteen activations.
        let shapes = [(8, 32, 1), (24, 64, 3), (72, 576, 5), (200, 96, 16), (16, 1536, 4), (40, 64, 7)];
        let paths: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.is_available()).collect();
        println!("kernel paths compared: {paths:?}");
        for (ty, (rows, cols, n)) in
            [GgmlType::Q4_1, GgmlType::Q8_0].into_iter().flat_map(|t| shapes.map(|s| (t, s)))
        {
            let data = matrix_of(ty, rows, cols, 3 * rows as u32 + 1);
            let m = QMatrix::new(ty, rows, cols, &data).unwrap();
            let il = Interleaved::from_matrix(&m).unwrap();
            let a = acts(n, cols, rows);
            let outs: Vec<Vec<u32>> = paths
                .iter()
                .map(|&k| {
                    let mut out = vec![0f32; rows * n];
                    matmul_group_interleaved_with(k, &[&il], &a, &mut [&mut out]).unwrap();
                    out.iter().map(|x| x.to_bits()).collect()
                })
                .collect();
            for (k, o) in paths.iter().zip(&outs) {
                assert_eq!(o, &outs[0], "{ty} {rows}x{cols}, {n} activations: {k} vs {}", paths[0]);
            }
        }
    }

    #[test]
    fn repacked_dequantization_is_bit_identical_to_the_row_layout() {
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let data = matrix_of(ty, 24, 96, 7);
            let m = QMatrix::new(ty, 24, 96, &data).unwrap();
            let il = Interleaved::from_matrix(&m).unwrap();
            let mut out = vec![0f32; 24 * 96];
            il.dequantize_into(&mut out).unwrap();
            assert_eq!(out, m.dequantize().unwrap(), "{ty}");
            assert!(il.dequantize_into(&mut out[1..]).is_err());
        }
    }

    #[test]
    fn only_q4_1_with_whole_groups_is_repacked() {
        let data = matrix(12, 32, 1);
        assert!(Interleaved::from_matrix(&QMatrix::new(GgmlType::Q4_1, 12, 32, &data).unwrap()).is_none());
        let q4 = quantize(GgmlType::Q4_0, &[0.5; 256]).unwrap();
        assert!(Interleaved::from_matrix(&QMatrix::new(GgmlType::Q4_0, 8, 32, &q4).unwrap()).is_none());
        let data = matrix(8, 64, 2);
        let il = Interleaved::from_matrix(&QMatrix::new(GgmlType::Q4_1, 8, 64, &data).unwrap()).unwrap();
        let bad = acts(1, 32, 0);
        assert!(matmul_group_interleaved(&[&il], &bad, &mut [&mut [0f32; 8]]).is_err());
    }
}
