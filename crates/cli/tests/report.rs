//! `tokenpath report` through the real binary: a saved run in, the explicit metrics out.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions
use std::process::Command;
use tokenpath_timeline::{ClientRecord, RequestId, StreamEvent, Usage};

const MS: u64 = 1_000_000;

fn records_file(name: &str) -> std::path::PathBuf {
    let recs: Vec<ClientRecord> = (0..10u64)
        .map(|i| {
            let mut r = ClientRecord::new(RequestId(i), i * 100 * MS, i * 100 * MS, true);
            r.events.push(StreamEvent { at_ns: (i * 100 + 1) * MS, tokens: 0 }); // role-only
            for k in 0..4 {
                r.events.push(StreamEvent { at_ns: (i * 100 + 30 + 20 * k) * MS, tokens: 1 });
            }
            r.usage = Some(Usage { prompt_tokens: 100, completion_tokens: 4, cached_tokens: Some(10) });
            r
        })
        .collect();
    let path = std::env::temp_dir().join(format!("tp-cli-{}-{name}.jsonl", std::process::id()));
    let body: String = recs.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    std::fs::write(&path, body).unwrap();
    path
}

#[test]
fn report_json_has_metric_unit_stat_keys() {
    let path = records_file("ok");
    let out = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["report", "--json", "--slo", "ttft:50ms,tpot:25ms"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["summary"]["ttft_ms"]["p99"], 30.0, "role-only chunk must not count as first token");
    assert_eq!(v["summary"]["tpot_ms"]["p50"], 20.0);
    assert_eq!(v["summary"]["chunk_gap_ms"]["max"], 20.0);
    assert_eq!(v["summary"]["attainment"], 1.0);
    assert_eq!(v["summary"]["completed"], 10);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn bad_slo_is_a_clear_usage_error() {
    let path = records_file("bad");
    let out = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["report", "--slo", "latency:2s"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown metric \"latency\""), "{err}");
    std::fs::remove_file(path).unwrap();
}
