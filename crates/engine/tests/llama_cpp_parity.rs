//! Parity with llama.cpp on the real default model.
//!
//! `fixtures/llama_cpp_greedy.json` was produced by llama.cpp (llama-cpp-python 0.3.36, same GGUF,
//! `scripts/peer/greedy.py`; `scripts/parity-engine` re-runs it live): for 20 varied prompts,
//! llama.cpp's prompt token ids, its greedy continuation (≤ 64 tokens), the top-50 logits of the
//! first step and the top two logits of every step. Our engine is fed the same ids.
//!
//! Two tests, one per arithmetic ([`Numerics`]):
//! - `Numerics::Ggml` reproduces ggml's CPU arithmetic rounding for rounding (model/ggml.rs), so
//!   the criterion applies as written: greedy continuations identical for ≥ 18 of 20
//!   prompts, any divergence a near-tie (top-2 gap < 0.1), the first step's logit difference
//!   reported (measured: 20/20, difference 0 — every logit bit-identical).
//! - `Numerics::Fast`, the serving kernels, round differently. With Q8 activation quantization
//!   between every layer the pass is chaotic: a one-ulp change flips 8-bit roundings and moves
//!   the default model's logits by up to ~1.0, so free-running greedy continuations part at the
//!   first near-tie (llama.cpp's own flash-attention path agrees with its default path on only
//!   5/20 prompts, first-step difference 0.76). The test asserts what is meaningful there:
//!   1. teacher-forced (fed llama.cpp's tokens) our argmax equals llama.cpp's token at ≥ 90% of
//!      all steps, and every disagreement is a near-tie at the noise level (top-2 gap < 1.0 on
//!      either side) — a wrong kernel or RoPE gives gaps of several logits on most steps;
//!   2. the first step's top-50 logits are within 2.0 of llama.cpp's (a real bug is off by 5–20).
//!
//! Both report how many free-running greedy continuations are identical and where the others
//! part, with both top-2 gaps. `TOKENPATH_PARITY_JSON` points them at another fixture.

#![allow(clippy::unwrap_used)]

mod support;

use serde_json::Value;
use tokenpath_engine::kv_cache::{BlockTable, KvCache, KvLayout};
use tokenpath_engine::model::{BatchItem, Model, Numerics};

/// Logit noise of the quantized forward pass (see the module docs).
const NOISE: f32 = 1.0;

fn top2(logits: &[f32]) -> [(usize, f32); 2] {
    let mut best = [(0usize, f32::NEG_INFINITY); 2];
    for (i, &l) in logits.iter().enumerate() {
        if l > best[0].1 {
            best[1] = best[0];
            best[0] = (i, l);
        } else if l > best[1].1 {
            best[1] = (i, l);
        }
    }
    best
}

struct Runner<'a> {
    model: &'a Model,
    cache: KvCache,
}

impl Runner<'_> {
    fn step(&mut self, table: &mut BlockTable, tokens: &[u32]) -> Vec<f32> {
        let mut b = [BatchItem { table, tokens, all_logits: false }];
        self.model.forward(&mut self.cache, &mut b).expect("forward").into_first()
    }
}

