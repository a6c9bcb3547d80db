//! A Llama-family model loaded from GGUF: hyper-parameters, weight handles into the (memory-mapped)
//! file, and the forward pass over a batch that mixes prefill chunks and decode steps.
//!
//! Weights are never copied out of the file: a [`Mat`] is a type, a shape and a byte range, turned
//! into a borrowed [`QMatrix`] at use. Only the small norm vectors are decoded to f32 at load.
//! The forward pass takes any mix of sequences and token counts in one call — a decode step is a
//! one-token chunk — which is what continuous batching with chunked prefill needs from an engine.

mod attention;
mod attention_amx;
#[cfg(target_arch = "x86_64")]
mod attention_avx2;
#[cfg(target_arch = "x86_64")]
mod attention_avx512;
mod attention_gemm;
mod config;
mod forward;
mod ggml;
pub(crate) mod math;

pub use config::{ModelConfig, SUPPORTED_ARCHITECTURES};
pub(crate) use forward::gemm_xwt;
pub(crate) use forward::with_kept;
pub use forward::{BatchItem, ForwardOutput};

use crate::error::{EngineError, Result};
use crate::gguf::{Gguf, GgufIndex, TensorView};
use crate::quant::amx_bf16::{self, Bf16Matrix};
use crate::quant::{GgmlType, Interleaved, QMatrix};
use std::ops::Range;
use std::path::Path;

/// Where a model's bytes live.
#[derive(Debug)]
pub enum ModelBytes {
    /// Memory-mapped from a file.
    Mapped(memmap2::Mmap),
    /// In memory (tests, generated models).
    Owned(Vec<u8>),
}

impl ModelBytes {
    /// Tells the kernel the mapped pages of `range` are not needed any more (their repacked copy
    /// is used instead), so they leave the resident set; a later read faults them back in from
    /// the file. A no-op for owned bytes or when the advice is refused.
    fn release(&self, range: Range<usize>) {
        if let ModelBytes::Mapped(map) = self {
            const PAGE: usize = 4096;
            let start = range.start.div_ceil(PAGE) * PAGE;
            let end = range.end / PAGE * PAGE;
            if end > start {
                // SAFETY: the mapping is a read-only mapping of a file we never write,
                // so dropping its pages loses nothing: the next access re-reads the same bytes
                // from the file. No page is written through this mapping.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
                };
            }
        }
    }
}

impl AsRef<[u8]> for ModelBytes {
    fn as_ref(&self) -> &[u8] {
        match self {
            ModelBytes::Mapped(m) => m,
            ModelBytes::Owned(v) => v,
        }
    }
}

/// A weight matrix: a type, a shape and where its bytes are in the file, plus (Q4_1, Q8_0, Q5_0,
/// Q4_K, Q6_K) a copy repacked eight rows at a time that every product of it runs on.
#[derive(Debug, Clone)]
pub struct Mat {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    range: Range<usize>,
    interleaved: Option<std::sync::Arc<Interleaved>>,
    /// Repacked layer matrices on a CPU with AMX-BF16 (kernels at `amx`): a bfloat16 copy for
    /// prompt products (`quant::amx_bf16`).
    bf16: Option<std::sync::Arc<Bf16Matrix>>,
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    ffn_norm: Vec<f32>,
    w_gate: Mat,
    w_up: Mat,
    w_down: Mat,
}

impl Layer {
    /// Its seven matrices, in the forward pass's order.
    fn mats(&self) -> [&Mat; 7] {
        [&self.wq, &self.wk, &self.wv, &self.wo, &self.w_gate, &self.w_up, &self.w_down]
    }

    fn mats_mut(&mut self) -> [&mut Mat; 7] {
        [
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.w_gate,
            &mut self.w_up,
            &mut self.w_down,
        ]
    }
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    file: Gguf<ModelBytes>,
    config: ModelConfig,
    token_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
    /// The threads the forward pass runs on. One `install` per forward call keeps every nested
    /// parallel kernel on pool threads; calling rayon from outside its pool instead hands every
    /// one of the ~300 kernels of a decode step across threads and back.
    pool: rayon::ThreadPool,
    /// The arithmetic of the forward pass.
    numerics: Numerics,
    /// [`Model::weights_digest`], once computed.
    digest: std::sync::OnceLock<[u8; 32]>,
    /// Tests only: forward calls fail after their last layer (`forward.rs`'s invariant-11 test).
    #[cfg(test)]
    pub(crate) fail_at_the_head: std::sync::atomic::AtomicBool,
}

