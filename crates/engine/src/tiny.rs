//! Tiny random-weight Llama GGUF files, written by the tests themselves, so the engine (and the
//! worker and gateway above it) can be tested end to end without downloading a model. The file
//! is a real GGUF with a real byte-level BPE vocabulary and ChatML template; only the weights are
//! random, so the text it generates is gibberish but every code path is the production one.

use crate::error::Result;
use crate::gguf::{GgufWriter, Value};
use crate::quant::{quantize, GgmlType};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Seeded mutations of a file's bytes for the never-panics tests of whatever reads untrusted
/// files (the same `n` files on every run): truncations, bit flips, 8- and 4-byte windows set to
/// edge values (where a length, a count or an offset lives) and a random byte before a cut; the
/// flips and windows inside the first `region` bytes (a file's header and tables, where they
/// bite). `base` must be longer than 8 bytes.
pub fn mutations(base: &[u8], region: usize, n: usize, seed: u64) -> impl Iterator<Item = Vec<u8>> + '_ {
    const EDGES: [u64; 8] = [0, 1, 0x7f, 0xff, 0xffff_ffff, 1 << 32, 1 << 60, u64::MAX];
    let region = region.clamp(9, base.len().max(9));
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(move |i| {
        let mut below = |k: usize| (rng.next_u64() % k.max(1) as u64) as usize;
        let mut b = base.to_vec();
        match i % 5 {
            0 => b.truncate(below(b.len())),
            1 => {
                for _ in 0..1 + below(4) {
                    let p = below(region);
                    b[p] ^= 1 << below(8);
                }
            }
            2 => {
                let (p, v) = (below(region - 8), EDGES[below(EDGES.len())]);
                b[p..p + 8].copy_from_slice(&v.to_le_bytes());
            }
            3 => {
                let (p, v) = (below(region - 4), EDGES[below(EDGES.len())] as u32);
                b[p..p + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let p = below(b.len());
                b[p] = below(256) as u8;
                let cut = p + below(b.len() - p);
                b.truncate(cut);
            }
        }
        b
    })
}

/// Shape and encoding of a tiny model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// FFN hidden size.
    pub n_ff: usize,
    /// Context length.
    pub n_ctx: usize,
    /// Encoding of the weight matrices (norms stay F32).
    pub ty: GgmlType,
    /// Seed of the random weights.
    pub seed: u64,
    /// The `tokenizer.chat_template` it carries.
    pub chat_template: String,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            n_layer: 2,
            n_embd: 64,
            n_head: 4,
            n_head_kv: 2,
            n_ff: 128,
            n_ctx: 256,
            ty: GgmlType::F32,
            seed: 7,
            chat_template: TINY_CHAT_TEMPLATE.to_string(),
        }
    }
}

/// The ChatML template the tiny model carries (the same shape as SmolLM2's).
pub const TINY_CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The vocabulary: 3 special tokens, 256 byte tokens, then the products of [`tiny_merges`].
fn tiny_vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<|im_end|>".into()];
    let mut types = vec![3, 3, 3];
    for c in crate::tokenizer::byte_to_char_table() {
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges = vec!["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"];
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, types, merges.into_iter().map(String::from).collect())
}

/// Writes a tiny model as GGUF bytes.
pub fn tiny_model_bytes(spec: &TinySpec) -> Result<Vec<u8>> {
    let (tokens, types, merges) = tiny_vocab();
    let n_vocab = tokens.len();
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let mut rand = |n: usize, scale: f32| -> Vec<f32> {
        (0..n).map(|_| ((rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0) * scale).collect()
    };
    let mut w = GgufWriter::new();
    let a = "llama";
    w.metadata("general.architecture", a)
        .metadata("general.name", "tiny-random-llama")
        .metadata(format!("{a}.block_count"), spec.n_layer as u32)
        .metadata(format!("{a}.context_length"), spec.n_ctx as u32)
        .metadata(format!("{a}.embedding_length"), spec.n_embd as u32)
        .metadata(format!("{a}.feed_forward_length"), spec.n_ff as u32)
        .metadata(format!("{a}.attention.head_count"), spec.n_head as u32)
        .metadata(format!("{a}.attention.head_count_kv"), spec.n_head_kv as u32)
        .metadata(format!("{a}.attention.layer_norm_rms_epsilon"), 1e-5f32)
        .metadata(format!("{a}.rope.freq_base"), 10_000f32)
        .metadata("tokenizer.ggml.model", "gpt2")
        .metadata("tokenizer.ggml.pre", "smollm")
        .metadata("tokenizer.ggml.tokens", Value::Array(crate::gguf::Array::String(tokens)))
        .metadata("tokenizer.ggml.token_type", types)
        .metadata("tokenizer.ggml.merges", Value::Array(crate::gguf::Array::String(merges)))
        .metadata("tokenizer.ggml.bos_token_id", 1u32)
        .metadata("tokenizer.ggml.eos_token_id", 2u32)
        .metadata("tokenizer.ggml.add_bos_token", false)
        .metadata("tokenizer.chat_template", spec.chat_template.as_str());
    let d = spec.n_embd;
    let kv = d / spec.n_head * spec.n_head_kv;
    let mut mat = |w: &mut GgufWriter, name: String, rows: usize, cols: usize| -> Result<()> {
        let vals = rand(rows * cols, 1.0 / (cols as f32).sqrt() * 1.7);
        let bytes = quantize(spec.ty, &vals)?;
        w.tensor(name, &[cols as u64, rows as u64], spec.ty, bytes)?;
        Ok(())
    };
    mat(&mut w, "token_embd.weight".into(), n_vocab, d)?;
    for i in 0..spec.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        mat(&mut w, n("attn_q"), d, d)?;
        mat(&mut w, n("attn_k"), kv, d)?;
        mat(&mut w, n("attn_v"), kv, d)?;
        mat(&mut w, n("attn_output"), d, d)?;
        mat(&mut w, n("ffn_gate"), spec.n_ff, d)?;
        mat(&mut w, n("ffn_up"), spec.n_ff, d)?;
        mat(&mut w, n("ffn_down"), d, spec.n_ff)?;
        for norm in ["attn_norm", "ffn_norm"] {
            let v: Vec<f32> = (0..d).map(|k| 1.0 + 0.01 * (k % 7) as f32).collect();
            w.tensor_f32(n(norm), &[d as u64], GgmlType::F32, &v)?;
        }
    }
    let v: Vec<f32> = vec![1.0; d];
    w.tensor_f32("output_norm.weight", &[d as u64], GgmlType::F32, &v)?;
    Ok(w.to_bytes())
}
