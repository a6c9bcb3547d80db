//! Causal attention over the paged KV cache, the only per-sequence part of the forward pass:
//! split into tasks of (sequence, KV head, query rows) so a long prefill and a wide decode batch
//! both spread over every core; few query rows (decode) take an online softmax over each block,
//! many (prefill) two GEMMs over the gathered K and V. Apart from `forward.rs` because it is a
//! kernel of its own with its own CPU paths and tests.

use super::forward::{gemm_strided, sized, with_kept, GEMM_MIN_ROWS, SCRATCH_MAX};
use super::math;
use crate::kv_cache::{BlockId, BlockTable, KvCache};
use crate::model::BatchItem;

/// Causal attention for every stacked row and query head; returns `[T × n_head·hd]`.
///
/// Work is split into tasks of (sequence, KV head, up to 32 query rows), so a long prefill and a
/// wide decode batch both spread over every core. Each task walks the sequence's KV blocks once:
/// a block's K and V for that head are converted from f16 to f32 once and reused by every query
/// row and every query head of the group, with an online softmax (running max and sum), so the
/// cost is the arithmetic, not the conversions.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    cache: &KvCache,
    batch: &[BatchItem<'_>],
    rows: &[(usize, usize)],
    q: &[f32],
    layer: usize,
    n_head: usize,
    group: usize,
    hd: usize,
) -> Vec<f32> {
    const ROWS_PER_TASK: usize = 128;
    assert_eq!(cache.layout().head_dim, hd, "the KV cache is laid out for another head width");
    let d = n_head * hd;
    let n_kv = n_head / group;
    // Tasks: (item, kv head, first stacked row, row count, query heads of the group).
    let mut tasks = Vec::new();
    let mut first = 0;
    for (i, item) in batch.iter().enumerate() {
        let n = item.tokens.len();
        for kvh in 0..n_kv {
            for start in (0..n).step_by(ROWS_PER_TASK) {
                tasks.push((i, kvh, first + start, ROWS_PER_TASK.min(n - start), 0..group));
            }
        }
        first += n;
    }
    // Fewer tasks than threads (one or two sequences on a wide pool, or a model with one KV
    // head): one task per query head instead, for the rows below the GEMM path, so no thread sits
    // out. Each head's arithmetic is the same either way; only its block loads and conversions
    // are repeated, by the one-head kernel — which is why the split waits for idle threads: on
    // two threads, one sequence's three KV-head tasks (shared 2:1) beat nine query-head tasks by
    // 30% (`decode_attention_throughput` at one and two sequences, the two rules alternating in
    // one process through a temporary switch), and a whole batch-1 step at 512 tokens of context
    // by 6–10% (alternating every eight steps in one `bench-engine` run).
    if tasks.len() < rayon::current_num_threads() && group > 1 {
        tasks = tasks
            .into_iter()
            .flat_map(|(i, kvh, r0, nr, g)| {
                if nr * group >= GEMM_MIN_ROWS {
                    vec![(i, kvh, r0, nr, g)]
                } else {
                    g.map(|h| (i, kvh, r0, nr, h..h + 1)).collect()
                }
            })
            .collect();
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let slots: Vec<std::sync::OnceLock<Vec<f32>>> =
        tasks.iter().map(|_| std::sync::OnceLock::new()).collect();
    crate::par::for_each(tasks.len(), |t| {
        let (i, kvh, r0, nr, heads) = &tasks[t];
        let table: &BlockTable = &*batch[*i].table;
        let job = Job { cache, table, layer, kvh: *kvh, group, heads: heads.clone(), hd, scale, d };
        let _ = slots[t].set(attend_task(&job, &rows[*r0..r0 + nr], &q[r0 * d..(r0 + nr) * d]));
    });
    let results: Vec<Vec<f32>> = slots.into_iter().map(|s| s.into_inner().unwrap_or_default()).collect();
    let mut out = vec![0f32; rows.len() * d];
    for ((_, kvh, r0, nr, heads), res) in tasks.iter().zip(&results) {
        let w = heads.len();
        for r in 0..*nr {
            for (j, g) in heads.clone().enumerate() {
                let h = kvh * group + g;
                let src = &res[(r * w + j) * hd..(r * w + j + 1) * hd];
                out[(r0 + r) * d + h * hd..(r0 + r) * d + (h + 1) * hd].copy_from_slice(src);
            }
        }
    }
    out
}

/// What one attention task reads: the cache, the sequence's blocks, and which query heads of KV
/// head `kvh`'s group it computes.
struct Job<'a> {
    cache: &'a KvCache,
    table: &'a BlockTable,
    layer: usize,
    kvh: usize,
    group: usize,
    heads: std::ops::Range<usize>,
    hd: usize,
    scale: f32,
    /// Row stride of `q` (all heads).
    d: usize,
}

