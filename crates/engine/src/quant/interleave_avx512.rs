//! The repacked products (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) on AVX-512 (F, BW, VL, VNNI): two 8-row groups side by side
//! in one 512-bit register, so one `vpdpbusd` advances sixteen rows by four products each.
//!
//! The AVX2 tile needs `vpmaddubsw` (pairs to 16 bits), 16-bit adds and a `vpmaddwd` to reach 32
//! bits, eight rows per instruction; VNNI's `vpdpbusd` multiplies four unsigned bytes by four
//! signed bytes and adds them into a 32-bit lane in one instruction, and the 512-bit register
//! holds sixteen rows. The layout is [`super::interleave`]'s unchanged: the two groups are
//! loaded from their own places (one 256-bit half each), so the repacked copy, its
//! dequantization and the AVX2 and portable paths all stay as they are.
//!
//! Numerics: every block's integer dot product is exact on both paths (the AVX2 sums cannot
//! saturate — see `interleave.rs` — and `vpdpbusd` does not saturate), and each lane then does the
//! AVX2 tile's float operations in the same order: `acc = fma(dot, d_w · d_a, acc)`,
//! `acc_m = fma(m_w, s_a, acc_m)` per block, `acc + acc_m` at the end. So a row's result is
//! bit-identical to the AVX2 and portable paths, whatever the batch: a machine with AVX-512 and
//! one without produce the same logits.
//!
//! The signed kinds (Q8_0, Q6_K): `vpdpbusd` needs one unsigned operand, so their weight bytes
//! are made unsigned in registers, as Q5_0's are — Q8_0's `w + 128` (a flipped sign bit), Q6_K's
//! `w + 32` (its stored `q6`, 0..=63) — one instruction per register per block, shared by every
//! activation; `128 · Σa` (the activation block's sum) or `32 · Σa` over each half (its low half's
//! sum is kept beside the block's) comes off each dot. The same exact integers as the AVX2
//! tile's `vpsignb` trick, with one instruction per step instead of three. (They were the other
//! way round — activations biased by 128 in a copy made per product, `128 · Σw` by eight more
//! `vpdpbusd` per block: the copy alone was 2% of a Q4_K_M prefill.)
//!
//! Safety contract: the CPU supports avx512f, avx512bw, avx512vl, avx512vnni (and avx2, fma,
//! f16c), and both group pointers address one group block per activation block (checked by
//! `matmul_group_interleaved`).

use std::arch::x86_64::*;

use super::activation::BlockQ8x32;
use super::interleave::GROUP;
use super::interleave_pack::{
    blocks_per_unit, min_bytes_at, quants_at, scale_bytes_at, unit_bytes, unit_of, Q4_1_KIND as Q4_1,
    Q4_K_KIND as Q4_K, Q5_0_KIND as Q5_0, Q6_K_KIND as Q6_K, Q8_0_KIND as Q8_0,
};

/// Block `sub`'s weight scales in the unit at `u0` (group 0, lanes 0..8) and `u1` (group 1,
/// lanes 8..16) as `(dw, dw_hi, mw)`: the f16 scale (times `sc` for Q4_K; Q6_K: each 16-element
/// half's), and the minimum term (Q4_1 `m`, Q4_K `dmin · m`, else zero). A macro so that every
/// tile using it (this file's, the AMX one's) inlines the same operations.
macro_rules! block_scales {
    ($kind:expr, $u0:expr, $u1:expr, $sub:expr) => {{
        let (u0, u1, sub): (*const u8, *const u8, usize) = ($u0, $u1, $sub);
        // Eight f16 of each group at `off` (scales, minimums) → sixteen f32 lanes.
        let halves = |off: usize| {
            _mm512_cvtph_ps(_mm256_set_m128i(
                _mm_loadu_si128(u1.add(off) as *const __m128i),
                _mm_loadu_si128(u0.add(off) as *const __m128i),
            ))
        };
        // Eight bytes of each group at `off` (the K-quants' integer scales) → sixteen f32.
        let bytes = |off: usize, signed: bool| {
            let v = _mm_set_epi64x(
                std::ptr::read_unaligned(u1.add(off) as *const i64),
                std::ptr::read_unaligned(u0.add(off) as *const i64),
            );
            _mm512_cvtepi32_ps(if signed { _mm512_cvtepi8_epi32(v) } else { _mm512_cvtepu8_epi32(v) })
        };
        let d = halves(0);
        let (dw, dw_hi) = match $kind {
            Q4_K => (_mm512_mul_ps(d, bytes(scale_bytes_at($kind, sub, 0), false)), d),
            Q6_K => (
                _mm512_mul_ps(d, bytes(scale_bytes_at($kind, sub, 0), true)),
                _mm512_mul_ps(d, bytes(scale_bytes_at($kind, sub, 1), true)),
            ),
            _ => (d, d),
        };
        let mw = match $kind {
            Q4_1 => halves(16),
            Q4_K => _mm512_mul_ps(halves(16), bytes(min_bytes_at(sub), false)),
            _ => _mm512_setzero_ps(),
        };
        (dw, dw_hi, mw)
    }};
}
pub(super) use block_scales;

