//! Q4_1, Q8_0, Q5_0, Q4_K and Q6_K weights repacked eight rows at a time: the kernel of every product
//! of those types, decode (one to a few dozen activations) and prefill alike.
//!
//! In ggml's row layout a 32-element block's dot product ends in an 8-lane vector per (row,
//! activation) pair that must be converted, scaled and folded in on its own: six float and integer
//! operations per 32 products, which makes decode compute-bound on this CPU class. Interleaving
//! eight rows puts one row in each 32-bit lane instead: four consecutive nibbles of row `j` sit in
//! lane `j`, so one `vpmaddubsw` against four activation bytes broadcast to every lane advances
//! eight rows at once, eight of them (summed in 16 bits, which cannot overflow: 8 × 2 × 15 × 127 <
//! 2^15) cover the block, and a single `vpmaddwd` + convert + FMA finishes eight pairs. That is
//! about 2.5 vector operations per pair instead of about 9. The K-quants take the same tiles:
//! a super-block is eight 32-element blocks under one header, each block's scale `d · sc` is
//! formed in registers from the unpacked integer scales (`interleave_pack.rs` has the layouts),
//! and every product uses the 32-element Q8 activations the Q4_1 tiles use.
//!
//! Numerics: each block's integer dot product is exact, then `acc = fma(dot, d_w · d_a, acc)`
//! (Q6_K: once per 16-element half, each with its own scale) and `acc_m = fma(m_w, s_a, acc_m)`
//! (Q4_1: `m`; Q4_K: `-dmin · m`) per row in block order, and the result is `acc + acc_m`. Every
//! row sees the same operations whatever the number of activations, so a sequence's output does
//! not depend on its batch. The portable path computes exactly the same thing.

use rayon::prelude::*;

use super::activation::BlockQ8x32;
pub use super::interleave_pack::GROUP;
use super::interleave_pack::{
    blocks_per_unit, dequantize_group, element, kind_of, quants_at, repack, row_min, row_scale, unit_bytes,
    unit_of, Q4_1_KIND, Q4_K_KIND, Q5_0_KIND, Q6_K_KIND, Q8_0_KIND,
};
use super::{ActivationKind, GgmlType, Kernel, QMatrix, QuantizedActivation};
use crate::error::{EngineError, Result};

/// `$tile::<KIND, N>($w.., [ys[0], .., ys[N - 1]], $out)` for `N = $ys.len()` (1 to 4).
macro_rules! tile_width {
    ($tile:ident, $kind:expr, $ys:expr, ($($w:expr),*), $out:expr) => {{
        let ys = $ys;
        match ys.len() {
            4 => $tile::<{ $kind }, 4>($($w,)* $crate::quant::first(ys), $out),
            3 => $tile::<{ $kind }, 3>($($w,)* $crate::quant::first(ys), $out),
            2 => $tile::<{ $kind }, 2>($($w,)* $crate::quant::first(ys), $out),
            _ => $tile::<{ $kind }, 1>($($w,)* $crate::quant::first(ys), $out),
        }
    }};
}
pub(super) use tile_width;

/// [`tile_width!`] for the kind `$kind` holds at run time: the one dispatch from a run-time kind
/// and width to each path's const-generic tiles.
macro_rules! tile_for {
    ($tile:ident, $kind:expr, $ys:expr, ($($w:expr),*), $out:expr) => {{
        use $crate::quant::interleave_pack::{Q4_1_KIND, Q4_K_KIND, Q5_0_KIND, Q6_K_KIND, Q8_0_KIND};
        match $kind {
            Q8_0_KIND => $crate::quant::interleave::tile_width!($tile, Q8_0_KIND, $ys, ($($w),*), $out),
            Q5_0_KIND => $crate::quant::interleave::tile_width!($tile, Q5_0_KIND, $ys, ($($w),*), $out),
            Q4_K_KIND => $crate::quant::interleave::tile_width!($tile, Q4_K_KIND, $ys, ($($w),*), $out),
            Q6_K_KIND => $crate::quant::interleave::tile_width!($tile, Q6_K_KIND, $ys, ($($w),*), $out),
            _ => $crate::quant::interleave::tile_width!($tile, Q4_1_KIND, $ys, ($($w),*), $out),
        }
    }};
}
pub(super) use tile_for;