/// The decode attention kernels, by CPU path (capped with the products' by `TOKENPATH_KERNEL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// Blocks converted to f32, then [`online_block`].
    Portable,
    /// `attention_avx2.rs`: one head, eight positions per vector, f16 read in place.
    Avx2,
    /// `attention_avx512.rs`: up to three heads, sixteen positions per vector.
    Avx512,
}

impl Path {
    /// The fastest path this CPU runs at or below [`crate::quant::Kernel::best`].
    pub(super) fn best() -> Path {
        use crate::quant::Kernel;
        match Kernel::best() {
            Kernel::Avx512 | Kernel::Amx => Path::Avx512,
            Kernel::Avx2 => Path::Avx2,
            Kernel::Scalar => Path::Portable,
        }
    }
}

/// One task of [`attention`]: rows `rows` (all of one sequence) × query heads `job.heads` of KV
/// head `job.kvh`'s group. Returns `[rows × heads × hd]`. Every path gives the same bits.
fn attend_task(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32]) -> Vec<f32> {
    let n_q = rows.len() * job.heads.len();
    if n_q >= GEMM_MIN_ROWS && job.heads.len() == job.group {
        let max_pos = rows.iter().map(|r| r.1).max().unwrap_or(0);
        return attend_task_gemm(job, rows, q, max_pos);
    }
    attend_online_path(job, rows, q, Path::best())
}

