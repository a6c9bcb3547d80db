//! Shared test helpers: locate the default model and build its tokenizer with the engine's own
//! GGUF parser.
//!
//! Tests that need the real SmolLM2 GGUF skip (loudly, on stderr) when it is absent so a
//! developer without the download can still run the rest — except under CI (`CI` set), where
//! `scripts/test` has fetched the model and a missing file is a failure, not a skip.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use half::f16;
use tokenpath_engine::gguf::{Gguf, GgufFile};
use tokenpath_engine::model::ModelConfig;
use tokenpath_engine::tokenizer::{tokenizer_from_gguf, ChatTemplate, Tokenizer};

/// The default model's path, or `None` (with a note) when it is absent outside CI.
pub fn model_path() -> Option<PathBuf> {
    let p = tokenpath_engine::default_model_path();
    if p.is_file() {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "default model missing at {} under CI: scripts/test should have fetched it",
        p.display()
    );
    eprintln!("SKIP: default model not found at {} (run scripts/setup --model)", p.display());
    None
}

/// A tokenizer (and its pre-tokenizer name) read from the GGUF at `path`.
pub fn tokenizer_at(path: &Path) -> (Tokenizer, Option<String>) {
    let g = GgufFile::open(path).expect("open GGUF");
    let pre = g.get_str("tokenizer.ggml.pre").ok().map(str::to_owned);
    (tokenizer_from_gguf(&g).expect("tokenizer from GGUF"), pre)
}

pub struct Loaded {
    pub tok: Tokenizer,
    pub template: Option<String>,
    pub bos_text: String,
    pub eos_text: String,
}

pub fn load_default() -> Option<Loaded> {
    let path = model_path()?;
    let g = GgufFile::open(&path).expect("open GGUF");
    let tok = tokenizer_from_gguf(&g).expect("tokenizer from GGUF");
    let template = g.get_str("tokenizer.chat_template").ok().map(str::to_owned);
    let text = |id: Option<u32>| id.map(|i| tok.token_text(i).expect("id").to_string()).unwrap_or_default();
    let (bos_text, eos_text) = (text(tok.bos()), text(tok.eos()));
    Some(Loaded { tok, template, bos_text, eos_text })
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub fn template_of(l: &Loaded) -> ChatTemplate {
    ChatTemplate::new(l.template.as_deref().expect("model has a chat template"), &l.bos_text, &l.eos_text)
        .expect("template compiles")
}

/// Dense f32 transformer written the obvious way from the dequantized weights: the definition the
/// engine is checked against. K and V are rounded to f16 as the cache stores them.
pub fn reference_logits<B: AsRef<[u8]>>(file: &Gguf<B>, c: &ModelConfig, tokens: &[u32]) -> Vec<f32> {
    let c = c.clone();
    let w = |n: &str| file.tensor(n).unwrap().dequantize().unwrap();
    let (d, hd, kvd) = (c.n_embd, c.head_dim, c.kv_dim());
    let matvec = |wt: &[f32], x: &[f32], rows: usize| -> Vec<f32> {
        (0..rows)
            .map(|r| wt[r * x.len()..(r + 1) * x.len()].iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let norm = |x: &[f32], g: &[f32]| -> Vec<f32> {
        let s = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + c.rms_eps).sqrt();
        x.iter().zip(g).map(|(v, g)| v * s * g).collect()
    };
    let rope = |x: &mut [f32], pos: usize| {
        for h in x.chunks_mut(hd) {
            for i in (0..c.rope_dims).step_by(2) {
                let th = pos as f32 * c.rope_base.powf(-(i as f32) / c.rope_dims as f32);
                let (s, co) = th.sin_cos();
                let (a, b) = (h[i], h[i + 1]);
                h[i] = a * co - b * s;
                h[i + 1] = a * s + b * co;
            }
        }
    };
    let emb = w("token_embd.weight");
    let mut xs: Vec<Vec<f32>> =
        tokens.iter().map(|&t| emb[t as usize * d..(t as usize + 1) * d].to_vec()).collect();
    for l in 0..c.n_layer {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let (wq, wk, wv, wo) = (w(&n("attn_q")), w(&n("attn_k")), w(&n("attn_v")), w(&n("attn_output")));
        let (an, fnw) = (w(&n("attn_norm")), w(&n("ffn_norm")));
        let (wg, wu, wd) = (w(&n("ffn_gate")), w(&n("ffn_up")), w(&n("ffn_down")));
        let f16r = |v: Vec<f32>| v.into_iter().map(|x| f16::from_f32(x).to_f32()).collect::<Vec<_>>();
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (p, x) in xs.iter().enumerate() {
            let h = norm(x, &an);
            let mut q = matvec(&wq, &h, d);
            let mut k = matvec(&wk, &h, kvd);
            rope(&mut q, p);
            rope(&mut k, p);
            qs.push(q);
            ks.push(f16r(k));
            vs.push(f16r(matvec(&wv, &h, kvd)));
        }
        for p in 0..xs.len() {
            let mut att = vec![0f32; d];
            for h in 0..c.n_head {
                let kh = h / (c.n_head / c.n_head_kv);
                let q = &qs[p][h * hd..(h + 1) * hd];
                let sc: Vec<f32> = (0..=p)
                    .map(|j| {
                        q.iter().zip(&ks[j][kh * hd..(kh + 1) * hd]).map(|(a, b)| a * b).sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let mx = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = sc.iter().map(|s| (s - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for j in 0..=p {
                    for i in 0..hd {
                        att[h * hd + i] += e[j] / z * vs[j][kh * hd + i];
                    }
                }
            }
            let o = matvec(&wo, &att, d);
            let x = &mut xs[p];
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = norm(x, &fnw);
            let (gt, up) = (matvec(&wg, &h, c.n_ff), matvec(&wu, &h, c.n_ff));
            let act: Vec<f32> = gt.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let dn = matvec(&wd, &act, d);
            x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
        }
    }
    let last = norm(xs.last().unwrap(), &w("output_norm.weight"));
    let out = if file.tensor_info("output.weight").is_some() { w("output.weight") } else { emb };
    matvec(&out, &last, c.n_vocab)
}
