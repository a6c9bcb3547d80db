//! The forward pass over a batch of sequences, each contributing any number of new tokens (a
//! prefill chunk) or exactly one (a decode step). All new tokens of the batch are stacked into one
//! `[T × d]` activation so every weight matrix is streamed from memory once per call, whatever the
//! mix; attention is the only per-sequence part and runs in parallel over (token, head).

use super::attention::attention;
use super::{ggml, math, Mat, Model, Numerics};
use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockTable, KvCache};
use crate::quant::amx_bf16::{self, Bf16Matrix};
use crate::quant::{matmul_group, matmul_group_interleaved, matmul_swiglu_interleaved, Interleaved, QMatrix};
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

/// Logits per batch item — one row of `n_vocab` for the last token, or one per token — in the
/// one buffer the output product wrote: handing each item a copy of its rows was 3 MB of
/// `memcpy` a 16-sequence decode step, on the thread that runs it alone.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    logits: Vec<f32>,
    /// Where each item's rows end in `logits`.
    ends: Vec<usize>,
}

impl ForwardOutput {
    /// Batch items.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether the step had no items.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Item `i`'s logits, `rows × n_vocab`, row-major.
    pub fn item(&self, i: usize) -> &[f32] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.logits[start..self.ends[i]]
    }

    /// Every item's logits, in batch order, to sample from in place.
    pub fn items_mut(&mut self) -> Vec<&mut [f32]> {
        let mut rest = &mut self.logits[..];
        let mut start = 0;
        let mut items = Vec::with_capacity(self.ends.len());
        for &end in &self.ends {
            let (item, tail) = std::mem::take(&mut rest).split_at_mut(end - start);
            items.push(item);
            (rest, start) = (tail, end);
        }
        items
    }

    /// The first item's logits, owned (a batch of one hands over the buffer itself).
    pub fn into_first(mut self) -> Vec<f32> {
        let end = self.ends.first().copied().unwrap_or(0);
        self.logits.truncate(end);
        self.logits
    }

    /// Every item's logits, each copied out.
    pub fn into_items(self) -> Vec<Vec<f32>> {
        (0..self.len()).map(|i| self.item(i).to_vec()).collect()
    }
}

/// `x / rms(x) · w`. The squares are summed in sixteen interleaved partial sums, folded
/// pairwise: one running sum waits out an add's latency per value (576 of them took ~0.8 µs, two
/// per layer on the owner thread while the partner waits), sixteen let the loop vectorize. Every
/// row takes the same order whatever the batch.
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    let tail = chunks.remainder().iter().map(|v| v * v).sum::<f32>();
    let ms = (acc[0] + tail) / x.len() as f32;
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
pub(super) const GEMM_MIN_ROWS: usize = 32;

/// From this many rows of one item on (a prompt or its chunk, never a decode step's one), the
/// layer matrices' products take their bf16 copies on AMX where the model made them
/// (`Numerics::Fast` on a CPU with AMX-BF16). A bf16 product's row has the same bits alone or
/// among others, so a prompt's bits depend on its chunking only where a chunk is one row.
pub(super) const BF16_MIN_ROWS: usize = 2;

