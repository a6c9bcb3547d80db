//! Issue 18, OTLP in, through real processes: `tokenpath mock-engine` plays a vLLM that exports
//! one `llm_request` span per traced request (OTLP/HTTP protobuf, then OTLP/gRPC) to the
//! receiver `tokenpath bench --otlp-listen` runs. Every request carries a fresh `traceparent`;
//! every span the engine sent is joined to its request by trace id, its stages are exactly the
//! span's attributes (checked against the engine's own log of what it exported), marked as
//! measured by the span, with unmapped attributes kept raw; a run whose engine exports nothing
//! says so instead of passing silently. Through our gateway (`serve --upstream --otlp-listen`),
//! the client's trace context reaches the engine, and the engine's spans come back to the
//! gateway's own receiver and its stage metrics.

#![allow(clippy::unwrap_used)]

mod support;

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
        // Our exporters flush every 0.5 s: a quiet second is enough, and the suite stays quick.
        .args(["--otlp-settle-s", "1.5"])
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    stdout
}

/// A fresh directory holding the tiny model (its tokenizer and template are what a gateway
/// needs; served, it is a real engine).
fn tiny_model(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("tp-otlp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    let spec = tokenpath_engine::tiny::TinySpec::default();
    std::fs::write(&model, tokenpath_engine::tiny::tiny_model_bytes(&spec).unwrap()).unwrap();
    (dir, model)
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

#[test]
fn through_the_gateway_the_trace_reaches_the_engine_and_its_spans_come_back_to_the_gateway() {
    let (dir, model) = tiny_model("gw");
    let gw_otlp = free_port();
    let log = dir.join("mock.jsonl");
    let m = mock(&["--otlp-endpoint", &format!("http://127.0.0.1:{gw_otlp}")], &log);
    let listen = format!("127.0.0.1:{gw_otlp}");
    let upstream = format!("http://127.0.0.1:{}", m.1);
    // The gateway exports its own spans to the bench's receiver; the engine exports to the
    // gateway's.
    let bench_otlp = free_port();
    let ours = format!("http://127.0.0.1:{bench_otlp}");
    let gateway = support::serve(
        &model,
        &[
            "--served-model-name",
            "mock",
            "--upstream",
            &upstream,
            "--otlp-listen",
            &listen,
            "--otlp-endpoint",
            &ours,
        ],
    );
    // Six requests carry the bench's trace context; three carry none, and the gateway starts
    // their traces.
    let out = dir.join("run.json");
    bench(gateway.port, bench_otlp, "30", &out);
    let body = serde_json::json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    for _ in 0..3 {
        let (status, text) = support::http(gateway.port, "POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(status, 200, "{text}");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let metrics = loop {
        let (_, text) = support::http(gateway.port, "GET", "/metrics", "");
        if text.contains("tokenpath_engine_spans_total{outcome=\"joined\"} 9") {
            break text;
        }
        assert!(std::time::Instant::now() < deadline, "the gateway never joined 9 spans:\n{text}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    for stage in ["queue", "prefill", "decode"] {
        let line = format!("tokenpath_engine_span_stage_seconds_count{{stage=\"{stage}\"}} 9");
        assert!(metrics.contains(&line), "{line}\n{metrics}");
    }
    // A vLLM span's wait before its scheduler saw the request is queue, not a gateway stage
    // (which would sit beside ours under the same name).
    assert!(!metrics.contains("tokenpath_engine_span_stage_seconds_count{stage=\"gateway\"}"), "{metrics}");
    assert!(!metrics.contains("outcome=\"missing\""), "{metrics}");
    let sent = exported_spans(&log);
    assert_eq!(sent.len(), 9, "one span per request, each its own trace");
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for r in run["requests"].as_array().unwrap() {
        let trace = r["trace_id"].as_str().unwrap();
        assert!(sent.contains_key(trace), "the bench's trace {trace} reached the engine through the gateway");
        // One tree: the engine's span is a child of the gateway's root span.
        let root = r["spans"].as_array().unwrap().iter().find(|s| s["name"] == "tokenpath.request").unwrap();
        assert_eq!(sent[trace]["parent"], root["span_id"], "{r}");
    }
    drop(gateway);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn our_servers_own_spans_reach_the_bench_as_one_tree_per_request_with_the_timings_durations() {
    let (dir, model) = tiny_model("out");
    let otlp_port = free_port();
    let endpoint = format!("http://127.0.0.1:{otlp_port}");
    let served = support::serve(
        &model,
        &["--served-model-name", "mock", "--kv-tokens", "1024", "--otlp-endpoint", &endpoint],
    );
    let out = dir.join("run.json");
    let table = bench(served.port, otlp_port, "30", &out);
    assert!(table.contains("engine spans: 6 of 6 requests joined by trace id"), "{table}");
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for r in run["requests"].as_array().unwrap() {
        let spans = r["spans"].as_array().unwrap();
        let roots: Vec<&Value> = spans.iter().filter(|s| s["name"] == "tokenpath.request").collect();
        assert_eq!(roots.len(), 1, "{r}");
        let root = roots[0];
        assert_eq!(root["trace_id"], r["trace_id"]);
        assert!(root.get("parent").is_some(), "the root continues the bench's context");
        let stages = r["server"]["stages_ms"].as_object().unwrap();
        let kids: Vec<&Value> = spans.iter().filter(|s| s["name"] != "tokenpath.request").collect();
        assert_eq!(kids.len(), stages.len(), "one span per stage: {r}");
        for k in kids {
            assert_eq!(k["parent"], root["span_id"]);
            let stage = k["attributes"]["tokenpath.stage"].as_str().unwrap();
            let ns = k["end_unix_ns"].as_u64().unwrap() - k["start_unix_ns"].as_u64().unwrap();
            let want = stages[stage].as_f64().unwrap();
            assert!((ns as f64 / 1e6 - want).abs() < 1e-5, "{stage}: span {ns} ns, timing {want} ms");
        }
    }
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 18, OTLP out across processes: `serve --prefill 1 --decode 1 --otlp-endpoint` is three
/// processes, each exporting its own spans; the bench's receiver gets one trace per request
/// whose stage spans come from the process that ran the stage (the gateway's stage from the
/// gateway, queue/prefill/kv_transfer from the prefill worker, decode_queue/decode from the
/// decode worker), every one a child of the gateway's root span, none twice, and each lasting
/// what the response's `timing` says (the worker's queue is the timing's queue less the
/// gateway's dispatch).
#[test]
fn one_trace_spans_the_gateway_and_both_workers_each_stage_from_the_process_that_ran_it() {
    let (dir, model) = tiny_model("pd");
    let otlp_port = free_port();
    let endpoint = format!("http://127.0.0.1:{otlp_port}");
    let served = support::serve(
        &model,
        &[
            "--served-model-name",
            "mock",
            "--kv-tokens",
            "4096",
            "--no-prefix-cache",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--otlp-endpoint",
            &endpoint,
        ],
    );
    let gateway = u64::from(served.child.id());
    let workers: Vec<u64> = support::children_of(served.child.id()).into_iter().map(u64::from).collect();
    assert_eq!(workers.len(), 2, "two worker processes");
    let out = dir.join("run.json");
    let table = bench(served.port, otlp_port, "30", &out);
    assert!(table.contains("engine spans: 6 of 6 requests joined by trace id"), "{table}");
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let ms =
        |s: &Value| (s["end_unix_ns"].as_u64().unwrap() - s["start_unix_ns"].as_u64().unwrap()) as f64 / 1e6;
    for r in run["requests"].as_array().unwrap() {
        let spans = r["spans"].as_array().unwrap();
        let roots: Vec<&Value> = spans.iter().filter(|s| s["name"] == "tokenpath.request").collect();
        assert_eq!(roots.len(), 1, "{r}");
        let root = roots[0];
        assert_eq!(
            (&root["service"], &root["attributes"]["process.pid"]),
            (&Value::from("tokenpath"), &Value::from(gateway))
        );
        // OpenTelemetry's GenAI attributes, where they apply to a server.
        let a = &root["attributes"];
        assert_eq!(a["gen_ai.operation.name"], "chat", "{a}");
        assert_eq!(a["gen_ai.request.model"], "mock", "{a}");
        // The tiny random model may sample its end-of-text before max_tokens.
        let reasons = &a["gen_ai.response.finish_reasons"];
        assert!(reasons == &serde_json::json!(["length"]) || reasons == &serde_json::json!(["stop"]), "{a}");
        assert_eq!(a["gen_ai.usage.output_tokens"], r["usage"]["completion_tokens"], "{a} vs {r}");
        let timing = &r["server"];
        let stages = timing["stages_ms"].as_object().unwrap();
        let mut by_stage = HashMap::new();
        for k in spans.iter().filter(|s| s["name"] != "tokenpath.request") {
            assert_eq!((&k["trace_id"], &k["parent"]), (&r["trace_id"], &root["span_id"]), "{k}");
            let stage = k["attributes"]["tokenpath.stage"].as_str().unwrap().to_owned();
            assert!(by_stage.insert(stage.clone(), k).is_none(), "{stage} exported twice: {r}");
        }
        let mut names: Vec<&String> = by_stage.keys().collect();
        names.sort();
        let mut want: Vec<&String> = stages.keys().collect();
        want.sort();
        assert_eq!(names, want, "one span per stage of the timing: {r}");
        let (p, d) = (&timing["workers"]["prefill"], &timing["workers"]["decode"]);
        let mut pids = std::collections::BTreeSet::new();
        for (stage, span) in &by_stage {
            let (service, worker) = match stage.as_str() {
                "gateway" => ("tokenpath", &Value::Null),
                "queue" | "prefill" | "kv_transfer" => ("tokenpath-worker", p),
                _ => ("tokenpath-worker", d),
            };
            assert_eq!(span["service"], service, "{stage}: {span}");
            assert_eq!(&span["attributes"]["tokenpath.worker"], worker, "{stage}: {span}");
            let pid = span["attributes"]["process.pid"].as_u64().unwrap();
            assert!(pid == gateway || workers.contains(&pid), "{stage} from pid {pid}");
            pids.insert((worker.to_string(), pid));
            let want = stages[stage.as_str()].as_f64().unwrap();
            if stage == "queue" {
                assert!(ms(span) <= want + 1e-5, "worker queue {} ms > timing's {want} ms", ms(span));
            } else {
                assert!((ms(span) - want).abs() < 1e-5, "{stage}: span {} ms, timing {want} ms", ms(span));
            }
        }
        assert_eq!(pids.len(), 3, "three processes, one per role: {pids:?}");
        // One host, one wall clock: the workers' spans sit inside the gateway's request.
        let slack = 5_000_000;
        for s in by_stage.values() {
            assert!(
                s["start_unix_ns"].as_u64().unwrap() + slack >= root["start_unix_ns"].as_u64().unwrap(),
                "{s}"
            );
            assert!(
                s["end_unix_ns"].as_u64().unwrap() <= root["end_unix_ns"].as_u64().unwrap() + slack,
                "{s}"
            );
        }
        // The prefill worker's transfer report may miss the gateway's wait (KV_REPORT_WAIT) on a
        // loaded machine: the stage is then absent from the timing and from the spans alike
        // (checked above), never invented. When it is there, it starts where prefill ended.
        if let Some(kv) = by_stage.get("kv_transfer") {
            let prefill = by_stage["prefill"];
            let gap = kv["start_unix_ns"].as_i64().unwrap() - prefill["end_unix_ns"].as_i64().unwrap();
            assert!(gap.abs() < 1_000_000, "the transfer starts where prefill ended: {gap} ns");
        } else {
            println!("request {}: no kv_transfer report in time", r["id"]);
        }
    }
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}
