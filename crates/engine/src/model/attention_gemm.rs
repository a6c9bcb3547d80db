//! The prefill attention's two products — `S = Q·Kᵀ` and `O = P·V` over one score block — by
//! hand, with the same bits on every CPU path.
//!
//! Why not the `gemm` crate (which the other f32 products use): its AVX-512 kernels need a
//! nightly compiler (its `nightly` feature), so on stable it runs its AVX2 kernels — half the
//! multiply-adds of a CPU with two 512-bit FMA units (7 G of them a second per core on the AMX
//! Xeon, 512-bit and 256-bit alike) — and its blocking may order a value's additions differently
//! from one CPU to the next. These products are small and cache-resident (a score block of 32
//! query rows × three heads against at most a few thousand positions, 64-value heads), so they
//! need no packing: a register tile of `MR` rows × 32 columns (AVX-512) or 16 (AVX2) walks `k`,
//! each output one chain of fused multiply-adds in `k` order from zero. Every path — AVX-512,
//! AVX2, the plain loop — forms each output with exactly those operations, so they give the same
//! bits (`attention::tests`).

use super::attention::Path;

/// `c[i·ldc + j] = Σₖ a[i·lda + k] · b[k·ldb + j]` for `i < m`, `j < n`, `k < kk` (every output
/// overwritten): `acc = fma(a, b, acc)` for `k` in order from `+0`.
pub(super) fn matmul(
    path: Path,
    (m, n, kk): (usize, usize, usize),
    (c, ldc): (&mut [f32], usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        ldc >= n
            && (m - 1) * ldc + n <= c.len()
            && (kk == 0 || ((m - 1) * lda + kk <= a.len() && (kk - 1) * ldb + n <= b.len())),
        "attention product operand sizes"
    );
    let op = Op { n, kk, ldc, lda, ldb };
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: the path was picked from the detected CPU (`Path::best`, or a test that
        // checked it); every row `i < m`, column `j < n` and `k < kk` lies in its slice (asserted).
        Path::Avx512 => return unsafe { matmul_avx512(m, op, c, a, b) },
        Path::Avx2 => return unsafe { matmul_avx2(m, op, c, a, b) },
        Path::Portable => {}
    }
    let _ = path;
    for i in 0..m {
        for j in 0..n {
            c[i * ldc + j] = dot(op, a, b, i, j);
        }
    }
}

/// The shape and strides of one [`matmul`] (`m` apart).
#[derive(Clone, Copy)]
struct Op {
    n: usize,
    kk: usize,
    ldc: usize,
    lda: usize,
    ldb: usize,
}

/// One output with scalar operations in the vector paths' order (the plain path, and the
/// columns past the AVX2 path's last whole vector pair).
#[inline(always)]
fn dot(op: Op, a: &[f32], b: &[f32], i: usize, j: usize) -> f32 {
    let mut acc = 0f32;
    for k in 0..op.kk {
        acc = a[i * op.lda + k].mul_add(b[k * op.ldb + j], acc);
    }
    acc
}

/// [`matmul`] on AVX-512: rows in tiles of 12 (then 8, 4, 2, 1), columns in pairs of vectors,
/// the last pair masked.
///
/// # Safety
/// AVX-512 F is present; the operands hold every element [`matmul`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn matmul_avx512(m: usize, op: Op, c: &mut [f32], a: &[f32], b: &[f32]) {
    let mut i = 0;
    while i < m {
        // SAFETY: rows `i..i + MR` are below `m`; the rest is the caller's promise.
        i += unsafe {
            match m - i {
                12.. => tile_avx512::<12>(op, c, a, b, i),
                8..=11 => tile_avx512::<8>(op, c, a, b, i),
                4..=7 => tile_avx512::<4>(op, c, a, b, i),
                2 | 3 => tile_avx512::<2>(op, c, a, b, i),
                _ => tile_avx512::<1>(op, c, a, b, i),
            }
        };
    }
}

/// Rows `i0..i0 + MR` of [`matmul_avx512`]; returns `MR`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const MR: usize>(op: Op, c: &mut [f32], a: &[f32], b: &[f32], i0: usize) -> usize {
    use std::arch::x86_64::*;
    let Op { n, kk, ldc, lda, ldb } = op;
    let mask = |left: usize| -> __mmask16 {
        if left >= 16 {
            0xffff
        } else {
            (1u16 << left) - 1
        }
    };
    for j in (0..n).step_by(32) {
        let (m0, m1) = (mask(n - j), mask((n - j).saturating_sub(16)));
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        // SAFETY: the loads are masked to columns `< n` of rows `k < kk` of `b`, the broadcasts
        // read `a[(i0 + r)·lda + k]` with `i0 + r < m`, the stores are masked to columns `< n`
        // of rows `< m` of `c`: all inside the slices (the caller's assertion). The pointers
        // are formed with `wrapping_add`, since a masked lane's address may lie past the end.
        unsafe {
            for k in 0..kk {
                let bp = b.as_ptr().wrapping_add(k * ldb + j);
                let b0 = _mm512_maskz_loadu_ps(m0, bp);
                let b1 = _mm512_maskz_loadu_ps(m1, bp.wrapping_add(16));
                for (r, ar) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*a.get_unchecked((i0 + r) * lda + k));
                    ar[0] = _mm512_fmadd_ps(av, b0, ar[0]);
                    ar[1] = _mm512_fmadd_ps(av, b1, ar[1]);
                }
            }
            for (r, ar) in acc.iter().enumerate() {
                let cp = c.as_mut_ptr().wrapping_add((i0 + r) * ldc + j);
                _mm512_mask_storeu_ps(cp, m0, ar[0]);
                _mm512_mask_storeu_ps(cp.wrapping_add(16), m1, ar[1]);
            }
        }
    }
    MR
}