/// Activations per tile.
const C: usize = 4;
/// Row groups per parallel task; half as many when a partner splits the region in two halves
/// (`crate::par`): a 576-row product then has 18 tasks, not 9 — even halves, +0.2–2.4% a batch-1 step.
const GROUPS_PER_TASK: usize = 8;

/// A Q4_1, Q8_0, Q5_0, Q4_K or Q6_K matrix repacked eight rows at a time (an owned copy).
#[derive(Clone)]
pub struct Interleaved {
    ty: GgmlType,
    kind: u8,
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
    /// Repacks `m`; `None` unless it is Q4_1, Q8_0, Q5_0, Q4_K or Q6_K with a whole number of 8-row
    /// groups.
    pub fn from_matrix(m: &QMatrix<'_>) -> Option<Self> {
        let kind = kind_of(m.ty())?;
        if !m.rows().is_multiple_of(GROUP) || m.rows() == 0 {
            return None;
        }
        let data = repack(m, kind);
        Some(Self { ty: m.ty(), kind, rows: m.rows(), cols: m.cols(), data })
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Every row of `x` (`rows × cols`) quantized for these tiles: 32-element Q8 blocks, whatever
    /// the weight type.
    pub fn prepare_rows(&self, x: &[f32]) -> Result<Vec<QuantizedActivation>> {
        super::matrix::prepare_rows_as(ActivationKind::Q8x32, self.cols, x)
    }

    /// Dequantizes the whole matrix into `out` (`rows × cols`, row-major), with exactly the
    /// arithmetic of the row layout's dequantization, so a GEMM over it gives the same result
    /// whichever copy it came from.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        super::check_matrix_len(self.rows, self.cols, out.len())?;
        out.par_chunks_mut(GROUP * self.cols)
            .enumerate()
            .for_each(|(g, o)| dequantize_group(self.kind, self.group(g), self.cols, o));
        Ok(())
    }

