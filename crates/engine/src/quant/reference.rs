//! Scalar reference code for the ggml block formats: dequantize (every supported type) and
//! quantize from f32 (F32, F16, Q8_0, Q4_0, Q4_1).
//!
//! This file is the executable definition of each block layout and is written for clarity, not
//! speed: the fast dot kernels are tested against "dequantize here, then an f32 dot". Layouts
//! follow ggml's `ggml-common.h` exactly (all multi-byte fields little-endian):
//!
//! | type | block | bytes | layout |
//! |------|-------|-------|--------|
//! | Q4_0 | 32  | 18  | `d: f16, qs: [u8; 16]`; x[j] = (lo(qs[j]) - 8)·d, x[j+16] = (hi(qs[j]) - 8)·d |
//! | Q4_1 | 32  | 20  | `d: f16, m: f16, qs: [u8; 16]`; x = q·d + m, same nibble order as Q4_0 |
//! | Q5_0 | 32  | 22  | `d: f16, qh: u32, qs: [u8; 16]`; x[j] = (lo(qs[j]) | bit j of qh << 4) - 16)·d, x[j+16] with hi and bit j+16 |
//! | Q8_0 | 32  | 34  | `d: f16, qs: [i8; 32]`; x = q·d |
//! | Q4_K | 256 | 144 | `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`; 8 sub-blocks of 32 with 6-bit scale/min |
//! | Q6_K | 256 | 210 | `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`; 16 sub-blocks of 16 |
//!
//! All functions take lengths already validated by the public entry points in `quant/mod.rs`.

use super::GgmlType;

/// Reads the little-endian f16 at `b[i..i + 2]` as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

#[inline]
fn put_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// The 6-bit (scale, min) pair of sub-block `j` (0..8) from a Q4_K `scales` field.
#[inline]
pub(crate) fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Element `e` (0..32) of a Q5_0 block, in -16..=15: the nibble (low for `e < 16`, high
/// after) with bit `e` of the block's `qh` as its fifth bit, minus 16.
#[inline]
pub(crate) fn q5_0_value(b: &[u8], e: usize) -> i32 {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let nib = if e < 16 { b[6 + e] & 0x0F } else { b[6 + e - 16] >> 4 };
    (nib as i32 | ((qh >> e) as i32 & 1) << 4) - 16
}

/// Dequantizes whole blocks. `bytes.len()` must be `out.len() / block_size * type_size` and
/// `ty` must be supported; the caller checks both.
pub(crate) fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(bytes, 2 * i);
            }
        }
        GgmlType::Q4_0 => {
            for (b, o) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    o[j] = ((b[2 + j] & 0x0F) as i32 - 8) as f32 * d;
                    o[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, o) in bytes.chunks_exact(20).zip(out.chunks_exact_mut(32)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    o[j] = (b[4 + j] & 0x0F) as f32 * d + m;
                    o[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (b, o) in bytes.chunks_exact(22).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(b, 0);
                for (j, x) in o.iter_mut().enumerate() {
                    *x = q5_0_value(b, j) as f32 * d;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = b[2 + j] as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4_K => {
            for (b, o) in bytes.chunks_exact(144).zip(out.chunks_exact_mut(256)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for c in 0..4 {
                    let (sc1, m1) = q4k_scale_min(2 * c, scales);
                    let (sc2, m2) = q4k_scale_min(2 * c + 1, scales);
                    let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                    for l in 0..32 {
                        let q = qs[32 * c + l];
                        o[64 * c + l] = d1 * (q & 0x0F) as f32 - m1;
                        o[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            for (b, o) in bytes.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
                let d = f16_at(b, 208);
                for half in 0..2 {
                    let ql = &b[64 * half..64 * half + 64];
                    let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                    let sc = &b[192 + 8 * half..192 + 8 * half + 8];
                    let o = &mut o[128 * half..128 * half + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        o[l] = d * (sc[is] as i8 as f32) * q1 as f32;
                        o[l + 32] = d * (sc[is + 2] as i8 as f32) * q2 as f32;
                        o[l + 64] = d * (sc[is + 4] as i8 as f32) * q3 as f32;
                        o[l + 96] = d * (sc[is + 6] as i8 as f32) * q4 as f32;
                    }
                }
            }
        }
        // Unreachable for validated callers; leave the output untouched rather than panic.
        _ => {}
    }
}

/// Quantizes `x` (a whole number of blocks) to `ty`, appending to `out`. Supports F32, F16,
/// Q8_0, Q4_0 and Q4_1 (ggml's reference rounding); returns `false` for other types.
pub(crate) fn quantize(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> bool {
    match ty {
        GgmlType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => x.iter().for_each(|&v| put_f16(out, v)),
        GgmlType::Q8_0 => {
            for blk in x.chunks_exact(32) {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(out, d);
                out.extend(blk.iter().map(|v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8));
            }
        }
        GgmlType::Q4_0 => {
            for blk in x.chunks_exact(32) {
                // The value of largest magnitude, sign kept, maps to -8.
                let max = blk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(out, d);
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
            }
        }
        GgmlType::Q4_1 => {
            for blk in x.chunks_exact(32) {
                let min = blk.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = blk.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(out, d);
                put_f16(out, min);
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
            }
        }
        _ => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn q8_0_hand_built_block_is_bit_exact() {
        let mut b = Vec::new();
        b.extend_from_slice(&f16_bytes(0.5));
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut out);
        for (j, v) in out.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_hand_built_block_is_bit_exact() {
        let mut b = Vec::new();
        b.extend_from_slice(&f16_bytes(0.25));
        b.extend_from_slice(&f16_bytes(-1.0));
        // Low nibble j, high nibble 15 - j.
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.25 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.25 - 1.0);
        }
    }

    #[test]
    fn q4_0_hand_built_block_is_bit_exact() {
        let mut b = Vec::new();
        b.extend_from_slice(&f16_bytes(2.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 2.0);
            assert_eq!(out[j + 16], (7.0 - j as f32) * 2.0);
        }
    }

    #[test]
    fn q4_k_scale_min_unpacking() {
        // Sub-blocks 0..4 read the low 6 bits; 4..8 combine nibbles with the top 2 bits.
        let mut s = [0u8; 12];
        s[0] = 0b11_000101; // sc0 = 5, top bits 3 -> sc4 high
        s[4] = 0b01_000111; // m0 = 7, top bits 1 -> m4 high
        s[8] = 0x9A; // sc4 low nibble 0xA, m4 low nibble 0x9
        assert_eq!(q4k_scale_min(0, &s), (5, 7));
        assert_eq!(q4k_scale_min(4, &s), (0xA | (3 << 4), 0x9 | (1 << 4)));
    }

    #[test]
    fn quantize_then_dequantize_is_close() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        for (ty, tol) in [(GgmlType::Q8_0, 0.03), (GgmlType::Q4_0, 1.0), (GgmlType::Q4_1, 0.5)] {
            let mut bytes = Vec::new();
            assert!(quantize(ty, &x, &mut bytes));
            assert_eq!(bytes.len(), 2 * ty.type_size());
            let mut y = vec![0f32; 64];
            dequantize(ty, &bytes, &mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{ty}: {a} vs {b}");
            }
        }
    }
}
