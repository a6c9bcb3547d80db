//! The repacked products of many activations (prefill) on AMX: `tdpbssd` multiplies a 16 × 32
//! byte tile of activations by a 32 × 16 tile of one block's weights for sixteen rows into a
//! 16 × 16 tile of exact 32-bit dots — 8,192 products per instruction, where `vpdpbusd` does 64.
//!
//! The layout is [`super::interleave`]'s unchanged: a block's eight registers of sixteen rows
//! (four consecutive elements of each row in its 32-bit lane, as [`block_quants!`] unpacks them
//! for the AVX-512 tile) *are* the weight tile in the layout `tdpbssd` wants for its second
//! operand (row `st` of the tile holds elements `4st..4st + 4` of each of the sixteen rows), so
//! each block is unpacked once per sixteen rows into a scratch tile and met by every activation.
//! Both operands are signed bytes as they are — the activations' `qs`, the weights as
//! `block_quants!` gives them (Q8_0's and Q6_K's signed values, the 4-bit kinds' nibbles, Q5_0's
//! `q + 16`, whose `16 · Σa` comes off as on the AVX-512 tile) — so no copy is biased and no
//! correction is computed per row.
//!
//! Why it is shaped so: every 32-element block has its own weight and activation scales, so each
//! block's tile of dots must be stored, converted and scaled before the next block's is added —
//! the scaling, not the multiplication, is the work. It runs at three vector operations per
//! (activation, block) of sixteen rows: the dot row converted straight from memory, `d_w` times
//! the activation's `d` broadcast from memory ([`Acts`] keeps a tile's scales side by side for that),
//! one FMA into one of sixteen accumulators that stay in registers for the whole row of blocks;
//! the minimum terms (Q4_1, Q4_K) in a pass of their own. The tiles run a few blocks ahead of the
//! scaling, so no reload waits for its `tdpbssd` (docs/engine.md, Kernel paths: where the time
//! goes).
//!
//! Numerics: the tile's dots are the same exact integers the other paths form, and the scaling
//! is the AVX-512 tile's, lane for lane and in the same order (`acc = fma(dot, d_w · d_a, acc)`,
//! Q6_K once per half; `acc_m = fma(m_w, s_a, acc_m)`; `acc + acc_m`), so a row's result is
//! bit-identical to every other path's, whatever the batch — the product of one activation and
//! of five hundred go through different instructions and give the same bits.
//!
//! Linux gives a process the 8 KB of tile state only when it asks (`arch_prctl`
//! `ARCH_REQ_XCOMP_PERM`); [`available`] asks once, and a refusal means the AVX-512 tiles.
//! Each call configures the tiles for its thread (`ldtilecfg`) and releases them at the end.
//!
//! Safety contract: [`available`] returned true, and the caller checked the shapes as for the
//! AVX-512 tile.

use std::arch::asm;
use std::arch::x86_64::*;

use super::activation::BlockQ8x32;
use super::interleave_avx512::{block_quants, block_scales, ROWS};
use super::interleave_pack::{
    min_bytes_at, quants_at, scale_bytes_at, unit_of, Q4_1_KIND as Q4_1, Q4_K_KIND as Q4_K,
    Q5_0_KIND as Q5_0, Q6_K_KIND as Q6_K, Q8_0_KIND as Q8_0,
};

/// Fewest activations a product must have to take these tiles: a call prepares every block's
/// weight tile for its sixteen rows, which pays over a prefill's passes but not over the one or
/// two of a decode step (16 sequences ran 10–20% slower on AMX than on the AVX-512 tiles,
/// prefills of 512 and 2,048 tokens 3–19% faster: `TOKENPATH_KERNEL=amx|avx512 tokenpath
/// bench-engine`, alternating).
pub(super) const MIN_ACTS: usize = 64;

/// Activations per tile (its rows).
pub(super) const TILE: usize = 16;

/// Units whose dots the tiles compute ahead of the one being scaled, and the ring of slots
/// they are stored in.
const AHEAD: usize = 3;
const SLOTS: usize = AHEAD + 1;

