//! Tests against GGUF files this crate did not write.
//!
//! - `python_fixture`: a small file written by llama.cpp's own Python package (gguf-py), holding
//!   random blocks of every supported type and gguf-py's dequantization of each; it checks the
//!   parser against an independent writer and our block layouts against an independent decoder.
//! - `smollm2_if_present`: the real default model, when it has been downloaded (see
//!   `scripts/setup`); skipped with a note otherwise, except under CI, where a missing model fails.

mod support;

use std::path::PathBuf;

use tokenpath_engine::gguf::GgufFile;
use tokenpath_engine::quant::{GgmlType, Kernel};

#[test]
fn python_fixture() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/python_fixture.gguf");
    let g = GgufFile::open(&path).expect("fixture present (scripts/make_python_fixture.py)");
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_u32("fixture.version").unwrap(), 1);
    assert_eq!(g.get_str_array("fixture.strings").unwrap(), ["a", "bc", ""]);
    let mut checked = 0;
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::F16]
    {
        let t = g.tensor(ty.name()).unwrap();
        assert_eq!(t.ty, ty);
        let got = t.dequantize().unwrap();
        let want = g.tensor(&format!("{}.expected", ty.name())).unwrap().dequantize().unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "{ty} element {i}: ours {a}, gguf-py {b}");
        }
        checked += 1;
    }
    assert_eq!(checked, 6);
}

#[test]
fn smollm2_if_present() {
    let Some(path) = support::model_path() else { return };
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(g.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(g.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(g.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(g.get_u32("llama.feed_forward_length").unwrap(), 1536);
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(g.get_i32_array("tokenizer.ggml.token_type").unwrap().len(), 49152);
    assert!(g.get_str("tokenizer.chat_template").unwrap().contains("<|im_start|>"));
    assert_eq!(g.tensors().len(), 272);

    let mut total = 0usize;
    for t in g.tensor_views() {
        t.require_supported().unwrap();
        let m = t.matrix().unwrap();
        let v = m.dequantize().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{} has non-finite values", t.name);
        total += v.len();
        // Every matrix also runs through the fast kernel: finite outputs, equal to the
        // portable kernel up to summation order.
        if m.rows() > 1 && m.ty() != GgmlType::F32 {
            let x: Vec<f32> = (0..m.cols()).map(|i| ((i * 37) % 17) as f32 / 8.0 - 1.0).collect();
            let act = m.prepare_input(&x).unwrap();
            let rows = m.rows().min(64);
            let sub = tokenpath_engine::quant::QMatrix::new(
                m.ty(),
                rows,
                m.cols(),
                &t.data[..rows * m.row_bytes()],
            )
            .unwrap();
            let (mut fast, mut slow) = (vec![0f32; rows], vec![0f32; rows]);
            sub.matvec_with(Kernel::best(), &act, &mut fast).unwrap();
            sub.matvec_with(Kernel::Scalar, &act, &mut slow).unwrap();
            for (a, b) in fast.iter().zip(&slow) {
                assert!(a.is_finite() && (a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{}: {a} vs {b}", t.name);
            }
        }
    }
    // 134.5M parameters.
    assert!(total > 130_000_000 && total < 140_000_000, "{total} parameters");
}
