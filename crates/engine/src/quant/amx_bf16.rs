//! Prompt products on AMX-BF16: a copy of each layer matrix in bfloat16, multiplied by the
//! prompt's activations rounded to bfloat16, `tdpbf16ps` accumulating f32 over the whole row.
//!
//! Why a second copy and a second arithmetic: the integer tiles (`interleave_amx`) must store,
//! reload and scale every 32-value block's dots, since every block has its own scales — the
//! scaling, not the multiplication, bounds them (~350 G products a second a core here). With the
//! scales folded into bfloat16 weights once at load, a 16 × 16 tile of sums stays in its register
//! from the first column to the last: a register block of 2 × 2 tiles (32 activations × 32 rows,
//! one tile load per `tdpbf16ps`) ran ~1.3 T multiply-adds' worth of FLOP a second a core on the
//! machine measured, the activations streaming from L2 (docs/engine.md, Kernel paths). The copy
//! costs two bytes a weight (212 MB for the default model), so it is made only where the CPU has
//! AMX-BF16 and the integer AMX path is allowed (`TOKENPATH_KERNEL` at `amx`).
//!
//! Numerics: a different rounding from the integer tiles (bfloat16 weights and activations, f32
//! sums, against Q8 activations and exact integer dots), so the forward pass uses it only as a
//! method of its own for prompt-sized items, as it uses dequantize + GEMM for the other weight
//! types (invariant 12). An output depends only on its own activation row and weight row: the
//! tiles' sums run over k in the same order for every row of a tile, so a row gives the same bits
//! alone, in a tile of strangers, or in any chunk of its prompt.
//!
//! Safety contract of the kernel: [`available`] returned true, the shapes were checked here.

#[cfg(target_arch = "x86_64")]
use std::arch::{asm, x86_64::*};

use rayon::prelude::*;

use crate::error::{EngineError, Result};

/// Rows (of weights) or activations per tile.
pub(crate) const TILE: usize = 16;
/// Columns (k) per tile step: 32 bfloat16 are a tile row's 64 bytes.
pub(crate) const KSTEP: usize = 32;
/// `u16`s per tile (16 rows of 64 bytes).
pub(crate) const TILE_LEN: usize = TILE * KSTEP;
/// Activations per parallel task: 256 activations × 576 columns of bf16 are 288 KB, which the
/// task's core keeps in its L2 while it sweeps every row pair of the matrix.
const ACTS_PER_TASK: usize = 256;

/// Whether this CPU has AMX-BF16 beside AMX-TILE, the process got the tile state, and the
/// AVX-512 F/BW conversions of the activations run.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            // CPUID.(EAX=7, ECX=0):EDX bit 22 is AMX-BF16.
            let leaf = __cpuid_count(7, 0);
            leaf.edx & (1 << 22) != 0
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && super::interleave_amx::available()
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A matrix in bfloat16, laid out as `tdpbf16ps`'s second operand: for each tile of sixteen rows
/// (row count padded with zero rows to a whole pair of tiles) and each step of 32 columns, sixteen
/// tile rows, each holding columns `2j, 2j + 1` of the sixteen rows side by side.
#[derive(Debug)]
pub struct Bf16Matrix {
    rows: usize,
    cols: usize,
    data: Vec<Line>,
}

/// A tile row: 32 bfloat16 on a cache line of their own. A tile row that straddles two lines
/// costs every load two (the allocator aligns a `Vec<u16>` to 16 bytes).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line([u16; KSTEP]);
// SAFETY: 64 bytes of `u16`s, no padding (size = alignment = 64), any bit pattern valid.
unsafe impl bytemuck::Zeroable for Line {}
unsafe impl bytemuck::Pod for Line {}

/// `n` values of zeros as whole lines.
pub(crate) fn zeroed_lines(lines: &mut Vec<Line>, n: usize) -> &mut [u16] {
    lines.clear();
    lines.resize(n.div_ceil(KSTEP), Line([0; KSTEP]));
    &mut bytemuck::cast_slice_mut(lines.as_mut_slice())[..n]
}

