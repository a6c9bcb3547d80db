//! `tokenpath serve --kv-pool DIR` through the real binary: a server killed outright (SIGKILL, no
//! chance to flush anything on the way out) and started again on the same directory serves the
//! prompt prefix it computed before from the SSD tier (the pool writes blocks down as soon as
//! it is idle); the answer is the same as the first time.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use support::http;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};

/// A tiny model file and an empty pool directory for one test, both removed when it ends.
struct Setup {
    model: std::path::PathBuf,
    dir: std::path::PathBuf,
    dir_arg: String,
}

impl Setup {
    fn new(name: &str) -> Self {
        let id = std::process::id();
        let model = std::env::temp_dir().join(format!("tp-cli-{name}-{id}.gguf"));
        std::fs::write(&model, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
        let dir = std::env::temp_dir().join(format!("tp-cli-{name}-{id}"));
        let _ = std::fs::remove_dir_all(&dir);
        let dir_arg = dir.to_str().unwrap().to_owned();
        Self { model, dir, dir_arg }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.model);
    }
}

/// `serve`'s flags for the tiny model on the pool in `dir` with an SSD tier of `ssd`.
fn pool_args<'a>(dir: &'a str, ssd: &'a str) -> [&'a str; 8] {
    ["--served-model-name", "tiny", "--kv-tokens", "1024", "--kv-pool", dir, "--kv-pool-ssd", ssd]
}

/// A greedy completion of `prompt`, five tokens.
fn body(prompt: &[u32]) -> String {
    serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": true})
        .to_string()
}

/// `tokenpath kv-pool` on `dir` (8 MiB of RAM, `ssd` of SSD; `abort_at`: the slab's testing-only
/// crash point), once it says it hosts the pool.
fn pool_host(model: &std::path::Path, dir: &str, ssd: &str, abort_at: Option<&str>) -> std::process::Child {
    use std::io::BufRead as _;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tokenpath"));
    cmd.args(["kv-pool", "--kv-pool", dir, "--kv-pool-ram", "8MiB", "--kv-pool-ssd", ssd])
        .arg("--model")
        .arg(model);
    if let Some(n) = abort_at {
        cmd.env("TOKENPATH_FAULT_SLAB_ABORT_AT", n);
    }
    let mut host =
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let mut first_line = String::new();
    std::io::BufReader::new(host.stdout.take().unwrap()).read_line(&mut first_line).unwrap();
    assert!(first_line.starts_with("tokenpath kv-pool hosting "), "{first_line:?}");
    host
}

/// Waits until the server at `port` has stored in the pool every block it computed so far
/// (its workers write the pool behind their steps), at most 30 s.
fn stored(port: u16) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (_, metrics) = http(port, "GET", "/metrics", "");
        if metrics.lines().any(|l| l == "tokenpath_kv_pool_stores_pending 0") {
            return;
        }
        assert!(std::time::Instant::now() < until, "the pool stores never ended: {metrics}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// (generated text, cached prompt tokens) of a greedy completion of `prompt`, its blocks
/// stored in the pool by the time it returns.
fn complete(port: u16, prompt: &[u32]) -> (String, u64) {
    let (status, text) = http(port, "POST", "/v1/completions", &body(prompt));
    assert_eq!(status, 200, "{text}");
    stored(port);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    // The timeline says which tier they came from.
    let ssd = v["timing"]["cached_tokens_ssd"].as_u64().unwrap_or(0);
    assert!(ssd <= cached, "{text}");
    if cached > 0 {
        assert_eq!(ssd, cached, "a fresh process's arena holds nothing: {text}");
    }
    (v["choices"][0]["text"].as_str().unwrap().to_owned(), cached)
}

#[test]
fn a_killed_server_restarted_on_its_pool_serves_the_prefix_it_computed_before() {
    let t = Setup::new("kvpool");
    let (model, dir_arg) = (t.model.as_path(), t.dir_arg.clone());
    let args = pool_args(&dir_arg, "16MiB");
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 37 % 200)).collect();

    let mut first = support::serve(model, &args);
    let (want, cached) = complete(first.port, &prompt);
    assert_eq!(cached, 0);
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let logs = first.logs();
    assert!(logs.contains("KV pool SSD tier opened"), "{logs}");

    let mut second = support::serve(model, &args);
    assert_eq!(complete(second.port, &prompt), (want, 64), "four 16-token blocks from the SSD tier");
    let (status, metrics) = http(second.port, "GET", "/metrics", "");
    assert_eq!(status, 200);
    assert!(metrics.contains(r#"tokenpath_kv_pool_hit_tokens_total{tier="ssd"} 64"#), "{metrics}");
    assert!(metrics.contains("tokenpath_kv_pool_failed_loads_total 0"), "{metrics}");
    // Every lease ended: nothing pinned once the request is done.
    assert!(metrics.contains("tokenpath_kv_pool_leases 0"), "{metrics}");
    assert!(metrics.contains("tokenpath_kv_pool_pinned_blocks 0"), "{metrics}");
    let blocks: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"tokenpath_kv_pool_blocks{tier="ssd"} "#))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!(blocks >= 4, "{blocks} blocks in the SSD tier");
    second.child.kill().unwrap();
    second.child.wait().unwrap();
    let logs = second.logs();
    assert!(logs.contains("blocks=4") || logs.contains("blocks: 4"), "{logs}");
}

/// Two `tokenpath serve` processes on one pool directory — the second disaggregated, its
/// prefill and decode workers child processes — share the host-RAM tier: what the first
/// computed, the second's prefill worker loads (the same answer), and the blocks are counted
/// as `cached_tokens_host`.
#[test]
fn a_second_server_on_the_same_pool_loads_what_the_first_computed_from_host_ram() {
    let t = Setup::new("kvpool-ram");
    let (model, dir_arg) = (t.model.as_path(), t.dir_arg.clone());
    let pool = pool_args(&dir_arg, "0");
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 41 % 200)).collect();
    let body = body(&prompt);
    let mut first = support::serve(model, &pool);
    let (status, a) = http(first.port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{a}");
    stored(first.port);
    let mut args = pool.to_vec();
    args.extend(["--prefill", "1", "--decode", "1"]);
    let mut second = support::serve(model, &args);
    let (status, b) = http(second.port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{b}");
    let (a, b): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(&a).unwrap(), serde_json::from_str(&b).unwrap());
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "the same answer");
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 64, "{b}");
    assert_eq!(b["timing"]["cached_tokens_host"], 64, "from the first server's pool: {b}");
    assert!(b["timing"]["stages_ms"]["kv_load"].as_f64().is_some(), "a kv_load stage: {b}");
    for s in [&mut second, &mut first] {
        s.child.kill().unwrap();
        s.child.wait().unwrap();
    }
}

