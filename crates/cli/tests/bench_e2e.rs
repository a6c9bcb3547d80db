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
    let mut served = support::serve(&model, &["--kv-tokens", "4096"]);
    let port = served.port;
    let (a, b) = (dir.join("a.json"), dir.join("b.json"));
    bench(port, &a);
    bench(port, &b);
    // The legacy completions API, streamed and not: the raw prompt, the same token accounting.
    for stream in [true, false] {
        let c = dir.join(format!("completions-{stream}.json"));
        let mut cmd = Command::new(BIN);
        cmd.args(["bench", "--url", &format!("http://127.0.0.1:{port}"), "--endpoint", "completions"])
            .args(["--workload", "fixed:24:6", "--num-requests", "4", "--concurrency", "2", "--ignore-eos"])
            .arg("--out")
            .arg(&c);
        if !stream {
            cmd.arg("--no-stream");
        }
        assert!(cmd.status().unwrap().success());
        let run: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&c).unwrap()).unwrap();
        assert_eq!(run["summary"]["completed"], 4, "{}", run["errors"]);
        for r in run["requests"].as_array().unwrap() {
            assert_eq!(r["usage"]["completion_tokens"], 6, "{r}");
        }
    }
    let _ = served.child.kill();
    let _ = served.child.wait();

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

/// The workload and run-control flags through the real binary against the tiny model: a
/// multi-turn run with `--tokenizer` (exact client token counts checked against `usage`), with the
/// GGUF file and with the same tokenizer as a Hugging Face `tokenizer.json`, a shared-prefix run
/// bounded by a ramp, and a `--find-max-rate` search with a tiny budget.
#[test]
fn workloads_tokenizer_ramp_and_rate_search() {
    let dir = std::env::temp_dir().join(format!("tp-e2e-wl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    let spec = TinySpec { n_ctx: 1024, ..TinySpec::default() };
    std::fs::write(&model, tiny_model_bytes(&spec).unwrap()).unwrap();
    let mut served = support::serve(&model, &["--kv-tokens", "8192"]);
    let port = served.port;
    let url = format!("http://127.0.0.1:{port}");
    let bench = |extra: &[&str], out: &Path| {
        let o = Command::new(BIN)
            .args(["bench", "--url", &url, "--ignore-eos", "--seed", "7"])
            .args(extra)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        // stdout (the report) then stderr (the log lines).
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
        (text, json)
    };

    let (text, mt) = bench(
        &["--workload", "multi-turn:2:8-16:3-3", "--rate", "20", "--num-requests", "6"]
            .iter()
            .copied()
            .chain(["--tokenizer", model.to_str().unwrap()])
            .collect::<Vec<_>>(),
        &dir.join("mt.json"),
    );
    assert_eq!(mt["summary"]["completed"], 6, "{}", mt["errors"]);
    let reqs = mt["requests"].as_array().unwrap();
    // A second turn's prompt holds the first turn's prompt and answer: it is longer on the server.
    for s in 0..3 {
        let (a, b) = (&reqs[2 * s]["usage"]["prompt_tokens"], &reqs[2 * s + 1]["usage"]["prompt_tokens"]);
        assert!(b.as_u64().unwrap() > a.as_u64().unwrap() + 3, "session {s}: {a} then {b}");
    }
    let check = &mt["token_check"]["prompt"];
    assert_eq!(check["compared"], 6, "{mt}");
    assert_eq!(check["disagree"], 0, "our tokenizer and template are the server's: {check}");
    assert!(text.contains("tokens vs usage"), "{text}");

    // The same with the model's tokenizer as Hugging Face files (`tokenizer.json` and the
    // `tokenizer_config.json` holding the chat template), given as their directory.
    let hf_dir = dir.join("hf");
    support::hf_json::write_hf_files(&model, &hf_dir);
    let (text, hf) = bench(
        &["--workload", "multi-turn:2:8-16:3-3", "--rate", "20", "--num-requests", "6"]
            .iter()
            .copied()
            .chain(["--tokenizer", hf_dir.to_str().unwrap()])
            .collect::<Vec<_>>(),
        &dir.join("mt-hf.json"),
    );
    assert_eq!(hf["summary"]["completed"], 6, "{}", hf["errors"]);
    assert_eq!(hf["token_check"]["prompt"]["compared"], 6, "{hf}");
    assert_eq!(
        hf["token_check"]["prompt"]["disagree"], 0,
        "tokenizer.json + template: {}",
        hf["token_check"]
    );
    assert_eq!(hf["token_check"]["output"]["compared"], 6, "{hf}");
    assert!(hf["requests"].as_array().unwrap().iter().all(|r| r["prompt_tokens_hint"].is_u64()));
    assert!(text.contains("tokens vs usage"), "{text}");
    assert!(text.contains("Hugging Face tokenizer.json, 267 tokens, chat template from"), "{text}");
    // A bare tokenizer.json (no config beside it): outputs are re-tokenized, prompts are not
    // counted, and the report says so.
    let bare = dir.join("bare").join("tokenizer.json");
    std::fs::create_dir_all(bare.parent().unwrap()).unwrap();
    std::fs::copy(hf_dir.join("tokenizer.json"), &bare).unwrap();
    let (text, b) = bench(
        &[
            "--workload",
            "fixed:8:2",
            "--rate",
            "20",
            "--num-requests",
            "2",
            "--tokenizer",
            bare.to_str().unwrap(),
        ],
        &dir.join("bare.json"),
    );
    assert!(
        text.contains("no chat template (no ") && text.contains("prompt token counts are not checked"),
        "{text}"
    );
    assert_eq!(b["token_check"]["prompt"]["compared"], 0, "{b}");
    assert_eq!(b["token_check"]["output"]["compared"], 2, "{b}");
    assert!(
        b["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains("no chat template")),
        "{b}"
    );

    let (_, sp) = bench(
        &["--workload", "shared-prefix:2:64:4-8:2-2", "--arrival", "constant", "--ramp", "5:15:1"],
        &dir.join("sp.json"),
    );
    // Λ(1 s) = 10 expected arrivals: constant arrivals through the ramp send 11 (t = 0 included).
    assert_eq!(sp["requests"].as_array().unwrap().len(), 11);
    assert!(sp["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains("approximate")));

    let (text, search) = bench(
        &["--workload", "fixed:8:2", "--rate", "2", "--num-requests", "3"]
            .iter()
            .copied()
            .chain(["--find-max-rate", "--slo", "e2e:30s", "--attainment", "0.9", "--max-probes", "2"])
            .collect::<Vec<_>>(),
        &dir.join("search.json"),
    );
    let _ = served.child.kill();
    let _ = served.child.wait();
    let probes = search["find_max_rate"]["probes"].as_array().unwrap();
    assert_eq!(probes.len(), 2, "{search}");
    assert_eq!(search["find_max_rate"]["max_rate"], 4.0, "{search}");
    assert!(text.contains("max rate meeting"), "{text}");
    std::fs::remove_dir_all(dir).unwrap();
}
