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
    unit_of, Q4_1_KIND, Q4_K_KIND, Q6_K_KIND,
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
    let p = Product::new(kernel, mats, acts)?;
    for (m, out) in mats.iter().zip(outs.iter()) {
        if Some(out.len()) != m.rows.checked_mul(n) {
            return Err(EngineError::shape("matmul output length", format!("{} x {n}", m.rows), out.len()));
        }
    }
    if n == 0 {
        return Ok(());
    }
    // Tasks own runs of row groups and write their rows of every activation straight into the
    // outputs (disjoint ranges: no buffer to zero and copy back on one thread — a twelfth of a
    // prefill's time when they were).
    let out_ptrs: Vec<SharedOut<f32>> = outs.iter_mut().map(|o| SharedOut::new(o)).collect();
    let per_task = Product::groups_per_task();
    let mut tasks: Vec<(usize, usize, usize)> =
        Vec::with_capacity(mats.iter().map(|m| (m.rows / GROUP).div_ceil(per_task)).sum());
    for (i, m) in mats.iter().enumerate() {
        let groups = m.rows / GROUP;
        for g0 in (0..groups).step_by(per_task) {
            tasks.push((i, g0, (g0 + per_task).min(groups)));
        }
    }
    let run = |&(i, g0, g1): &(usize, usize, usize)| {
        let (m, out) = (mats[i], &out_ptrs[i]);
        p.rows(m, g0, g1, |b, r, vals| {
            // Row `r` of activation `b` is `b · m.rows + r`; this task's rows are `g0·8..g1·8`.
            assert!(r >= g0 * GROUP && r + vals.len() <= g1 * GROUP && b < n, "tile output outside its task");
            // SAFETY: in bounds of the output (its length is `m.rows · n`, checked above), and
            // only this task writes rows `g0·8..g1·8` of any activation (asserted), while the
            // outputs are borrowed mutably by this function.
            unsafe { out.write(b * m.rows + r, vals) };
        });
    };
    p.run(mats, tasks.len(), |t| run(&tasks[t]));
    Ok(())
}

/// An element-wise `h = silu(g) · u` over runs of a row (`silu_mul(g, u, h)`).
pub type SiluMul = dyn Fn(&[f32], &[f32], &mut [f32]) + Sync;

/// `silu(gate · x) ⊙ (up · x)` for every activation `x`, quantized as the next product's
/// activations ([`Interleaved::prepare_rows`]): each task computes the same rows of both
/// matrices, then `silu_mul` and the quantization of its own 32-row blocks, inside the parallel
/// region. A decode step otherwise runs both on one thread between two regions while the other
/// waits. `silu_mul(g, u, h)` must be element-wise (`h[i]` from `g[i]` and `u[i]` alone, the same
/// whichever run it is given), so the result has the bits of the product, `silu_mul` over whole
/// rows, then [`Interleaved::prepare_rows`].
pub fn matmul_swiglu_interleaved(
    gate: &Interleaved,
    up: &Interleaved,
    acts: &[QuantizedActivation],
    silu_mul: &SiluMul,
) -> Result<Vec<QuantizedActivation>> {
    matmul_swiglu_interleaved_with(Kernel::best(), gate, up, acts, silu_mul)
}

