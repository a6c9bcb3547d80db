//! The forward pass over a batch of sequences, each contributing any number of new tokens (a
//! prefill chunk) or exactly one (a decode step). All new tokens of the batch are stacked into one
//! `[T × d]` activation so every weight matrix is streamed from memory once per call, whatever the
//! mix; attention is the only per-sequence part and runs in parallel over (token, head).

use super::{Mat, Model};
use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockTable, KvCache};
use crate::quant::QuantizedActivation;
use half::f16;
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

/// Rotates adjacent pairs (ggml's "normal" RoPE, which Llama GGUF files are converted for).
fn rope(x: &mut [f32], head_dim: usize, rope_dims: usize, pos: usize, base: f32) {
    for head in x.chunks_exact_mut(head_dim) {
        for i in (0..rope_dims).step_by(2) {
            let theta = pos as f32 * base.powf(-(i as f32) / rope_dims as f32);
            let (s, c) = theta.sin_cos();
            let (a, b) = (head[i], head[i + 1]);
            head[i] = a * c - b * s;
            head[i + 1] = a * s + b * c;
        }
    }
}

impl Model {
    /// `y[T × rows] = W · x[T × cols]` for every row of `x`.
    fn linear(&self, w: &Mat, x: &[f32], t: usize) -> Result<Vec<f32>> {
        let m = self.q(w)?;
        let acts = x
            .chunks_exact(m.cols())
            .map(|row| m.prepare_input(row))
            .collect::<Result<Vec<QuantizedActivation>>>()?;
        let mut y = vec![0f32; t * m.rows()];
        if t == 1 {
            m.matvec_prepared(&acts[0], &mut y)?;
        } else {
            m.matmul(&acts, &mut y)?;
        }
        Ok(y)
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
        self.forward_reserved(cache, batch)
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
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, layer) in self.layers.iter().enumerate() {
            for (o, r) in xn.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                rms_norm(r, &layer.attn_norm, c.rms_eps, o);
            }
            let mut q = self.linear(&layer.wq, &xn, t)?;
            let mut k = self.linear(&layer.wk, &xn, t)?;
            let v = self.linear(&layer.wv, &xn, t)?;
            for (r, &(_, pos)) in rows.iter().enumerate() {
                rope(&mut q[r * d..(r + 1) * d], hd, c.rope_dims, pos, c.rope_base);
                rope(&mut k[r * kv..(r + 1) * kv], hd, c.rope_dims, pos, c.rope_base);
                let item = &batch[rows[r].0];
                cache.write(item.table, l, pos, &k[r * kv..(r + 1) * kv], &v[r * kv..(r + 1) * kv]);
            }
            // Attention, parallel over (row, head).
            let cache_ref = &*cache;
            let tables: Vec<&BlockTable> = batch.iter().map(|it| &*it.table).collect();
            let mut attn = vec![0f32; t * d];
            attn.par_chunks_mut(hd).enumerate().for_each(|(rh, out)| {
                let (r, h) = (rh / c.n_head, rh % c.n_head);
                let (item, pos) = rows[r];
                let qh = &q[r * d + h * hd..r * d + (h + 1) * hd];
                attend(cache_ref, tables[item], l, h / group, hd, pos, qh, scale, out);
            });
            let o = self.linear(&layer.wo, &attn, t)?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            for (o, r) in xn.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                rms_norm(r, &layer.ffn_norm, c.rms_eps, o);
            }
            let gate = self.linear(&layer.w_gate, &xn, t)?;
            let up = self.linear(&layer.w_up, &xn, t)?;
            let h: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = self.linear(&layer.w_down, &h, t)?;
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        for item in batch.iter_mut() {
            let n = item.tokens.len();
            cache.advance(item.table, n);
        }
        // Output head only for the rows whose logits are wanted.
        let mut logits = Vec::with_capacity(batch.len());
        let mut first = 0;
        for item in batch.iter() {
            let n = item.tokens.len();
            let wanted = if item.all_logits { first..first + n } else { first + n - 1..first + n };
            let mut normed = vec![0f32; wanted.len() * d];
            for (o, r) in normed.chunks_exact_mut(d).zip(x[wanted.start * d..wanted.end * d].chunks_exact(d))
            {
                rms_norm(r, &self.output_norm, c.rms_eps, o);
            }
            logits.push(self.linear(&self.output, &normed, wanted.len())?);
            first += n;
        }
        Ok(ForwardOutput { logits })
    }
}

/// Causal attention of one query head over positions `0..=pos` of a sequence's cached K/V, in
/// f32 (only K and V are stored as f16).
#[allow(clippy::too_many_arguments)]
fn attend(
    cache: &KvCache,
    table: &BlockTable,
    layer: usize,
    kv_head: usize,
    hd: usize,
    pos: usize,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let layout = cache.layout();
    let bs = layout.block_size;
    let off = kv_head * hd;
    let kv_dim = layout.kv_dim;
    let mut scores = Vec::with_capacity(pos + 1);
    let mut buf = vec![0f32; hd];
    let slot = |p: usize, v: bool| -> &[f16] {
        let slab = cache.slab(table.blocks()[p / bs], layer, v);
        let s = (p % bs) * kv_dim + off;
        &slab[s..s + hd]
    };
    for p in 0..=pos {
        let k = slot(p, false);
        let dot: f32 = q.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum();
        scores.push(dot * scale);
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += f64::from(*s);
    }
    let inv = (1.0 / sum) as f32;
    out.iter_mut().for_each(|o| *o = 0.0);
    for (p, s) in scores.iter().enumerate() {
        let w = s * inv;
        let v = slot(p, true);
        for (b, x) in buf.iter_mut().zip(v) {
            *b = x.to_f32();
        }
        for (o, b) in out.iter_mut().zip(&buf) {
            *o += w * b;
        }
    }
}