impl Bf16Matrix {
    /// The matrix `w` (`rows × cols`, row-major f32) rounded to bfloat16 (to nearest, ties to
    /// even). `cols` must be a whole number of 32-column steps.
    pub fn from_f32(w: &[f32], rows: usize, cols: usize) -> Result<Self> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(KSTEP) {
            return Err(EngineError::InvalidArgument(format!(
                "a bf16 tile matrix needs rows and a multiple of {KSTEP} columns, got {rows} × {cols}"
            )));
        }
        super::check_matrix_len(rows, cols, w.len())?;
        let (tiles, steps) = (rows.div_ceil(2 * TILE) * 2, cols / KSTEP);
        let mut data = Vec::new();
        zeroed_lines(&mut data, tiles * steps * TILE_LEN)
            .par_chunks_mut(steps * TILE_LEN)
            .enumerate()
            .for_each(|(t, tile)| {
                for n in 0..TILE.min(rows.saturating_sub(t * TILE)) {
                    let row = &w[(t * TILE + n) * cols..(t * TILE + n + 1) * cols];
                    for (k, &v) in row.iter().enumerate() {
                        tile[b_at(n, k, steps)] = bf16_bits(v);
                    }
                }
            });
        Ok(Self { rows, cols, data })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<Line>()
    }

    /// Bytes a `rows × cols` matrix takes (its rows padded to a whole pair of tiles).
    pub fn bytes_for(rows: usize, cols: usize) -> usize {
        rows.div_ceil(2 * TILE) * 2 * TILE * cols * 2
    }

    /// The values, as laid out.
    fn values(&self) -> &[u16] {
        bytemuck::cast_slice(&self.data)
    }

    /// Pairs of row tiles.
    fn pairs(&self) -> usize {
        self.values().len() / (2 * (self.cols / KSTEP) * TILE_LEN)
    }

    /// The weight `(r, k)` as f32 (what the tiles multiply).
    #[cfg(test)]
    fn at(&self, r: usize, k: usize) -> f32 {
        f32::from_bits((self.values()[b_at(r, k, self.cols / KSTEP)] as u32) << 16)
    }
}

/// `v` rounded to bfloat16, as bits: `half`'s conversion (to nearest, ties to even; NaN stays
/// NaN, made quiet), the one the vector path reproduces.
pub(crate) fn bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// Where value `(row, col)` of the tiles' first operand lies (`steps` steps of 32 columns a tile
/// of sixteen rows): tile by tile, step by step, a row's 32 values of a step side by side.
#[inline]
pub(crate) fn a_at(row: usize, col: usize, steps: usize) -> usize {
    ((row / TILE) * steps + col / KSTEP) * TILE_LEN + (row % TILE) * KSTEP + col % KSTEP
}

/// Where value `(n, k)` of the tiles' second operand lies (`k` along the sum, `steps` steps of 32
/// a tile of sixteen `n`): tile by tile, step by step, each tile row holding `k = 2j, 2j + 1` of
/// the sixteen `n` side by side.
#[inline]
pub(crate) fn b_at(n: usize, k: usize, steps: usize) -> usize {
    ((n / TILE) * steps + k / KSTEP) * TILE_LEN + ((k % KSTEP) / 2) * 2 * TILE + (n % TILE) * 2 + k % 2
}

/// `ys[i] = x · mats[i]ᵀ` (`m × rows_i`, row-major) for matrices of the same width reading the same
/// `x` (`m × cols`): the activations rounded to bfloat16 once, then every matrix's row pairs as
/// tasks of one parallel region.
pub fn matmul_group(mats: &[&Bf16Matrix], x: &[f32], m: usize, ys: &mut [&mut [f32]]) -> Result<()> {
    let Some(cols) = mats.first().map(|w| w.cols) else { return Ok(()) };
    if mats.len() != ys.len() {
        return Err(EngineError::shape("bf16 product outputs", mats.len(), ys.len()));
    }
    if x.len() != m * cols {
        return Err(EngineError::shape("bf16 product input", m * cols, x.len()));
    }
    for (w, y) in mats.iter().zip(ys.iter()) {
        if w.cols != cols {
            return Err(EngineError::shape("bf16 product width", cols, w.cols));
        }
        if y.len() != m * w.rows {
            return Err(EngineError::shape("bf16 product output", m * w.rows, y.len()));
        }
    }
    if m == 0 {
        return Ok(());
    }
    if !available() {
        return Err(EngineError::InvalidArgument("bf16 tiles need AMX-BF16".into()));
    }
    #[cfg(target_arch = "x86_64")]
    run(mats, x, m, ys);
    Ok(())
}

/// [`matmul_group`] once its shapes are checked and the CPU's features are known.
#[cfg(target_arch = "x86_64")]
fn run(mats: &[&Bf16Matrix], x: &[f32], m: usize, ys: &mut [&mut [f32]]) {
    let cols = mats[0].cols;
    let m_pad = m.div_ceil(2 * TILE) * 2 * TILE;
    // The activations' copy is kept between calls on this thread (a fresh one is page faults
    // every product); its rows past `m` are zeros for the tiles' padding.
    crate::model::with_kept(&KEPT, true, |lines| {
        let xb = zeroed_lines(lines, m_pad * cols);
        xb.par_chunks_mut(TILE * cols).zip(x.par_chunks(TILE * cols)).for_each(|(o, i)| {
            // SAFETY: `available` checked AVX-512 F and BW.
            unsafe { tile_to_bf16_avx512(i, cols, o) }
        });
        products(mats, xb, m, ys);
    });
}