/// [`attend_online`] on `path`: for heads of 64 or 128 values on AVX2 or AVX-512 the cache's
/// f16 blocks are read in place by `attention_avx2.rs` / `attention_avx512.rs`; otherwise the
/// portable walk. All give the portable path's bits.
fn attend_online_path(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32], path: Path) -> Vec<f32> {
    let (hd, d) = (job.hd, job.d);
    if path == Path::Portable || (hd != 64 && hd != 128) {
        return attend_online(job, rows, q);
    }
    let bs = job.cache.layout().block_size;
    let w = job.heads.len();
    let n_q = rows.len() * w;
    let max_pos = rows.iter().map(|r| r.1).max().unwrap_or(0);
    let mut m = vec![f32::NEG_INFINITY; n_q];
    let mut l = vec![0f32; n_q];
    let mut acc = vec![0f32; n_q * hd];
    let mut scores = vec![0f32; 3 * bs];
    // A row's query heads of this group are side by side in `q`: each kernel call takes a run.
    let g0 = job.kvh * job.group + job.heads.start;
    for (bi, block) in job.table.blocks().iter().enumerate() {
        let p0 = bi * bs;
        if p0 > max_pos {
            break;
        }
        let slots = bs.min(max_pos + 1 - p0);
        let (k, v) =
            (job.cache.k_head(*block, job.layer, job.kvh), job.cache.v_head(*block, job.layer, job.kvh));
        // The next blocks are elsewhere in the cache, where no hardware prefetcher looks: ask
        // for this head's part of the block `AHEAD` on (the first call: of every block up to it)
        // into L2 now, so it arrives while the blocks before it are computed.
        let first = if bi == 0 { 1 } else { bi + AHEAD };
        for next in first..=bi + AHEAD {
            if let Some(b) = job.table.blocks().get(next).filter(|_| next * bs <= max_pos) {
                prefetch(job.cache.k_head(*b, job.layer, job.kvh));
                prefetch(job.cache.v_head(*b, job.layer, job.kvh));
            }
        }
        for (ri, &(_, pos)) in rows.iter().enumerate() {
            if pos < p0 {
                continue;
            }
            let n = slots.min(pos + 1 - p0);
            let qs = &q[ri * d + g0 * hd..][..w * hd];
            let mut j = 0;
            while j < w {
                let nh = if path == Path::Avx512 { (w - j).min(3) } else { 1 };
                let qi = ri * w + j;
                let (mj, lj) = (&mut m[qi..qi + nh], &mut l[qi..qi + nh]);
                let (qj, aj) = (&qs[j * hd..(j + nh) * hd], &mut acc[qi * hd..(qi + nh) * hd]);
                // SAFETY: the path was picked from the detected CPU (`Path::best`, or a test
                // that checked it); `k` is `hd × bs`, `v` `bs × hd` and `n <= bs`; the kernels
                // assert the slice lengths.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    use super::{attention_avx2 as a2, attention_avx512 as a5};
                    let sc = &mut scores[..nh * bs];
                    // One call per kernel instance: (heads of 8·NC values, NH heads per call).
                    macro_rules! avx512 {
                        ($nc:literal, $nh:literal) => {
                            a5::online_block_f16::<$nc, $nh>(qj, k, v, bs, n, sc, job.scale, mj, lj, aj)
                        };
                    }
                    macro_rules! avx2 {
                        ($nc:literal) => {{
                            let (sc, m0, l0) = (&mut sc[..n], &mut mj[0], &mut lj[0]);
                            a2::online_block_f16::<$nc>(qj, k, v, bs, sc, job.scale, m0, l0, aj)
                        }};
                    }
                    match (path, hd, nh) {
                        (Path::Avx512, 64, 3) => avx512!(8, 3),
                        (Path::Avx512, 64, 2) => avx512!(8, 2),
                        (Path::Avx512, 64, _) => avx512!(8, 1),
                        (Path::Avx512, _, 3) => avx512!(16, 3),
                        (Path::Avx512, _, 2) => avx512!(16, 2),
                        (Path::Avx512, _, _) => avx512!(16, 1),
                        (_, 64, _) => avx2!(8),
                        (_, _, _) => avx2!(16),
                    }
                }
                j += nh;
            }
        }
    }
    for (qi, a) in acc.chunks_exact_mut(hd).enumerate() {
        let inv = 1.0 / l[qi];
        a.iter_mut().for_each(|x| *x *= inv);
    }
    acc
}

/// Blocks ahead whose K and V a decode task asks for while it computes the current one. Measured
/// with the ignored `decode_attention_throughput` (16 sequences at 720 positions, 30 layers;
/// variants alternating in one process): two blocks ahead into L2 is 6–15% faster than one block
/// ahead into L1; three ahead, or L1 hints added for the next block, no better.
const AHEAD: usize = 2;

/// Asks for `run` (a KV head's part of a block) to be brought into L2.
#[inline(always)]
fn prefetch(run: &[half::f16]) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..run.len()).step_by(32) {
        // SAFETY: a prefetch never faults; the address is inside `run`.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(run.as_ptr().add(off) as *const i8);
        }
    }
}