/// `--kv-pool-second-sighting`: a prefix computed once is held in RAM but never written down,
/// so a server restarted on the pool finds nothing on the SSD tier (without the flag the test
/// above finds all four blocks there, with less time to write them).
#[test]
fn under_the_second_sighting_filter_a_prefix_seen_once_is_not_written_to_ssd() {
    let t = Setup::new("kvpool-2s");
    let (model, dir_arg) = (t.model.as_path(), t.dir_arg.clone());
    let args = pool_args(&dir_arg, "16MiB").to_vec();
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 43 % 200)).collect();
    let mut first = {
        let mut a = args.clone();
        a.push("--kv-pool-second-sighting");
        support::serve(model, &a)
    };
    let (want, cached) = complete(first.port, &prompt);
    assert_eq!(cached, 0);
    // Time enough for the owner's idle write-down, had it anything to write.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let (_, metrics) = http(first.port, "GET", "/metrics", "");
    assert!(metrics.contains(r#"tokenpath_kv_pool_blocks{tier="host"} 4"#), "held in RAM: {metrics}");
    assert!(!metrics.contains(r#"tokenpath_kv_pool_written_total{tier="ssd"} 4"#), "{metrics}");
    first.child.kill().unwrap();
    first.child.wait().unwrap();

    let mut second = support::serve(model, &args);
    assert_eq!(complete(second.port, &prompt), (want, 0), "nothing was written down");
    second.child.kill().unwrap();
    second.child.wait().unwrap();
}

/// An SSD tier that cannot be written (its slab is `/dev/full`): the pool runs on host RAM,
/// says so in its log and in `tokenpath_kv_pool_ssd_degraded`, and serving goes on — a second
/// server on the pool loads what the first computed from RAM.
#[test]
fn an_unwritable_ssd_tier_leaves_the_pool_on_ram_and_says_so() {
    let t = Setup::new("kvpool-full");
    let (model, dir_arg) = (t.model.as_path(), t.dir_arg.clone());
    let args = pool_args(&dir_arg, "16MiB");
    // A first start names the slab file; it is then replaced by a device that is always full.
    let mut probe = support::serve(model, &args);
    probe.child.kill().unwrap();
    probe.child.wait().unwrap();
    let slab = std::fs::read_dir(&t.dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "slab"))
        .expect("a slab file");
    std::fs::remove_file(&slab).unwrap();
    std::os::unix::fs::symlink("/dev/full", &slab).unwrap();

    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 47 % 200)).collect();
    let mut first = support::serve(model, &args);
    let (want, cached) = complete(first.port, &prompt);
    assert_eq!(cached, 0);
    let (_, metrics) = http(first.port, "GET", "/metrics", "");
    assert!(metrics.contains("tokenpath_kv_pool_ssd_degraded 1"), "{metrics}");
    let mut second = support::serve(model, &args);
    let body = body(&prompt);
    let (status, b) = http(second.port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{b}");
    let b: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(b["choices"][0]["text"], want.as_str(), "the same answer");
    assert_eq!(b["timing"]["cached_tokens_host"], 64, "from host RAM: {b}");
    for s in [&mut second, &mut first] {
        s.child.kill().unwrap();
        s.child.wait().unwrap();
    }
    let logs = first.logs();
    assert!(logs.contains("SSD tier cannot be used"), "{logs}");
}

/// `tokenpath kv-pool` hosts the pool in a process of its own: a server killed and started again
/// finds what it computed in host RAM (no SSD tier here), a second `kv-pool` on the directory is
/// refused, and SIGTERM stops it cleanly.
#[test]
fn a_standalone_pool_keeps_its_ram_tier_across_server_restarts() {
    use std::io::BufRead as _;
    let t = Setup::new("kvpool-host");
    let (model, dir_arg) = (t.model.as_path(), t.dir_arg.clone());
    let host_args = ["kv-pool", "--kv-pool", &dir_arg, "--kv-pool-ram", "8MiB", "--kv-pool-ssd", "0"];
    let start = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_tokenpath"))
            .args(host_args)
            .arg("--model")
            .arg(model)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut host = start();
    let mut first_line = String::new();
    std::io::BufReader::new(host.stdout.take().unwrap()).read_line(&mut first_line).unwrap();
    assert!(first_line.starts_with("tokenpath kv-pool hosting "), "{first_line:?}");
    let second = start().wait_with_output().unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("hosts the KV pool"), "{second:?}");

    let args = pool_args(&dir_arg, "0");
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 53 % 200)).collect();
    let body = body(&prompt);
    let mut a = support::serve(model, &args);
    let (status, first) = http(a.port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{first}");
    stored(a.port);
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    assert!(!a.logs().contains("KV pool hosted here"), "the server joined the standalone pool");
    let mut b = support::serve(model, &args);
    let (status, again) = http(b.port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{again}");
    let (first, again): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(&first).unwrap(), serde_json::from_str(&again).unwrap());
    assert_eq!(first["choices"][0]["text"], again["choices"][0]["text"], "the same answer");
    assert_eq!(again["timing"]["cached_tokens_host"], 64, "the RAM tier outlived the server: {again}");
    b.child.kill().unwrap();
    b.child.wait().unwrap();

    let _ = std::process::Command::new("kill").args(["-TERM", &host.id().to_string()]).status();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(s) = host.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "kv-pool did not stop on SIGTERM");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

