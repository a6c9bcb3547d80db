//! The forward pass over a batch of sequences, each contributing any number of new tokens (a
//! prefill chunk) or exactly one (a decode step). All new tokens of the batch are stacked into one
//! `[T × d]` activation so every weight matrix is streamed from memory once per call, whatever the
//! mix; attention is the only per-sequence part and runs in parallel over (token, head).

use super::{ggml, math, Mat, Model, Numerics};
use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockId, BlockTable, KvCache};
use crate::quant::{matmul_group, matmul_group_interleaved, Interleaved, QMatrix};
use rayon::prelude::*;

/// One sequence's part of a forward call.
#[derive(Debug)]
pub struct BatchItem<'a> {
    /// The sequence's blocks; the new tokens go at positions `table.len()..`.
    pub table: &'a mut BlockTable,
    /// New tokens to run.
    pub tokens: &'a [u32],
    /// Return logits for every new token (scoring, parity checks), not only the last.
    pub all_logits: bool,
}

/// Logits per batch item: one row of `n_vocab` for the last token, or one per token.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// `logits[item]` is `rows × n_vocab`, row-major.
    pub logits: Vec<Vec<f32>>,
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (ms + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// `(sin, cos)` of every rotated pair at each position in `positions`: `rope_dims / 2` entries
/// per position. Computed once per forward call and shared by every layer (the angles depend on
/// the position only), instead of a `powf` and a `sin_cos` per pair, head and layer.
fn rope_table(positions: impl Iterator<Item = usize>, rope_dims: usize, base: f32) -> Vec<(f32, f32)> {
    let inv: Vec<f32> =
        (0..rope_dims).step_by(2).map(|i| base.powf(-(i as f32) / rope_dims as f32)).collect();
    positions.flat_map(|pos| inv.iter().map(move |&f| (pos as f32 * f).sin_cos())).collect()
}

/// Rotates adjacent pairs (ggml's "normal" RoPE, which Llama GGUF files are converted for) with
/// one position's entries of [`rope_table`].
fn rope(x: &mut [f32], head_dim: usize, table: &[(f32, f32)]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, &(s, c)) in head.chunks_exact_mut(2).zip(table) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
    }
}

/// From this many stacked rows on, a linear layer dequantizes its weights and runs an f32 GEMM
/// (compute-bound prefill); below it, the integer matvec kernels on the quantized weights win
/// (bandwidth-bound decode, where dequantizing the whole matrix would cost more than the product).
const GEMM_MIN_ROWS: usize = 32;

/// `y[t × n] = x[t × k] · wᵀ` with `w` row-major `[n × k]`, on every thread of the current pool.
pub(crate) fn gemm_xwt(x: &[f32], w: &[f32], y: &mut [f32], t: usize, n: usize, k: usize) {
    gemm_into(x, w, y, t, n, k, true, gemm::Parallelism::Rayon(rayon::current_num_threads()));
}