/// The block's weight bytes whose quant chunks start at `b0` (group 0) and `b1` (group 1) as
/// eight registers, register `st` holding elements `4st..4st + 4` of each of the sixteen rows in
/// its 32-bit lanes (the unsigned kinds' nibbles unpacked, Q5_0's with their fifth bits: `q + 16`);
/// with `$sums`, also `128 · Σw` per row over steps 0..4 and 4..8 (else zeros).
macro_rules! block_quants {
    ($kind:expr, $b0:expr, $b1:expr, $sums:expr) => {{
        let (b0, b1): (*const u8, *const u8) = ($b0, $b1);
        // 32 bytes of each group at `off`: group 0 in the low half, group 1 in the high.
        let pair = |off: usize| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(b0.add(off) as *const __m256i)),
                _mm256_loadu_si256(b1.add(off) as *const __m256i),
            )
        };
        let zero = _mm512_setzero_si512();
        let mut q = [zero; 8];
        if $kind == Q8_0 || $kind == Q6_K {
            for (st, qv) in q.iter_mut().enumerate() {
                *qv = pair(32 * st);
            }
        } else {
            let low4 = _mm512_set1_epi8(0x0F);
            for c in 0..4 {
                let v = pair(32 * c);
                q[2 * c] = _mm512_and_si512(v, low4);
                q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
            }
            if $kind == $crate::quant::interleave_pack::Q5_0_KIND {
                // Bit `st` of each byte is step `st`'s fifth bit: moved to bit 4 by a 16-bit
                // shift (no bit crosses into bit 4 of the other byte) and or-ed in under 0x10.
                let h = pair($crate::quant::interleave_pack::Q5_0_HIGH);
                let at4 = [
                    _mm512_slli_epi16::<4>(h),
                    _mm512_slli_epi16::<3>(h),
                    _mm512_slli_epi16::<2>(h),
                    _mm512_slli_epi16::<1>(h),
                    h,
                    _mm512_srli_epi16::<1>(h),
                    _mm512_srli_epi16::<2>(h),
                    _mm512_srli_epi16::<3>(h),
                ];
                let bit4 = _mm512_set1_epi8(0x10);
                for (qv, hv) in q.iter_mut().zip(at4) {
                    // q | (h & 0x10)
                    *qv = _mm512_ternarylogic_epi32::<0xF8>(*qv, hv, bit4);
                }
            }
        }
        let (mut lo, mut hi) = (zero, zero);
        if $sums {
            let ones = _mm512_set1_epi8(1);
            for (st, qv) in q.iter().enumerate() {
                if st < 4 {
                    lo = _mm512_dpbusd_epi32(lo, ones, *qv);
                } else {
                    hi = _mm512_dpbusd_epi32(hi, ones, *qv);
                }
            }
            lo = _mm512_slli_epi32::<7>(lo);
            hi = _mm512_slli_epi32::<7>(hi);
        }
        (q, lo, hi)
    }};
}
pub(super) use block_quants;

/// Most activations per tile.
pub(super) const ACTS: usize = 8;

/// Rows of one tile: two groups.
pub(super) const ROWS: usize = 2 * GROUP;

/// `$f::<KIND, $k>($a.., [ys[0], .., ys[$k - 1]], $out)` for the repacked kind `kind`.
macro_rules! by_kind {
    ($f:ident, $kind:expr, $k:literal, $ys:expr, ($($a:expr),*), $out:expr) => {
        match $kind {
            Q8_0 => $f::<Q8_0, $k>($($a,)* super::first($ys), $out),
            Q5_0 => $f::<Q5_0, $k>($($a,)* super::first($ys), $out),
            Q4_K => $f::<Q4_K, $k>($($a,)* super::first($ys), $out),
            Q6_K => $f::<Q6_K, $k>($($a,)* super::first($ys), $out),
            _ => $f::<Q4_1, $k>($($a,)* super::first($ys), $out),
        }
    };
}