/// `y[t × n] = x[t × k] · wᵀ` with `w` row-major `[n × k]`, on every thread of the current pool:
/// the products of weights without a repacked copy, and the one call site of the `gemm` crate.
pub(crate) fn gemm_xwt(x: &[f32], w: &[f32], y: &mut [f32], t: usize, n: usize, k: usize) {
    assert!(x.len() == t * k && w.len() == n * k && y.len() == t * n, "gemm operand sizes");
    let par = gemm::Parallelism::Rayon(rayon::current_num_threads());
    // SAFETY: `x` is `t × k`, `y` `t × n` (row strides `k` and `n`, columns adjacent) and `w`
    // `n × k`, read as `wᵀ[kk, j] = w[j · k + kk]` (row stride 1, column stride `k`): every
    // element addressed is inside its slice (asserted above); `y`'s rows do not overlap, and
    // `read_dst = false`, so its old contents are never read.
    unsafe {
        gemm::gemm(
            t,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
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
    /// `y[T × rows] = W · x[T × cols]` for every row of `x`, stacked from items of `spans` rows.
    fn linear(&self, w: &Mat, x: &[f32], spans: &[usize]) -> Result<Vec<f32>> {
        let t = spans.iter().sum::<usize>();
        let mut y = vec![0f32; t * self.q(w)?.rows()];
        self.linears_into(&[w], x, spans, &mut [&mut y])?;
        Ok(y)
    }

    /// [`Model::linear`] for several matrices reading the same `x` (Q, K and V; gate and up),
    /// into `ys` (`T × rows` each, every value overwritten: the forward pass keeps one buffer per
    /// projection for all layers instead of zeroing new ones per layer). `x` is quantized once
    /// per activation kind and the matrices sharing it run as one parallel region.
    ///
    /// Matrices with a repacked copy (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) always run the 8-row integer
    /// tiles — for prefill too: they beat dequantize + f32 GEMM on this CPU class (measured: 600
    /// vs 530 prompt tok/s at 512 tokens), and one kernel for every batch size means a prompt's
    /// logits do not depend on its chunking or on a prefix-cache hit. Other types take
    /// dequantize + f32 GEMM for the rows of each item (`spans`: rows per item, in order) of at
    /// least [`GEMM_MIN_ROWS`] rows — one GEMM per item, so an item's own row count decides, never
    /// the batch around it (invariant 12): a decode step of 40 sequences gives each the bits it
    /// gets alone — and the integer kernels for the rest.
    fn linears_into(&self, ws: &[&Mat], x: &[f32], spans: &[usize], ys: &mut [&mut [f32]]) -> Result<()> {
        let t = spans.iter().sum::<usize>();
        let mats = ws.iter().map(|w| self.q(w)).collect::<Result<Vec<QMatrix<'_>>>>()?;
        for (m, y) in mats.iter().zip(ys.iter()) {
            if y.len() != t * m.rows() {
                return Err(EngineError::shape("projection output", t * m.rows(), y.len()));
            }
        }
        if x.len() != t * mats.first().map_or(0, |m| m.cols()) {
            return Err(EngineError::shape("projection input", t, x.len()));
        }
        if self.numerics == Numerics::Ggml {
            for (m, y) in mats.iter().zip(ys.iter_mut()) {
                y.copy_from_slice(&ggml::linear(m, x, t)?);
            }
            return Ok(());
        }
        // Prompt items take the bf16 copies where they exist (every matrix of the call has one).
        let bf16: Option<Vec<&Bf16Matrix>> = (self.numerics == Numerics::Fast)
            .then(|| ws.iter().map(|w| w.bf16.as_deref()).collect::<Option<Vec<_>>>())
            .flatten();
        let (plain, long_rows) = match bf16 {
            Some(_) => ((0..mats.len()).collect::<Vec<usize>>(), BF16_MIN_ROWS),
            None => {
                let (repacked, plain): (Vec<usize>, Vec<usize>) =
                    (0..mats.len()).partition(|&i| ws[i].interleaved.is_some());
                self.kernel_groups(ws, &mats, &repacked, x, ys)?;
                (plain, GEMM_MIN_ROWS)
            }
        };
        if plain.is_empty() {
            return Ok(());
        }
        // Items long enough for their own product (bf16 tiles, or dequantize + GEMM), as row
        // ranges; the other rows stay together.
        let (mut long, mut short, mut r0) = (Vec::new(), Vec::new(), 0);
        for &n in spans {
            if n >= long_rows {
                long.push(r0..r0 + n)
            } else {
                short.extend(r0..r0 + n)
            }
            r0 += n;
        }
        if let Some(bf) = &bf16 {
            let cols = bf[0].cols();
            for r in &long {
                let mut parts: Vec<&mut [f32]> = ys
                    .iter_mut()
                    .zip(bf)
                    .map(|(y, w)| &mut y[r.start * w.rows()..r.end * w.rows()])
                    .collect();
                amx_bf16::matmul_group(bf, &x[r.start * cols..r.end * cols], r.len(), &mut parts)?;
            }
        }
        for &i in plain.iter().filter(|_| bf16.is_none() && !long.is_empty()) {
            let (m, (rows, cols)) = (&mats[i], (mats[i].rows(), mats[i].cols()));
            with_dequantized(m, |wf| {
                for r in &long {
                    let (xr, yr) =
                        (&x[r.start * cols..r.end * cols], &mut ys[i][r.start * rows..r.end * rows]);
                    gemm_xwt(xr, wf, yr, r.len(), rows, cols);
                }
            })?;
        }
        if short.len() == t {
            return self.kernel_groups(ws, &mats, &plain, x, ys);
        }
        if short.is_empty() {
            return Ok(());
        }
        // The short items' rows gathered, multiplied, and put back in place.
        let cols = mats[plain[0]].cols();
        let xs: Vec<f32> = short.iter().flat_map(|&r| x[r * cols..(r + 1) * cols].iter().copied()).collect();
        let mut parts: Vec<Vec<f32>> = (0..mats.len())
            .map(|i| vec![0f32; if plain.contains(&i) { short.len() * mats[i].rows() } else { 0 }])
            .collect();
        self.kernel_groups(
            ws,
            &mats,
            &plain,
            &xs,
            &mut parts.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>(),
        )?;
        for &i in &plain {
            let rows = mats[i].rows();
            for (k, &r) in short.iter().enumerate() {
                ys[i][r * rows..(r + 1) * rows].copy_from_slice(&parts[i][k * rows..(k + 1) * rows]);
            }
        }
        Ok(())
    }

    /// The integer kernels for matrices `which` over every row of `x` into `ys[i]`: repacked
    /// copies all in one parallel region, the rest one region per activation kind.
    fn kernel_groups(
        &self,
        ws: &[&Mat],
        mats: &[QMatrix<'_>],
        which: &[usize],
        x: &[f32],
        ys: &mut [&mut [f32]],
    ) -> Result<()> {
        let mut done: Vec<bool> = (0..mats.len()).map(|i| !which.contains(&i)).collect();
        let repacked = |i: usize| ws[i].interleaved.is_some();
        // Repacked copies all take 32-element Q8 activations, whatever their type.
        let key_of =
            |i: usize| (repacked(i), if repacked(i) { None } else { mats[i].ty().activation_kind() });
        while let Some(first) = done.iter().position(|d| !d) {
            let key = key_of(first);
            let group: Vec<usize> = (first..mats.len()).filter(|&i| !done[i] && key_of(i) == key).collect();
            let acts = match ws[first].interleaved.as_deref() {
                Some(il) => il.prepare_rows(x)?,
                None => mats[first].prepare_rows(x)?,
            };
            let mut outs: Vec<&mut [f32]> =
                ys.iter_mut().enumerate().filter(|(i, _)| group.contains(i)).map(|(_, y)| &mut **y).collect();
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
        Ok(())
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
        // All or nothing (invariant 11): a failure after the reservation — here or inside the
        // pass — gives back every block reserved for it; the tables advance only on success.
        let before: Vec<usize> = batch.iter().map(|i| i.table.blocks().len()).collect();
        let out = batch
            .iter_mut()
            .try_for_each(|i| {
                let end = i.table.len() + i.tokens.len();
                cache.reserve(i.table, end)
            })
            .and_then(|()| self.pool.install(|| self.forward_reserved(cache, batch)));
        if out.is_err() {
            for (item, n) in batch.iter_mut().zip(&before) {
                cache.truncate_blocks(item.table, *n);
            }
        }
        out
    }

    fn forward_reserved(&self, cache: &mut KvCache, batch: &mut [BatchItem<'_>]) -> Result<ForwardOutput> {
        // A decode-sized step (every row-wise step serial, every product and attention task
        // through `par::for_each`) keeps the pool's other worker spinning beside this one for
        // the whole call: its regions are too short for rayon's idle loop (`crate::par`;
        // measured 5–9% faster at batch 1, 1–5% at 4 to 8 rows, alternating in one process; at
        // 16 sequences, where rayon's wake-ups were a tenth of a step's time under `perf`,
        // +15–23% at short context and +16–20% at 512 tokens of it, three alternating runs of
        // two binaries).
        // `ggml` numerics keep rayon: their kernels do not go through `par::for_each`.
        let t: usize = batch.iter().map(|i| i.tokens.len()).sum();
        if t < PAR_MIN_ROWS && self.numerics == Numerics::Fast {
            return crate::par::with_partner(|| self.forward_rows(cache, batch));
        }
        self.forward_rows(cache, batch)
    }

    fn forward_rows(&self, cache: &mut KvCache, batch: &mut [BatchItem<'_>]) -> Result<ForwardOutput> {
        let c = &self.config;
        let (d, kv, hd) = (c.n_embd, c.kv_dim(), c.head_dim);
        // (item, position) of every stacked row.
        let rows: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .flat_map(|(i, it)| (0..it.tokens.len()).map(move |k| (i, it.table.len() + k)))
            .collect();
        let t = rows.len();
        let spans: Vec<usize> = batch.iter().map(|it| it.tokens.len()).collect();
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
        // One buffer per projection for every layer (each product overwrites all of it).
        let (mut q, mut k, mut v, mut o) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut gate, mut up, mut h, mut down) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let rows_of = |w: &Mat| self.q(w).map(|m| t * m.rows());
        // Row-wise steps run on every thread for a prefill chunk (each row's arithmetic is the
        // same alone or not); for a few rows a parallel region costs more than the step.
        let par = t >= PAR_MIN_ROWS;
        let norm_rows = |x: &[f32], w: &[f32], xn: &mut [f32]| {
            each_row(par, d, xn, x, |o, r| rms_norm(r, w, c.rms_eps, o));
        };
        let add = |x: &mut [f32], y: &[f32]| {
            each_row(par, d, x, y, |a, b| a.iter_mut().zip(b).for_each(|(a, b)| *a += b))
        };
        let bf16_prompts = self.bf16_prompts();
        for (l, layer) in self.layers.iter().enumerate() {
            norm_rows(&x, &layer.attn_norm, &mut xn);
            let (q, k, v) = (
                sized(&mut q, rows_of(&layer.wq)?),
                sized(&mut k, rows_of(&layer.wk)?),
                sized(&mut v, rows_of(&layer.wv)?),
            );
            self.linears_into(
                &[&layer.wq, &layer.wk, &layer.wv],
                &xn,
                &spans,
                &mut [&mut *q, &mut *k, &mut *v],
            )?;
            let rope_row = |(r, (qr, kr)): (usize, (&mut [f32], &mut [f32]))| {
                let angles = &rope_at[r * half..(r + 1) * half];
                rope(qr, hd, angles);
                rope(kr, hd, angles);
            };
            if par {
                q.par_chunks_mut(d).zip(k.par_chunks_mut(kv)).enumerate().for_each(rope_row);
            } else {
                q.chunks_mut(d).zip(k.chunks_mut(kv)).enumerate().for_each(rope_row);
            }
            for (r, &(item, pos)) in rows.iter().enumerate() {
                cache.write(batch[item].table, l, pos, &k[r * kv..(r + 1) * kv], &v[r * kv..(r + 1) * kv]);
            }
            let attn = if exact {
                ggml::attention(&*cache, batch, &rows, q, l, c.n_head, group, hd)
            } else {
                attention(&*cache, batch, &rows, q, l, c.n_head, group, hd, bf16_prompts)
            };
            let o = sized(&mut o, rows_of(&layer.wo)?);
            self.linears_into(&[&layer.wo], &attn, &spans, &mut [&mut *o])?;
            add(&mut x, o);

            norm_rows(&x, &layer.ffn_norm, &mut xn);
            let down = sized(&mut down, rows_of(&layer.w_down)?);
            let (g, u, dn) = (&layer.w_gate.interleaved, &layer.w_up.interleaved, &layer.w_down.interleaved);
            let bf16_ffn = self.numerics == Numerics::Fast
                && layer.w_gate.bf16.is_some()
                && spans.iter().any(|&n| n >= BF16_MIN_ROWS);
            if let (false, false, Some(g), Some(u), Some(dn)) = (exact, bf16_ffn, g, u, dn) {
                // Gate, up, SiLU and the down product's quantized input in one region (each task
                // its own rows); the same bits as the steps one by one below. Alternating every
                // eight steps in one process: batch-1 steps 0.6–1.3% faster (three runs), a
                // 512-token prefill 1.7–4.2% (Q4_1; Q4_K_M within ±3%).
                let hq = matmul_swiglu_interleaved(g, u, &g.prepare_rows(&xn)?, &math::silu_mul_into)?;
                matmul_group_interleaved(&[dn], &hq, &mut [&mut *down])?;
            } else {
                let (gate, up) =
                    (sized(&mut gate, rows_of(&layer.w_gate)?), sized(&mut up, rows_of(&layer.w_up)?));
                self.linears_into(&[&layer.w_gate, &layer.w_up], &xn, &spans, &mut [&mut *gate, &mut *up])?;
                let h = sized(&mut h, gate.len().min(up.len()));
                if exact {
                    h.copy_from_slice(&ggml::silu_mul(gate, up));
                } else {
                    math::silu_mul_into(gate, up, h);
                }
                self.linears_into(&[&layer.w_down], h, &spans, &mut [&mut *down])?;
            }
            add(&mut x, down);
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
        let out_spans: Vec<usize> = wanted.iter().map(|r| r.len()).collect();
        let logits = self.linear(&self.output, &normed, &out_spans)?;
        let nv = c.n_vocab;
        let mut end = 0;
        let ends = wanted.iter().map(|r| {
            end += r.len() * nv;
            end
        });
        let ends = ends.collect();
        #[cfg(test)]
        if self.fail_at_the_head.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(EngineError::InvalidArgument("a failure injected after every layer".into()));
        }
        for item in batch.iter_mut() {
            let n = item.tokens.len();
            cache.advance(item.table, n);
        }
        Ok(ForwardOutput { logits, ends })
    }
}

/// Rows from which a forward call runs on rayon's pool, its row-wise steps split over the
/// threads; below, on the calling thread with the pool's other worker spinning beside it. As
/// many as the AMX tiles' smallest product (`quant::interleave_amx::MIN_ACTS`), so every
/// decode step of up to 63 sequences is decode-sized.
const PAR_MIN_ROWS: usize = 64;

/// Largest matrix (in elements) whose dequantized copy is kept in a per-thread scratch buffer:
/// every layer matrix of a small model, not a 50k-row vocabulary.
pub(super) const SCRATCH_MAX: usize = 4 << 20;

thread_local! {
    static DEQUANT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f` on this thread's buffers in `kept` when `fits` (at most [`SCRATCH_MAX`] values) and they
/// are free, else on fresh ones: they are taken when a task runs inside another on this thread (a
/// rayon steal while it waits). The one way the forward pass keeps scratch memory between calls
/// (no allocation, zeroing or page faults per prefill chunk or attention task).
pub(crate) fn with_kept<T: Default, R>(
    kept: &'static std::thread::LocalKey<std::cell::RefCell<T>>,
    fits: bool,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    kept.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) if fits => f(&mut buf),
        _ => f(&mut T::default()),
    })
}

/// Runs `f` on `m` dequantized to f32, in this thread's kept buffer when the matrix is small
/// enough ([`with_kept`]).
fn with_dequantized<R>(m: &QMatrix<'_>, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let n = m.rows() * m.cols();
    with_kept(&DEQUANT, n <= SCRATCH_MAX, |buf| {
        let w = sized(buf, n);
        m.dequantize_into(w)?;
        Ok(f(w))
    })
}

/// `f(out row, in row)` for every `width`-wide row of `out` and `inp`, on every thread when `par`.
fn each_row(
    par: bool,
    width: usize,
    out: &mut [f32],
    inp: &[f32],
    f: impl Fn(&mut [f32], &[f32]) + Sync + Send,
) {
    if par {
        out.par_chunks_mut(width).zip(inp.par_chunks(width)).for_each(|(o, i)| f(o, i));
    } else {
        out.chunks_mut(width).zip(inp.chunks(width)).for_each(|(o, i)| f(o, i));
    }
}

/// The first `n` values of `buf`, grown (zeroed) when shorter: a buffer reused across layers.
pub(super) fn sized(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

#[cfg(test)]
#[path = "forward_tests.rs"]
mod tests;
