//! The repacked layouts of [`super::interleave`]: where each part of a group's block lives, the
//! repacking from ggml's row layout, and the per-row scales every path computes the same way.
//!
//! A group is eight rows; its data is a run of *units*, one per ggml block (Q4_1, Q8_0: 32
//! elements) or super-block (Q4_K, Q6_K: 256 elements = eight 32-element blocks). Every kernel
//! walks 32-element blocks against Q8 activation blocks of 32, so a K-quant super-block is eight
//! such blocks sharing one unit header. Layouts (bytes from the unit's start, `j` the row in the
//! group):
//!
//! - Q4_1, 160 bytes: `d[j]` f16 at `2j`, `m[j]` f16 at `16 + 2j`, then 4 chunks of 32 bytes:
//!   byte `i` of lane `j` in chunk `c` holds element `8c + i` of row `j` in its low nibble and
//!   element `8c + 4 + i` in its high nibble.
//! - Q8_0, 272 bytes: `d[j]` at `2j`, then 8 chunks of 32 bytes, lane `j` of chunk `s` holding
//!   elements `4s..4s + 4` of row `j` (signed).
//! - Q5_0, 176 bytes: `d[j]` at `2j`, the low four bits of each value `q + 16` (0..=31) in Q4_1's
//!   chunk layout at 16, then 32 bytes of fifth bits at 144: bit `s` of byte `i` of lane `j`
//!   is that of element `4s + i` of row `j`, so one 16-bit shift and a mask put step `s`'s
//!   fifth bits in place. 5.5 bits per weight, the file's (it was widened to Q8_0's 8.5 once;
//!   decode reads every byte, and this model file is mostly Q5_0). The kernels multiply the
//!   unsigned `q + 16` and take `16 · Σa` off each block's integer dot: the same exact integers.
//! - Q4_K, 1,184 bytes: `d[j]` at `2j`, `dmin[j]` at `16 + 2j`, the 6-bit scales unpacked to a
//!   byte each (`sc[sub][j]` at `32 + 8 sub + j`, `m[sub][j]` at `96 + 8 sub + j`), then the
//!   eight sub-blocks' nibbles, each in Q4_1's chunk layout, at `160 + 128 sub`. 4.6 bits per
//!   weight, as the file's 4.5: decode stays bandwidth-light.
//! - Q6_K, 2,192 bytes: `d[j]` at `2j`, the sixteen 16-element scales `sc[s][j]` (i8) at
//!   `16 + 8 s + j`, then each 32-element block's values `q - 32` as i8 in Q8_0's chunk layout at
//!   `144 + 256 sub`: the kernels multiply bytes, so the 6-bit values are widened once at load
//!   (8.6 bits per weight instead of 6.6, against unpacking two bit fields in every product).
//!
//! Scales: a K-quant's sub-block scale is `d · sc` (f16 × a small integer: exact in f32) and its
//! minimum `dmin · m`, computed in every path from these bytes in that order, so the portable,
//! AVX2 and AVX-512 products agree bit for bit, and the dequantization matches ggml's row layout's.

use rayon::prelude::*;

use super::reference::{f16_at, q4k_scale_min, q5_0_value};
use super::{GgmlType, QMatrix};

/// Rows interleaved together.
pub const GROUP: usize = 8;

/// The weight kinds the tiles of each path are instantiated for (const generic parameters).
pub(super) const Q4_1_KIND: u8 = 1;
pub(super) const Q5_0_KIND: u8 = 5;
pub(super) const Q8_0_KIND: u8 = 8;
pub(super) const Q4_K_KIND: u8 = 4;
pub(super) const Q6_K_KIND: u8 = 6;

/// The kind `ty` repacks to, if it does.
pub(super) const fn kind_of(ty: GgmlType) -> Option<u8> {
    match ty {
        GgmlType::Q4_1 => Some(Q4_1_KIND),
        GgmlType::Q5_0 => Some(Q5_0_KIND),
        GgmlType::Q8_0 => Some(Q8_0_KIND),
        GgmlType::Q4_K => Some(Q4_K_KIND),
        GgmlType::Q6_K => Some(Q6_K_KIND),
        _ => None,
    }
}

/// Bytes of one group's unit.
pub(super) const fn unit_bytes(kind: u8) -> usize {
    match kind {
        Q8_0_KIND => 272,
        Q5_0_KIND => 176,
        Q4_K_KIND => 1184,
        Q6_K_KIND => 2192,
        _ => 160,
    }
}