/// The fixture (`TOKENPATH_PARITY_JSON`, else the committed one).
fn fixture() -> Value {
    let path = std::env::var_os("TOKENPATH_PARITY_JSON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| support::fixture("llama_cpp_greedy.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A KV cache for the fixture's longest case, in blocks of 16.
fn cache_for(model: &Model) -> KvCache {
    let c = model.config();
    KvCache::new(
        KvLayout { n_layer: c.n_layer, kv_dim: c.kv_dim(), head_dim: c.head_dim, block_size: 16 },
        4096 / 16,
    )
    .unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Top-1 minus top-2 logit of one `step_top2` entry.
fn gap(v: &Value) -> f32 {
    (v[0][1].as_f64().unwrap() - v[1][1].as_f64().unwrap()) as f32
}

/// Largest difference between `logits` and the fixture's first-step top-50.
fn first_step_diff(case: &Value, logits: &[f32]) -> f32 {
    case["first_step_top"].as_array().unwrap().iter().fold(0f32, |m, pair| {
        let (id, l) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32);
        m.max((logits[id] - l).abs())
    })
}

#[test]
fn engine_tracks_llama_cpp() {
    let Some(path) = support::model_path() else { return };
    let doc = fixture();
    let model = Model::open(&path).unwrap();
    let mut r = Runner { model: &model, cache: cache_for(&model) };

    let cases = doc["cases"].as_array().unwrap();
    let (mut steps, mut agree, mut identical, mut max_first) = (0usize, 0usize, 0usize, 0f32);
    let mut not_ties = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap_or("?");
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["continuation"]);
        let theirs = case["step_top2"].as_array().unwrap();

        // Teacher-forced: llama.cpp's tokens in, our argmax compared at every step.
        let mut table = BlockTable::default();
        let mut logits = r.step(&mut table, &prompt);
        max_first = max_first.max(first_step_diff(case, &logits));
        // Up to the first disagreement, teacher forcing *is* free-running greedy: that step is
        // where the two greedy continuations part.
        let mut parted = None;
        for (k, &tok) in want.iter().enumerate() {
            let [(ours, l0), (_, l1)] = top2(&logits);
            steps += 1;
            if ours as u32 == tok {
                agree += 1;
            } else if parted.is_none() {
                parted = Some((k, l0 - l1, gap(&theirs[k])));
            }
            if ours as u32 != tok && l0 - l1 >= NOISE && gap(&theirs[k]) >= NOISE {
                not_ties.push(format!(
                    "{name} step {k}: ours {ours} (gap {:.2}) vs {tok} (gap {:.2})",
                    l0 - l1,
                    gap(&theirs[k])
                ));
            }
            logits = r.step(&mut table, &[tok]);
        }
        r.cache.free_table(&mut table).unwrap();

        match parted {
            None => identical += 1,
            Some((k, ours, theirs)) => {
                eprintln!(
                    "{name}: greedy parts at step {k} (top-2 gap ours {ours:.3}, llama.cpp {theirs:.3})"
                )
            }
        }
    }
    let rate = agree as f64 / steps as f64;
    eprintln!(
        "llama.cpp parity: teacher-forced top-1 agreement {agree}/{steps} ({:.1}%); free-running greedy identical {identical}/{}; max first-step logit difference (top-50 ids) {max_first:.3}",
        rate * 100.0,
        cases.len()
    );
    assert_eq!(r.cache.used_blocks(), 0);
    assert!(not_ties.is_empty(), "disagreements that are not near-ties:\n{}", not_ties.join("\n"));
    assert!(rate >= 0.9, "teacher-forced agreement {rate:.3} < 0.9");
    assert!(max_first < 2.0, "first-step logits differ by {max_first}");
}

/// The criterion, on the engine's [`Numerics::Ggml`] forward (paged KV, the same
/// `Model::forward`): greedy continuations identical for ≥ 18 of 20 prompts, every divergence a
/// near-tie (top-2 gap < 0.1), the first step's logit difference reported.
#[test]
fn ggml_numerics_reproduce_llama_cpp_greedy() {
    let Some(path) = support::model_path() else { return };
    let doc = fixture();
    let mut model = Model::open(&path).unwrap();
    model.set_numerics(Numerics::Ggml).unwrap();
    let mut r = Runner { model: &model, cache: cache_for(&model) };
    let cases = doc["cases"].as_array().unwrap();
    let (mut identical, mut max_first, mut parted) = (0usize, 0f32, Vec::new());
    for case in cases {
        let name = case["name"].as_str().unwrap_or("?");
        let want = ids(&case["continuation"]);
        let theirs = case["step_top2"].as_array().unwrap();
        let mut table = BlockTable::default();
        let mut logits = r.step(&mut table, &ids(&case["prompt_ids"]));
        max_first = max_first.max(first_step_diff(case, &logits));
        // Free-running: our own argmax is fed back.
        let mut same = true;
        for (k, &tok) in want.iter().enumerate() {
            let [(next, l0), (_, l1)] = top2(&logits);
            if next as u32 != tok {
                parted.push((name.to_string(), k, l0 - l1, gap(&theirs[k])));
                same = false;
                break;
            }
            logits = r.step(&mut table, &[next as u32]);
        }
        identical += same as usize;
        r.cache.free_table(&mut table).unwrap();
    }
    for (name, k, ours, theirs) in &parted {
        eprintln!(
            "ggml numerics: {name} parts at step {k} (top-2 gap ours {ours:.3}, llama.cpp {theirs:.3})"
        );
    }
    eprintln!(
        "ggml numerics vs llama.cpp: greedy identical {identical}/{}; max first-step logit difference (top-50 ids) {max_first}",
        cases.len()
    );
    assert_eq!(r.cache.used_blocks(), 0);
    assert!(identical * 10 >= cases.len() * 9, "greedy identical for only {identical}/{}", cases.len());
    for (name, k, ours, theirs) in &parted {
        assert!(ours.min(*theirs) < 0.1, "{name} step {k}: not a near-tie ({ours:.3} vs {theirs:.3})");
    }
}
