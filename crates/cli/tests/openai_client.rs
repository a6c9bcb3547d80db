//! The official `openai` Python client (installed by `scripts/setup --deps`) against
//! `tokenpath serve` on a tiny model: chat and completions, streamed and not, `usage`, and the
//! error classes it maps our statuses to. The checks live in `openai_client.py`.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use std::process::Command;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};

#[test]
fn official_openai_client_works_unchanged() {
    let has_client =
        Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    if !has_client {
        assert!(
            std::env::var_os("CI").is_none(),
            "the openai client is missing under CI: scripts/setup --deps installs it"
        );
        eprintln!("SKIP: python3 -m pip install openai (scripts/setup --deps) to run this test");
        return;
    }
    let model = std::env::temp_dir().join(format!("tp-openai-{}.gguf", std::process::id()));
    std::fs::write(&model, tiny_model_bytes(&TinySpec { n_ctx: 1024, ..TinySpec::default() }).unwrap())
        .unwrap();
    let mut served = support::serve(&model, &["--kv-tokens", "4096"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{}", served.port))
        .output()
        .unwrap();
    let _ = served.child.kill();
    let _ = served.child.wait();
    let _ = std::fs::remove_file(&model);
    assert!(
        out.status.success(),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
