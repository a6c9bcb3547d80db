//! Causal attention over the paged KV cache, the only per-sequence part of the forward pass:
//! split into tasks of (sequence, KV head, query rows) so a long prefill and a wide decode batch
//! both spread over every core; few query rows (decode) take two passes over the blocks — every
//! score, one softmax, then `P·V` — many (prefill) two products over the gathered K and V
//! (`attention_gemm.rs`). Apart from `forward.rs` because it is a kernel of its own with its own
//! CPU paths and tests.

use super::attention_gemm::matmul;
use super::forward::{sized, with_kept, GEMM_MIN_ROWS, SCRATCH_MAX};
use super::math;
use crate::kv_cache::{BlockId, BlockTable, KvCache};
use crate::model::BatchItem;

/// Causal attention for every stacked row and query head; returns `[T × n_head·hd]`.
///
/// Work is split into tasks of (sequence, KV head, up to 128 query rows), so a long prefill and a
/// wide decode batch both spread over every core. A task's K and V for its head are converted
/// from f16 to f32 once for every query head of the group (in registers, block by block, on the
/// AVX2 and AVX-512 decode paths), so the cost is the arithmetic, not the conversions.
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
    bf16: bool,
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
        let job = Job { cache, table, layer, kvh: *kvh, group, heads: heads.clone(), hd, scale, d, bf16 };
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
    /// Prefill products on bf16 tiles (`attention_amx.rs`), where the CPU has them.
    bf16: bool,
}

/// The decode attention kernels, by CPU path (capped with the products' by `TOKENPATH_KERNEL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// Blocks converted to f32, then [`attend_decode`]'s plain loops.
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
    attend_decode_path(job, rows, q, Path::best())
}

/// A sequence's blocks for one layer and KV head, in order: each one's keys (`hd × bs`,
/// dimension-major) and values (`bs × hd`), read in place from the cache.
pub(super) type Blocks<'a> = [(&'a [half::f16], &'a [half::f16])];

/// [`attend_decode`] on `path`: for heads of 64 or 128 values on AVX2 or AVX-512 the cache's
/// f16 blocks are read in place by `attention_avx2.rs` / `attention_avx512.rs`; otherwise the
/// portable walk. All give the portable path's bits.
fn attend_decode_path(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32], path: Path) -> Vec<f32> {
    let (hd, d) = (job.hd, job.d);
    if path == Path::Portable || (hd != 64 && hd != 128) {
        return attend_decode(job, rows, q);
    }
    let bs = job.cache.layout().block_size;
    let w = job.heads.len();
    let mut out = vec![0f32; rows.len() * w * hd];
    // A row's query heads of this group are side by side in `q`: each kernel call takes a run.
    let g0 = job.kvh * job.group + job.heads.start;
    for (ri, &(_, pos)) in rows.iter().enumerate() {
        let n = pos + 1;
        let blocks: Vec<_> = job.table.blocks()[..n.div_ceil(bs)]
            .iter()
            .map(|b| (job.cache.k_head(*b, job.layer, job.kvh), job.cache.v_head(*b, job.layer, job.kvh)))
            .collect();
        let mut scores = vec![0f32; w.min(3) * n];
        let qs = &q[ri * d + g0 * hd..][..w * hd];
        let mut j = 0;
        while j < w {
            let nh = if path == Path::Avx512 { (w - j).min(3) } else { 1 };
            let (qj, oj) = (&qs[j * hd..(j + nh) * hd], &mut out[(ri * w + j) * hd..(ri * w + j + nh) * hd]);
            // SAFETY: the path was picked from the detected CPU (`Path::best`, or a test that
            // checked it); every block is a whole one of the cache and they cover `n`
            // positions; the kernels assert the slice lengths.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                use super::{attention_avx2 as a2, attention_avx512 as a5};
                let (sc, scale) = (&mut scores[..nh * n], job.scale);
                // One call per kernel instance: (heads of 8·NC values, NH heads per call).
                macro_rules! avx512 {
                    ($nc:literal, $nh:literal) => {
                        a5::attend_f16::<$nc, $nh>(qj, &blocks, bs, n, scale, sc, oj)
                    };
                }
                match (path, hd, nh) {
                    (Path::Avx512, 64, 3) => avx512!(8, 3),
                    (Path::Avx512, 64, 2) => avx512!(8, 2),
                    (Path::Avx512, 64, _) => avx512!(8, 1),
                    (Path::Avx512, _, 3) => avx512!(16, 3),
                    (Path::Avx512, _, 2) => avx512!(16, 2),
                    (Path::Avx512, _, _) => avx512!(16, 1),
                    (_, 64, _) => a2::attend_f16::<8>(qj, &blocks, bs, n, scale, sc, oj),
                    (_, _, _) => a2::attend_f16::<16>(qj, &blocks, bs, n, scale, sc, oj),
                }
            }
            j += nh;
        }
    }
    out
}