    fn group(&self, g: usize) -> &[u8] {
        let len = self.cols / (32 * blocks_per_unit(self.kind)) * unit_bytes(self.kind);
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
            _ => return Err(EngineError::InvalidArgument("repacked weights need Q8x32 activations".into())),
        }
    }
    for (m, out) in mats.iter().zip(outs.iter()) {
        for a in acts {
            if a.len() != m.cols {
                return Err(EngineError::shape(format!("activation for a {} matrix", m.ty), m.cols, a.len()));
            }
        }
        if Some(out.len()) != m.rows.checked_mul(n) {
            return Err(EngineError::shape("matmul output length", format!("{} x {n}", m.rows), out.len()));
        }
    }
    if n == 0 {
        return Ok(());
    }
    // Resolved once per product: the AVX-512 tiles take two groups at a time, AVX2 one.
    let wide = kernel >= Kernel::Avx512 && Kernel::Avx512.is_available();
    // Sixteen or more activations fill the AMX tiles: their biased bytes, made once here. (Not
    // for Q5_0's layout: its tiles are the AVX-512 ones, which AMX does not beat here either.)
    #[cfg(target_arch = "x86_64")]
    let amx = wide
        && n >= super::interleave_amx::MIN_ACTS
        && kernel >= Kernel::Amx
        && Kernel::Amx.is_available()
        && mats.iter().all(|m| m.kind != Q5_0_KIND);
    #[cfg(not(target_arch = "x86_64"))]
    let amx = false;
    #[cfg(target_arch = "x86_64")]
    let amx_acts = if amx { super::interleave_amx::biased_rows(&ys, mats[0].cols) } else { Vec::new() };
    // The AVX-512 tiles of the signed kinds take each activation byte biased by 128 (unsigned, as
    // `vpdpbusd` wants its first operand), made once per product here, not once per row group.
    let signed = mats.iter().any(|m| m.kind == Q8_0_KIND || m.kind == Q6_K_KIND);
    let biased: Vec<Vec<u8>> = if wide && signed && !amx {
        ys.iter().map(|y| y.iter().flat_map(|b| b.qs.map(|q| (q as u8) ^ 0x80)).collect()).collect()
    } else {
        Vec::new()
    };
    let yb: Vec<&[u8]> = biased.iter().map(Vec::as_slice).collect();
    let avx2 = kernel >= Kernel::Avx2 && Kernel::Avx2.is_available();
    // Tasks own runs of row groups and write their rows of every activation straight into the
    // outputs (disjoint ranges: no buffer to zero and copy back on one thread — a twelfth of a
    // prefill's time when they were).
    let out_ptrs: Vec<OutRows> =
        outs.iter_mut().map(|o| OutRows { ptr: o.as_mut_ptr(), len: o.len() }).collect();
    let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
    let per_task = if crate::par::partnered() { GROUPS_PER_TASK / 2 } else { GROUPS_PER_TASK };
    for (i, m) in mats.iter().enumerate() {
        let groups = m.rows / GROUP;
        for g0 in (0..groups).step_by(per_task) {
            tasks.push((i, g0, (g0 + per_task).min(groups)));
        }
    }
    let run = |&(i, g0, g1): &(usize, usize, usize)| {
        let m = mats[i];
        let out = &out_ptrs[i];
        // Row `r` of activation `b` is `b · m.rows + r`; this task's rows are `g0·8..g1·8`.
        let put = |b: usize, r: usize, vals: &[f32]| {
            assert!(r >= g0 * GROUP && r + vals.len() <= g1 * GROUP && b < n, "tile output outside its task");
            // SAFETY: in bounds of the output (its length is `m.rows · n`, checked above), and
            // only this task writes rows `g0·8..g1·8` of any activation (asserted), while the
            // outputs are borrowed mutably by this function.
            unsafe { out.write(b * m.rows + r, vals) };
        };
        let mut g = g0;
        #[cfg(target_arch = "x86_64")]
        let (mut scratch, mut buf) = (super::interleave_amx::Scratch::default(), Vec::new());
        while g < g1 {
            let two = wide && g + 1 < g1;
            #[cfg(target_arch = "x86_64")]
            if amx && two {
                // AMX writes `[activation][16 rows]` into a buffer of its own (opt-in, not the
                // hot path), copied into place.
                buf.resize(2 * GROUP * n, 0f32);
                // SAFETY: AMX granted and AVX-512 detected (`amx`); both groups hold one unit per
                // activation unit (checked above); `amx_acts` is `biased_rows` of `ys`; `buf`
                // holds `n × 16` and `0 + 16 <= 16`.
                unsafe {
                    let op = super::interleave_amx::Rows16 {
                        w0: m.group(g),
                        w1: m.group(g + 1),
                        ab: &amx_acts,
                        ys: &ys,
                        buf: &mut buf[..],
                        rows: 2 * GROUP,
                        at: 0,
                    };
                    super::interleave_amx::rows16(m.kind, op, &mut scratch);
                }
                for (b, r) in buf.chunks_exact(2 * GROUP).enumerate() {
                    put(b, g * GROUP, r);
                }
                g += 2;
                continue;
            }
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
                            m.kind,
                            m.group(g),
                            m.group(g + 1),
                            yb.get(c..c + k).unwrap_or(&[]),
                            c == 0,
                            &ys[c..c + k],
                            &mut res,
                        );
                    }
                    for (kk, r) in res.iter().enumerate().take(k) {
                        put(c + kk, g * GROUP, r);
                    }
                } else {
                    let mut res = [[0f32; GROUP]; C];
                    one_group(avx2, m.kind, m.group(g), &ys[c..c + k], &mut res);
                    for (kk, r) in res.iter().enumerate().take(k) {
                        put(c + kk, g * GROUP, r);
                    }
                }
                c += k;
            }
            g += if two { 2 } else { 1 };
        }
    };
    let work: usize = mats.iter().map(|m| m.data.len()).sum::<usize>() * n;
    if work < 64 * 1024 {
        tasks.iter().for_each(run);
    } else {
        crate::par::for_each(tasks.len(), |i| run(&tasks[i]));
    }
    Ok(())
}

/// One output of a product, written by several tasks at once, each into rows of its own.
struct OutRows {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the tasks sharing an `OutRows` write disjoint ranges (see `put` above), and the slice
// it points into is borrowed mutably for as long as they run.
unsafe impl Sync for OutRows {}

impl OutRows {
    /// Copies `vals` to `at..at + vals.len()`.
    ///
    /// # Safety
    /// No other thread reads or writes that range meanwhile.
    unsafe fn write(&self, at: usize, vals: &[f32]) {
        assert!(at.checked_add(vals.len()).is_some_and(|end| end <= self.len), "output range out of bounds");
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), self.ptr.add(at), vals.len()) };
    }
}