/// [`matmul`] on AVX2 + FMA: rows in tiles of 6 (then 4, 2, 1), columns in pairs of vectors,
/// the columns past the last whole pair by [`dot`].
///
/// # Safety
/// AVX2 and FMA are present; the operands hold every element [`matmul`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn matmul_avx2(m: usize, op: Op, c: &mut [f32], a: &[f32], b: &[f32]) {
    let mut i = 0;
    while i < m {
        // SAFETY: rows `i..i + MR` are below `m`; the rest is the caller's promise.
        i += unsafe {
            match m - i {
                6.. => tile_avx2::<6>(op, c, a, b, i),
                4 | 5 => tile_avx2::<4>(op, c, a, b, i),
                2 | 3 => tile_avx2::<2>(op, c, a, b, i),
                _ => tile_avx2::<1>(op, c, a, b, i),
            }
        };
    }
}

/// Rows `i0..i0 + MR` of [`matmul_avx2`]; returns `MR`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const MR: usize>(op: Op, c: &mut [f32], a: &[f32], b: &[f32], i0: usize) -> usize {
    use std::arch::x86_64::*;
    let Op { n, kk, ldc, lda, ldb } = op;
    let wide = n / 16 * 16;
    for j in (0..wide).step_by(16) {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        // SAFETY: columns `j..j + 16 <= n` of rows `k < kk` of `b` and rows `< m` of `c`,
        // `a[(i0 + r)·lda + k]` with `i0 + r < m`: inside the slices (the caller's assertion).
        unsafe {
            for k in 0..kk {
                let bp = b.as_ptr().add(k * ldb + j);
                let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8)));
                for (r, ar) in acc.iter_mut().enumerate() {
                    let av = _mm256_set1_ps(*a.get_unchecked((i0 + r) * lda + k));
                    ar[0] = _mm256_fmadd_ps(av, b0, ar[0]);
                    ar[1] = _mm256_fmadd_ps(av, b1, ar[1]);
                }
            }
            for (r, ar) in acc.iter().enumerate() {
                let cp = c.as_mut_ptr().add((i0 + r) * ldc + j);
                _mm256_storeu_ps(cp, ar[0]);
                _mm256_storeu_ps(cp.add(8), ar[1]);
            }
        }
    }
    for r in 0..MR {
        for j in wide..n {
            c[(i0 + r) * ldc + j] = dot(op, a, b, i0 + r, j);
        }
    }
    MR
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_gives_the_plain_loops_bits_and_the_product() {
        let val = |i: usize| ((i * 2_654_435_761 % 1000) as f32 / 500.0 - 1.0) * 0.9;
        // Row counts around every tile height, columns around every vector width, `k` from none
        // to more than a block, and strides wider than the rows.
        for (m, n, kk) in
            [(1, 1, 1), (13, 70, 64), (12, 32, 3), (7, 17, 0), (25, 64, 129), (6, 15, 5), (3, 48, 64)]
        {
            let (lda, ldb, ldc) = (kk + 3, n + 5, n + 2);
            let a: Vec<f32> = (0..m * lda).map(|i| val(i * 7 + 1)).collect();
            let b: Vec<f32> = (0..kk.max(1) * ldb).map(|i| val(i * 13 + 5)).collect();
            let run = |path| {
                let mut c = vec![f32::NAN; m * ldc];
                matmul(path, (m, n, kk), (&mut c, ldc), (&a, lda), (&b, ldb));
                c
            };
            let want = run(Path::Portable);
            for i in 0..m {
                for j in 0..n {
                    let exact: f64 = (0..kk).map(|k| a[i * lda + k] as f64 * b[k * ldb + j] as f64).sum();
                    let got = want[i * ldc + j];
                    assert!(
                        (got as f64 - exact).abs() < 1e-4,
                        "({m}, {n}, {kk}) [{i}, {j}]: {got} vs {exact}"
                    );
                }
            }
            for path in super::super::attention::available_paths() {
                let got = run(path);
                for i in 0..m {
                    let row =
                        |c: &[f32]| c[i * ldc..i * ldc + n].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(row(&got), row(&want), "{path:?} ({m}, {n}, {kk}) row {i}");
                    // The padding between rows is never written.
                    assert!(got[i * ldc + n..(i + 1) * ldc].iter().all(|x| x.is_nan()), "{path:?} padding");
                }
            }
        }
    }
}
