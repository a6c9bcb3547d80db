//! Hyper-parameters of a Llama-family model, read from GGUF metadata and checked against each
//! other before any tensor is touched, so a file with inconsistent numbers fails at load with the
//! key that is wrong rather than as an out-of-bounds slice in the middle of a forward pass.

use crate::error::{EngineError, Result};
use crate::gguf::GgufIndex;

/// Architectures the forward pass implements.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama"];

/// Longest context a model file may declare (tokens).
pub const MAX_CONTEXT: usize = 1 << 20;

/// Model hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture`.
    pub architecture: String,
    /// `general.name`, when present.
    pub name: Option<String>,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_head_kv: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Feed-forward hidden size.
    pub n_ff: usize,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Trained context length: the longest sequence the engine accepts.
    pub n_ctx: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_base: f32,
    /// Dimensions rotated by RoPE (the rest pass through).
    pub rope_dims: usize,
}

impl ModelConfig {
    /// Reads and validates the hyper-parameters from GGUF metadata.
    pub fn from_gguf(idx: &GgufIndex) -> Result<Self> {
        let arch = idx.architecture()?.to_owned();
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(EngineError::UnsupportedArchitecture {
                arch,
                supported: SUPPORTED_ARCHITECTURES.join(", "),
            });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| idx.get_u32(&key(k)).map(|v| v as usize);
        let n_embd = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_head_kv = if idx.contains(&key("attention.head_count_kv")) {
            u("attention.head_count_kv")?
        } else {
            n_head
        };
        let bad = |what: String| EngineError::InvalidModel(what);
        if n_head == 0 || n_head_kv == 0 || n_embd % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(bad(format!(
                "inconsistent attention shape: embedding {n_embd}, {n_head} heads, {n_head_kv} KV heads"
            )));
        }
        let head_dim = n_embd / n_head;
        let rope_dims =
            if idx.contains(&key("rope.dimension_count")) { u("rope.dimension_count")? } else { head_dim };
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(bad(format!("rope dimension {rope_dims} does not fit head dimension {head_dim}")));
        }
        let n_vocab = match idx.get_str_array("tokenizer.ggml.tokens") {
            Ok(t) => t.len(),
            Err(_) => u("vocab_size")?,
        };
        let f =
            |k: &str, default: f32| if idx.contains(&key(k)) { idx.get_f32(&key(k)) } else { Ok(default) };
        let cfg = ModelConfig {
            name: idx.get_str("general.name").ok().map(str::to_owned),
            n_layer: u("block_count")?,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: u("feed_forward_length")?,
            n_vocab,
            n_ctx: u("context_length")?,
            rms_eps: f("attention.layer_norm_rms_epsilon", 1e-5)?,
            rope_base: f("rope.freq_base", 10_000.0)?,
            rope_dims,
            architecture: arch,
        };
        if cfg.n_layer == 0 || cfg.n_ff == 0 || cfg.n_vocab == 0 || cfg.n_ctx == 0 {
            return Err(bad(format!("a zero dimension in {cfg:?}")));
        }
        if cfg.n_ctx > MAX_CONTEXT {
            // The KV cache is sized from it: a file claiming 4 G tokens would ask for terabytes
            // and abort the process instead of failing to load.
            return Err(bad(format!(
                "context_length {} is above the {MAX_CONTEXT} this engine serves",
                cfg.n_ctx
            )));
        }
        Ok(cfg)
    }

    /// Width of one token's K (or V) in one layer: `n_head_kv × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Approximate multiply-adds ×2 per token for the weight matrices (no attention): the FLOP
    /// count used for utilisation figures.
    pub fn flops_per_token(&self) -> u64 {
        let d = self.n_embd as u64;
        let kv = self.kv_dim() as u64;
        let per_layer = d * d * 2 + d * kv * 2 + d * self.n_ff as u64 * 3;
        2 * (per_layer * self.n_layer as u64 + d * self.n_vocab as u64)
    }
}