/// One group's eight rows × `ys.len()` (1 to 4) activations, on AVX2 when `avx2` (detected).
fn one_group(avx2: bool, kind: u8, w: &[u8], ys: &[&[BlockQ8x32]], res: &mut [[f32; GROUP]]) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2/FMA/F16C detected by the caller; `w` holds one group unit per activation
        // unit (checked by the caller).
        unsafe { super::interleave_avx2::tile_any(kind, w, ys, res) };
        return;
    }
    let _ = avx2;
    for (r, y) in res.iter_mut().zip(ys) {
        *r = portable_group(kind, w, y);
    }
}

/// One group's eight rows · one activation, with the operations the vector tiles perform: per
/// block, the exact integer dot, then `acc = fma(dot, scale · d_a, acc)` (Q6_K: once per
/// 16-element half) and `acc_m = fma(min, s_a, acc_m)`; the result is `acc + acc_m`.
fn portable_group(kind: u8, w: &[u8], y: &[BlockQ8x32]) -> [f32; GROUP] {
    let mut acc = [0f32; GROUP];
    let mut accm = [0f32; GROUP];
    for (b, yb) in y.iter().enumerate() {
        let (base, sub) = unit_of(kind, b);
        let unit = &w[base..base + unit_bytes(kind)];
        let q = &unit[quants_at(kind, sub)..];
        for j in 0..GROUP {
            let halves = if kind == Q6_K_KIND { 2 } else { 1 };
            let len = 32 / halves;
            for h in 0..halves {
                let dot: i32 =
                    (h * len..(h + 1) * len).map(|e| element(kind, q, j, e) * yb.qs[e] as i32).sum();
                acc[j] = (dot as f32).mul_add(row_scale(kind, unit, sub, h, j) * yb.d, acc[j]);
            }
            if matches!(kind, Q4_1_KIND | Q4_K_KIND) {
                accm[j] = row_min(kind, unit, sub, j).mul_add(yb.s, accm[j]);
            }
        }
    }
    std::array::from_fn(|j| acc[j] + accm[j])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize, vec_dot};

    /// A `rows × cols` matrix of `ty`: quantized from pseudo-random values for the 32-block types,
    /// pseudo-random block bytes with sane f16 scales for the K-quants (every bit pattern of
    /// their quants and integer scales is a valid block).
    fn matrix_of(ty: GgmlType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let hash = |i: usize| ((i as u32) ^ seed).wrapping_mul(2_654_435_761) >> 8;
        if !matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q5_0) {
            let x: Vec<f32> = (0..rows * cols).map(|i| (hash(i) % 2001) as f32 / 1000.0 - 1.0).collect();
            return quantize(ty, &x).unwrap();
        }
        let (bs, n) = (ty.type_size(), rows * cols / ty.block_size());
        let mut data: Vec<u8> = (0..n * bs).map(|i| (hash(i) >> 3) as u8).collect();
        for (b, blk) in data.chunks_exact_mut(bs).enumerate() {
            let f =
                |k: usize| half::f16::from_f32(0.002 + (hash(b * 7 + k) % 1000) as f32 * 1e-5).to_le_bytes();
            if ty == GgmlType::Q4_K {
                blk[0..2].copy_from_slice(&f(1));
                blk[2..4].copy_from_slice(&f(2));
            } else if ty == GgmlType::Q5_0 {
                blk[0..2].copy_from_slice(&f(4));
            } else {
                blk[208..210].copy_from_slice(&f(3));
            }
        }
        data
    }

    const TYPES: [GgmlType; 5] =
        [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K];

    /// `(rows, cols, activations)` shapes for `ty`: K-quant rows are whole super-blocks.
    fn shapes(ty: GgmlType, base: [(usize, usize, usize); 6]) -> Vec<(usize, usize, usize)> {
        let k = matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K);
        base.iter().map(|&(r, c, n)| (r, if k { c.div_ceil(256) * 256 } else { c }, n)).collect()
    }

    /// The f32 dot of a dequantized row and a dequantized activation.
    fn f32_dot(ty: GgmlType, row: &[u8], ys: &[BlockQ8x32]) -> (f32, f32) {
        let mut w = vec![0f32; ys.len() * 32];
        crate::quant::reference::dequantize(ty, row, &mut w);
        let terms =
            ys.iter().enumerate().flat_map(|(b, y)| (0..32).map(move |e| (b, y.qs[e] as f32 * y.d, e)));
        let (mut sum, mut mag) = (0f64, 0f64);
        for (b, a, e) in terms {
            let t = (w[32 * b + e] * a) as f64;
            sum += t;
            mag += t.abs();
        }
        (sum as f32, mag as f32)
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
        let base = [(8, 32, 1), (16, 64, 3), (72, 576, 5), (200, 96, 16), (8, 1536, 2), (24, 64, 7)];
        for (ty, (rows, cols, n)) in
            TYPES.into_iter().flat_map(|t| shapes(t, base).into_iter().map(move |s| (t, s)))
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
                assert_eq!(&out[b * rows..(b + 1) * rows], &solo[..], "{ty}: batch of {n} vs alone");
                let QuantizedActivation::Q8x32(ys) = act else { unreachable!() };
                for r in 0..rows {
                    let got = out[b * rows + r];
                    if matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q5_0) {
                        // The row layout's kernel, on the same activation.
                        let want = vec_dot(ty, m.row(r).unwrap(), act).unwrap();
                        assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {r}: {got} vs {want}");
                    }
                    // The plain f32 dot (Q4_K's minimum term meets the activation sum rounded to
                    // f16, as Q4_1's does: that is the tolerance).
                    let (want, mag) = f32_dot(ty, m.row(r).unwrap(), ys);
                    assert!((got - want).abs() <= 2e-3 * (1.0 + mag), "{ty} row {r}: {got} vs f32 {want}");
                    assert_eq!(
                        portable_group(il.kind, il.group(r / GROUP), ys)[r % GROUP].to_bits(),
                        got.to_bits(),
                        "{ty}: portable"
                    );
                }
            }
        }
    }

    /// For every type and `(rows, cols, activations)` of `base`: every path this CPU runs gives
    /// the bits of the first, and (when `alone`) the first and last activations' rows are those
    /// of a product of that activation by itself. Returns the paths compared.
    fn paths_agree(base: [(usize, usize, usize); 6], seed: u32, alone: bool) -> Vec<Kernel> {
        let paths: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.is_available()).collect();
        for (ty, (rows, cols, n)) in
            TYPES.into_iter().flat_map(|t| shapes(t, base).into_iter().map(move |s| (t, s)))
        {
            let data = matrix_of(ty, rows, cols, seed * rows as u32 + n as u32);
            let m = QMatrix::new(ty, rows, cols, &data).unwrap();
            let il = Interleaved::from_matrix(&m).unwrap();
            let a = acts(n, cols, rows);
            let product = |k: Kernel, a: &[QuantizedActivation]| -> Vec<u32> {
                let mut out = vec![0f32; rows * a.len()];
                matmul_group_interleaved_with(k, &[&il], a, &mut [&mut out]).unwrap();
                out.iter().map(|x| x.to_bits()).collect()
            };
            let outs: Vec<Vec<u32>> = paths.iter().map(|&k| product(k, &a)).collect();
            for (k, o) in paths.iter().zip(&outs) {
                assert_eq!(o, &outs[0], "{ty} {rows}x{cols}, {n} activations: {k} vs {}", paths[0]);
            }
            if alone {
                let last = outs.last().unwrap();
                for b in [0, n - 1] {
                    let one = product(Kernel::Scalar, &a[b..b + 1]);
                    assert_eq!(
                        &last[b * rows..(b + 1) * rows],
                        &one[..],
                        "{ty} {rows}x{cols}: activation {b} alone"
                    );
                }
            }
        }
        paths
    }

    /// The AVX2 tiles add Q6_K's products and Q5_0's (`q + 16`, up to 31) four steps at a time
    /// in 16 bits: the largest magnitudes (every weight at its minimum, or Q5_0's at its
    /// maximum, every activation at ±127) reach 32,512 and 31,496 and must not wrap. Every path
    /// gives the scalar path's bits, and the value is the f32 dot's.
    #[test]
    fn extreme_q5_0_and_q6_k_blocks_do_not_overflow_the_16_bit_sums() {
        let (rows, cols) = (16, 512);
        for (ty, top) in [
            (GgmlType::Q5_0, false),
            (GgmlType::Q5_0, true),
            (GgmlType::Q6_K, false),
            (GgmlType::Q8_0, false),
        ] {
            let (bs, n) = (ty.type_size(), rows * cols / ty.block_size());
            // All-zero quants: Q5_0's value -16, Q6_K's -32, Q8_0's 0 (then -127 below); Q5_0's
            // all-one quants (`top`): 15.
            let mut data = vec![0u8; n * bs];
            let one = half::f16::from_f32(0.5).to_le_bytes();
            for blk in data.chunks_exact_mut(bs) {
                match ty {
                    GgmlType::Q6_K => {
                        blk[192..208].fill(127); // the sixteen i8 scales
                        blk[208..210].copy_from_slice(&one);
                    }
                    GgmlType::Q8_0 => {
                        blk[0..2].copy_from_slice(&one);
                        blk[2..].fill(0x81); // -127
                    }
                    _ => {
                        blk[0..2].copy_from_slice(&one);
                        if top {
                            blk[2..].fill(0xFF);
                        }
                    }
                }
            }
            let m = QMatrix::new(ty, rows, cols, &data).unwrap();
            let il = Interleaved::from_matrix(&m).unwrap();
            for sign in [1.0f32, -1.0] {
                let a =
                    vec![QuantizedActivation::new(crate::quant::ActivationKind::Q8x32, &vec![sign; cols])
                        .unwrap()];
                let QuantizedActivation::Q8x32(ys) = &a[0] else { unreachable!() };
                assert!(ys.iter().all(|b| b.qs.iter().all(|&q| q == (127.0 * sign) as i8)));
                let mut want = vec![0f32; rows];
                matmul_group_interleaved_with(Kernel::Scalar, &[&il], &a, &mut [&mut want]).unwrap();
                let (f, mag) = f32_dot(ty, m.row(0).unwrap(), ys);
                assert!((want[0] - f).abs() <= 1e-3 * mag, "{ty}: {} vs f32 {f}", want[0]);
                for k in Kernel::ALL.into_iter().filter(|k| k.is_available()) {
                    let mut got = vec![0f32; rows];
                    matmul_group_interleaved_with(k, &[&il], &a, &mut [&mut got]).unwrap();
                    assert_eq!(
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{ty}, activations {sign}: {k}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_kernel_path_gives_the_same_bits() {
        // Odd group counts (a lone group after the AVX-512 pairs), one to sixteen activations.
        let base = [(8, 32, 1), (24, 64, 3), (72, 576, 5), (200, 96, 16), (16, 1536, 4), (40, 64, 7)];
        println!("kernel paths compared: {:?}", paths_agree(base, 3, false));
    }

    #[test]
    fn prefill_sized_products_give_the_same_bits_on_every_path() {
        // Sixteen and more activations: the AMX tiles where the CPU has them (partial last tiles,
        // a lone group after the pairs), against every other path and a product of one.
        let base = [(16, 64, 16), (24, 96, 17), (72, 576, 37), (40, 64, 33), (16, 1536, 20), (8, 32, 16)];
        println!("kernel paths compared: {:?}", paths_agree(base, 5, true));
    }

    #[test]
    fn repacked_dequantization_is_bit_identical_to_the_row_layout() {
        for ty in TYPES {
            let cols = if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) { 512 } else { 96 };
            let data = matrix_of(ty, 24, cols, 7);
            let m = QMatrix::new(ty, 24, cols, &data).unwrap();
            let il = Interleaved::from_matrix(&m).unwrap();
            let mut out = vec![0f32; 24 * cols];
            il.dequantize_into(&mut out).unwrap();
            assert_eq!(out, m.dequantize().unwrap(), "{ty}");
            assert!(il.dequantize_into(&mut out[1..]).is_err());
        }
    }

    #[test]
    fn only_repackable_types_with_whole_groups_are_repacked() {
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