/// [`by_kind!`] for `$k = ys.len()` (1 to [`ACTS`]; more are cut to [`ACTS`]).
macro_rules! by_kind_and_width {
    ($f:ident, $kind:expr, $ys:expr, ($($a:expr),*), $out:expr) => {
        match $ys.len() {
            8.. => by_kind!($f, $kind, 8, $ys, ($($a),*), $out),
            7 => by_kind!($f, $kind, 7, $ys, ($($a),*), $out),
            6 => by_kind!($f, $kind, 6, $ys, ($($a),*), $out),
            5 => by_kind!($f, $kind, 5, $ys, ($($a),*), $out),
            4 => by_kind!($f, $kind, 4, $ys, ($($a),*), $out),
            3 => by_kind!($f, $kind, 3, $ys, ($($a),*), $out),
            2 => by_kind!($f, $kind, 2, $ys, ($($a),*), $out),
            _ => by_kind!($f, $kind, 1, $ys, ($($a),*), $out),
        }
    };
}

/// Groups `w0` and `w1` (sixteen rows: `out[k][..8]` are `w0`'s, `out[k][8..]` `w1`'s) ×
/// `ys.len()` (1 to [`ACTS`]) activations of kind `kind`, written to `out[..ys.len()]` (every
/// lane: the caller may hand rows it left uninitialized). With `prefetch`, the next pair's
/// weights are asked for while these are computed (the first tile of a pair).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tile_any(
    kind: u8,
    w0: &[u8],
    w1: &[u8],
    prefetch: bool,
    ys: &[&[BlockQ8x32]],
    out: &mut [std::mem::MaybeUninit<[f32; ROWS]>],
) {
    // Five to eight activations: 8 unpacked weight registers + 2 accumulators each still fit the
    // 32 zmm registers, and each unpacked block meets twice as many activations.
    // SAFETY: the caller's contract.
    unsafe { by_kind_and_width!(tile, kind, ys, (w0, w1, prefetch), out) }
}

/// Decode reads each weight once, from DRAM: the hardware prefetchers lose two interleaved
/// group streams of ~2 KB each at every pair (`kernel_throughput`'s
/// `interleaved_decode_throughput`: 10–12 GB/s swept against 17–20 for the AVX2 tile's single
/// stream), so ask for block `b` of the next pair (the two groups after `p0`, `p1`: `2 · (p1 −
/// p0)` on) into L2 while this pair is computed (into L1 measured no better than none; 4–8
/// groups ahead no better than 2). The callers ask for it once per pair: a prefill meets each
/// pair in dozens of tiles, and prefetching in every one of them cost 14% of a 512-token prefill;
/// decode steps of five to eight rows had none when this was decided by the tile's width, and
/// ran 35% slower than four rows (the simulator's step model found that cliff). Addresses only: a
/// prefetch never faults, and past the matrix's end it fetches nothing useful, harmlessly.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn prefetch_next<const KIND: u8>(p0: *const u8, p1: *const u8, b: usize) {
    let ahead = 2 * (p1 as usize).wrapping_sub(p0 as usize);
    let span = unit_bytes(KIND) / blocks_per_unit(KIND);
    let at = ahead.wrapping_add(b * span);
    for off in (0..span + 63).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(p0.wrapping_add(at + off) as *const i8);
        _mm_prefetch::<_MM_HINT_T1>(p1.wrapping_add(at + off) as *const i8);
    }
}

/// One block of a pair of groups ready for the dot products: the weight bytes unsigned for every
/// kind (the nibbles, Q5_0's `q + 16`, and the signed kinds' bytes offset as the module docs
/// say), register `st` holding elements `4st..4st + 4` of the sixteen rows, and the scales of
/// [`block_scales!`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Unpacked {
    q: [__m512i; 8],
    dw: __m512,
    dw_hi: __m512,
    mw: __m512,
}