/// Few query rows (decode): each block's K and V converted once, then an online softmax
/// (running max and sum) per (row, head). Head widths that are a multiple of 8 up to 128 (every
/// model we load) take [`online_block`]; others a plain loop with the same order of operations.
#[inline(always)]
fn attend_online(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32]) -> Vec<f32> {
    let (hd, d) = (job.hd, job.d);
    let bs = job.cache.layout().block_size;
    let w = job.heads.len();
    let n_q = rows.len() * w;
    let max_pos = rows.iter().map(|r| r.1).max().unwrap_or(0);
    let mut m = vec![f32::NEG_INFINITY; n_q];
    let mut l = vec![0f32; n_q];
    let mut acc = vec![0f32; n_q * hd];
    let mut kb = vec![0f32; hd * bs];
    let mut vb = vec![0f32; bs * hd];
    let mut scores = vec![0f32; bs];
    for (bi, block) in job.table.blocks().iter().enumerate() {
        let p0 = bi * bs;
        if p0 > max_pos {
            break;
        }
        let slots = bs.min(max_pos + 1 - p0);
        gather_keys(job.cache, *block, job.layer, job.kvh, slots, &mut kb, bs);
        gather_values(job.cache, *block, job.layer, job.kvh, slots, &mut vb);
        for (ri, &(_, pos)) in rows.iter().enumerate() {
            if pos < p0 {
                continue;
            }
            let valid = slots.min(pos + 1 - p0);
            for (j, g) in job.heads.clone().enumerate() {
                let qi = ri * w + j;
                let qh = &q[ri * d + (job.kvh * job.group + g) * hd..][..hd];
                let (k, v, sc) = ((&kb[..], bs), &vb[..valid * hd], &mut scores[..valid]);
                let a = &mut acc[qi * hd..(qi + 1) * hd];
                match hd / 8 {
                    8 if hd == 64 => online_block::<8>(qh, k, v, sc, job.scale, &mut m[qi], &mut l[qi], a),
                    16 if hd == 128 => online_block::<16>(qh, k, v, sc, job.scale, &mut m[qi], &mut l[qi], a),
                    _ => online_block_any(qh, k, v, sc, job.scale, &mut m[qi], &mut l[qi], a),
                }
            }
        }
    }
    for (qi, a) in acc.chunks_exact_mut(hd).enumerate() {
        let inv = 1.0 / l[qi];
        a.iter_mut().for_each(|x| *x *= inv);
    }
    acc
}

/// One block of one (row, head) for a head of `8 · NC` values, keys dimension-major (`k.0[e ·
/// k.1 + s]`, as the cache holds them) and values position-major: scores eight positions at a time
/// in eight-lane partial sums (fused multiply-adds; Rust's `mul_add` is one rounding everywhere,
/// an instruction where FMA is compiled in and a correctly rounded call where not, so every path
/// gives the same bits), folded pairwise; then the online-softmax update and `acc += p · V` with
/// the accumulator held in registers across the block's positions.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn online_block<const NC: usize>(
    q: &[f32],
    (k, ks): (&[f32], usize),
    v: &[f32],
    scores: &mut [f32],
    scale: f32,
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
) {
    let hd = 8 * NC;
    let qv: [[f32; 8]; NC] = std::array::from_fn(|c| std::array::from_fn(|i| q[8 * c + i]));
    let n = scores.len();
    let mut s0 = 0;
    while s0 < n {
        let np = (n - s0).min(8);
        let mut part = [[0f32; 8]; 8];
        for (c, qc) in qv.iter().enumerate() {
            for (p, pp) in part.iter_mut().enumerate().take(np) {
                for i in 0..8 {
                    pp[i] = k[(8 * c + i) * ks + s0 + p].mul_add(qc[i], pp[i]);
                }
            }
        }
        for (p, pp) in part.iter().enumerate().take(np) {
            scores[s0 + p] = fold8(pp) * scale;
        }
        s0 += np;
    }
    let (sum, correction) = softmax_step(scores, m, l);
    let mut a: [[f32; 8]; NC] = std::array::from_fn(|c| std::array::from_fn(|i| acc[8 * c + i] * correction));
    for (s, &wt) in scores.iter().enumerate() {
        for (c, ac) in a.iter_mut().enumerate() {
            let vr = &v[s * hd + 8 * c..][..8];
            for i in 0..8 {
                ac[i] = wt.mul_add(vr[i], ac[i]);
            }
        }
    }
    for (c, ac) in a.iter().enumerate() {
        acc[8 * c..8 * c + 8].copy_from_slice(ac);
    }
    *l = sum;
}