/// A pool host that dies between a block's payload and its header (a crash mid-write, made
/// deterministic by the slab's test fault) loses only that write: the next host rebuilds its
/// index from the slot headers, the two blocks written whole are served from SSD, the torn
/// third and the fourth are computed, and the answer is the same.
#[test]
fn a_pool_killed_mid_write_loses_only_the_unfinished_write() {
    let t = Setup::new("kvpool-crash");
    let (model, dir_arg) = (t.model.as_path(), t.dir_arg.clone());
    let mut host = pool_host(model, &dir_arg, "16MiB", Some("3"));

    let args = pool_args(&dir_arg, "16MiB");
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 59 % 200)).collect();
    let mut a = support::serve(model, &args);
    let (want, cached) = complete(a.port, &prompt);
    assert_eq!(cached, 0);
    // The host writes the four blocks down when idle, and dies writing the third.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(s) = host.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "the fault never fired");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(!status.success(), "aborted: {status:?}");
    a.child.kill().unwrap();
    a.child.wait().unwrap();

    let mut b = support::serve(model, &args);
    assert_eq!(complete(b.port, &prompt), (want, 32), "two whole blocks from SSD, the rest computed");
    b.child.kill().unwrap();
    b.child.wait().unwrap();
    let logs = b.logs();
    assert!(logs.contains("KV pool SSD tier opened") && logs.contains("blocks=2"), "{logs}");
}

/// The process hosting the pool dies under a running server: the server's pool writer thread
/// hosts it again by itself — no request needed, and never on a batcher's thread, which only
/// ever connects — and a second server then joins that pool and loads what the first computed.
#[test]
fn when_the_pool_host_dies_a_running_server_hosts_it_again() {
    let t = Setup::new("kvpool-rehost");
    let (model, dir_arg) = (t.model.as_path(), t.dir_arg.clone());
    let mut host = pool_host(model, &dir_arg, "0", None);
    let args = pool_args(&dir_arg, "0");
    let mut a = support::serve(model, &args);
    host.kill().unwrap();
    host.wait().unwrap();

    // The socket answers again once somebody hosts the pool; only `a` is there to do it.
    let socket = std::fs::read_dir(&t.dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "sock"))
        .expect("the pool's socket");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(std::time::Instant::now() < deadline, "nobody hosted the pool again");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 61 % 200)).collect();
    let (want, cached) = complete(a.port, &prompt);
    assert_eq!(cached, 0);
    let mut b = support::serve(model, &args);
    let (status, again) = http(b.port, "POST", "/v1/completions", &body(&prompt));
    assert_eq!(status, 200, "{again}");
    let again: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["choices"][0]["text"], want.as_str(), "the same answer");
    assert_eq!(again["timing"]["cached_tokens_host"], 64, "from the pool the first server hosts: {again}");
    for s in [&mut b, &mut a] {
        s.child.kill().unwrap();
        s.child.wait().unwrap();
    }
    assert!(a.logs().contains("KV pool hosted here"), "the running server hosted the pool");
    assert!(!b.logs().contains("KV pool hosted here"), "the second server joined it");
}