/// Which arithmetic the forward pass uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Numerics {
    /// The engine's own kernels (repacked integer tiles, two-pass softmax, vectorized exp), and
    /// on a CPU with AMX-BF16 the layer matrices' bf16 copies for items of two or more rows (a
    /// prompt or its chunk): the serving default. Logits match llama.cpp's to quantization noise
    /// (≈ 0.7 on the default model), so a greedy continuation may part from llama.cpp's at a
    /// near-tie.
    #[default]
    Fast,
    /// [`Numerics::Fast`] without the bf16 prompt products: every repacked product on the
    /// integer tiles at every size, so a sequence's bits do not depend on how its prompt was
    /// chunked, on a prefix-cache hit, on a recomputation after preemption, or on the CPU
    /// (invariant 12).
    Invariant,
    /// llama.cpp's CPU arithmetic reproduced rounding for rounding (see `model/ggml.rs`): greedy
    /// output token-for-token llama.cpp's, at a fraction of the speed. Q4_1/Q8_0 matrices only.
    Ggml,
}

impl Model {
    /// Memory-maps and loads the GGUF file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::load(Gguf::parse(ModelBytes::Mapped(crate::gguf::map_file(path.as_ref())?))?)
    }

    /// Loads a model from bytes already in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::load(Gguf::parse(ModelBytes::Owned(bytes))?)
    }

    fn load(file: Gguf<ModelBytes>) -> Result<Self> {
        let config = ModelConfig::from_gguf(file.index())?;
        let kernel = crate::quant::Kernel::best();
        tracing::info!(
            kernel = kernel.name(),
            "kernels: {kernel} ({} caps the choice)",
            crate::quant::KERNEL_ENV
        );
        let c = &config;
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Mat> {
            let t = file.tensor(name)?;
            t.matrix_checked(rows, cols)?;
            Ok(Mat { ty: t.ty, rows, cols, range: range_of(&file, &t), interleaved: None, bf16: None })
        };
        let vec = |name: &str, n: usize| -> Result<Vec<f32>> {
            let t = file.tensor(name)?;
            if t.n_elements() != n as u64 {
                return Err(EngineError::shape(format!("tensor `{name}`"), n, t.n_elements()));
            }
            t.dequantize()
        };
        let (d, kv, ff) = (c.n_embd, c.kv_dim(), c.n_ff);
        let token_embd = mat("token_embd.weight", c.n_vocab, d)?;
        let output = if file.tensor_info("output.weight").is_some() {
            mat("output.weight", c.n_vocab, d)?
        } else {
            token_embd.clone()
        };
        let layers = (0..c.n_layer)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}.weight");
                Ok(Layer {
                    attn_norm: vec(&n("attn_norm"), d)?,
                    wq: mat(&n("attn_q"), d, d)?,
                    wk: mat(&n("attn_k"), kv, d)?,
                    wv: mat(&n("attn_v"), kv, d)?,
                    wo: mat(&n("attn_output"), d, d)?,
                    ffn_norm: vec(&n("ffn_norm"), d)?,
                    w_gate: mat(&n("ffn_gate"), ff, d)?,
                    w_up: mat(&n("ffn_up"), ff, d)?,
                    w_down: mat(&n("ffn_down"), d, ff)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let output_norm = vec("output_norm.weight", d)?;
        // Repacked copies of every matrix the forward pass multiplies (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K;
        // the embedding lookups keep reading the file's rows).
        let (mut layers, mut output) = (layers, output);
        // And bf16 copies of the layer matrices for prompts where the CPU has AMX-BF16 (the
        // output head multiplies one row an item, so it keeps the integer tiles).
        // Two bytes a weight: made only while they fit in a quarter of the machine's memory (a
        // large model keeps its prompts on the integer tiles rather than risk the memory).
        let bf16_need: usize = layers
            .iter()
            .flat_map(Layer::mats)
            .map(|m| amx_bf16::Bf16Matrix::bytes_for(m.rows, m.cols))
            .sum();
        let bf16 = kernel >= crate::quant::Kernel::Amx && amx_bf16::available() && bf16_fits(bf16_need);
        let mut bf16_bytes = 0;
        let mats = layers.iter_mut().flat_map(Layer::mats_mut);
        for (m, layer_matrix) in mats.map(|m| (m, true)).chain(std::iter::once((&mut output, false))) {
            let data = file.bytes().get(m.range.clone()).unwrap_or(&[]);
            let q = QMatrix::new(m.ty, m.rows, m.cols, data)?;
            m.interleaved = Interleaved::from_matrix(&q).map(std::sync::Arc::new);
            // Quantized weights only: their rounding to bf16 is below the quantization's own,
            // where f32 and f16 weights would lose bits to it (they keep dequantize + f32 GEMM).
            if let (true, true, Some(il)) = (bf16, layer_matrix, &m.interleaved) {
                let mut f = vec![0f32; m.rows * m.cols];
                il.dequantize_into(&mut f)?;
                let b = Bf16Matrix::from_f32(&f, m.rows, m.cols)?;
                bf16_bytes += b.bytes();
                m.bf16 = Some(std::sync::Arc::new(b));
            }
            if m.interleaved.is_some() {
                file.backing().release(m.range.clone());
            }
        }
        if bf16 {
            tracing::info!(
                bytes = bf16_bytes,
                "prompt products on AMX-BF16: {} MiB of bf16 weights",
                bf16_bytes >> 20
            );
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("tokenpath-engine-{i}"))
            .build()
            .map_err(|e| {
            EngineError::InvalidArgument(format!("cannot start the engine's threads: {e}"))
        })?;
        Ok(Model {
            config,
            token_embd,
            output_norm,
            output,
            layers,
            file,
            pool,
            numerics: Numerics::Fast,
            digest: std::sync::OnceLock::new(),
            #[cfg(test)]
            fail_at_the_head: Default::default(),
        })
    }

    /// Switches the arithmetic of later forward calls. [`Numerics::Ggml`] refuses models with
    /// matrix types it does not reproduce.
    pub fn set_numerics(&mut self, numerics: Numerics) -> Result<()> {
        if numerics == Numerics::Ggml {
            let mats = self.layers.iter().flat_map(|l| {
                [("attn_q", &l.wq), ("attn_k", &l.wk), ("attn_v", &l.wv), ("attn_output", &l.wo)]
                    .into_iter()
                    .chain([("ffn_gate", &l.w_gate), ("ffn_up", &l.w_up), ("ffn_down", &l.w_down)])
            });
            for (name, m) in mats.chain([("output", &self.output), ("token_embd", &self.token_embd)]) {
                ggml::check_type(name, m.ty)?;
            }
        }
        if numerics != Numerics::Fast {
            // Only `Fast` multiplies prompts on the bf16 copies: the memory goes back now (a
            // model switched back to `Fast` runs its prompts on the integer tiles).
            self.layers.iter_mut().flat_map(Layer::mats_mut).for_each(|m| m.bf16 = None);
        }
        self.numerics = numerics;
        Ok(())
    }

    /// The arithmetic in use.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// Whether prompts run on the bf16 copies ([`Numerics::Fast`] on a CPU with AMX-BF16): their
    /// KV differs from the integer tiles' in the last bits, so what keys KV beyond one forward
    /// call (the prefix namespace) names it.
    pub fn bf16_prompts(&self) -> bool {
        self.numerics == Numerics::Fast && self.layers.iter().flat_map(Layer::mats).any(|m| m.bf16.is_some())
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The parsed GGUF metadata (tokenizer, chat template, ...).
    pub fn gguf(&self) -> &GgufIndex {
        self.file.index()
    }

    /// BLAKE3 of the whole model file: what binds KV kept beyond this process (the KV pool) to
    /// these weights, and what a cluster gateway checks its workers serve. Reads every page of
    /// the file, so computed when first asked, once.
    pub fn weights_digest(&self) -> [u8; 32] {
        *self.digest.get_or_init(|| file_digest(self.file.bytes()))
    }

    /// Size of the model file in bytes.
    pub fn file_bytes(&self) -> usize {
        self.file.bytes().len()
    }

    fn q(&self, m: &Mat) -> Result<QMatrix<'_>> {
        // Shape and range were validated at load; re-checking here is cheap and keeps this
        // non-panicking by construction.
        let data = self.file.bytes().get(m.range.clone()).unwrap_or(&[]);
        QMatrix::new(m.ty, m.rows, m.cols, data)
    }
}

/// Whether bf16 copies of `need` bytes fit in a quarter of this machine's memory (logged when not).
fn bf16_fits(need: usize) -> bool {
    let fits = need <= physical_memory() / 4;
    if !fits {
        tracing::info!(
            "prompt products on the integer tiles: bf16 copies would take {} MiB, over a quarter of this machine's memory",
            need >> 20
        );
    }
    fits
}

/// A model file's identity: BLAKE3 of all its bytes ([`Model::weights_digest`] of a loaded one;
/// a cluster gateway's of the file it tokenizes for, which its workers must serve too).
pub fn file_digest(bytes: &[u8]) -> [u8; 32] {
    *blake3::hash(bytes).as_bytes()
}

/// This machine's physical memory in bytes (0 when unknown).
pub(crate) fn physical_memory() -> usize {
    // SAFETY: `sysconf` only reads system configuration.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages.max(0) as usize).saturating_mul(size.max(0) as usize)
}

fn range_of(file: &Gguf<ModelBytes>, t: &TensorView<'_>) -> Range<usize> {
    let base = file.bytes().as_ptr() as usize;
    let start = t.data.as_ptr() as usize - base;
    start..start + t.data.len()
}