/// `y[m × n] = x[m × k] · (bᵀ if b_is_nk else b)`, with `b` row-major `[n × k]` when transposed,
/// `[k × n]` otherwise. The one call site of the `gemm` crate.
#[allow(clippy::too_many_arguments)]
fn gemm_into(
    x: &[f32],
    b: &[f32],
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    b_is_nk: bool,
    par: gemm::Parallelism,
) {
    assert!(x.len() == m * k && b.len() == n * k && y.len() == m * n, "gemm operand sizes");
    let (b_cs, b_rs) = if b_is_nk { (k as isize, 1) } else { (1, n as isize) };
    // SAFETY: the assert above guarantees the slices have exactly the sizes these strides
    // address: dst m × n row-major (col stride 1, row stride n), lhs m × k row-major, rhs k × n
    // read through (b_rs, b_cs). `read_dst = false`, so `y`'s old contents are never read.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

impl Model {
    /// `y[T × rows] = W · x[T × cols]` for every row of `x`.
    fn linear(&self, w: &Mat, x: &[f32], t: usize) -> Result<Vec<f32>> {
        Ok(self.linears(&[w], x, t)?.pop().unwrap_or_default())
    }

    /// [`Model::linear`] for several matrices reading the same `x` (Q, K and V; gate and up):
    /// `x` is quantized once per activation kind and the matrices sharing it run as one parallel
    /// region. Matrices with a repacked copy (Q4_1, Q8_0) always run the 8-row integer tiles —
    /// for prefill too: they beat dequantize + f32 GEMM on this CPU class (measured: 600 vs 530
    /// prompt tok/s at 512 tokens), and one kernel for every batch size means a prompt's logits
    /// do not depend on its chunking or on a prefix-cache hit. Other types take dequantize + f32
    /// GEMM from [`GEMM_MIN_ROWS`] rows on.
    fn linears(&self, ws: &[&Mat], x: &[f32], t: usize) -> Result<Vec<Vec<f32>>> {
        let mats = ws.iter().map(|w| self.q(w)).collect::<Result<Vec<QMatrix<'_>>>>()?;
        if self.numerics == Numerics::Ggml {
            return mats.iter().map(|m| ggml::linear(m, x, t)).collect();
        }
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; t * m.rows()]).collect();
        let mut done = vec![false; mats.len()];
        for (i, m) in mats.iter().enumerate() {
            if t >= GEMM_MIN_ROWS && ws[i].interleaved.is_none() {
                with_dequantized(m, |wf| gemm_xwt(x, wf, &mut ys[i], t, m.rows(), m.cols()))?;
                done[i] = true;
            }
        }
        // Repacked copies first, all in one parallel region; then the rest, one region per
        // activation kind.
        let repacked = |i: usize| ws[i].interleaved.is_some();
        while let Some(first) = done.iter().position(|d| !d) {
            let key = (repacked(first), mats[first].ty().activation_kind());
            let group: Vec<usize> = (first..mats.len())
                .filter(|&i| !done[i] && (repacked(i), mats[i].ty().activation_kind()) == key)
                .collect();
            let acts = mats[first].prepare_rows(x)?;
            let mut outs: Vec<&mut [f32]> = ys
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| group.contains(i))
                .map(|(_, y)| y.as_mut_slice())
                .collect();
            if key.0 {
                let gm: Vec<&Interleaved> =
                    group.iter().filter_map(|&i| ws[i].interleaved.as_deref()).collect();
                matmul_group_interleaved(&gm, &acts, &mut outs)?;
            } else {
                let gm: Vec<QMatrix<'_>> = group.iter().map(|&i| mats[i]).collect();
                matmul_group(&gm, &acts, &mut outs)?;
            }
            group.iter().for_each(|&i| done[i] = true);
        }
        Ok(ys)
    }

    /// Runs the new tokens of every item, writes their K/V into `cache`, and returns logits.
    /// All or nothing: on error (context overflow, unknown token, KV cache full) no table grows
    /// and no block stays allocated.
    pub fn forward(&self, cache: &mut KvCache, batch: &mut [BatchItem<'_>]) -> Result<ForwardOutput> {
        let c = &self.config;
        for item in batch.iter() {
            if item.tokens.is_empty() {
                return Err(EngineError::InvalidArgument("a batch item has no tokens".into()));
            }
            let end = item.table.len() + item.tokens.len();
            if end > c.n_ctx {
                return Err(EngineError::ContextOverflow { tokens: end, limit: c.n_ctx });
            }
            if let Some(&bad) = item.tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
                return Err(EngineError::InvalidArgument(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    c.n_vocab
                )));
            }
        }
        let before: Vec<usize> = batch.iter().map(|i| i.table.blocks().len()).collect();
        let reserved = batch.iter_mut().try_for_each(|i| {
            let end = i.table.len() + i.tokens.len();
            cache.reserve(i.table, end)
        });
        if let Err(e) = reserved {
            for (item, n) in batch.iter_mut().zip(&before) {
                cache.truncate_blocks(item.table, *n);
            }
            return Err(e);
        }
        self.pool.install(|| self.forward_reserved(cache, batch))
    }

    fn forward_reserved(&self, cache: &mut KvCache, batch: &mut [BatchItem<'_>]) -> Result<ForwardOutput> {
        let c = &self.config;
        let (d, kv, hd) = (c.n_embd, c.kv_dim(), c.head_dim);
        // (item, position) of every stacked row.
        let rows: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .flat_map(|(i, it)| (0..it.tokens.len()).map(move |k| (i, it.table.len() + k)))
            .collect();
        let t = rows.len();
        let emb = self.q(&self.token_embd)?;
        let mut x = vec![0f32; t * d];
        for (row, tok) in x.chunks_exact_mut(d).zip(batch.iter().flat_map(|it| it.tokens.iter())) {
            emb.dequantize_row(*tok as usize, row)?;
        }
        let mut xn = vec![0f32; t * d];
        let group = c.n_head / c.n_head_kv;
        let half = c.rope_dims / 2;
        let exact = self.numerics == Numerics::Ggml;
        let rms_norm = if exact { ggml::rms_norm } else { rms_norm };
        let rope = if exact { ggml::rope } else { rope };
        let positions = rows.iter().map(|r| r.1);
        let rope_at = if exact {
            ggml::rope_table(positions, c.rope_dims, c.rope_base)
        } else {
            rope_table(positions, c.rope_dims, c.rope_base)
        };
        for (l, layer) in self.layers.iter().enumerate() {
            for (o, r) in xn.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                rms_norm(r, &layer.attn_norm, c.rms_eps, o);
            }
            let mut qkv = self.linears(&[&layer.wq, &layer.wk, &layer.wv], &xn, t)?.into_iter();
            let (mut q, mut k, v) = (next(&mut qkv), next(&mut qkv), next(&mut qkv));
            for (r, &(_, pos)) in rows.iter().enumerate() {
                let angles = &rope_at[r * half..(r + 1) * half];
                rope(&mut q[r * d..(r + 1) * d], hd, angles);
                rope(&mut k[r * kv..(r + 1) * kv], hd, angles);
                let item = &batch[rows[r].0];
                cache.write(item.table, l, pos, &k[r * kv..(r + 1) * kv], &v[r * kv..(r + 1) * kv]);
            }
            let attn = if exact {
                ggml::attention(&*cache, batch, &rows, &q, l, c.n_head, group, hd)
            } else {
                attention(&*cache, batch, &rows, &q, l, c.n_head, group, hd)
            };
            let o = self.linear(&layer.wo, &attn, t)?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            for (o, r) in xn.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                rms_norm(r, &layer.ffn_norm, c.rms_eps, o);
            }
            let mut gu = self.linears(&[&layer.w_gate, &layer.w_up], &xn, t)?.into_iter();
            let (gate, up) = (next(&mut gu), next(&mut gu));
            let h = if exact { ggml::silu_mul(&gate, &up) } else { math::silu_mul(&gate, &up) };
            let down = self.linear(&layer.w_down, &h, t)?;
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        for item in batch.iter_mut() {
            let n = item.tokens.len();
            cache.advance(item.table, n);
        }
        // Output head only for the rows whose logits are wanted, all items in one product so the
        // vocabulary matrix (the largest in the model) is streamed once per step, not per item.
        let mut wanted = Vec::with_capacity(batch.len());
        let mut first = 0;
        for item in batch.iter() {
            let n = item.tokens.len();
            wanted.push(if item.all_logits { first..first + n } else { first + n - 1..first + n });
            first += n;
        }
        let n_rows: usize = wanted.iter().map(|r| r.len()).sum();
        let mut normed = vec![0f32; n_rows * d];
        let rows_out = wanted.iter().flat_map(|r| r.clone());
        for (o, r) in normed.chunks_exact_mut(d).zip(rows_out) {
            rms_norm(&x[r * d..(r + 1) * d], &self.output_norm, c.rms_eps, o);
        }
        let all = self.linear(&self.output, &normed, n_rows)?;
        let nv = c.n_vocab;
        let mut logits = Vec::with_capacity(batch.len());
        let mut at = 0;
        for r in &wanted {
            logits.push(all[at * nv..(at + r.len()) * nv].to_vec());
            at += r.len();
        }
        Ok(ForwardOutput { logits })
    }
}