/// Whether this CPU has AMX-TILE and AMX-INT8 and the kernel granted this process the tile
/// state (asked once per process; the grant holds for every thread).
pub(super) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        // CPUID.(EAX=7, ECX=0):EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
        let leaf = __cpuid_count(7, 0);
        if leaf.edx & (3 << 24) != 3 << 24 {
            return false;
        }
        request_tile_state()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permissions.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if r != 0 {
        tracing::info!(
            "AMX present, but the kernel refused its tile state: {}",
            std::io::Error::last_os_error()
        );
    }
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// `ldtilecfg`'s 64-byte operand (palette 1).
#[repr(C, align(64))]
pub(super) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Eight tiles of sixteen rows × 64 bytes (the bf16 tiles' `amx_bf16::with_tiles`).
    pub(super) fn uniform() -> Self {
        let mut c = Self { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in 0..8 {
            c.colsb[t] = 64;
            c.rows[t] = TILE as u8;
        }
        c
    }

    /// Dots over `k` bytes (32: a block; 16: a Q6_K half): tmm0, tmm1, tmm6, tmm7 hold 16 × 16
    /// dots, tmm2, tmm4 16 activations × `k` bytes, tmm3, tmm5 the weights (`k / 4` rows of 64
    /// bytes).
    fn for_k(k: usize) -> Self {
        let mut c = Self { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in [0, 1, 6, 7] {
            c.colsb[t] = 64;
            c.rows[t] = TILE as u8;
        }
        for t in [2, 4] {
            c.colsb[t] = k as u16;
            c.rows[t] = TILE as u8;
        }
        for t in [3, 5] {
            c.colsb[t] = 64;
            c.rows[t] = (k / 4) as u8;
        }
        c
    }
}

/// A product's activations as the tiles read them, made once per product: each activation's
/// quantized bytes as one row of `cols` (`tdpbssd`'s signed first operand; rows padded with
/// zeros to a whole tile), and for each tile of sixteen activations and each block their `d`,
/// `s` and Q5_0's `16 · Σqs` side by side ([`TileScales`]), so each is broadcast from memory by
/// the instruction that uses it.
pub(super) struct Acts {
    bytes: Vec<i8>,
    /// `[tile · nb + b]`.
    scales: Vec<TileScales>,
    /// Activations, and that rounded up to whole tiles.
    n: usize,
    n_pad: usize,
    cols: usize,
}

/// One block's scales for a tile of sixteen activations (zeros past the last activation).
#[derive(Clone, Copy)]
struct TileScales {
    d: [f32; TILE],
    s: [f32; TILE],
    off: [i32; TILE],
}

/// [`Acts`] of `ys`, each `cols` values: a tile of sixteen activations per parallel task, every
/// byte written once (no zeroing first — a prefill's copies ran on the calling thread alone, with
/// a `memset` of the whole buffer before them).
pub(super) fn acts(ys: &[&[BlockQ8x32]], cols: usize) -> Acts {
    use rayon::prelude::*;
    let (n, nb) = (ys.len(), cols / 32);
    let n_pad = n.div_ceil(TILE) * TILE;
    let (mut bytes, mut scales) = (Vec::with_capacity(n_pad * cols), Vec::with_capacity(n_pad / TILE * nb));
    let tiles = bytes.spare_capacity_mut()[..n_pad * cols]
        .par_chunks_mut(TILE * cols)
        .zip(scales.spare_capacity_mut()[..n_pad / TILE * nb].par_chunks_mut(nb));
    tiles.enumerate().for_each(|(t, (bytes, scales))| {
        let rows = &ys[(t * TILE).min(n)..((t + 1) * TILE).min(n)];
        for (b, sc) in scales.iter_mut().enumerate() {
            let mut v = TileScales { d: [0.0; TILE], s: [0.0; TILE], off: [0; TILE] };
            for (m, y) in rows.iter().enumerate() {
                (v.d[m], v.s[m], v.off[m]) = (y[b].d, y[b].s, 16 * y[b].sum);
            }
            sc.write(v);
        }
        for (m, row) in bytes.chunks_exact_mut(cols).enumerate() {
            match rows.get(m) {
                Some(y) => {
                    for (dst, blk) in row.chunks_exact_mut(32).zip(y.iter()) {
                        dst.write_copy_of_slice(&blk.qs);
                    }
                }
                None => row.iter_mut().for_each(|v| _ = v.write(0)),
            }
        }
    });
    // SAFETY: the loop above wrote every element of both lengths: each tile's `TILE` rows of
    // `cols` bytes (a row per activation, zeros past the last) and its `nb` scale sets.
    unsafe {
        bytes.set_len(n_pad * cols);
        scales.set_len(n_pad / TILE * nb);
    }
    Acts { bytes, scales, n, n_pad, cols }
}

/// A block's weight tile and what scales its dots, for sixteen rows.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Prepared {
    /// The weight tile: eight rows (steps) of sixteen rows' four bytes (Q6_K: its halves' four
    /// steps each).
    tile: [[u8; 64]; 8],
    /// `dw`, `dw_hi`, `mw` of [`block_scales!`].
    scales: [[f32; ROWS]; 3],
}

/// Where [`rows16`] keeps its prepared blocks and its ring of dot slots between calls on one
/// thread.
#[derive(Default)]
pub(super) struct Scratch(Vec<Prepared>, Vec<[i32; ROWS]>);

/// One call's operands: groups `w0` and `w1` (sixteen rows) × every activation of `acts`; the
/// sixteen rows of activation `m` go to `buf[m]`.
pub(super) struct Rows16<'a> {
    pub w0: &'a [u8],
    pub w1: &'a [u8],
    pub acts: &'a Acts,
    pub buf: &'a mut [[f32; ROWS]],
}