/// The decode kernels' operand check (`attention_avx2.rs`, `attention_avx512.rs`): `nh` heads of
/// `hd` values in `q` and `out`, `n > 0` positions covered by whole `bs`-slot blocks, `n` scores
/// per head.
pub(super) fn assert_operands(
    (hd, nh, bs, n): (usize, usize, usize, usize),
    q: &[f32],
    blocks: &Blocks<'_>,
    scores: &[f32],
    out: &[f32],
) {
    assert!(
        n > 0
            && n <= blocks.len() * bs
            && blocks.iter().all(|(k, v)| k.len() >= hd * bs && v.len() >= bs * hd)
            && q.len() >= nh * hd
            && scores.len() >= nh * n
            && out.len() >= nh * hd,
        "decode attention operand sizes"
    );
}

/// Every decode-attention path this CPU runs (for the tests).
#[cfg(test)]
pub(super) fn available_paths() -> Vec<Path> {
    use crate::quant::Kernel;
    let mut p = vec![Path::Portable];
    if Kernel::Avx2.is_available() {
        p.push(Path::Avx2);
    }
    if Kernel::Avx512.is_available() {
        p.push(Path::Avx512);
    }
    p
}

/// Blocks ahead whose K (while scoring) or V (while summing) a decode task asks for while it
/// computes the current one. Measured with the ignored `decode_attention_throughput` (16
/// sequences at 720 positions, 30 layers; variants alternating in one process) on the earlier
/// one-pass kernel: two blocks ahead into L2 was 6–15% faster than one block ahead into L1; three
/// ahead, or L1 hints added for the next block, no better. With the requests spread over the
/// block's work ([`ahead`], AVX-512) one to four ahead measure within noise of each other.
pub(super) const AHEAD: usize = 2;

/// Asks for the keys (`keys`) or values of `blocks[range]` (those that exist) to be brought
/// into L2: a sequence's next blocks are elsewhere in the cache, where no hardware prefetcher
/// looks. (The AVX-512 kernel does so only for a pass's first blocks, before there is work to
/// spread its requests over.)
#[inline(always)]
pub(super) fn prefetch_blocks(blocks: &Blocks<'_>, range: std::ops::Range<usize>, keys: bool) {
    for bi in range {
        if let Some(&(k, v)) = blocks.get(bi) {
            let run = if keys { k } else { v };
            prefetch_lines(Some(run), 0, run.len());
        }
    }
}

/// Block `bi + AHEAD`'s keys (`keys`) or values, if there is one: what the AVX-512 kernel,
/// working on block `bi`, asks for line by line ([`prefetch_line`]) as it goes through the same
/// lines of its own. Asking for a whole 2 KB run at once stalled on the CPU's outstanding-miss
/// limit (under `perf`, a third of the kernel's samples sat on the prefetch instructions); with
/// the requests spread over the block's work, 16 sequences' attention over 30 layers ran 6%
/// faster from memory and 14% from the caches (`decode_attention_throughput`, the two builds
/// alternating, three rounds). The AVX2 kernel, which reads each block once per query head,
/// ran 15–25% slower that way and keeps [`prefetch_blocks`].
#[inline(always)]
pub(super) fn ahead<'a>(blocks: &Blocks<'a>, bi: usize, keys: bool) -> Option<&'a [half::f16]> {
    blocks.get(bi + AHEAD).map(|&(k, v)| if keys { k } else { v })
}

/// Prefetches into L2 the 64-byte lines of `run` that start within its values `at..at + len`
/// (so parts that tile a run ask for each of its lines once).
#[inline(always)]
pub(super) fn prefetch_lines(run: Option<&[half::f16]>, at: usize, len: usize) {
    let Some(run) = run else { return };
    let (mut off, end) = ((2 * at).next_multiple_of(64), 2 * (at + len).min(run.len()));
    while off < end {
        prefetch_line(run, off / 2);
        off += 64;
    }
}

