//! The repacked products of many activations (prefill) on AMX: `tdpbusd` multiplies a 16 × 32
//! byte tile of activations by a 32 × 16 tile of one block's weights for sixteen rows into a
//! 16 × 16 tile of exact 32-bit dots — 8,192 products per instruction, where `vpdpbusd` does 64.
//!
//! The layout is [`super::interleave`]'s unchanged: a block's eight registers of sixteen rows
//! (four consecutive elements of each row in its 32-bit lane, as [`block_quants!`] unpacks them
//! for the AVX-512 tile) *are* the weight tile in the layout `tdpbusd` wants for its second
//! operand (row `st` of the tile holds elements `4st..4st + 4` of each of the sixteen rows), so
//! each block is unpacked once per sixteen rows into a scratch tile and met by every activation.
//! The first operand must be unsigned: the activations are biased by 128 once per product (as
//! the AVX-512 tile does for its signed kinds) and `128 · Σw` per row and block comes off each
//! dot, for every kind.
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
    Q6_K_KIND as Q6_K, Q8_0_KIND as Q8_0,
};

/// Fewest activations a product must have to take these tiles (fewer fill too little of one).
pub(super) const MIN_ACTS: usize = 16;

/// Activations per tile (its rows).
pub(super) const TILE: usize = 16;

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
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Dots over `k` bytes (32: a block; 16: a Q6_K half): tmm0, tmm1 hold 16 × 16 dots, tmm2,
    /// tmm4 16 activations × `k` bytes, tmm3, tmm5 the weights (`k / 4` rows of 64 bytes).
    fn for_k(k: usize) -> Self {
        let mut c = Self { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in [0, 1] {
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

/// A block's weight tile and what scales its dots, for sixteen rows.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Prepared {
    /// The weight tile: eight rows (steps) of sixteen rows' four bytes.
    tile: [[u8; 64]; 8],
    /// `128 · Σw` per row over steps 0..4 and 4..8 (Q6_K's halves), or the whole block in `[0]`.
    wsum: [[i32; ROWS]; 2],
    /// `dw`, `dw_hi`, `mw` of [`block_scales!`].
    scales: [[f32; ROWS]; 3],
}

/// Where [`rows16`] keeps its prepared blocks between calls on one thread.
#[derive(Default)]
pub(super) struct Scratch(Vec<Prepared>, Vec<[i32; ROWS]>);

/// The activations biased by 128 (`tdpbusd`'s unsigned operand), `cols` bytes each, padded with
/// zeros to a whole number of tiles: what [`rows16`] reads its activation tiles from.
pub(super) fn biased_rows(ys: &[&[BlockQ8x32]], cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; ys.len().div_ceil(2 * TILE) * 2 * TILE * cols];
    for (row, y) in out.chunks_exact_mut(cols).zip(ys) {
        for (dst, b) in row.chunks_exact_mut(32).zip(y.iter()) {
            for (d, q) in dst.iter_mut().zip(b.qs) {
                *d = (q as u8) ^ 0x80;
            }
        }
    }
    out
}

/// One call's operands: groups `w0` and `w1` (sixteen rows) × every activation of `ys`, whose
/// biased bytes are `ab` ([`biased_rows`]); row `r` of activation `m` goes to
/// `buf[m * rows + at + r]`.
pub(super) struct Rows16<'a> {
    pub w0: &'a [u8],
    pub w1: &'a [u8],
    pub ab: &'a [u8],
    pub ys: &'a [&'a [BlockQ8x32]],
    pub buf: &'a mut [f32],
    pub rows: usize,
    pub at: usize,
}

