use super::*;

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 20_001) as f32 / 10_000.0 - 1.0
        })
        .collect()
}

#[test]
#[cfg(target_arch = "x86_64")]
fn the_vector_rounding_gives_half_s_bits() {
    if !available() {
        eprintln!("skipped: no AMX-BF16 here");
        return;
    }
    let mut x = values(1000, 3);
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::MAX,
        f32::MIN_POSITIVE / 3.0,
        f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
        f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
        f32::from_bits(0x3f80_8001),
        f32::from_bits(0x7f7f_ffff),
    ];
    x[..specials.len()].copy_from_slice(&specials);
    let mut out = vec![0u16; x.len()];
    // SAFETY: `available` checked AVX-512 F and BW.
    unsafe { to_bf16_avx512(&x, &mut out) };
    for (i, (&v, &o)) in x.iter().zip(&out).enumerate() {
        assert_eq!(o, bf16_bits(v), "value {i}: {v:e}");
    }
    let mut pairs = [0u16; 32];
    // SAFETY: as above.
    unsafe { pairs_to_bf16_avx512(&x[..16], &x[16..32], &mut pairs) };
    for i in 0..16 {
        assert_eq!((pairs[2 * i], pairs[2 * i + 1]), (bf16_bits(x[i]), bf16_bits(x[16 + i])), "pair {i}");
    }
}

/// Every shape edge (a partial activation tile, a partial row pair, one row, several matrices
/// in one region) against the same products summed in f64 over the bf16 operands: within
/// f32 rounding of a sum, and each row the same bits alone as among others.
#[test]
fn products_match_a_wide_sum_and_a_row_is_the_same_alone() {
    if !available() {
        eprintln!("skipped: no AMX-BF16 here");
        return;
    }
    for &(m, rows_a, rows_b, cols) in
        &[(1, 16, 8, 32), (37, 40, 72, 96), (300, 64, 24, 576), (64, 32, 32, 1536)]
    {
        let wa = values(rows_a * cols, 7);
        let wb = values(rows_b * cols, 11);
        let (a, b) = (
            Bf16Matrix::from_f32(&wa, rows_a, cols).unwrap(),
            Bf16Matrix::from_f32(&wb, rows_b, cols).unwrap(),
        );
        let x = values(m * cols, 5);
        let (mut ya, mut yb) = (vec![f32::NAN; m * rows_a], vec![f32::NAN; m * rows_b]);
        matmul_group(&[&a, &b], &x, m, &mut [&mut ya, &mut yb]).unwrap();
        for (w, y) in [(&a, &ya), (&b, &yb)] {
            for i in 0..m {
                for r in 0..w.rows {
                    let terms = (0..cols).map(|k| {
                        let xv = f32::from_bits((bf16_bits(x[i * cols + k]) as u32) << 16);
                        xv as f64 * w.at(r, k) as f64
                    });
                    let (wide, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                    // Recursive summation's bound: (n − 1) · 2⁻²⁴ · Σ|terms|.
                    let bound = cols as f64 * f64::powi(2.0, -24) * size;
                    let got = y[i * w.rows + r] as f64;
                    assert!((got - wide).abs() <= bound, "({i}, {r}) {got} vs {wide} (bound {bound:e})");
                }
            }
        }
        let last = m - 1;
        let mut alone = vec![0f32; rows_a];
        matmul_group(&[&a], &x[last * cols..], 1, &mut [&mut alone]).unwrap();
        assert_eq!(
            alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            ya[last * rows_a..].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "row {last} of {m} alone"
        );
    }
}

#[test]
fn bad_shapes_are_errors() {
    assert!(Bf16Matrix::from_f32(&[0.0; 48], 1, 48).is_err());
    assert!(Bf16Matrix::from_f32(&[0.0; 31], 1, 32).is_err());
    let w = Bf16Matrix::from_f32(&[0.5; 64], 2, 32).unwrap();
    assert_eq!(w.bytes(), Bf16Matrix::bytes_for(2, 32));
    assert!(matmul_group(&[&w], &[0.0; 31], 1, &mut [&mut [0.0; 2]]).is_err());
    assert!(matmul_group(&[&w], &[0.0; 32], 1, &mut [&mut [0.0; 3]]).is_err());
}