/// [`matmul_swiglu_interleaved`] on `kernel`'s path.
pub fn matmul_swiglu_interleaved_with(
    kernel: Kernel,
    gate: &Interleaved,
    up: &Interleaved,
    acts: &[QuantizedActivation],
    silu_mul: &SiluMul,
) -> Result<Vec<QuantizedActivation>> {
    let (n, rows) = (acts.len(), gate.rows);
    if up.rows != rows {
        return Err(EngineError::shape("SwiGLU up rows (as many as gate's)", rows, up.rows));
    }
    if !rows.is_multiple_of(32) {
        return Err(EngineError::shape(
            "SwiGLU rows (whole 32-value blocks)",
            rows.next_multiple_of(32),
            rows,
        ));
    }
    let p = Product::new(kernel, &[gate, up], acts)?;
    let mut hs: Vec<Vec<BlockQ8x32>> = (0..n).map(|_| vec![BlockQ8x32::default(); rows / 32]).collect();
    let out_ptrs: Vec<SharedOut<BlockQ8x32>> = hs.iter_mut().map(|h| SharedOut::new(h)).collect();
    // Whole 32-row blocks per task: a multiple of four groups.
    let per_task = Product::groups_per_task();
    assert!(per_task.is_multiple_of(32 / GROUP), "a SwiGLU task must cover whole 32-row blocks");
    let groups = rows / GROUP;
    let tasks = groups.div_ceil(per_task);
    let run = |t: usize| {
        let (g0, g1) = (t * per_task, ((t + 1) * per_task).min(groups));
        let (r0, len) = (g0 * GROUP, (g1 - g0) * GROUP);
        // Both matrices' rows of this task, `[activation][row]`, then one activation's `h` at a
        // time: in this thread's kept buffer (a fresh one per task was three allocations, 48
        // tasks a layer).
        SWIGLU.with(|cell| {
            let mut kept = cell.take();
            kept.clear();
            // `h` for up to SWIGLU_H values' worth of activations at a time, quantized together
            // (sixteen blocks per AVX-512 step, where one activation's run is two).
            let per = (SWIGLU_H / len).max(1);
            kept.resize(2 * n * len + per * len, 0f32);
            let (gu, h) = kept.split_at_mut(2 * n * len);
            for (j, m) in [gate, up].into_iter().enumerate() {
                let part = &mut gu[j * n * len..(j + 1) * n * len];
                p.rows(m, g0, g1, |b, r, vals| part[b * len + r - r0..][..vals.len()].copy_from_slice(vals));
            }
            let (g, u) = gu.split_at(n * len);
            let mut blocks = [BlockQ8x32::default(); SWIGLU_H / 32];
            for b0 in (0..n).step_by(per) {
                let k = per.min(n - b0);
                let (h, blocks) = (&mut h[..k * len], &mut blocks[..k * len / 32]);
                for (i, h) in h.chunks_exact_mut(len).enumerate() {
                    let b = b0 + i;
                    silu_mul(&g[b * len..(b + 1) * len], &u[b * len..(b + 1) * len], h);
                }
                super::activation::quantize_q8x32_into(h, blocks);
                for (out, blocks) in out_ptrs[b0..b0 + k].iter().zip(blocks.chunks_exact(len / 32)) {
                    // SAFETY: blocks `r0/32..(r0+len)/32` of each activation belong to this task
                    // alone (tasks cover disjoint row ranges), and `hs` is not touched until the
                    // region ends.
                    unsafe { out.write(r0 / 32, blocks) };
                }
            }
            cell.set(kept);
        });
    };
    p.run(&[gate, up], tasks, run);
    Ok(hs.into_iter().map(QuantizedActivation::Q8x32).collect())
}

/// Values of `h` [`matmul_swiglu_interleaved`] quantizes at once (sixteen 32-value blocks): at
/// least one task's rows of one activation.
const SWIGLU_H: usize = 512;
const _: () = assert!(GROUPS_PER_TASK * GROUP <= SWIGLU_H);

thread_local! {
    /// [`matmul_swiglu_interleaved`]'s per-thread task buffer (taken while a task runs, so a task
    /// a rayon steal nests inside another gets a fresh one).
    static SWIGLU: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// What every task of one product reads, resolved once per product: the activations' blocks
/// and the kernel path.
struct Product<'a> {
    /// Each activation's blocks.
    ys: Vec<&'a [BlockQ8x32]>,
    /// The AVX-512 tiles, two groups at a time.
    wide: bool,
    avx2: bool,
    /// The activations as AMX's tiles read them (with AMX only).
    #[cfg(target_arch = "x86_64")]
    amx: Option<super::interleave_amx::Acts>,
}

impl<'a> Product<'a> {
    fn new(kernel: Kernel, mats: &[&Interleaved], acts: &'a [QuantizedActivation]) -> Result<Self> {
        let n = acts.len();
        let mut ys: Vec<&[BlockQ8x32]> = Vec::with_capacity(n);
        for a in acts {
            match a {
                QuantizedActivation::Q8x32(v) => ys.push(v),
                _ => {
                    return Err(EngineError::InvalidArgument(
                        "repacked weights need Q8x32 activations".into(),
                    ))
                }
            }
        }
        for m in mats {
            for a in acts {
                if a.len() != m.cols {
                    return Err(EngineError::shape(
                        format!("activation for a {} matrix", m.ty),
                        m.cols,
                        a.len(),
                    ));
                }
            }
        }
        let wide = kernel >= Kernel::Avx512 && Kernel::Avx512.is_available();
        // Prefill-sized products take the AMX tiles: the activations' bytes and scales as the
        // tiles read them, made once here.
        #[cfg(target_arch = "x86_64")]
        let amx = (wide
            && n >= super::interleave_amx::MIN_ACTS
            && kernel >= Kernel::Amx
            && Kernel::Amx.is_available())
        .then(|| mats.first().map(|m| super::interleave_amx::acts(&ys, m.cols)))
        .flatten();
        let avx2 = kernel >= Kernel::Avx2 && Kernel::Avx2.is_available();
        Ok(Product {
            ys,
            wide,
            avx2,
            #[cfg(target_arch = "x86_64")]
            amx,
        })
    }

    /// Row groups per task.
    fn groups_per_task() -> usize {
        if crate::par::partnered() {
            GROUPS_PER_TASK / 2
        } else {
            GROUPS_PER_TASK
        }
    }

    /// `run(t)` for every task `t < tasks` of a product over `mats`: as one parallel region, or
    /// on this thread when the whole product is too small to share.
    fn run(&self, mats: &[&Interleaved], tasks: usize, run: impl Fn(usize) + Sync + Send) {
        let work: usize = mats.iter().map(|m| m.data.len()).sum::<usize>() * self.ys.len();
        if work < 64 * 1024 {
            (0..tasks).for_each(run);
        } else {
            crate::par::for_each(tasks, run);
        }
    }