/// [`online_block`] for any head width, with the same operations in the same order.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn online_block_any(
    q: &[f32],
    (k, ks): (&[f32], usize),
    v: &[f32],
    scores: &mut [f32],
    scale: f32,
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
) {
    let hd = q.len();
    for (s, sc) in scores.iter_mut().enumerate() {
        let mut part = [0f32; 8];
        for (e, &qx) in q.iter().enumerate() {
            part[e % 8] = k[e * ks + s].mul_add(qx, part[e % 8]);
        }
        *sc = fold8(&part) * scale;
    }
    let (sum, correction) = softmax_step(scores, m, l);
    acc.iter_mut().for_each(|x| *x *= correction);
    for (s, &wt) in scores.iter().enumerate() {
        for (x, &vx) in acc.iter_mut().zip(&v[s * hd..(s + 1) * hd]) {
            *x = wt.mul_add(vx, *x);
        }
    }
    *l = sum;
}

/// `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`.
#[inline(always)]
fn fold8(p: &[f32; 8]) -> f32 {
    ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
}

/// The online softmax's update for a block's `scores`: turns them into `e^(s - m')` for the new
/// running max `m'`, stores `m'`, and returns the new running sum and the factor the accumulator
/// must be scaled by (`e^(m - m')`).
#[inline(always)]
fn softmax_step(scores: &mut [f32], m: &mut f32, l: &f32) -> (f32, f32) {
    let bmax = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    softmax_step_max(scores, bmax, m, l)
}

/// [`softmax_step`] with the block's largest score `bmax` already known (the maximum of finite
/// values does not depend on the order it is taken in).
#[inline(always)]
pub(super) fn softmax_step_max(scores: &mut [f32], bmax: f32, m: &mut f32, l: &f32) -> (f32, f32) {
    let new_m = m.max(bmax);
    let correction = math::exp(*m - new_m);
    let sum = l * correction + math::exp_shift_sum(scores, new_m);
    *m = new_m;
    (sum, correction)
}

/// [`attend_task`] for many query rows (prefill): the sequence's K and V for this head are
/// gathered to f32 once, then `S = Q·Kᵀ` and `O = softmax(S)·V` run as two GEMMs on the calling
/// thread (the tasks themselves are the parallelism), with the causal mask applied to `S`.
fn attend_task_gemm(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32], max_pos: usize) -> Vec<f32> {
    let n_pos = max_pos + 1;
    let n_q = rows.len() * job.group;
    let values = 2 * job.hd * n_pos + n_q * job.hd + n_q * n_pos;
    with_kept(&SCRATCH, values <= SCRATCH_MAX, |s| attend_gemm_in(job, rows, q, n_pos, s))
}

thread_local! {
    /// [`attend_task_gemm`]'s Kᵀ, V, queries and scores, kept between tasks on each thread
    /// (up to [`SCRATCH_MAX`] values): every value a task reads it has written first, and fresh
    /// zeroed buffers — ~1 MB a task at 512 positions, ~400 MB over a 512-token prefill — cost
    /// 3–4% of a prefill (512 and 2048 tokens, Q4_1 and Q4_K_M, fresh and kept alternating in one
    /// process, ten prefills per figure).
    static SCRATCH: std::cell::RefCell<[Vec<f32>; 4]> = const { std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()]) };
}

