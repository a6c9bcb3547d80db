//! Prefill attention's two products on AMX-BF16, beside `attention_gemm.rs`'s f32 register
//! tiles: under `Numerics::Fast` where the model made bf16 copies of its matrices
//! (`quant::amx_bf16`), a task's queries, keys, probabilities and values are rounded to bfloat16
//! and `S = Q·Kᵀ`, `O = P·V` run as 2 × 2 blocks of tiles with f32 sums — a `tdpbf16ps` is 8,192
//! multiply-adds, against 16 for a 512-bit FMA.
//!
//! Why it is shaped so: the tiles want whole 16 × 32 operand tiles in memory, so the task's
//! queries, keys (16 positions × 32 dimensions, pairs of dimensions side by side) and values (16
//! dimensions × 32 positions, pairs of positions side by side) are laid out once per task, the
//! probabilities once per score block; positions are padded to whole pairs of tiles with zeros,
//! which add nothing to a sum. The softmax stays f32 (`attention.rs`'s, the same code as the
//! other paths).
//!
//! Numerics: a query row's scores and output depend only on its own row, the keys and the values
//! (each sum runs over the dimensions, then the positions, in one order for every row of a
//! tile), so a row gives the same bits whatever block or task it is in.

use super::attention::{exp_sum, Path};
use super::math;
use crate::quant::amx_bf16::{self, a_at, b_at, bf16_bits, zeroed_lines, Line, KSTEP, TILE, TILE_LEN};

/// `x` rounded to bfloat16 into `out` (the caller checked [`usable`], so AVX-512 is there).
fn to_bf16(x: &[f32], out: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `usable` checked AVX-512 F and BW (through `amx_bf16::available`).
    unsafe {
        amx_bf16::to_bf16_avx512(x, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = bf16_bits(v));
}

/// Rows of `cols` values (`x`, row-major) rounded to bfloat16 as the tiles' first operand: for
/// each tile of sixteen rows and each step of 32 columns, a 16 × 32 tile.
fn as_tiles(x: &[f32], cols: usize, out: &mut [u16]) {
    let steps = cols / KSTEP;
    for (i, row) in x.chunks_exact(cols).enumerate() {
        for (c, piece) in row.chunks_exact(KSTEP).enumerate() {
            let at = a_at(i, c * KSTEP, steps);
            to_bf16(piece, &mut out[at..at + KSTEP]);
        }
    }
}

/// The second operand's tiles from `k_len` rows (`row(k)`, `n_len` values each, `k` along the
/// sum): tile `nt` of sixteen `n`, step `s` of 32 `k` (`steps` a tile), each tile row holding
/// rows `2kp` and `2kp + 1` side by side. `out` is zeros past `k_len` and `n_len`.
fn in_pairs<'a>(row: impl Fn(usize) -> &'a [f32], k_len: usize, n_len: usize, steps: usize, out: &mut [u16]) {
    for k0 in (0..k_len).step_by(2) {
        let (a, b) = (row(k0), (k0 + 1 < k_len).then(|| row(k0 + 1)));
        for n0 in (0..n_len).step_by(TILE) {
            let at = b_at(n0, k0, steps);
            #[cfg(target_arch = "x86_64")]
            if let (true, Some(b)) = (n0 + TILE <= n_len, b) {
                // SAFETY: `usable` checked AVX-512 F and BW; sixteen values of each row at `n0`.
                unsafe {
                    amx_bf16::pairs_to_bf16_avx512(
                        &a[n0..n0 + TILE],
                        &b[n0..n0 + TILE],
                        &mut out[at..at + 2 * TILE],
                    )
                };
                continue;
            }
            for n in n0..(n0 + TILE).min(n_len) {
                out[b_at(n, k0, steps)] = bf16_bits(a[n]);
                out[b_at(n, k0 + 1, steps)] = b.map_or(0, |b| bf16_bits(b[n]));
            }
        }
    }
}

/// Tiles in a register block's side: a block is 32 rows × 32 columns.
const PAIR: usize = 2 * TILE;

thread_local! {
    /// A task's query, key, value and probability tiles, kept between tasks on each thread.
    static TILES: std::cell::RefCell<[Vec<Line>; 4]> =
        const { std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()]) };
}

/// One task's shapes: `n_q` query rows (`group` per stacked row, positions `rows[i].1`), `n_pos`
/// positions, head width `hd`.
pub(super) struct Task<'a> {
    pub rows: &'a [(usize, usize)],
    pub group: usize,
    pub n_pos: usize,
    pub hd: usize,
    /// Query rows per score block (each block's scores stop at its own last row's position).
    pub sub: usize,
}

/// Whether a task of head width `hd` can run here.
pub(super) fn usable(hd: usize) -> bool {
    amx_bf16::available() && hd.is_multiple_of(KSTEP)
}