/// 32-element blocks per unit.
pub(super) const fn blocks_per_unit(kind: u8) -> usize {
    match kind {
        Q4_K_KIND | Q6_K_KIND => 8,
        _ => 1,
    }
}

/// Where 32-element block `b` of a group is: its unit's offset and its index in the unit.
#[inline(always)]
pub(super) const fn unit_of(kind: u8, b: usize) -> (usize, usize) {
    let per = blocks_per_unit(kind);
    ((b / per) * unit_bytes(kind), b % per)
}

/// Offset in a unit of sub-block `sub`'s quant chunks.
#[inline(always)]
pub(super) const fn quants_at(kind: u8, sub: usize) -> usize {
    match kind {
        Q8_0_KIND | Q5_0_KIND => 16,
        Q4_K_KIND => 160 + 128 * sub,
        Q6_K_KIND => 144 + 256 * sub,
        _ => 32,
    }
}

/// Offset of the eight one-byte scales (Q4_K: `sc`, Q6_K: the 16-element half `h`'s).
#[inline(always)]
pub(super) const fn scale_bytes_at(kind: u8, sub: usize, h: usize) -> usize {
    match kind {
        Q6_K_KIND => 16 + 8 * (2 * sub + h),
        _ => 32 + 8 * sub,
    }
}

/// Offset of Q4_K's eight one-byte minimums of sub-block `sub`.
#[inline(always)]
pub(super) const fn min_bytes_at(sub: usize) -> usize {
    96 + 8 * sub
}

/// Row `j`'s weight scale for block `sub` of `unit` (Q6_K: its half `h`), as every path computes
/// it: the f16 scale, times the sub-block's integer scale for the K-quants.
#[inline(always)]
pub(super) fn row_scale(kind: u8, unit: &[u8], sub: usize, h: usize, j: usize) -> f32 {
    let d = f16_at(unit, 2 * j);
    match kind {
        Q4_K_KIND => d * unit[scale_bytes_at(kind, sub, h) + j] as f32,
        Q6_K_KIND => d * unit[scale_bytes_at(kind, sub, h) + j] as i8 as f32,
        _ => d,
    }
}

/// Row `j`'s minimum term of block `sub`: Q4_1 adds `m`, Q4_K subtracts `dmin · m` (returned
/// negated, so every kind adds it); zero for the symmetric kinds.
#[inline(always)]
pub(super) fn row_min(kind: u8, unit: &[u8], sub: usize, j: usize) -> f32 {
    match kind {
        Q4_1_KIND => f16_at(unit, 16 + 2 * j),
        Q4_K_KIND => -(f16_at(unit, 16 + 2 * j) * unit[min_bytes_at(sub) + j] as f32),
        _ => 0.0,
    }
}

/// Offset from a Q5_0 block's quant chunks to its fifth bits.
pub(super) const Q5_0_HIGH: usize = 128;

/// The unsigned nibble (Q4 kinds), signed byte (Q8_0, Q6_K) or signed value (Q5_0: its nibble
/// and fifth bit, less 16) of element `e` (0..32) of row `j` in the block whose quant chunks
/// start at `q`.
#[inline(always)]
pub(super) fn element(kind: u8, q: &[u8], j: usize, e: usize) -> i32 {
    if matches!(kind, Q8_0_KIND | Q6_K_KIND) {
        return q[32 * (e / 4) + 4 * j + e % 4] as i8 as i32;
    }
    let (c, i, high) = (e / 8, e % 4, e % 8 >= 4);
    let byte = q[32 * c + 4 * j + i];
    let nibble = (if high { byte >> 4 } else { byte & 0x0F }) as i32;
    if kind == Q5_0_KIND {
        let fifth = (q[Q5_0_HIGH + 4 * j + i] >> (e / 4)) & 1;
        (nibble | (fifth as i32) << 4) - 16
    } else {
        nibble
    }
}

/// Repacks `m` (its type must have a kind, its rows a multiple of [`GROUP`]).
pub(super) fn repack(m: &QMatrix<'_>, kind: u8) -> Vec<u8> {
    let units = m.cols() / (32 * blocks_per_unit(kind));
    let (ub, sb) = (unit_bytes(kind), m.ty().type_size());
    let mut data = vec![0u8; m.rows() / GROUP * units * ub];
    data.par_chunks_mut(units * ub).enumerate().for_each(|(g, out)| {
        for u in 0..units {
            let dst = &mut out[u * ub..(u + 1) * ub];
            for j in 0..GROUP {
                let row = m.row(g * GROUP + j).unwrap_or(&[]);
                let Some(src) = row.get(u * sb..(u + 1) * sb) else { return };
                pack_row(kind, src, dst, j);
            }
        }
    });
    data
}