/// [`attend_task_gemm`] with its buffers in `s` (grown as needed, never shrunk).
fn attend_gemm_in(
    job: &Job<'_>,
    rows: &[(usize, usize)],
    q: &[f32],
    n_pos: usize,
    s: &mut [Vec<f32>; 4],
) -> Vec<f32> {
    let Job { cache, table, layer, kvh, group, hd, scale, d, .. } = *job;
    let bs = cache.layout().block_size;
    let [kt, v, qm, sc] = s;
    // Kᵀ (`[hd × n_pos]`, the cache's own orientation) and V (`[n_pos × hd]`).
    let kt = sized(kt, hd * n_pos);
    let v = sized(v, n_pos * hd);
    for (bi, block) in table.blocks().iter().enumerate().take(n_pos.div_ceil(bs)) {
        let p0 = bi * bs;
        let slots = bs.min(n_pos - p0);
        gather_keys(cache, *block, layer, kvh, slots, &mut kt[p0..], n_pos);
        gather_values(cache, *block, layer, kvh, slots, &mut v[p0 * hd..(p0 + slots) * hd]);
    }
    // Query rows ordered (row, head-in-group), matching the output layout, pre-scaled by
    // 1/sqrt(hd) so the scores come out of the GEMM ready for the softmax.
    let n_q = rows.len() * group;
    let qm = sized(qm, n_q * hd);
    for ri in 0..rows.len() {
        for g in 0..group {
            let src = &q[ri * d + (kvh * group + g) * hd..][..hd];
            for (o, &x) in qm[(ri * group + g) * hd..(ri * group + g + 1) * hd].iter_mut().zip(src) {
                *o = x * scale;
            }
        }
    }
    let sc = sized(sc, n_q * n_pos);
    let mut out = vec![0f32; n_q * hd];
    // Rows in runs of `SUB`, each against only the positions its last row sees: causal rows of a
    // 512-token prompt in tasks of 128 need 25% fewer scores than the task's whole square.
    let mut sums = vec![0f32; n_q];
    for r0 in (0..rows.len()).step_by(SUB) {
        let r1 = (r0 + SUB).min(rows.len());
        let n_sub = rows[r0..r1].iter().map(|r| r.1).max().unwrap_or(0) + 1;
        let (q0, q1) = (r0 * group, r1 * group);
        let seq = gemm::Parallelism::None;
        // S = Q·Kᵀ over the first `n_sub` columns of Kᵀ, into rows of stride `n_pos`.
        let scores = &mut sc[q0 * n_pos..];
        gemm_strided((q1 - q0, n_sub, hd), (scores, n_pos), (&qm[q0 * hd..q1 * hd], hd), (kt, n_pos, 1), seq);
        // Unnormalized probabilities; each output row is divided by its sum after P·V (hd
        // values per row instead of n_sub).
        for (qi, sum) in (q0..q1).zip(&mut sums[q0..q1]) {
            let pos = rows[qi / group].1;
            let (live, masked) = sc[qi * n_pos..qi * n_pos + n_sub].split_at_mut(pos + 1);
            masked.iter_mut().for_each(|x| *x = 0.0);
            *sum = math::exp_shift_sum(live, math::max(live));
        }
        let o = &mut out[q0 * hd..q1 * hd];
        gemm_strided((q1 - q0, hd, n_sub), (o, hd), (&sc[q0 * n_pos..], n_pos), (v, hd, 1), seq);
    }
    for (o, &sum) in out.chunks_exact_mut(hd).zip(&sums) {
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
    out
}

/// Query rows per score block of [`attend_gemm_in`]: each block's scores stop at its own last
/// row's position. Against 128 (one block a task: the whole square), 512-token prefills ran
/// 1.9% and 6.0% faster (Q4_1) and 5.7% (Q4_K_M), the median of six each, the two alternating in
/// one process with their order rotated every round; 64 gained 3.7%; 2048-token prefills (6% of
/// their scores above the diagonal, not 25%) did not move.
const SUB: usize = 32;

/// Converts the keys of the first `slots` positions of KV head `kvh` in one block from f16 to
/// f32, dimension-major as the cache holds them: dimension `e` of slot `s` to `kt[e · stride + s]`.
fn gather_keys(
    cache: &KvCache,
    block: BlockId,
    layer: usize,
    kvh: usize,
    slots: usize,
    kt: &mut [f32],
    stride: usize,
) {
    let (bs, hd) = (cache.layout().block_size, cache.layout().head_dim);
    let at = math::Rows { first: 0, stride: bs, len: slots, count: hd, out_stride: stride };
    math::f16_rows_to_f32(cache.k_head(block, layer, kvh), at, kt);
}

/// Converts the values of the first `slots` positions of KV head `kvh` in one block from f16 to
/// f32 into `v` (`slots × hd`).
fn gather_values(cache: &KvCache, block: BlockId, layer: usize, kvh: usize, slots: usize, v: &mut [f32]) {
    let n = slots * cache.layout().head_dim;
    let at = math::Rows { first: 0, stride: n, len: n, count: 1, out_stride: n };
    math::f16_rows_to_f32(cache.v_head(block, layer, kvh), at, v);
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