/// Block `b` of the pair whose groups start at `p0` and `p1`, unpacked (a macro, as
/// [`block_scales!`], so that it inlines into every tile: a `#[target_feature]` function may not
/// be `#[inline(always)]`, and as a call it costs the tile its registers).
macro_rules! unpack {
    ($kind:expr, $p0:expr, $p1:expr, $b:expr) => {{
        let (p0, p1, b): (*const u8, *const u8, usize) = ($p0, $p1, $b);
        let (base, sub) = unit_of($kind, b);
        let (u0, u1) = (p0.add(base), p1.add(base));
        let (dw, dw_hi, mw) = block_scales!($kind, u0, u1, sub);
        let (mut q, _, _) =
            block_quants!($kind, u0.add(quants_at($kind, sub)), u1.add(quants_at($kind, sub)), false);
        if $kind == Q8_0 {
            q.iter_mut().for_each(|v| *v = _mm512_xor_si512(*v, _mm512_set1_epi8(-128)));
        } else if $kind == Q6_K {
            q.iter_mut().for_each(|v| *v = _mm512_add_epi8(*v, _mm512_set1_epi8(32)));
        }
        Unpacked { q, dw, dw_hi, mw }
    }};
}

/// Block `b` of every activation (`ys`, `cc` of them) against the unpacked block `un`, into the
/// accumulators (a macro for the reason [`unpack!`] is).
macro_rules! block_dots {
    ($kind:expr, $cc:expr, $un:expr, $ys:expr, $b:expr, $acc:expr, $accm:expr) => {{
        let zero = _mm512_setzero_si512();
        let q = &$un.q;
        for k in 0..$cc {
            let yblk = $ys[k].get_unchecked($b);
            let a = yblk.qs.as_ptr() as *const i32;
            // Indexed, not iterated: an iterator over `q` here stops the loop being unrolled
            // into registers (measured: a third of the speed).
            #[allow(clippy::needless_range_loop)]
            let dot = |from: usize, to: usize| {
                let step = |dot, st: usize| {
                    _mm512_dpbusd_epi32(dot, q[st], _mm512_set1_epi32(std::ptr::read_unaligned(a.add(st))))
                };
                // A whole block's eight steps as two chains (even and odd steps) added at the
                // end — integer sums, so the same dot in any order, from chains half as long;
                // Q6_K's halves are two chains already.
                let mut dot = if to - from == 8 {
                    let (mut even, mut odd) = (zero, zero);
                    for st in (from..to).step_by(2) {
                        (even, odd) = (step(even, st), step(odd, st + 1));
                    }
                    _mm512_add_epi32(even, odd)
                } else {
                    (from..to).fold(zero, step)
                };
                // Less what the offset added, `offset · Σa` over the steps taken: the signed
                // values' exact dot.
                let off = match $kind {
                    Q5_0 => Some(16 * yblk.sum),
                    Q8_0 => Some(128 * yblk.sum),
                    Q6_K if from == 0 => Some(32 * yblk.sum_lo),
                    Q6_K => Some(32 * (yblk.sum - yblk.sum_lo)),
                    _ => None,
                };
                if let Some(off) = off {
                    dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(off));
                }
                _mm512_cvtepi32_ps(dot)
            };
            let yd = _mm512_set1_ps(yblk.d);
            if $kind == Q6_K {
                $acc[k] = _mm512_fmadd_ps(dot(0, 4), _mm512_mul_ps($un.dw, yd), $acc[k]);
                $acc[k] = _mm512_fmadd_ps(dot(4, 8), _mm512_mul_ps($un.dw_hi, yd), $acc[k]);
            } else {
                $acc[k] = _mm512_fmadd_ps(dot(0, 8), _mm512_mul_ps($un.dw, yd), $acc[k]);
            }
            if $kind == Q4_1 {
                $accm[k] = _mm512_fmadd_ps($un.mw, _mm512_set1_ps(yblk.s), $accm[k]);
            } else if $kind == Q4_K {
                $accm[k] = _mm512_fnmadd_ps($un.mw, _mm512_set1_ps(yblk.s), $accm[k]);
            }
        }
    }};
}

