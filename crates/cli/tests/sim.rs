//! `tokenpath sim` against the real thing: a real server's run, its step log fitted by
//! `tokenpath calibrate`, and the same workload simulated — the decisions are the shared
//! scheduler's, so what they decide (prompt tokens, prefix-cache hits, output tokens) must be the
//! same request for request (ARCHITECTURE invariant 23).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::Value;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tokenpath");
const WORKLOAD: &str = "shared-prefix:2:128:16-48:8-8";

fn run(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).env("NO_COLOR", "1").output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tokenpath {args:?} failed:\n{text}");
    text
}

fn requests(path: &Path) -> Vec<Value> {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["requests"].as_array().unwrap().clone()
}

fn usage(r: &Value, key: &str) -> u64 {
    r["usage"][key].as_u64().unwrap_or(0)
}

fn e2e_ms(r: &[Value]) -> f64 {
    r.iter()
        .map(|x| (x["t_done"].as_u64().unwrap() - x["t_send"].as_u64().unwrap()) as f64 / 1e6)
        .sum::<f64>()
        / r.len() as f64
}

#[test]
fn the_simulator_replays_a_real_run_with_the_same_decisions() {
    let Some(model) = support::default_model() else { return };
    let dir = std::env::temp_dir().join(format!("tokenpath-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = |name: &str| dir.join(name).display().to_string();
    let m = model.display().to_string();
    let steps = p("steps.jsonl");
    let mut served = support::serve(&model, &["--step-log", &steps]);
    let url = format!("http://127.0.0.1:{}", served.port);
    let load = ["--workload", WORKLOAD, "--concurrency", "1", "--num-requests", "10", "--tokenizer", &m];
    let real = p("real.json");
    let mut bench = vec!["bench", "--url", &url, "--ignore-eos", "--no-progress", "--out", &real];
    bench.extend(load);
    run(&bench);
    served.child.kill().unwrap();
    served.child.wait().unwrap();
    let calib = p("calib.json");
    let fitted = run(&["calibrate", "--step-log", &steps, "--model", &m, "--run", &real, "--out", &calib]);
    assert!(fitted.contains("step model median error"), "{fitted}");
    let sim = p("sim.json");
    let mut args = vec!["sim", "--calibration", &calib, "--out", &sim, "--step-log-out"];
    let sim_steps = p("sim-steps.jsonl");
    args.push(&sim_steps);
    args.extend(load);
    let said = run(&args);
    assert!(said.contains("sim: 10 requests"), "{said}");
    // The same seed gives the same bytes.
    let (again, again_steps) = (p("sim-again.json"), p("sim-again-steps.jsonl"));
    let mut twice = vec!["sim", "--calibration", &calib, "--out", &again, "--step-log-out", &again_steps];
    twice.extend(load);
    run(&twice);
    assert!(std::fs::read(&sim).unwrap() == std::fs::read(&again).unwrap(), "two runs of one seed differ");
    assert!(
        std::fs::read(&sim_steps).unwrap() == std::fs::read(&again_steps).unwrap(),
        "their step logs differ"
    );

    let (real, sim) = (requests(Path::new(&real)), requests(Path::new(&sim)));
    assert_eq!(real.len(), 10);
    assert_eq!(sim.len(), 10);
    for (i, (a, b)) in real.iter().zip(&sim).enumerate() {
        for key in ["prompt_tokens", "completion_tokens", "cached_tokens"] {
            assert_eq!(usage(a, key), usage(b, key), "request {i}: {key} differs\nreal {a}\nsim {b}");
        }
    }
    assert!(
        real.iter().any(|r| usage(r, "cached_tokens") >= 128),
        "the workload's shared prefixes were hits"
    );
    // Timing is modelled, not decided: only a gross error (a unit slip) is caught here, the
    // fidelity itself is measured by scripts/validate-sim.
    let ratio = e2e_ms(&sim) / e2e_ms(&real);
    assert!((0.33..3.0).contains(&ratio), "simulated E2E {ratio:.2}× the real one");
    // The simulated step log is a step log: `calibrate` reads it, and scores the calibration
    // on it.
    run(&["calibrate", "--step-log", &sim_steps, "--model", &m, "--out", &p("calib-of-sim.json")]);
    let scored = run(&["calibrate", "--step-log", &sim_steps, "--score", &calib]);
    assert!(
        scored.contains("held-out steps: step model median error") && scored.contains("noise floor"),
        "{scored}"
    );
    // The bench's capacity search, each probe simulated.
    let search = p("search.json");
    let said = run(&[
        "sim",
        "--calibration",
        &calib,
        "--workload",
        "fixed:64:8",
        "--rate",
        "1",
        "--num-requests",
        "12",
        "--slo",
        "ttft:5s",
        "--find-max-rate",
        "--max-probes",
        "3",
        "--out",
        &search,
    ]);
    assert!(said.contains("max rate meeting") || said.contains("no probed rate met"), "{said}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&search).unwrap()).unwrap();
    assert_eq!(doc["find_max_rate"]["probes"].as_array().unwrap().len(), 3, "{doc}");
    let refused = Command::new(BIN)
        .args(["sim", "--calibration", &calib, "--concurrency", "2", "--slo", "ttft:5s", "--find-max-rate"])
        .output()
        .unwrap();
    assert!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr).contains("sets the offered rate")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plan_answers_for_a_catalogued_fleet_and_refuses_unknown_hardware() {
    let dir = std::env::temp_dir().join(format!("tokenpath-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json").display().to_string();
    let said = run(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h100",
        "--gpus",
        "4",
        "--workload",
        "fixed:4000:64",
        "--rate",
        "8",
        "--num-requests",
        "60",
        "--slo",
        "ttft:2s,tpot:20ms",
        "--out",
        &out,
    ]);
    assert!(said.contains("answer:"), "{said}");
    for split in ["4 colocated", "1P3D", "2P2D", "3P1D"] {
        assert!(said.contains(split), "{split} missing:\n{said}");
    }
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(doc["rows"].as_array().unwrap().len(), 4);
    let bad =
        Command::new(BIN).args(["plan", "--model", "llama-3.1-8b", "--gpu", "tpu-v9"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown GPU \"tpu-v9\" (known: h100"), "{bad:?}");
    let bad = Command::new(BIN)
        .args(["plan", "--model", "llama-3.1-70b", "--gpu", "rtx4090", "--gpus", "1"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("does not fit"), "{bad:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
