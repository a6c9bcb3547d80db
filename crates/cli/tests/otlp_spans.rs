//! Issue 18, OTLP in, through real processes: `tokenpath mock-engine` plays a vLLM that exports
//! one `llm_request` span per traced request (OTLP/HTTP protobuf, then OTLP/gRPC) to the
//! receiver `tokenpath bench --otlp-listen` runs. Every request carries a fresh `traceparent`;
//! every span the engine sent is joined to its request by trace id, its stages are exactly the
//! span's attributes (checked against the engine's own log of what it exported), marked as
//! measured by the span, with unmapped attributes kept raw; a run whose engine exports nothing
//! says so instead of passing silently.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_tokenpath");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Mock(Child, u16);

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mock(extra: &[&str], log: &Path) -> Mock {
    let mut child = Command::new(BIN)
        .args(["mock-engine", "--listen", "127.0.0.1:0", "--tokens", "4", "--token-delay-us", "3000"])
        .args(extra)
        .arg("--log")
        .arg(log)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let port = line.trim().strip_prefix("port=").unwrap().parse().unwrap();
    Mock(child, port)
}

fn bench(mock_port: u16, otlp_port: u16, wait_s: &str, out: &Path) -> String {
    let o = Command::new(BIN)
        .args(["bench", "--url", &format!("http://127.0.0.1:{mock_port}"), "--model", "mock"])
        .args(["--workload", "fixed:8:4", "--num-requests", "6", "--concurrency", "2"])
        .args(["--otlp-listen", &format!("127.0.0.1:{otlp_port}"), "--otlp-wait-s", wait_s])
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    stdout
}

fn exported_spans(log: &Path) -> HashMap<String, Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?.get("span").cloned())
        .map(|s| (s["trace_id"].as_str().unwrap().to_owned(), s))
        .collect()
}

#[test]
fn an_engines_spans_join_each_request_by_trace_id_over_http_and_grpc() {
    let dir = std::env::temp_dir().join(format!("tp-otlp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for grpc in [false, true] {
        let otlp_port = free_port();
        let log = dir.join(format!("mock-{grpc}.jsonl"));
        let endpoint = format!("http://127.0.0.1:{otlp_port}");
        let mut args = vec!["--otlp-endpoint", endpoint.as_str()];
        if grpc {
            args.push("--otlp-grpc");
        }
        let m = mock(&args, &log);
        let out = dir.join(format!("run-{grpc}.json"));
        let table = bench(m.1, otlp_port, "30", &out);
        assert!(
            table.contains("engine spans: 6 of 6 requests joined by trace id (6 with stages)"),
            "{table}"
        );
        assert!(table.contains("queue_ms [span]") && table.contains("decode_ms [span]"), "{table}");
        let run: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(run["spans"]["joined"], 6);
        let sent = exported_spans(&log);
        assert_eq!(sent.len(), 6);
        for r in run["requests"].as_array().unwrap() {
            let trace = r["trace_id"].as_str().unwrap();
            let span = &sent[trace];
            let attr = |k: &str| span["attributes"][k].as_f64().unwrap() * 1e3;
            let stages = &r["server"]["stages_ms"];
            for (stage, key) in [
                ("queue", "gen_ai.latency.time_in_queue"),
                ("prefill", "gen_ai.latency.time_in_model_prefill"),
                ("decode", "gen_ai.latency.time_in_model_decode"),
            ] {
                assert!((stages[stage].as_f64().unwrap() - attr(key)).abs() < 1e-9, "{stage}: {r}");
                assert_eq!(r["server"]["sources"][stage], "span");
            }
            assert!(stages.get("kv_transfer").is_none(), "never invented");
            // The engine continued our context: its parent is the span id we sent.
            assert_eq!(r["spans"][0]["parent"], span["parent"]);
            assert_eq!(r["spans"][0]["attributes"]["tokenpath_mock.unmapped"], "kept raw");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn requests_without_a_span_are_counted_and_said_so() {
    let dir = std::env::temp_dir().join(format!("tp-otlp-none-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = mock(&[], &dir.join("mock.jsonl"));
    let out = dir.join("run.json");
    let table = bench(m.1, free_port(), "0.5", &out);
    assert!(table.contains("engine spans: 0 of 6 requests joined"), "{table}");
    assert!(table.contains("6 of 6 requests got no span"), "{table}");
    let _ = std::fs::remove_dir_all(&dir);
}