thread_local! {
    static KEPT: std::cell::RefCell<Vec<Line>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Every matrix's row pairs times the bf16 activations `xb` (`m` rows padded to whole tile pairs,
/// in tiles: [`tile_to_bf16_avx512`]'s layout).
#[cfg(target_arch = "x86_64")]
fn products(mats: &[&Bf16Matrix], xb: &[u16], m: usize, ys: &mut [&mut [f32]]) {
    let m_pad = xb.len() / mats[0].cols;
    // Tasks: (block of activations, matrix, row pair), activation blocks outermost so each core
    // keeps its own activations.
    let pairs: Vec<usize> = mats.iter().map(|w| w.pairs()).collect();
    let per_block: usize = pairs.iter().sum();
    let blocks = m_pad.div_ceil(ACTS_PER_TASK);
    let outs: Vec<Out> = ys.iter_mut().map(|y| Out(y.as_mut_ptr())).collect();
    let outs = &outs;
    crate::par::for_each(blocks * per_block, |task| {
        let (block, mut p) = (task / per_block, task % per_block);
        let mut i = 0;
        while p >= pairs[i] {
            p -= pairs[i];
            i += 1;
        }
        let acts = block * ACTS_PER_TASK..((block + 1) * ACTS_PER_TASK).min(m_pad);
        // SAFETY: `available` checked the CPU; `xb` holds `m_pad × cols` values; pair `p` is
        // within the matrix; this task alone writes rows `acts` × row pair `p` of output `i`,
        // which has `m × rows` values, and the kernel writes only within `m` and `rows`.
        unsafe { with_tiles(|| pair_product(mats[i], p, xb, acts, m, outs[i])) };
    });
}

/// An output buffer the tasks write disjoint parts of.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: each task writes only its own (activations × row pair) part of the buffer, and the
// region ends before the buffer's borrow does.
unsafe impl Sync for Out {}
unsafe impl Send for Out {}

/// Activations `acts` (a range of whole 32-activation blocks of `xb`) times row pair `p` of `w`,
/// into `out` (`m × w.rows`): the sums of each 2 × 2 block of tiles stay in tmm0–3 over every
/// column.
///
/// # Safety
/// Inside [`with_tiles`]; `xb` holds at least `acts.end × w.cols` values and `acts` is
/// 32-aligned; `p < w.pairs()`; `out` points to `m × w.rows` writable values that no one else
/// touches in this part.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pair_product(
    w: &Bf16Matrix,
    p: usize,
    xb: &[u16],
    acts: std::ops::Range<usize>,
    m: usize,
    out: Out,
) {
    let (cols, rows, steps) = (w.cols, w.rows, w.cols / KSTEP);
    debug_assert!(xb.len() >= acts.end * cols && p < w.pairs());
    let w0 = w.values()[2 * p * steps * TILE_LEN..].as_ptr();
    let w1 = w.values()[(2 * p + 1) * steps * TILE_LEN..].as_ptr();
    let c0 = 2 * TILE * p;
    let mut spill = [0f32; 4 * TILE * TILE];
    for a0 in acts.step_by(2 * TILE) {
        let (x0, x1) = (xb[a0 * cols..].as_ptr(), xb[(a0 + TILE) * cols..].as_ptr());
        // Activations a0.., rows 32p..: stored in place when the 32 × 32 block is whole, else
        // through `spill` for the part inside `m × rows`.
        // SAFETY: inside `with_tiles` (the caller's contract); `steps` tiles from each operand
        // pointer lie in `xb` and `w`; the block written lies in `out` or `spill`.
        unsafe {
            if a0 + 2 * TILE <= m && c0 + 2 * TILE <= rows {
                block_2x2([x0, x1], [w0, w1], steps, out.0.add(a0 * rows + c0), rows);
            } else if a0 < m {
                block_2x2([x0, x1], [w0, w1], steps, spill.as_mut_ptr(), 2 * TILE);
                let (nr, nc) = ((m - a0).min(2 * TILE), (rows - c0).min(2 * TILE));
                for r in 0..nr {
                    std::ptr::copy_nonoverlapping(
                        spill.as_ptr().add(r * 2 * TILE),
                        out.0.add((a0 + r) * rows + c0),
                        nc,
                    );
                }
            }
        }
    }
}