/// Largest matrix (in elements) whose dequantized copy is kept in a per-thread scratch buffer:
/// every layer matrix of a small model, not a 50k-row vocabulary.
const SCRATCH_MAX: usize = 4 << 20;

thread_local! {
    static DEQUANT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `m` dequantized to f32, in a reused per-thread buffer (no allocation, zeroing or
/// page faults per prefill chunk) when the matrix is small enough and the buffer is free.
fn with_dequantized<R>(m: &QMatrix<'_>, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let n = m.rows() * m.cols();
    DEQUANT.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) if n <= SCRATCH_MAX => {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
            m.dequantize_into(&mut buf[..n])?;
            Ok(f(&buf[..n]))
        }
        _ => Ok(f(&m.dequantize()?)),
    })
}

/// The next output of [`Model::linears`] (which returns exactly one per matrix asked for).
fn next(it: &mut std::vec::IntoIter<Vec<f32>>) -> Vec<f32> {
    it.next().unwrap_or_default()
}

/// Causal attention for every stacked row and query head; returns `[T × n_head·hd]`.
///
/// Work is split into tasks of (sequence, KV head, up to 32 query rows), so a long prefill and a
/// wide decode batch both spread over every core. Each task walks the sequence's KV blocks once:
/// a block's K and V for that head are converted from f16 to f32 once and reused by every query
/// row and every query head of the group, with an online softmax (running max and sum), so the
/// cost is the arithmetic, not the conversions.
#[allow(clippy::too_many_arguments)]
fn attention(
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
    // Too few tasks to keep every thread busy (a decode step of a few sequences has one per KV
    // head): one task per query head instead, for the rows below the GEMM path. Each head's
    // arithmetic is the same either way; only its block conversions are repeated.
    if tasks.len() < 4 * rayon::current_num_threads() && group > 1 {
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
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|(i, kvh, r0, nr, heads)| {
            let table: &BlockTable = &*batch[*i].table;
            let job = Job { cache, table, layer, kvh: *kvh, group, heads: heads.clone(), hd, scale, d };
            attend_task(&job, &rows[*r0..r0 + nr], &q[r0 * d..(r0 + nr) * d])
        })
        .collect();
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

/// One task of [`attention`]: rows `rows` (all of one sequence) × query heads `job.heads` of KV
/// head `job.kvh`'s group. Returns `[rows × heads × hd]`. On AVX2 + FMA + F16C the same code is
/// compiled with those features (wider vectors, the same operations in the same order: Rust
/// never fuses a multiply and an add on its own), so both paths give the same bits.
fn attend_task(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32]) -> Vec<f32> {
    let n_q = rows.len() * job.heads.len();
    if n_q >= GEMM_MIN_ROWS && job.heads.len() == job.group {
        let max_pos = rows.iter().map(|r| r.1).max().unwrap_or(0);
        return attend_task_gemm(job, rows, q, max_pos);
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    {
        // SAFETY: the features the function is compiled for were detected.
        return unsafe { attend_online_avx2(job, rows, q) };
    }
    attend_online(job, rows, q)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_online_avx2(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32]) -> Vec<f32> {
    attend_online(job, rows, q)
}

/// Few query rows (decode): each block's K and V converted once, then an online softmax
/// (running max and sum) per (row, head).
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
    let mut kb = vec![0f32; bs * hd];
    let mut vb = vec![0f32; bs * hd];
    let mut scores = vec![0f32; bs];
    for (bi, block) in job.table.blocks().iter().enumerate() {
        let p0 = bi * bs;
        if p0 > max_pos {
            break;
        }
        let slots = bs.min(max_pos + 1 - p0);
        gather_head(job.cache, *block, job.layer, job.kvh, hd, slots, &mut kb, &mut vb);
        for (ri, &(_, pos)) in rows.iter().enumerate() {
            if pos < p0 {
                continue;
            }
            let valid = slots.min(pos + 1 - p0);
            for (j, g) in job.heads.clone().enumerate() {
                let qi = ri * w + j;
                let qh = &q[ri * d + (job.kvh * job.group + g) * hd..][..hd];
                let mut bmax = f32::NEG_INFINITY;
                for (s, sc) in scores[..valid].iter_mut().enumerate() {
                    *sc = dot(qh, &kb[s * hd..(s + 1) * hd]) * job.scale;
                    bmax = bmax.max(*sc);
                }
                let new_m = m[qi].max(bmax);
                let correction = math::exp(m[qi] - new_m);
                let a = &mut acc[qi * hd..(qi + 1) * hd];
                if correction != 1.0 {
                    a.iter_mut().for_each(|x| *x *= correction);
                }
                let sum = l[qi] * correction + math::exp_shift_sum(&mut scores[..valid], new_m);
                for (s, &wt) in scores[..valid].iter().enumerate() {
                    axpy(wt, &vb[s * hd..(s + 1) * hd], a);
                }
                m[qi] = new_m;
                l[qi] = sum;
            }
        }
    }
    for (qi, a) in acc.chunks_exact_mut(hd).enumerate() {
        let inv = 1.0 / l[qi];
        a.iter_mut().for_each(|x| *x *= inv);
    }
    acc
}

