//! Portable dot kernels: one quantized weight row · one prepared activation vector.
//!
//! These run wherever AVX2 is absent and are the oracle the AVX2 kernels are tested against.
//! They do the same integer arithmetic as the SIMD versions (integer sums per block, one float
//! multiply-add per block), so both differ from "dequantize then f32 dot" only by activation
//! quantization error, and from each other only by float summation order.
//!
//! Lengths are validated by the caller: `row` holds exactly as many weight blocks as the
//! activation has blocks.

use super::activation::{BlockQ8K, BlockQ8x32};
use super::reference::{f16_at, q4k_scale_min};

pub(crate) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    row.chunks_exact(4).zip(x).map(|(c, &v)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * v).sum()
}

pub(crate) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    x.iter().enumerate().map(|(i, &v)| f16_at(row, 2 * i) * v).sum()
}

pub(crate) fn dot_q4_0(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    let mut acc = 0f32;
    for (b, y) in row.chunks_exact(18).zip(y) {
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = b[2 + j];
            sumi += ((q & 0x0F) as i32 - 8) * y.qs[j] as i32;
            sumi += ((q >> 4) as i32 - 8) * y.qs[j + 16] as i32;
        }
        acc += f16_at(b, 0) * y.d * sumi as f32;
    }
    acc
}

pub(crate) fn dot_q4_1(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    let mut acc = 0f32;
    for (b, y) in row.chunks_exact(20).zip(y) {
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = b[4 + j];
            sumi += (q & 0x0F) as i32 * y.qs[j] as i32;
            sumi += (q >> 4) as i32 * y.qs[j + 16] as i32;
        }
        acc += f16_at(b, 0) * y.d * sumi as f32 + f16_at(b, 2) * y.s;
    }
    acc
}

pub(crate) fn dot_q8_0(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    let mut acc = 0f32;
    for (b, y) in row.chunks_exact(34).zip(y) {
        let sumi: i32 = b[2..34].iter().zip(&y.qs).map(|(&q, &a)| q as i8 as i32 * a as i32).sum();
        acc += f16_at(b, 0) * y.d * sumi as f32;
    }
    acc
}

pub(crate) fn dot_q5_0(row: &[u8], y: &[BlockQ8x32]) -> f32 {
    let mut acc = 0f32;
    for (b, y) in row.chunks_exact(22).zip(y) {
        let sumi: i32 = (0..32).map(|e| super::reference::q5_0_value(b, e) * y.qs[e] as i32).sum();
        acc += f16_at(b, 0) * y.d * sumi as f32;
    }
    acc
}

pub(crate) fn dot_q4_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (b, y) in row.chunks_exact(144).zip(y) {
        let scales = &b[4..16];
        let qs = &b[16..144];
        let mut sumi = 0i32; // Σ_j sc_j · Σ q·y
        let mut summ = 0i32; // Σ_j m_j · Σ y
        for j in 0..8 {
            let (sc, m) = q4k_scale_min(j, scales);
            let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let ys = &y.qs[32 * j..32 * j + 32];
            let shift = if j % 2 == 0 { 0 } else { 4 };
            let s: i32 = chunk.iter().zip(ys).map(|(&q, &a)| ((q >> shift) & 0x0F) as i32 * a as i32).sum();
            sumi += sc as i32 * s;
            summ += m as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
        }
        acc += f16_at(b, 0) * y.d * sumi as f32 - f16_at(b, 2) * y.d * summ as f32;
    }
    acc
}

pub(crate) fn dot_q6_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (b, y) in row.chunks_exact(210).zip(y) {
        let mut sumi = 0i32;
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let sc = &b[192 + 8 * half..192 + 8 * half + 8];
            let ys = &y.qs[128 * half..128 * half + 128];
            // Four 32-element quarters; each quarter has two 16-element sub-blocks.
            let mut part = [0i32; 8];
            for l in 0..32 {
                let q = [
                    (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, &qk) in q.iter().enumerate() {
                    part[2 * k + l / 16] += (qk as i32 - 32) * ys[32 * k + l] as i32;
                }
            }
            for (p, &s) in part.iter().zip(sc) {
                sumi += p * s as i8 as i32;
            }
        }
        acc += f16_at(b, 208) * y.d * sumi as f32;
    }
    acc
}