/// Up to sixteen activations `x` (`cols` each) rounded to bfloat16 into `out` as the tiles read
/// them: for each step of 32 columns a 16 × 32 tile (1 KB, one `tileloadd` at a 64-byte stride);
/// rows past `x`'s stay as they are (zeros).
///
/// # Safety
/// AVX-512 F and BW are present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile_to_bf16_avx512(x: &[f32], cols: usize, out: &mut [u16]) {
    let steps = cols / KSTEP;
    for (r, row) in x.chunks_exact(cols).enumerate().take(TILE) {
        for s in 0..steps {
            let at = a_at(r, s * KSTEP, steps);
            // SAFETY: the caller's features.
            unsafe { to_bf16_avx512(&row[s * KSTEP..(s + 1) * KSTEP], &mut out[at..at + KSTEP]) };
        }
    }
}

/// Sixteen f32 (as bits) rounded to bfloat16 — `bits + 0x7fff + lsb`, the top half (to nearest,
/// ties to even), NaNs quieted as [`bf16_bits`] does — each in the low half of its 32-bit lane.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn round16(b: __m512i) -> __m512i {
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let rounded =
        _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb));
    let nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff)),
        _mm512_set1_epi32(0x7f80_0000),
    );
    let quieted = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x0040));
    _mm512_mask_mov_epi32(rounded, nan, quieted)
}

/// `x` rounded to bfloat16 into `out`, sixteen at a time ([`round16`]): the same bits as
/// [`bf16_bits`].
///
/// # Safety
/// AVX-512 F and BW are present.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn to_bf16_avx512(x: &[f32], out: &mut [u16]) {
    let n = x.len().min(out.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: sixteen values read from `x` and written to `out` at `i`, both within `n`.
        unsafe {
            let v = round16(_mm512_loadu_si512(x.as_ptr().add(i).cast()));
            _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi16(v));
        }
        i += 16;
    }
    for (o, &v) in out[i..n].iter_mut().zip(&x[i..n]) {
        *o = bf16_bits(v);
    }
}

/// `out[2i] = bf16(a[i])`, `out[2i + 1] = bf16(b[i])` for the first sixteen `i`: two rows side by
/// side in pairs, as a row of the tiles' second operand holds them.
///
/// # Safety
/// AVX-512 F and BW are present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn pairs_to_bf16_avx512(a: &[f32], b: &[f32], out: &mut [u16]) {
    assert!(a.len() >= 16 && b.len() >= 16 && out.len() >= 32, "sixteen pairs");
    // SAFETY: the lengths just asserted.
    unsafe {
        let ra = round16(_mm512_loadu_si512(a.as_ptr().cast()));
        let rb = round16(_mm512_loadu_si512(b.as_ptr().cast()));
        _mm512_storeu_si512(out.as_mut_ptr().cast(), _mm512_or_si512(ra, _mm512_slli_epi32::<16>(rb)));
    }
}

/// Runs `f` with this thread's tiles configured as eight tiles of 16 rows × 64 bytes (what
/// [`block_2x2`] uses), released after.
///
/// # Safety
/// [`available`] returned true.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn with_tiles<R>(f: impl FnOnce() -> R) -> R {
    let config = super::interleave_amx::TileConfig::uniform();
    unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly)) };
    let r = f();
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    r
}

/// The 2 × 2 tiles of f32 sums `c[(16i + r) · ldc + 16j + n] = Σ_s A_i(s) · B_j(s)` (overwritten):
/// `a[i]` and `b[j]` point at a tile's first step, each step [`TILE_LEN`] values further, in the
/// layouts [`Bf16Matrix`] (B) and [`tile_to_bf16_avx512`] (A) describe.
///
/// # Safety
/// Inside [`with_tiles`]; `steps` tiles readable from each of `a` and `b`; 32 rows of `ldc`
/// floats (the first 32 of each) writable at `c`.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) unsafe fn block_2x2(
    a: [*const u16; 2],
    b: [*const u16; 2],
    steps: usize,
    c: *mut f32,
    ldc: usize,
) {
    unsafe {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        for s in 0..steps {
            asm!(
                "tileloadd tmm4, [{x0} + {st}*1]",
                "tileloadd tmm5, [{x1} + {st}*1]",
                "tileloadd tmm6, [{w0} + {st}*1]",
                "tileloadd tmm7, [{w1} + {st}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                x0 = in(reg) a[0].add(s * TILE_LEN),
                x1 = in(reg) a[1].add(s * TILE_LEN),
                w0 = in(reg) b[0].add(s * TILE_LEN),
                w1 = in(reg) b[1].add(s * TILE_LEN),
                st = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c1} + {s}*1], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c3} + {s}*1], tmm3",
            c0 = in(reg) c,
            c1 = in(reg) c.add(TILE),
            c2 = in(reg) c.add(TILE * ldc),
            c3 = in(reg) c.add(TILE * ldc + TILE),
            s = in(reg) ldc * 4,
            options(nostack),
        );
    }
}

#[cfg(test)]
#[path = "amx_bf16_tests.rs"]
mod tests;