/// Writes row `j`'s part of one unit from its ggml block `src`.
fn pack_row(kind: u8, src: &[u8], dst: &mut [u8], j: usize) {
    // `put(q, v)`: element `e` of the block at `q` in the 4-bit or 8-bit chunk layout.
    let nib = |dst: &mut [u8], q: usize, e: usize, v: u8| {
        let (c, i) = (e / 8, e % 4);
        let at = q + 32 * c + 4 * j + i;
        dst[at] |= if e % 8 >= 4 { v << 4 } else { v & 0x0F };
    };
    let byte = |dst: &mut [u8], q: usize, e: usize, v: u8| dst[q + 32 * (e / 4) + 4 * j + e % 4] = v;
    match kind {
        Q5_0_KIND => {
            dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
            let q = quants_at(kind, 0);
            for e in 0..32 {
                let v = (q5_0_value(src, e) + 16) as u8; // 0..=31
                nib(dst, q, e, v & 0x0F);
                dst[q + Q5_0_HIGH + 4 * j + e % 4] |= (v >> 4) << (e / 4);
            }
        }
        Q4_1_KIND | Q8_0_KIND => {
            dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
            let q = quants_at(kind, 0);
            if kind == Q8_0_KIND {
                (0..32).for_each(|e| byte(dst, q, e, src[2 + e]));
            } else {
                dst[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&src[2..4]);
                (0..32).for_each(|e| nib(dst, q, e, if e < 16 { src[4 + e] } else { src[4 + e - 16] >> 4 }));
            }
        }
        Q4_K_KIND => {
            dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
            dst[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&src[2..4]);
            let (scales, qs) = (&src[4..16], &src[16..144]);
            for sub in 0..8 {
                let (sc, mn) = q4k_scale_min(sub, scales);
                dst[scale_bytes_at(kind, sub, 0) + j] = sc;
                dst[min_bytes_at(sub) + j] = mn;
                let (c, high) = (sub / 2, sub % 2 == 1);
                for e in 0..32 {
                    let b = qs[32 * c + e];
                    nib(dst, quants_at(kind, sub), e, if high { b >> 4 } else { b & 0x0F });
                }
            }
        }
        _ => {
            // Q6_K: ql[128], qh[64], scales[16] (i8), d (f16) — see `reference::dequantize`.
            dst[2 * j..2 * j + 2].copy_from_slice(&src[208..210]);
            for s in 0..16 {
                dst[16 + 8 * s + j] = src[192 + s];
            }
            for p in 0..256 {
                let (half, quarter, l) = (p / 128, p % 128 / 32, p % 32);
                let (ql, qh) = (&src[64 * half..64 * half + 64], &src[128 + 32 * half..128 + 32 * half + 32]);
                let lo = if quarter % 2 == 0 { ql[l] } else { ql[l + 32] };
                let lo = if quarter < 2 { lo & 0x0F } else { lo >> 4 };
                let hi = (qh[l] >> (2 * quarter)) & 3;
                let v = ((lo | (hi << 4)) as i32 - 32) as i8 as u8;
                byte(dst, quants_at(kind, p / 32), p % 32, v);
            }
        }
    }
}

/// Dequantizes group `w` (`GROUP` rows of `cols`) into `o` (row-major), with the arithmetic of
/// ggml's row layout: `q · d + m` (Q4_1), `q · d` (Q8_0, Q5_0), `(d · sc) · q - dmin · m` (Q4_K),
/// `(d · sc) · q` (Q6_K).
pub(super) fn dequantize_group(kind: u8, w: &[u8], cols: usize, o: &mut [f32]) {
    for b in 0..cols / 32 {
        let (base, sub) = unit_of(kind, b);
        let unit = &w[base..base + unit_bytes(kind)];
        let q = &unit[quants_at(kind, sub)..];
        for j in 0..GROUP {
            let row = &mut o[j * cols + 32 * b..][..32];
            for (e, x) in row.iter_mut().enumerate() {
                let v = element(kind, q, j, e) as f32;
                *x = match kind {
                    Q4_1_KIND => v * row_scale(kind, unit, sub, 0, j) + row_min(kind, unit, sub, j),
                    Q4_K_KIND => row_scale(kind, unit, sub, 0, j) * v + row_min(kind, unit, sub, j),
                    Q6_K_KIND => row_scale(kind, unit, sub, e / 16, j) * v,
                    _ => v * row_scale(kind, unit, sub, 0, j),
                };
            }
        }
    }
}