/// [`Rows16`]'s product for weights of `kind`.
///
/// # Safety
/// [`available`] returned true (and the AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C features are
/// present); both groups hold one unit per activation unit.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn rows16(kind: u8, op: Rows16<'_>, scratch: &mut Scratch) {
    assert!(op.buf.len() >= op.acts.n, "rows16's output: a row set per activation");
    unsafe {
        match kind {
            Q8_0 => run::<Q8_0>(op, scratch),
            Q5_0 => run::<Q5_0>(op, scratch),
            Q4_K => run::<Q4_K>(op, scratch),
            Q6_K => run::<Q6_K>(op, scratch),
            _ => run::<Q4_1>(op, scratch),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run<const KIND: u8>(op: Rows16<'_>, scratch: &mut Scratch) {
    let Rows16 { w0, w1, acts, buf } = op;
    unsafe {
        let (cols, n_pad) = (acts.cols, acts.n_pad);
        let nb = cols / 32;
        // Every block's weight tile and scales, once for all the activations.
        let prep = &mut scratch.0;
        prep.clear();
        let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
        for b in 0..nb {
            let (base, sub) = unit_of(KIND, b);
            let (u0, u1) = (p0.add(base), p1.add(base));
            let (q, _, _) =
                block_quants!(KIND, u0.add(quants_at(KIND, sub)), u1.add(quants_at(KIND, sub)), false);
            let (dw, dw_hi, mw) = block_scales!(KIND, u0, u1, sub);
            let mut p = Prepared { tile: [[0; 64]; 8], scales: [[0.0; ROWS]; 3] };
            for (t, v) in p.tile.iter_mut().zip(q) {
                _mm512_storeu_si512(t.as_mut_ptr() as *mut __m512i, v);
            }
            for (s, v) in p.scales.iter_mut().zip([dw, dw_hi, mw]) {
                _mm512_storeu_ps(s.as_mut_ptr(), v);
            }
            prep.push(p);
        }
        let config = TileConfig::for_k(if KIND == Q6_K { 16 } else { 32 });
        asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        // A unit is what one `tdpbssd` covers: a block, or a Q6_K half (its own scale). A unit's
        // dots are read back from memory (a tile leaves only by a store), and a load of them
        // waits for the store, which waits for the `tdpbssd` — so the tiles run `AHEAD` units in
        // front of the scaling, into a ring of slots, each unit's dots in one of four dot
        // registers and its operands in one of two pairs, and no `tdpbssd` waits for the one
        // before it. (One unit ahead measured the same on the machine measured, where the tile
        // work and the scaling add up rather than overlap; further ahead costs nothing.)
        let per_block = if KIND == Q6_K { 2 } else { 1 };
        let units = nb * per_block;
        let dots = &mut scratch.1;
        dots.clear();
        dots.resize(SLOTS * TILE, [0; ROWS]);
        let d = dots.as_mut_ptr() as *mut u8;
        // Unit `u`'s dots of the sixteen activations at `a` into slot `u % SLOTS`.
        let tile_dots = |a: *const i8, u: usize| {
            let (b, h) = (u / per_block, u % per_block);
            let w = (prep.get_unchecked(b).tile.as_ptr() as *const u8).add(256 * h);
            let c = d.add(1024 * (u % SLOTS));
            let a = a.add(32 * b + 16 * h);
            macro_rules! dots {
                ($c:literal, $a:literal, $w:literal) => {
                    asm!(
                        concat!("tilezero ", $c),
                        concat!("tileloadd ", $a, ", [{a} + {s}*1]"),
                        concat!("tileloadd ", $w, ", [{w} + {ws}*1]"),
                        concat!("tdpbssd ", $c, ", ", $a, ", ", $w),
                        concat!("tilestored [{c} + {ws}*1], ", $c),
                        a = in(reg) a,
                        s = in(reg) cols,
                        w = in(reg) w,
                        ws = in(reg) 64usize,
                        c = in(reg) c,
                        options(nostack),
                    )
                };
            }
            match u % 4 {
                0 => dots!("tmm0", "tmm2", "tmm3"),
                1 => dots!("tmm1", "tmm4", "tmm5"),
                2 => dots!("tmm6", "tmm2", "tmm3"),
                _ => dots!("tmm7", "tmm4", "tmm5"),
            }
        };
        let zero = _mm512_setzero_ps();
        let mut minimums = [[0f32; ROWS]; TILE];
        for m0 in (0..n_pad).step_by(TILE) {
            let a = acts.bytes.as_ptr().add(m0 * cols);
            let tile_scales = &acts.scales[m0 / TILE * nb..][..nb];
            for u in 0..AHEAD.min(units) {
                tile_dots(a, u);
            }
            // The minimum terms first, in sixteen registers of their own.
            if KIND == Q4_1 || KIND == Q4_K {
                let mut accm = [zero; TILE];
                for (p, sc) in prep.iter().zip(tile_scales) {
                    let mw = _mm512_loadu_ps(p.scales[2].as_ptr());
                    let s = sc.s.as_ptr();
                    for (m, am) in accm.iter_mut().enumerate() {
                        let s = _mm512_set1_ps(*s.add(m));
                        *am = if KIND == Q4_1 {
                            _mm512_fmadd_ps(mw, s, *am)
                        } else {
                            _mm512_fnmadd_ps(mw, s, *am)
                        };
                    }
                }
                for (dst, am) in minimums.iter_mut().zip(accm) {
                    _mm512_storeu_ps(dst.as_mut_ptr(), am);
                }
            }
            let mut acc = [zero; TILE];
            for u in 0..units {
                if u + AHEAD < units {
                    tile_dots(a, u + AHEAD);
                }
                let (b, h) = (u / per_block, u % per_block);
                let c = d.add(1024 * (u % SLOTS)) as *const __m512i;
                let sc = tile_scales.get_unchecked(b);
                let (yd, off) = (sc.d.as_ptr(), sc.off.as_ptr());
                // `dw`, or Q6_K's second half's `dw_hi`.
                let dw = _mm512_loadu_ps(prep.get_unchecked(b).scales[h].as_ptr());
                for (m, am) in acc.iter_mut().enumerate() {
                    let mut dot = _mm512_loadu_si512(c.add(m));
                    if KIND == Q5_0 {
                        // Less `16 · Σa`: the signed values' exact dot.
                        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(*off.add(m)));
                    }
                    *am = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(dot),
                        _mm512_mul_ps(dw, _mm512_set1_ps(*yd.add(m))),
                        *am,
                    );
                }
            }
            for (m, (am, mins)) in acc.iter().zip(&minimums).enumerate().take(acts.n - m0) {
                let out = buf.as_mut_ptr().add(m0 + m) as *mut f32;
                _mm512_storeu_ps(out, _mm512_add_ps(*am, _mm512_loadu_ps(mins.as_ptr())));
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}