    /// Rows `g0·8..g1·8` of `m` for every activation, each tile's rows handed to `put(activation,
    /// first row, values)`.
    fn rows(&self, m: &Interleaved, g0: usize, g1: usize, mut put: impl FnMut(usize, usize, &[f32])) {
        let (ys, wide) = (&self.ys[..], self.wide);
        let n = ys.len();
        let mut g = g0;
        #[cfg(target_arch = "x86_64")]
        let (mut scratch, mut buf) = (super::interleave_amx::Scratch::default(), Vec::new());
        #[cfg(target_arch = "x86_64")]
        let mut unpacked = Vec::new();
        while g < g1 {
            let two = wide && g + 1 < g1;
            #[cfg(target_arch = "x86_64")]
            if let (Some(acts), true) = (&self.amx, two) {
                // AMX writes `[activation][16 rows]` into a buffer of its own, copied into
                // place.
                buf.resize(n, [0f32; 2 * GROUP]);
                // SAFETY: AMX granted and AVX-512 detected (`amx`); both groups hold one unit per
                // activation unit (checked in `new`).
                unsafe {
                    let op = super::interleave_amx::Rows16 {
                        w0: m.group(g),
                        w1: m.group(g + 1),
                        acts,
                        buf: &mut buf[..],
                    };
                    super::interleave_amx::rows16(m.kind, op, &mut scratch);
                }
                for (b, r) in buf.iter().enumerate() {
                    put(b, g * GROUP, r);
                }
                g += 2;
                continue;
            }
            // Many activations: the pair's blocks unpacked once, read by every tile.
            #[cfg(target_arch = "x86_64")]
            let unpack = two
                && n >= super::interleave_avx512::UNPACK_MIN_ACTS
                && super::interleave_avx512::unpack_pays(m.kind);
            #[cfg(target_arch = "x86_64")]
            if unpack {
                // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C detected (`wide`); both groups
                // hold one group block per activation block (checked in `new`).
                unsafe {
                    let (w0, w1, nb) = (m.group(g), m.group(g + 1), ys[0].len());
                    super::interleave_avx512::unpack_pair(m.kind, w0, w1, nb, &mut unpacked)
                };
            }
            let mut c = 0;
            while c < n {
                let k = (n - c).min(if two { super::interleave_avx512::ACTS } else { C });
                if two {
                    // Left uninitialized: the tile writes one row per activation it is given.
                    // Zeroing all eight rows was a `memset` call per pair, where a batch-1 step
                    // uses one row: 1–3% of batch-1 and batch-4 steps (three `bench-engine` runs
                    // alternating the two every eight steps in one process).
                    #[cfg(target_arch = "x86_64")]
                    {
                        let mut res = [std::mem::MaybeUninit::<[f32; 2 * GROUP]>::uninit(); 8];
                        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C detected (`wide`);
                        // both groups hold one group block per activation block (checked in
                        // `new`), and `unpacked` one unpacked block per activation block when
                        // `unpack`; `res` has room for `k <= ACTS` rows.
                        unsafe {
                            let ys = &ys[c..c + k];
                            if unpack {
                                super::interleave_avx512::tile_unpacked(m.kind, &unpacked, ys, &mut res);
                            } else {
                                let (w0, w1) = (m.group(g), m.group(g + 1));
                                super::interleave_avx512::tile_any(m.kind, w0, w1, c == 0, ys, &mut res);
                            }
                        }
                        for (kk, r) in res.iter().enumerate().take(k) {
                            // SAFETY: the tile wrote rows `0..k`, one per activation.
                            put(c + kk, g * GROUP, unsafe { r.assume_init_ref() });
                        }
                    }
                } else {
                    let mut res = [[0f32; GROUP]; C];
                    one_group(self.avx2, m.kind, m.group(g), &ys[c..c + k], &mut res);
                    for (kk, r) in res.iter().enumerate().take(k) {
                        put(c + kk, g * GROUP, r);
                    }
                }
                c += k;
            }
            g += if two { 2 } else { 1 };
        }
    }
}

/// One output of a product (a matrix's rows, an activation's quantized blocks), written by
/// several tasks at once, each into a range of its own.
struct SharedOut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the tasks sharing a `SharedOut` write disjoint ranges (their callers assert whose range
// is whose), and the slice it points into is borrowed mutably for as long as they run.
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T: Copy> SharedOut<T> {
    fn new(out: &mut [T]) -> Self {
        SharedOut { ptr: out.as_mut_ptr(), len: out.len() }
    }

    /// Copies `vals` to `at..at + vals.len()`.
    ///
    /// # Safety
    /// No other thread reads or writes that range meanwhile.
    unsafe fn write(&self, at: usize, vals: &[T]) {
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
#[path = "interleave_tests.rs"]
mod tests;
