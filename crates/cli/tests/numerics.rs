//! `tokenpath generate --numerics ggml` through the real binary: greedy text equals llama.cpp's
//! continuation from the committed parity fixture (produced by llama-cpp-python on the same GGUF),
//! and a model the mode cannot reproduce is refused with a clear message.
#![allow(clippy::unwrap_used)]

mod support;

use std::process::Command;
use tokenpath_engine::Engine;

fn fixture_case(name: &str) -> (String, Vec<u32>) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let prompts: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("scripts/peer/parity_prompts.json")).unwrap(),
    )
    .unwrap();
    let text = prompts.as_array().unwrap().iter().find(|p| p["name"] == name).unwrap()["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("crates/engine/tests/fixtures/llama_cpp_greedy.json")).unwrap(),
    )
    .unwrap();
    let case = fixture["cases"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap();
    let ids = case["continuation"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    (text, ids)
}

#[test]
fn ggml_numerics_generate_llama_cpp_text() {
    let Some(model) = support::default_model() else { return };
    let engine = Engine::open(&model).unwrap();
    // Both cases part from llama.cpp under `--numerics fast` (a near-tie within 64 tokens).
    for name in ["raw_code", "raw_digits"] {
        let (prompt, ids) = fixture_case(name);
        let want = engine.tokenizer().decode_lossy(&ids, false).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
            .args(["generate", "--numerics", "ggml", "--raw", "--max-tokens", &ids.len().to_string()])
            .arg("--model")
            .arg(&model)
            .arg(&prompt)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let got = String::from_utf8(out.stdout).unwrap();
        assert_eq!(got.strip_suffix('\n').unwrap_or(&got), want, "{name}");
    }
}

#[test]
fn ggml_numerics_refuse_a_model_they_cannot_reproduce() {
    let dir = std::env::temp_dir().join(format!("tokenpath-numerics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-f32.gguf");
    let spec = tokenpath_engine::tiny::TinySpec::default();
    std::fs::write(&path, tokenpath_engine::tiny::tiny_model_bytes(&spec).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["generate", "--numerics", "ggml", "--max-tokens", "2", "--model"])
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ggml numerics reproduce Q4_1 and Q8_0 matrices only"), "{err}");
}