/// `out = softmax(Q·Kᵀ)·V` for the task: `qm` its queries (`n_q × hd`, scaled), `kt` its keys as
/// `[hd × n_pos]`, `v` its values as `[n_pos × hd]`; `sc` scratch for the scores. Returns the
/// normalized outputs, `n_q × hd`.
///
/// The caller checked [`usable`].
pub(super) fn attend(
    t: &Task<'_>,
    qm: &[f32],
    kt: &[f32],
    v: &[f32],
    sc: &mut Vec<f32>,
    path: Path,
) -> Vec<f32> {
    let Task { rows, group, n_pos, hd, sub } = *t;
    let n_q = rows.len() * group;
    let (q_pad, p_pad) = (n_q.div_ceil(PAIR) * PAIR, n_pos.div_ceil(PAIR) * PAIR);
    let (dsteps, psteps) = (hd / KSTEP, p_pad / KSTEP);
    assert!(
        qm.len() >= n_q * hd && kt.len() >= hd * n_pos && v.len() >= n_pos * hd,
        "attention operand sizes"
    );
    super::forward::with_kept(&TILES, true, |[qa, kb, vb, pa]| {
        // Queries: tile `qt`, step `s` of dimensions: rows of 32 values.
        let qa = zeroed_lines(qa, q_pad * hd);
        as_tiles(&qm[..n_q * hd], hd, qa);
        // Keys: tile `pt` of sixteen positions, step `s` of dimensions; a tile row holds two
        // dimensions of each position side by side.
        let kb = zeroed_lines(kb, p_pad * hd);
        in_pairs(|dim| &kt[dim * n_pos..(dim + 1) * n_pos], hd, n_pos, dsteps, kb);
        // Values: tile `dt` of sixteen dimensions, step `s` of positions; a tile row holds two
        // positions of each dimension side by side.
        let vb = zeroed_lines(vb, p_pad * hd);
        in_pairs(|p| &v[p * hd..(p + 1) * hd], n_pos, hd, psteps, vb);
        let sc = super::forward::sized(sc, q_pad * p_pad);
        let mut o = vec![0f32; q_pad * hd];
        let mut sums = vec![1f32; q_pad];
        for r0 in (0..rows.len()).step_by(sub) {
            let r1 = (r0 + sub).min(rows.len());
            let n_sub = rows[r0..r1].iter().map(|r| r.1).max().unwrap_or(0) + 1;
            let sub_pad = n_sub.div_ceil(PAIR) * PAIR;
            let (q0, q1) = (r0 * group, (r1 * group).div_ceil(PAIR) * PAIR);
            // SAFETY: `usable` checked the CPU; every tile read lies in `qa` (q_pad rows), `kb`
            // (p_pad ≥ sub_pad positions) or, below, `pa`/`vb`; every block written lies in `sc`
            // (q_pad × p_pad) or `o` (q_pad × hd).
            #[cfg(target_arch = "x86_64")]
            unsafe {
                amx_bf16::with_tiles(|| {
                    for qp in (q0..q1).step_by(PAIR) {
                        let a = |i: usize| qa.as_ptr().add((qp / TILE + i) * dsteps * TILE_LEN);
                        for pp in (0..sub_pad).step_by(PAIR) {
                            let b = |j: usize| kb.as_ptr().add((pp / TILE + j) * dsteps * TILE_LEN);
                            let c = sc.as_mut_ptr().add(qp * p_pad + pp);
                            amx_bf16::block_2x2([a(0), a(1)], [b(0), b(1)], dsteps, c, p_pad);
                        }
                    }
                })
            };
            // Unnormalized probabilities, zero past each row's position and for the padding rows.
            for qi in q0..q1 {
                let row = &mut sc[qi * p_pad..qi * p_pad + sub_pad];
                if qi >= n_q.min(r1 * group) {
                    row.iter_mut().for_each(|x| *x = 0.0);
                    continue;
                }
                let pos = rows[qi / group].1;
                let (live, masked) = row.split_at_mut(pos + 1);
                masked.iter_mut().for_each(|x| *x = 0.0);
                sums[qi] = exp_sum(path, live, math::max(live));
            }
            // P as tiles of 16 rows × 32 positions, the block's rows from tile 0.
            let ssteps = sub_pad / KSTEP;
            let pa = zeroed_lines(pa, (q1 - q0) * sub_pad);
            for (i, qi) in (q0..q1).enumerate() {
                let row = &sc[qi * p_pad..qi * p_pad + sub_pad];
                for (c, piece) in row.chunks_exact(KSTEP).enumerate() {
                    let at = a_at(i, c * KSTEP, ssteps);
                    to_bf16(piece, &mut pa[at..at + KSTEP]);
                }
            }
            // SAFETY: as above; `pa` holds (q1 − q0) rows × `ssteps` steps, `vb` `psteps ≥ ssteps`
            // steps of every dimension tile.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                amx_bf16::with_tiles(|| {
                    for qp in (q0..q1).step_by(PAIR) {
                        let a = |i: usize| pa.as_ptr().add(((qp - q0) / TILE + i) * ssteps * TILE_LEN);
                        for dp in (0..hd).step_by(PAIR) {
                            let b = |j: usize| vb.as_ptr().add((dp / TILE + j) * psteps * TILE_LEN);
                            amx_bf16::block_2x2(
                                [a(0), a(1)],
                                [b(0), b(1)],
                                ssteps,
                                o.as_mut_ptr().add(qp * hd + dp),
                                hd,
                            );
                        }
                    }
                })
            };
        }
        o.truncate(n_q * hd);
        for (row, &sum) in o.chunks_exact_mut(hd).zip(&sums) {
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|x| *x *= inv);
        }
        o
    })
}