/// Prefetches into L2 the line holding value `at` of `run` (nothing past its end).
#[inline(always)]
pub(super) fn prefetch_line(run: &[half::f16], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < run.len() {
        // SAFETY: a prefetch never faults; the address is inside `run`.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(run.as_ptr().add(at) as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (run, at);
}

/// Few query rows (decode), the portable path and the reference the others match bit for bit:
/// per row and query head, the scores of every position (each block's keys converted to f32
/// once for all heads), one softmax over them all — the largest score, `e^(s - max)` summed in
/// sixteen lanes ([`math::exp_shift_sum16`]) — then `acc = fma(p, v, acc)` position by position
/// and `acc · (1 / sum)`. Two passes over the blocks rather than an online softmax per block:
/// the per-block rescaling of the output and the block-sized exponentials cost more than
/// the scores kept between the passes (`n` values per head).
fn attend_decode(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32]) -> Vec<f32> {
    let (hd, d) = (job.hd, job.d);
    let bs = job.cache.layout().block_size;
    let w = job.heads.len();
    let mut out = vec![0f32; rows.len() * w * hd];
    let mut kb = vec![0f32; hd * bs];
    let mut vb = vec![0f32; bs * hd];
    for (ri, &(_, pos)) in rows.iter().enumerate() {
        let n = pos + 1;
        let blocks = &job.table.blocks()[..n.div_ceil(bs)];
        let mut scores = vec![0f32; w * n];
        for (bi, block) in blocks.iter().enumerate() {
            let (p0, slots) = (bi * bs, bs.min(n - bi * bs));
            gather_keys(job.cache, *block, job.layer, job.kvh, slots, &mut kb, bs);
            for (j, g) in job.heads.clone().enumerate() {
                let qh = &q[ri * d + (job.kvh * job.group + g) * hd..][..hd];
                for s in 0..slots {
                    let mut part = [0f32; 8];
                    for (e, &qx) in qh.iter().enumerate() {
                        part[e % 8] = kb[e * bs + s].mul_add(qx, part[e % 8]);
                    }
                    scores[j * n + p0 + s] = math::fold8(&part) * job.scale;
                }
            }
        }
        let sums: Vec<f32> = scores
            .chunks_exact_mut(n)
            .map(|sc| {
                let max = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                math::exp_shift_sum16(sc, max)
            })
            .collect();
        let acc = &mut out[ri * w * hd..(ri + 1) * w * hd];
        for (bi, block) in blocks.iter().enumerate() {
            let (p0, slots) = (bi * bs, bs.min(n - bi * bs));
            gather_values(job.cache, *block, job.layer, job.kvh, slots, &mut vb[..slots * hd]);
            for (j, a) in acc.chunks_exact_mut(hd).enumerate() {
                for s in 0..slots {
                    let p = scores[j * n + p0 + s];
                    for (x, &vx) in a.iter_mut().zip(&vb[s * hd..(s + 1) * hd]) {
                        *x = p.mul_add(vx, *x);
                    }
                }
            }
        }
        for (a, sum) in acc.chunks_exact_mut(hd).zip(sums) {
            let inv = 1.0 / sum;
            a.iter_mut().for_each(|x| *x *= inv);
        }
    }
    out
}

/// [`attend_task`] for many query rows (prefill): the sequence's K and V for this head are
/// gathered to f32 once, then `S = Q·Kᵀ` and `O = softmax(S)·V` run as two GEMMs on the calling
/// thread (the tasks themselves are the parallelism), with the causal mask applied to `S`.
fn attend_task_gemm(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32], max_pos: usize) -> Vec<f32> {
    let n_pos = max_pos + 1;
    let n_q = rows.len() * job.group;
    let values = 2 * job.hd * n_pos + n_q * job.hd + n_q * n_pos;
    with_kept(&SCRATCH, values <= SCRATCH_MAX, |s| attend_gemm_in(job, rows, q, n_pos, Path::best(), s))
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
    path: Path,
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
    if job.bf16 && super::attention_amx::usable(hd) {
        let task = super::attention_amx::Task { rows, group, n_pos, hd, sub: SUB };
        return super::attention_amx::attend(&task, qm, kt, v, sc, path);
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
        // S = Q·Kᵀ over the first `n_sub` columns of Kᵀ, into rows of stride `n_pos`.
        let scores = &mut sc[q0 * n_pos..];
        matmul(path, (q1 - q0, n_sub, hd), (scores, n_pos), (&qm[q0 * hd..q1 * hd], hd), (kt, n_pos));
        // Unnormalized probabilities; each output row is divided by its sum after P·V (hd
        // values per row instead of n_sub).
        for (qi, sum) in (q0..q1).zip(&mut sums[q0..q1]) {
            let pos = rows[qi / group].1;
            let (live, masked) = sc[qi * n_pos..qi * n_pos + n_sub].split_at_mut(pos + 1);
            masked.iter_mut().for_each(|x| *x = 0.0);
            *sum = exp_sum(path, live, math::max(live));
        }
        let o = &mut out[q0 * hd..q1 * hd];
        matmul(path, (q1 - q0, hd, n_sub), (o, hd), (&sc[q0 * n_pos..], n_pos), (v, hd));
    }
    for (o, &sum) in out.chunks_exact_mut(hd).zip(&sums) {
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
    out
}

/// [`math::exp_shift_sum16`] on `path` (the same bits on each).
pub(super) fn exp_sum(path: Path, xs: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: the path was picked from the detected CPU (`Path::best`, or a test that
        // checked it).
        Path::Avx512 => return unsafe { math::exp_shift_sum16_avx512(xs, max) },
        Path::Avx2 => return unsafe { math::exp_shift_sum16_avx2(xs, max) },
        Path::Portable => {}
    }
    let _ = path;
    math::exp_shift_sum16(xs, max)
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