/// [`attend_task`] for many query rows (prefill): the sequence's K and V for this head are
/// gathered to f32 once, then `S = Q·Kᵀ` and `O = softmax(S)·V` run as two GEMMs on the calling
/// thread (the tasks themselves are the parallelism), with the causal mask applied to `S`.
fn attend_task_gemm(job: &Job<'_>, rows: &[(usize, usize)], q: &[f32], max_pos: usize) -> Vec<f32> {
    let Job { cache, table, layer, kvh, group, hd, scale, d, .. } = *job;
    let bs = cache.layout().block_size;
    let n_pos = max_pos + 1;
    let mut k = vec![0f32; n_pos * hd];
    let mut v = vec![0f32; n_pos * hd];
    for (bi, block) in table.blocks().iter().enumerate().take(n_pos.div_ceil(bs)) {
        let p0 = bi * bs;
        let slots = bs.min(n_pos - p0);
        let range = p0 * hd..(p0 + slots) * hd;
        gather_head(cache, *block, layer, kvh, hd, slots, &mut k[range.clone()], &mut v[range]);
    }
    // Query rows ordered (row, head-in-group), matching the output layout, pre-scaled by
    // 1/sqrt(hd) so the scores come out of the GEMM ready for the softmax.
    let n_q = rows.len() * group;
    let mut qm = vec![0f32; n_q * hd];
    for ri in 0..rows.len() {
        for g in 0..group {
            let src = &q[ri * d + (kvh * group + g) * hd..][..hd];
            for (o, &x) in qm[(ri * group + g) * hd..(ri * group + g + 1) * hd].iter_mut().zip(src) {
                *o = x * scale;
            }
        }
    }
    let mut sc = vec![0f32; n_q * n_pos];
    gemm_serial(&qm, &k, &mut sc, n_q, n_pos, hd, true);
    // Unnormalized probabilities; each output row is divided by its sum after P·V (hd values
    // per row instead of n_pos).
    let mut sums = vec![0f32; n_q];
    for ((qi, row), sum) in sc.chunks_exact_mut(n_pos).enumerate().zip(&mut sums) {
        let pos = rows[qi / group].1;
        let (live, masked) = row.split_at_mut(pos + 1);
        masked.iter_mut().for_each(|x| *x = 0.0);
        *sum = math::exp_shift_sum(live, math::max(live));
    }
    let mut out = vec![0f32; n_q * hd];
    gemm_serial(&sc, &v, &mut out, n_q, hd, n_pos, false);
    for (o, &sum) in out.chunks_exact_mut(hd).zip(&sums) {
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
    out
}

/// Single-threaded [`gemm_into`] (attention tasks are themselves the parallelism).
fn gemm_serial(x: &[f32], b: &[f32], y: &mut [f32], m: usize, n: usize, k: usize, b_is_nk: bool) {
    gemm_into(x, b, y, m, n, k, b_is_nk, gemm::Parallelism::None);
}

/// Converts the first `slots` positions of KV head `kvh` in one block from f16 to f32, K into
/// `k` and V into `v` (`slots × hd` each): the one place attention reads the cache.
#[allow(clippy::too_many_arguments)]
fn gather_head(
    cache: &KvCache,
    block: BlockId,
    layer: usize,
    kvh: usize,
    hd: usize,
    slots: usize,
    k: &mut [f32],
    v: &mut [f32],
) {
    let kv_dim = cache.layout().kv_dim;
    let (ks, vs) = (cache.slab(block, layer, false), cache.slab(block, layer, true));
    let at = math::Rows { first: kvh * hd, stride: kv_dim, len: hd, count: slots };
    math::f16_rows_to_f32(ks, at, k);
    math::f16_rows_to_f32(vs, at, v);
}

/// Dot product with eight independent accumulators, so it vectorises and pipelines.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    s.iter().sum::<f32>() + tail
}

