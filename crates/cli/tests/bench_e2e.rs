//! The whole path through real processes: `tokenpath serve` on a tiny model file, `tokenpath
//! bench` against it over loopback twice, then `tokenpath compare` on the two runs, with and
//! without a failing regression gate.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use std::path::Path;
use std::process::Command;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};

const BIN: &str = env!("CARGO_BIN_EXE_tokenpath");

fn bench(port: u16, out: &Path) {
    let status = Command::new(BIN)
        .args(["bench", "--url", &format!("http://127.0.0.1:{port}")])
        .args(["--workload", "fixed:24:6", "--rate", "20", "--num-requests", "12", "--ignore-eos"])
        .args(["--slo", "e2e:60s"])
        .arg("--out")
        .arg(out)
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn serve_bench_compare_through_real_processes() {
    let dir = std::env::temp_dir().join(format!("tp-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    let spec = TinySpec { n_ctx: 1024, ..TinySpec::default() };
    std::fs::write(&model, tiny_model_bytes(&spec).unwrap()).unwrap();
    let support::Served { child: mut server, port, .. } = support::serve(&model, &["--kv-tokens", "4096"]);
    let (a, b) = (dir.join("a.json"), dir.join("b.json"));
    bench(port, &a);
    bench(port, &b);
    let _ = server.kill();
    let _ = server.wait();

    let run: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&a).unwrap()).unwrap();
    assert_eq!(run["summary"]["completed"], 12, "{}", run["errors"]);
    assert_eq!(run["requests"].as_array().unwrap().len(), 12);
    assert_eq!(run["summary"]["attainment"], 1.0);
    for r in run["requests"].as_array().unwrap() {
        assert_eq!(r["usage"]["completion_tokens"], 6, "ignore_eos runs to max_tokens");
        assert!(r["server"]["stages_ms"]["prefill"].as_f64().is_some(), "server timing joined");
    }
    assert!(run["stages"]["decode_ms"]["p99"].as_f64().is_some());
    assert!(run["tail"].as_array().is_some_and(|t| !t.is_empty()));

    let cmp = Command::new(BIN).arg("compare").arg(&a).arg(&b).output().unwrap();
    assert!(cmp.status.success());
    let text = String::from_utf8_lossy(&cmp.stdout);
    assert!(text.contains("ttft") && text.contains("prefill"), "{text}");
    // A gate on a metric the runs lack (no PD, so no kv_transfer) fails rather than passing
    // silently; the gates' arithmetic is unit-tested in the bench crate.
    let gated = Command::new(BIN)
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .args(["--fail-if", "kv_transfer.p99>+10%"])
        .output()
        .unwrap();
    assert_eq!(gated.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&gated.stderr).contains("not present"));
    std::fs::remove_dir_all(dir).unwrap();
}