/// `acc + accm` of each activation into its output row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn store<const CC: usize>(
    acc: &[__m512; CC],
    accm: &[__m512; CC],
    out: &mut [std::mem::MaybeUninit<[f32; ROWS]>],
) {
    for k in 0..CC {
        // SAFETY: `out[k]` is a row of sixteen f32 (indexing checks `k`).
        unsafe { _mm512_storeu_ps(out[k].as_mut_ptr() as *mut f32, _mm512_add_ps(acc[k], accm[k])) };
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const KIND: u8, const CC: usize>(
    w0: &[u8],
    w1: &[u8],
    prefetch: bool,
    ys: [&[BlockQ8x32]; CC],
    out: &mut [std::mem::MaybeUninit<[f32; ROWS]>],
) {
    unsafe {
        let nb = ys[0].len();
        let mut acc = [_mm512_setzero_ps(); CC];
        let mut accm = [_mm512_setzero_ps(); CC];
        let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
        for b in 0..nb {
            if prefetch {
                prefetch_next::<KIND>(p0, p1, b);
            }
            let un = unpack!(KIND, p0, p1, b);
            block_dots!(KIND, CC, un, ys, b, acc, accm);
        }
        store(&acc, &accm, out);
    }
}

/// Activations from which a pair's blocks are unpacked once ([`unpack_pair`]) and every tile of
/// the pair reads them from there, instead of unpacking them again per tile of eight. A Q4_K_M
/// 512-token prefill (64 tiles a pair) ran 6.1% faster so (medians of six runs, old and new
/// binaries alternating); a batch-16 decode step (two tiles a pair) 11% slower, so below eight
/// tiles a pair the tiles unpack for themselves.
pub(super) const UNPACK_MIN_ACTS: usize = 64;

/// Whether unpacking once pays for `kind`: where a block's unpacking is real work — Q5_0's fifth
/// bits, the K-quants' integer scales — not where it is a mask and a shift (Q4_1) or a sign flip
/// (Q8_0), whose tiles ran slower reading the unpacked copy than redoing it.
pub(super) fn unpack_pays(kind: u8) -> bool {
    matches!(kind, Q5_0 | Q4_K | Q6_K)
}

/// Every block of the pair `w0`, `w1` (of kind `kind`, `nb` blocks) unpacked into `buf`, the
/// next pair's bytes asked for meanwhile ([`prefetch_next`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn unpack_pair(kind: u8, w0: &[u8], w1: &[u8], nb: usize, buf: &mut Vec<Unpacked>) {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn each<const KIND: u8>(p0: *const u8, p1: *const u8, nb: usize, buf: &mut Vec<Unpacked>) {
        buf.clear();
        for b in 0..nb {
            // SAFETY: the caller's contract (both groups hold `nb` blocks).
            unsafe {
                prefetch_next::<KIND>(p0, p1, b);
                buf.push(unpack!(KIND, p0, p1, b));
            }
        }
    }
    let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
    // SAFETY: as `tile_any`'s.
    unsafe {
        match kind {
            Q8_0 => each::<Q8_0>(p0, p1, nb, buf),
            Q5_0 => each::<Q5_0>(p0, p1, nb, buf),
            Q4_K => each::<Q4_K>(p0, p1, nb, buf),
            Q6_K => each::<Q6_K>(p0, p1, nb, buf),
            _ => each::<Q4_1>(p0, p1, nb, buf),
        }
    }
}

/// [`tile_any`] on a pair [`unpack_pair`] unpacked into `un` (one entry per activation block):
/// the same operations on the same values, so the same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tile_unpacked(
    kind: u8,
    un: &[Unpacked],
    ys: &[&[BlockQ8x32]],
    out: &mut [std::mem::MaybeUninit<[f32; ROWS]>],
) {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn each<const KIND: u8, const CC: usize>(
        un: &[Unpacked],
        ys: [&[BlockQ8x32]; CC],
        out: &mut [std::mem::MaybeUninit<[f32; ROWS]>],
    ) {
        // SAFETY: every activation holds `ys[0].len()` blocks (the caller checked); `out` has a
        // row per activation (indexing checks).
        unsafe {
            let mut acc = [_mm512_setzero_ps(); CC];
            let mut accm = [_mm512_setzero_ps(); CC];
            for (b, u) in un.iter().enumerate().take(ys[0].len()) {
                block_dots!(KIND, CC, u, ys, b, acc, accm);
            }
            store(&acc, &accm, out);
        }
    }
    assert!(un.len() >= ys.first().map_or(0, |y| y.len()), "an unpacked block per activation block");
    // SAFETY: as `tile_any`'s; the blocks read are inside `un` (asserted).
    unsafe { by_kind_and_width!(each, kind, ys, (un), out) }
}
