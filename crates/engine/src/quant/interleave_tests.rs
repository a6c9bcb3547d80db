//! The repacked products' tests: every kind and kernel path against the row-layout dot
//! products, bit for bit, and the repack's own round trip. Apart from `interleave.rs` so the
//! product reads in one sitting.

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
        let f = |k: usize| half::f16::from_f32(0.002 + (hash(b * 7 + k) % 1000) as f32 * 1e-5).to_le_bytes();
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

const TYPES: [GgmlType; 5] = [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K];

/// `(rows, cols, activations)` shapes for `ty`: K-quant rows are whole super-blocks.
fn shapes(ty: GgmlType, base: [(usize, usize, usize); 6]) -> Vec<(usize, usize, usize)> {
    let k = matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K);
    base.iter().map(|&(r, c, n)| (r, if k { c.div_ceil(256) * 256 } else { c }, n)).collect()
}

/// The f32 dot of a dequantized row and a dequantized activation.
fn f32_dot(ty: GgmlType, row: &[u8], ys: &[BlockQ8x32]) -> (f32, f32) {
    let mut w = vec![0f32; ys.len() * 32];
    crate::quant::reference::dequantize(ty, row, &mut w);
    let terms = ys.iter().enumerate().flat_map(|(b, y)| (0..32).map(move |e| (b, y.qs[e] as f32 * y.d, e)));
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
    for (ty, top) in
        [(GgmlType::Q5_0, false), (GgmlType::Q5_0, true), (GgmlType::Q6_K, false), (GgmlType::Q8_0, false)]
    {
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
            let a = vec![
                QuantizedActivation::new(crate::quant::ActivationKind::Q8x32, &vec![sign; cols]).unwrap()
            ];
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
    // Sixteen and more activations, and from 64 on the AMX tiles where the CPU has them (partial
    // last tiles, a lone group after the pairs) and the AVX-512 pairs unpacked once for all
    // their tiles, against every other path and a product of one.
    let base = [(16, 64, 70), (24, 96, 17), (72, 576, 81), (40, 64, 65), (16, 1536, 20), (8, 32, 16)];
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

#[test]
fn swiglu_in_one_region_gives_the_bits_of_its_steps() {
    // Gate and up products, SiLU over whole rows, then the next product's quantization — against
    // all of it inside the product's tasks: every kind, one to seventy activations (the unpacked
    // tiles from 64), each path, with the pair's halves and with rayon's tasks.
    let silu = |g: &[f32], u: &[f32], h: &mut [f32]| crate::model::math::silu_mul_into(g, u, h);
    let bits = |a: &[QuantizedActivation]| -> Vec<(Vec<i8>, u32, u32, i32, i32)> {
        a.iter()
            .flat_map(|x| match x {
                QuantizedActivation::Q8x32(v) => v.clone(),
                _ => unreachable!(),
            })
            .map(|b| (b.qs.to_vec(), b.d.to_bits(), b.s.to_bits(), b.sum, b.sum_lo))
            .collect()
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for ty in TYPES {
        let (rows, cols) = (160, if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) { 256 } else { 64 });
        let (gd, ud) = (matrix_of(ty, rows, cols, 11), matrix_of(ty, rows, cols, 12));
        let gi = Interleaved::from_matrix(&QMatrix::new(ty, rows, cols, &gd).unwrap()).unwrap();
        let ui = Interleaved::from_matrix(&QMatrix::new(ty, rows, cols, &ud).unwrap()).unwrap();
        for n in [1, 3, 70] {
            let a = acts(n, cols, 5);
            for k in Kernel::ALL.into_iter().filter(|k| k.is_available()) {
                let (mut g, mut u, mut h) =
                    (vec![0f32; rows * n], vec![0f32; rows * n], vec![0f32; rows * n]);
                matmul_group_interleaved_with(k, &[&gi, &ui], &a, &mut [&mut g, &mut u]).unwrap();
                silu(&g, &u, &mut h);
                let want = super::super::matrix::prepare_rows_as(ActivationKind::Q8x32, rows, &h).unwrap();
                let alone = pool.install(|| matmul_swiglu_interleaved_with(k, &gi, &ui, &a, &silu)).unwrap();
                let paired = pool
                    .install(|| {
                        crate::par::with_partner(|| matmul_swiglu_interleaved_with(k, &gi, &ui, &a, &silu))
                    })
                    .unwrap();
                assert_eq!(bits(&alone), bits(&want), "{ty}, {n} activations, {k}");
                assert_eq!(bits(&paired), bits(&want), "{ty}, {n} activations, {k}, paired");
            }
        }
    }
}

#[test]
fn swiglu_refuses_unequal_or_partial_block_rows() {
    let silu = |g: &[f32], u: &[f32], h: &mut [f32]| crate::model::math::silu_mul_into(g, u, h);
    let il = |rows: usize| {
        let data = matrix(rows, 64, 3);
        Interleaved::from_matrix(&QMatrix::new(GgmlType::Q4_1, rows, 64, &data).unwrap()).unwrap()
    };
    let a = acts(1, 64, 1);
    assert!(matmul_swiglu_interleaved(&il(64), &il(32), &a, &silu).is_err());
    assert!(matmul_swiglu_interleaved(&il(40), &il(40), &a, &silu).is_err());
    assert!(matmul_swiglu_interleaved(&il(64), &il(64), &acts(1, 32, 1), &silu).is_err());
    assert!(matmul_swiglu_interleaved(&il(64), &il(64), &a, &silu).is_ok());
}