/// `y += a · x`.
#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvLayout;

    #[test]
    fn decode_attention_gives_the_same_bits_on_each_path_and_per_head() {
        let (hd, group, n_kv, bs) = (64, 3, 2, 16);
        let layout = KvLayout { n_layer: 1, kv_dim: n_kv * hd, block_size: bs };
        let mut cache = KvCache::new(layout, 64).unwrap();
        let mut table = BlockTable::default();
        let n = 300;
        cache.reserve(&mut table, n).unwrap();
        let val = |i: usize| ((i * 2_654_435_761 % 1000) as f32 / 500.0 - 1.0) * 0.7;
        for pos in 0..n {
            let k: Vec<f32> = (0..n_kv * hd).map(|j| val(pos * 977 + j)).collect();
            let v: Vec<f32> = (0..n_kv * hd).map(|j| val(pos * 131 + j + 7)).collect();
            cache.write(&table, 0, pos, &k, &v);
        }
        cache.advance(&mut table, n);
        let d = n_kv * group * hd;
        let rows = [(0, n - 1), (0, 140)];
        let q: Vec<f32> = (0..rows.len() * d).map(|j| val(j * 31 + 3)).collect();
        let job = |kvh, heads| Job {
            cache: &cache,
            table: &table,
            layer: 0,
            kvh,
            group,
            heads,
            hd,
            scale: 0.125,
            d,
        };
        for kvh in 0..n_kv {
            let whole = attend_online(&job(kvh, 0..group), &rows, &q);
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                // SAFETY: features detected.
                let fast = unsafe { attend_online_avx2(&job(kvh, 0..group), &rows, &q) };
                assert_eq!(bits(&fast), bits(&whole), "AVX2-compiled path");
            }
            for g in 0..group {
                let one = attend_online(&job(kvh, g..g + 1), &rows, &q);
                for r in 0..rows.len() {
                    assert_eq!(
                        bits(&one[r * hd..(r + 1) * hd]),
                        bits(&whole[(r * group + g) * hd..(r * group + g + 1) * hd]),
                        "head {g} alone, row {r}"
                    );
                }
            }
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }
}