/// [`Rows16`]'s product for weights of `kind`.
///
/// # Safety
/// [`available`] returned true (and the AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C features are
/// present); both groups hold one unit per activation unit; `ab` is [`biased_rows`] of `ys`;
/// `buf` holds `ys.len() * rows` values and `at + 16 <= rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn rows16(kind: u8, op: Rows16<'_>, scratch: &mut Scratch) {
    unsafe {
        match kind {
            Q8_0 => run::<Q8_0>(op, scratch),
            Q4_K => run::<Q4_K>(op, scratch),
            Q6_K => run::<Q6_K>(op, scratch),
            _ => run::<Q4_1>(op, scratch),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run<const KIND: u8>(op: Rows16<'_>, scratch: &mut Scratch) {
    let Rows16 { w0, w1, ab, ys, buf, rows, at } = op;
    unsafe {
        let nb = ys[0].len();
        let cols = 32 * nb;
        let n = ys.len();
        // Every block's weight tile and scales, once for all the activations.
        let prep = &mut scratch.0;
        prep.clear();
        let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
        for b in 0..nb {
            let (base, sub) = unit_of(KIND, b);
            let (u0, u1) = (p0.add(base), p1.add(base));
            let (q, lo, hi) =
                block_quants!(KIND, u0.add(quants_at(KIND, sub)), u1.add(quants_at(KIND, sub)), true);
            let (dw, dw_hi, mw) = block_scales!(KIND, u0, u1, sub);
            let mut p = Prepared { tile: [[0; 64]; 8], wsum: [[0; ROWS]; 2], scales: [[0.0; ROWS]; 3] };
            for (t, v) in p.tile.iter_mut().zip(q) {
                _mm512_storeu_si512(t.as_mut_ptr() as *mut __m512i, v);
            }
            if KIND == Q6_K {
                _mm512_storeu_si512(p.wsum[0].as_mut_ptr() as *mut __m512i, lo);
                _mm512_storeu_si512(p.wsum[1].as_mut_ptr() as *mut __m512i, hi);
            } else {
                _mm512_storeu_si512(p.wsum[0].as_mut_ptr() as *mut __m512i, _mm512_add_epi32(lo, hi));
            }
            for (s, v) in p.scales.iter_mut().zip([dw, dw_hi, mw]) {
                _mm512_storeu_ps(s.as_mut_ptr(), v);
            }
            prep.push(p);
        }
        let k = if KIND == Q6_K { 16 } else { 32 };
        let config = TileConfig::for_k(k);
        asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        // Activations per pass: two tiles (one weight tile load for both); Q6_K one, whose two
        // 16-byte halves take the second tile's place.
        let step = if KIND == Q6_K { TILE } else { 2 * TILE };
        // Every block's two 16 × 16 dot tiles of the pass, stored back to back (`2 · 1 KB` per
        // block); the scaling reads them after all are computed, so it never waits on a store
        // in flight and each (activation, rows) pair keeps its sums in registers.
        let dots = &mut scratch.1;
        dots.clear();
        dots.resize(nb * 2 * TILE, [0; ROWS]);
        let d = dots.as_mut_ptr() as *mut u8;
        for m0 in (0..n).step_by(step) {
            let mv = (n - m0).min(step);
            for b in 0..nb {
                let a = ab.as_ptr().add(m0 * cols + 32 * b);
                let w = prep.get_unchecked(b).tile.as_ptr() as *const u8;
                let c = d.add(2048 * b);
                if KIND == Q6_K {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tileloadd tmm2, [{a} + {s}*1]",
                        "tileloadd tmm4, [{a2} + {s}*1]",
                        "tileloadd tmm3, [{w} + {ws}*1]",
                        "tileloadd tmm5, [{w2} + {ws}*1]",
                        "tdpbusd tmm0, tmm2, tmm3",
                        "tdpbusd tmm1, tmm4, tmm5",
                        "tilestored [{c} + {ws}*1], tmm0",
                        "tilestored [{c2} + {ws}*1], tmm1",
                        a = in(reg) a,
                        a2 = in(reg) a.add(16),
                        s = in(reg) cols,
                        w = in(reg) w,
                        w2 = in(reg) w.add(256),
                        ws = in(reg) 64usize,
                        c = in(reg) c,
                        c2 = in(reg) c.add(64 * TILE),
                        options(nostack),
                    );
                } else {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tileloadd tmm2, [{a} + {s}*1]",
                        "tileloadd tmm4, [{a2} + {s}*1]",
                        "tileloadd tmm3, [{w} + {ws}*1]",
                        "tdpbusd tmm0, tmm2, tmm3",
                        "tdpbusd tmm1, tmm4, tmm3",
                        "tilestored [{c} + {ws}*1], tmm0",
                        "tilestored [{c2} + {ws}*1], tmm1",
                        a = in(reg) a,
                        a2 = in(reg) a.add(TILE * cols),
                        s = in(reg) cols,
                        w = in(reg) w,
                        ws = in(reg) 64usize,
                        c = in(reg) c,
                        c2 = in(reg) c.add(64 * TILE),
                        options(nostack),
                    );
                }
            }
            // Dot row `i` (of 32) of block `b`: activation tile `i / 16`'s row `i % 16`, or
            // Q6_K's half `i / 16`.
            let row = |b: usize, i: usize| _mm512_loadu_si512(d.add(2048 * b + 64 * i) as *const __m512i);
            for m in 0..mv {
                let y = *ys.get_unchecked(m0 + m);
                let mut acc = _mm512_setzero_ps();
                let mut accm = _mm512_setzero_ps();
                for (b, p) in prep.iter().enumerate() {
                    let yblk = y.get_unchecked(b);
                    let yd = _mm512_set1_ps(yblk.d);
                    let ws0 = _mm512_loadu_si512(p.wsum[0].as_ptr() as *const __m512i);
                    let dw = _mm512_loadu_ps(p.scales[0].as_ptr());
                    let dot = _mm512_sub_epi32(row(b, m), ws0);
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, yd), acc);
                    if KIND == Q6_K {
                        let ws1 = _mm512_loadu_si512(p.wsum[1].as_ptr() as *const __m512i);
                        let dw_hi = _mm512_loadu_ps(p.scales[1].as_ptr());
                        let dot = _mm512_sub_epi32(row(b, TILE + m), ws1);
                        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw_hi, yd), acc);
                    }
                    if KIND == Q4_1 || KIND == Q4_K {
                        let mw = _mm512_loadu_ps(p.scales[2].as_ptr());
                        let s = _mm512_set1_ps(yblk.s);
                        accm = if KIND == Q4_1 {
                            _mm512_fmadd_ps(mw, s, accm)
                        } else {
                            _mm512_fnmadd_ps(mw, s, accm)
                        };
                    }
                }
                let out = buf.as_mut_ptr().add((m0 + m) * rows + at);
                _mm512_storeu_ps(out, _mm512_add_ps(acc, accm));
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}
