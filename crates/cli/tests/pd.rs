//! Prefill/decode disaggregation and KV reuse through real processes and sockets, on a tiny
//! random-weight model the test writes: `tokenpath serve --prefill 1 --decode 1` generates what
//! the colocated server generates; the prefix cache reports cached tokens in both topologies;
//! and the faults — a corrupted transfer, a decode worker killed mid-stream, a dead prefill
//! worker, a worker registering at run time — end the way the issue says, with no KV block
//! leaked on any worker.
#![allow(clippy::unwrap_used)]

mod support;

use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use support::{children_of, http, worker, worker_with_secret, Served};

use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};

fn model(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tp-pd-{tag}-{}.gguf", std::process::id()));
    std::fs::write(&p, tiny_model_bytes(&TinySpec { n_ctx: 4096, ..TinySpec::default() }).unwrap()).unwrap();
    p
}

/// A server killed when dropped, so a failing test never leaves processes holding its pipes.
struct Server(Option<Served>);

impl Server {
    fn port(&self) -> u16 {
        self.0.as_ref().map_or(0, |s| s.port)
    }

    fn stop(mut self) {
        if let Some(s) = self.0.take() {
            s.stop();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut s) = self.0.take() {
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
    }
}

fn serve(model: &std::path::Path, extra: &[&str]) -> Server {
    let mut args = vec!["--served-model-name", "tiny", "--kv-tokens", "16384"];
    args.extend_from_slice(extra);
    Server(Some(support::serve(model, &args)))
}

/// Regression: a server killed outright (SIGKILL runs no guard) left its worker processes
/// running; the kernel now kills them with it.
#[test]
fn workers_die_with_a_server_killed_outright() {
    let m = model("orphans");
    let mut s = serve(&m, &["--prefill", "1", "--decode", "1"]);
    let pid = s.0.as_ref().unwrap().child.id();
    let children: Vec<u32> = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(children.len(), 2, "two workers: {children:?}");
    if let Some(mut served) = s.0.take() {
        let _ = served.child.kill();
        let _ = served.child.wait();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for c in children {
        while std::path::Path::new(&format!("/proc/{c}")).exists()
            && !std::fs::read_to_string(format!("/proc/{c}/stat")).unwrap_or_default().contains(") Z ")
        {
            assert!(Instant::now() < deadline, "worker {c} outlived its server");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = std::fs::remove_file(&m);
}

/// A greedy completion unless `extra` sets the sampling (`,"temperature":0.9,"seed":1`).
fn ask(port: u16, prompt: &str, extra: &str) -> Value {
    let sampling = if extra.contains("temperature") { "" } else { r#","temperature":0"# };
    let body = format!(
        r#"{{"model":"tiny","prompt":{},"max_tokens":24,"ignore_eos":true{sampling}{extra}}}"#,
        serde_json::to_string(prompt).unwrap()
    );
    let (status, body) = http(port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

fn workers(port: u16) -> Vec<Value> {
    let (status, body) = http(port, "GET", "/admin/workers", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<Value>(&body).unwrap()["workers"].as_array().unwrap().clone()
}

/// Waits until every worker that is up holds no KV block (polls refresh every 500 ms).
fn assert_no_leaks(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ws = workers(port);
        let busy: Vec<&Value> = ws
            .iter()
            .filter(|w| w["up"] == true && w["stats"]["kv_blocks_used"].as_u64() != Some(0))
            .collect();
        if busy.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "KV blocks still in use: {busy:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn prompts() -> Vec<String> {
    (0..3)
        .map(|i| {
            format!("Request {i}: the quick brown fox jumps over the lazy dog {}", "again ".repeat(i * 7))
        })
        .collect()
}

#[test]
fn disaggregated_serving_generates_what_colocated_serving_generates() {
    let m = model("eq");
    let co = serve(&m, &["--no-prefix-cache"]);
    let want: Vec<String> = prompts().iter().map(|p| text(&ask(co.port(), p, ""))).collect();
    let seeded = text(&ask(co.port(), "Seeded sampling", r#","temperature":0.9,"seed":11"#));
    co.stop();

    let pd = serve(&m, &["--no-prefix-cache", "--prefill", "1", "--decode", "1"]);
    for (p, want) in prompts().iter().zip(&want) {
        let v = ask(pd.port(), p, "");
        assert_eq!(&text(&v), want, "PD output differs for {p:?}");
        let t = &v["timing"];
        assert!(t["stages_ms"]["kv_transfer"].as_f64().is_some(), "{t}");
        assert!(t["kv_transfer_bytes"].as_u64().unwrap() > 0);
        assert!(t["workers"]["prefill"].is_string() && t["workers"]["decode"].is_string(), "{t}");
        let sum: f64 = t["stages_ms"].as_object().unwrap().values().map(|x| x.as_f64().unwrap()).sum();
        let e2e = t["e2e_ms"].as_f64().unwrap();
        // Three clocks: a stage may overlap the next process's by the hop between them.
        assert!(sum <= e2e + 5.0, "stages {sum} ms exceed e2e {e2e} ms: {t}");
    }
    assert_eq!(text(&ask(pd.port(), "Seeded sampling", r#","temperature":0.9,"seed":11"#)), seeded);
    assert_no_leaks(pd.port());
    pd.stop();
}

#[test]
fn prefix_cache_reports_cached_tokens_colocated_and_disaggregated() {
    let m = model("prefix");
    let long = "A shared system prompt that many requests repeat word for word. ".repeat(8);
    for extra in [&[][..], &["--prefill", "1", "--decode", "1"][..]] {
        let s = serve(&m, extra);
        let first = ask(s.port(), &long, "");
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let second = ask(s.port(), &long, "");
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(cached > 0 && cached < prompt, "{extra:?}: {cached} of {prompt} cached");
        assert_eq!(second["timing"]["cached_tokens"].as_u64().unwrap(), cached);
        let (_, metrics) = http(s.port(), "GET", "/metrics", "");
        let counted: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("tokenpath_cached_prompt_tokens_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(counted, cached as f64, "{extra:?}: /metrics counts the cached tokens served:\n{metrics}");
        s.stop();
    }
}

#[test]
fn a_corrupted_transfer_is_recomputed_with_the_same_output() {
    // Same-host workers move KV through a shared-memory ring by default; both paths are checked.
    for transport in ["auto", "tcp"] {
        corrupted_transfer(transport);
    }
}

fn corrupted_transfer(transport: &str) {
    let m = model(&format!("corrupt-{transport}"));
    let t = ["--kv-transport", transport];
    let p = worker(&m, "prefill", &["--fault-corrupt-kv", "--no-prefix-cache", t[0], t[1]]);
    let d = worker(&m, "decode", &["--no-prefix-cache", t[0], t[1]]);
    let good = serve(&m, &["--no-prefix-cache"]);
    let want = text(&ask(good.port(), "Corrupt me please", ""));
    good.stop();
    let file = std::env::temp_dir().join(format!("tp-pd-cluster-{}.toml", std::process::id()));
    std::fs::write(
        &file,
        format!(
            "[[worker]]\naddr = \"{}\"\nrole = \"prefill\"\n\n[[worker]]\naddr = \"{}\"\nrole = \"decode\"\n",
            p.addr, d.addr
        ),
    )
    .unwrap();
    let s = serve(&m, &["--cluster", file.to_str().unwrap()]);
    let v = ask(s.port(), "Corrupt me please", "");
    assert_eq!(text(&v), want);
    assert_eq!(v["timing"]["kv_recomputed"], true, "{}", v["timing"]);
    assert!(v["timing"]["stages_ms"].get("kv_transfer").is_none(), "a failed transfer has no transfer stage");
    assert_no_leaks(s.port());
    s.stop();
}

/// Opens a streamed completion and reads until `n` text chunks arrived.
fn open_stream(port: u16, max_tokens: u32, n: usize) -> BufReader<TcpStream> {
    let body = format!(
        r#"{{"model":"tiny","prompt":"stream for a long while","max_tokens":{max_tokens},"ignore_eos":true,"stream":true}}"#
    );
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut seen = 0;
    let mut line = String::new();
    while seen < n {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "stream ended early");
        if line.contains("\"text\"") {
            seen += 1;
        }
    }
    r
}

#[test]
fn worker_faults_end_streams_cleanly_and_reroute() {
    let m = model("faults");
    let p1 = worker(&m, "prefill", &[]);
    let mut p2 = worker(&m, "prefill", &[]);
    let d1 = worker(&m, "decode", &[]);
    let d2 = worker(&m, "decode", &[]);
    let file = std::env::temp_dir().join(format!("tp-pd-faults-{}.toml", std::process::id()));
    let mut toml = String::new();
    for (a, r) in [(&p1.addr, "prefill"), (&p2.addr, "prefill"), (&d1.addr, "decode"), (&d2.addr, "decode")] {
        toml.push_str(&format!("[[worker]]\naddr = \"{a}\"\nrole = \"{r}\"\n"));
    }
    std::fs::write(&file, toml).unwrap();
    let s = serve(&m, &["--cluster", file.to_str().unwrap()]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while workers(s.port()).iter().any(|w| w["up"] != true) {
        assert!(Instant::now() < deadline, "workers did not all come up");
        std::thread::sleep(Duration::from_millis(50));
    }

    // A decode worker killed mid-stream: an error event, [DONE], and the connection closes.
    // Both decode workers are frozen the moment the first token arrives, so the kill lands
    // mid-stream however fast the tiny model decodes.
    let mut stream = open_stream(s.port(), 4000, 1);
    let signal = |sig: &str, pid: u32| {
        std::process::Command::new("kill").args([sig, &pid.to_string()]).status().unwrap();
    };
    signal("-STOP", d1.child.id());
    signal("-STOP", d2.child.id());
    let busy = workers(s.port())
        .into_iter()
        .find(|w| w["role"] == "decode" && w["in_flight"].as_u64() == Some(1))
        .expect("one decode worker carries the stream");
    let (mut victim, other) = if busy["addr"] == d1.addr.as_str() { (d1, d2) } else { (d2, d1) };
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    signal("-CONT", other.child.id());
    let mut rest = String::new();
    let t0 = Instant::now();
    std::io::Read::read_to_string(&mut stream, &mut rest).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(30), "the stream hung");
    assert!(rest.contains("\"error\""), "no error event: {rest:.300}");
    let (err_at, done_at) = (rest.find("\"error\"").unwrap(), rest.rfind("data: [DONE]").expect("[DONE]"));
    assert!(err_at < done_at, "{rest:.300}");
    let dead = victim.addr.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while workers(s.port()).iter().any(|w| w["addr"] == dead.as_str() && w["up"] == true) {
        assert!(Instant::now() < deadline, "the dead decode worker is still marked up");
        std::thread::sleep(Duration::from_millis(50));
    }

    // A prefill worker dies: new requests go to the other one, with no error.
    p2.child.kill().unwrap();
    p2.child.wait().unwrap();
    for i in 0..4 {
        let v = ask(s.port(), &format!("after the faults {i}"), "");
        assert_eq!(v["usage"]["completion_tokens"], 24);
    }
    assert_no_leaks(s.port());
    s.stop();
    drop((p1, other));
}

#[test]
fn workers_can_register_at_run_time() {
    let m = model("register");
    let s = serve(&m, &["--accept-workers"]);
    assert_eq!(http(s.port(), "GET", "/ready", "").0, 503, "no workers yet");
    // Said as what it is (regression: "the queue is full (0 requests waiting)").
    let none = r#"{"model":"tiny","prompt":"hello","max_tokens":2}"#;
    let (status, body) = http(s.port(), "POST", "/v1/completions", none);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("No worker is available"), "{body}");
    let (status, body) = http(s.port(), "POST", "/admin/workers", r#"{"addr":"nonsense","role":"chef"}"#);
    assert_eq!(status, 400, "{body}");
    // A bind address is not an address to dial (regression: `0.0.0.0:9001` was accepted).
    for addr in ["0.0.0.0:9001", "[::]:9001", "10.0.0.7:0"] {
        let req = format!(r#"{{"addr":"{addr}","role":"both"}}"#);
        let (status, body) = http(s.port(), "POST", "/admin/workers", &req);
        assert_eq!(status, 400, "{addr}: {body}");
        assert!(body.contains("reaches the worker"), "{addr}: {body}");
    }
    let _w = worker(&m, "both", &["--register", &format!("http://127.0.0.1:{}", s.port())]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while http(s.port(), "GET", "/ready", "").0 != 200 {
        assert!(Instant::now() < deadline, "the registered worker never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let v = ask(s.port(), "hello registered worker", "");
    assert_eq!(
        v["timing"]["workers"]["both"].as_str().map(|s| s.starts_with("both-")),
        Some(true),
        "{}",
        v["timing"]
    );
    s.stop();
}

/// A gateway routes only to workers serving the model file it tokenizes for: one serving
/// another file registers, is polled and stays down with the reason on /admin/workers, and
/// requests are refused as "no worker" until a worker with the right file comes.
#[test]
fn a_worker_serving_another_model_file_is_never_routed_to() {
    let m = model("ours");
    let other = std::env::temp_dir().join(format!("tp-pd-theirs-{}.gguf", std::process::id()));
    std::fs::write(
        &other,
        tiny_model_bytes(&TinySpec { n_ctx: 4096, seed: 99, ..TinySpec::default() }).unwrap(),
    )
    .unwrap();
    let s = serve(&m, &["--accept-workers"]);
    let url = format!("http://127.0.0.1:{}", s.port());
    let _theirs = worker(&other, "both", &["--register", &url]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let refused = loop {
        let ws = workers(s.port());
        if let Some(why) = ws.iter().find_map(|w| w["refused"].as_str().map(str::to_owned)) {
            break (why, ws);
        }
        assert!(Instant::now() < deadline, "the other model's worker was never refused: {ws:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(refused.0.contains("another model file"), "{}", refused.0);
    assert!(refused.1.iter().all(|w| w["up"] == false), "{:?}", refused.1);
    let (status, body) =
        http(s.port(), "POST", "/v1/completions", r#"{"model":"tiny","prompt":"hi","max_tokens":2}"#);
    assert_eq!(status, 503, "{body}");
    let _ours = worker(&m, "both", &["--register", &url]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while http(s.port(), "GET", "/ready", "").0 != 200 {
        assert!(Instant::now() < deadline, "the right model's worker never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    for _ in 0..4 {
        ask(s.port(), "routed to the worker with this file", "");
    }
    s.stop();
    let _ = std::fs::remove_file(&m);
    let _ = std::fs::remove_file(&other);
}

/// A worker listening on every interface cannot register its bind address: it is told to name
/// one the gateway can reach (`--advertise`), before it loads the model (regression: it
/// registered `0.0.0.0:port`, which only a gateway on its own host could dial).
#[test]
fn a_worker_on_an_unspecified_address_needs_advertise_to_register() {
    let m = model("advertise");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["worker", "--role", "both", "--listen", "0.0.0.0:0", "--register", "http://127.0.0.1:9"])
        .arg("--model")
        .arg(&m)
        .env("NO_COLOR", "1")
        .env("TOKENPATH_CLUSTER_SECRET", support::TEST_CLUSTER_SECRET)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the worker started instead of refusing its flags");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("--advertise") && err.contains("0.0.0.0"), "{err}");
    let _ = std::fs::remove_file(&m);
}

/// A worker exports what an endpoint picker scrapes (waiting, running, the KV-usage fraction)
/// and answers /health, on a listener of its own; served from its live stats.
#[test]
fn a_worker_exports_its_load_for_an_endpoint_picker() {
    let m = model("epp");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _w = worker(&m, "both", &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            drop(s);
            break http(port, "GET", "/metrics", "").1;
        }
        assert!(Instant::now() < deadline, "no metrics listener");
        std::thread::sleep(Duration::from_millis(20));
    };
    for series in [
        "tokenpath_num_requests_waiting 0",
        "tokenpath_num_requests_running 0",
        "tokenpath_kv_cache_usage_perc 0",
    ] {
        assert!(text.contains(series), "{series} in\n{text}");
    }
    assert!(text.contains("tokenpath_kv_blocks_free "), "{text}");
    assert_eq!(http(port, "GET", "/health", "").0, 200);
    assert_eq!(http(port, "GET", "/v1/models", "").0, 404, "nothing else on it");
}

#[test]
fn a_worker_without_the_cluster_secret_never_serves() {
    let m = model("secret");
    let w = worker(&m, "both", &[]);
    let stranger = worker_with_secret(&m, "both", &[], "some-other-cluster-secret");
    let s = serve(&m, &["--accept-workers"]);
    // Only the stranger: the gateway never finds a worker it can trust.
    let (status, body) =
        http(s.port(), "POST", "/admin/workers", &format!(r#"{{"addr":"{}","role":"both"}}"#, stranger.addr));
    assert_eq!(status, 200, "{body}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(http(s.port(), "GET", "/ready", "").0, 503, "a worker with another secret is not up");
    let (status, body) =
        http(s.port(), "POST", "/admin/workers", &format!(r#"{{"addr":"{}","role":"both"}}"#, w.addr));
    assert_eq!(status, 200, "{body}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while http(s.port(), "GET", "/ready", "").0 != 200 {
        assert!(Instant::now() < deadline, "the worker holding the secret never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    for i in 0..3 {
        assert_eq!(ask(s.port(), &format!("only trusted workers {i}"), "")["usage"]["completion_tokens"], 24);
    }
    let stranger_up =
        workers(s.port()).iter().any(|v| v["addr"] == stranger.addr.as_str() && v["up"] == true);
    assert!(!stranger_up, "the stranger was never up");
    s.stop();
}

fn signal(sig: &str, pid: u32) {
    std::process::Command::new("kill").args([sig, &pid.to_string()]).status().unwrap();
}

fn cluster_file(tag: &str, workers: &[(&str, &str)]) -> PathBuf {
    let file = std::env::temp_dir().join(format!("tp-pd-{tag}-{}.toml", std::process::id()));
    let toml: String =
        workers.iter().map(|(a, r)| format!("[[worker]]\naddr = \"{a}\"\nrole = \"{r}\"\n")).collect();
    std::fs::write(&file, toml).unwrap();
    file
}

#[test]
fn a_hung_decode_worker_ends_the_stream_with_an_error_in_bounded_time() {
    let m = model("hung");
    let p = worker(&m, "prefill", &[]);
    let d = worker(&m, "decode", &[]);
    let file = cluster_file("hung", &[(&p.addr, "prefill"), (&d.addr, "decode")]);
    let s = serve(&m, &["--cluster", file.to_str().unwrap()]);
    // Frozen, never killed: its sockets stay open and say nothing.
    let mut stream = open_stream(s.port(), 4000, 1);
    signal("-STOP", d.child.id());
    let mut rest = String::new();
    let t0 = Instant::now();
    std::io::Read::read_to_string(&mut stream, &mut rest).unwrap();
    // PEER_IDLE is 15 s; the bound is generous for a loaded machine, and far from "never".
    assert!(t0.elapsed() < Duration::from_secs(60), "the stream hung for {:?}", t0.elapsed());
    assert!(rest.contains("\"error\""), "no error event: {rest:.300}");
    assert!(rest.contains("data: [DONE]"), "{rest:.300}");
    signal("-CONT", d.child.id());
    s.stop();
    drop((p, d));
}

#[test]
fn a_worker_drains_on_sigterm() {
    let m = model("drain");
    let mut w = worker(&m, "both", &[]);
    let file = cluster_file("drain", &[(&w.addr, "both")]);
    let s = serve(&m, &["--cluster", file.to_str().unwrap()]);
    // A stream in flight when the worker is told to stop: it finishes, whole.
    let mut stream = open_stream(s.port(), 3000, 1);
    signal("-TERM", w.child.id());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stream, &mut rest).unwrap();
    assert!(!rest.contains("\"error\""), "the drained stream failed: {rest:.300}");
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest:.300}");
    // Then the worker exits by itself.
    let deadline = Instant::now() + Duration::from_secs(60);
    while w.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the worker did not exit after draining");
        std::thread::sleep(Duration::from_millis(50));
    }
    s.stop();
}

#[test]
fn serve_restarts_a_worker_that_died() {
    let m = model("restart");
    let s = serve(&m, &["--prefill", "1", "--decode", "1"]);
    assert_eq!(ask(s.port(), "before the crash", "")["usage"]["completion_tokens"], 24);
    let server_pid = s.0.as_ref().map(|x| x.child.id()).unwrap();
    let kids = children_of(server_pid);
    assert_eq!(kids.len(), 2, "two worker processes: {kids:?}");
    for k in &kids {
        signal("-KILL", *k);
    }
    // Both come back on their addresses; requests are served again.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let body = r#"{"model":"tiny","prompt":"after the crash","max_tokens":24,"ignore_eos":true,"temperature":0}"#;
        let (status, _) = http(s.port(), "POST", "/v1/completions", body);
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the workers never came back (last status {status})");
        std::thread::sleep(Duration::from_millis(200));
    }
    let now = children_of(server_pid);
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(now.iter().all(|p| !kids.contains(p)), "new processes");
    s.stop();
}

#[test]
fn a_registered_worker_comes_back_after_the_gateway_restarts() {
    let m = model("reregister");
    // A port that was free a moment ago, so the gateway can come back on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let first =
        Server(Some(support::serve_on(port, &m, &["--served-model-name", "tiny", "--accept-workers"])));
    let _w = worker(&m, "both", &["--register", &format!("http://127.0.0.1:{port}")]);
    let wait_ready = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while http(port, "GET", "/ready", "").0 != 200 {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_ready("the worker never registered");
    first.stop();
    // A new gateway knows nothing of it; the worker's heartbeat registers it again.
    let again =
        Server(Some(support::serve_on(port, &m, &["--served-model-name", "tiny", "--accept-workers"])));
    wait_ready("the worker did not register with the restarted gateway");
    assert_eq!(ask(port, "after the restart", "")["usage"]["completion_tokens"], 24);
    again.stop();
}
