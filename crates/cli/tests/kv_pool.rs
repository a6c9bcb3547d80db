//! `tokenpath serve --kv-pool DIR` through the real binary: a server killed outright (SIGKILL, no
//! chance to flush anything on the way out) and started again on the same directory serves the
//! prompt prefix it computed before from the SSD tier (the pool writes blocks down as soon as
//! it is idle); the answer is the same as the first time.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use support::http;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};

/// (generated text, cached prompt tokens) of a greedy completion of `prompt`.
fn complete(port: u16, prompt: &[u32]) -> (String, u64) {
    let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
        "ignore_eos": true})
    .to_string();
    let (status, text) = http(port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
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
    let id = std::process::id();
    let model = std::env::temp_dir().join(format!("tp-cli-kvpool-{id}.gguf"));
    std::fs::write(&model, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("tp-cli-kvpool-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.to_str().unwrap().to_owned();
    let args = [
        "--served-model-name",
        "tiny",
        "--kv-tokens",
        "1024",
        "--kv-pool",
        &dir_arg,
        "--kv-pool-ssd",
        "16MiB",
    ];
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 37 % 200)).collect();

    let mut first = support::serve(&model, &args);
    let (want, cached) = complete(first.port, &prompt);
    assert_eq!(cached, 0);
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let logs = first.logs();
    assert!(logs.contains("KV pool SSD tier opened"), "{logs}");

    let mut second = support::serve(&model, &args);
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
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&model);
}

/// Two `tokenpath serve` processes on one pool directory — the second disaggregated, its
/// prefill and decode workers child processes — share the host-RAM tier: what the first
/// computed, the second's prefill worker loads (the same answer), and the blocks are counted
/// as `cached_tokens_host`.
#[test]
fn a_second_server_on_the_same_pool_loads_what_the_first_computed_from_host_ram() {
    let id = std::process::id();
    let model = std::env::temp_dir().join(format!("tp-cli-kvpool-ram-{id}.gguf"));
    std::fs::write(&model, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("tp-cli-kvpool-ram-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.to_str().unwrap().to_owned();
    let pool =
        ["--served-model-name", "tiny", "--kv-tokens", "1024", "--kv-pool", &dir_arg, "--kv-pool-ssd", "0"];
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 41 % 200)).collect();
    let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
        "ignore_eos": true})
    .to_string();
    let mut first = support::serve(&model, &pool);
    let (status, a) = http(first.port, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{a}");
    let mut args = pool.to_vec();
    args.extend(["--prefill", "1", "--decode", "1"]);
    let mut second = support::serve(&model, &args);
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
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&model);
}

/// `--kv-pool-second-sighting`: a prefix computed once is held in RAM but never written down,
/// so a server restarted on the pool finds nothing on the SSD tier (without the flag the test
/// above finds all four blocks there, with less time to write them).
#[test]
fn under_the_second_sighting_filter_a_prefix_seen_once_is_not_written_to_ssd() {
    let id = std::process::id();
    let model = std::env::temp_dir().join(format!("tp-cli-kvpool-2s-{id}.gguf"));
    std::fs::write(&model, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("tp-cli-kvpool-2s-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.to_str().unwrap().to_owned();
    let args = vec![
        "--served-model-name",
        "tiny",
        "--kv-tokens",
        "1024",
        "--kv-pool",
        &dir_arg,
        "--kv-pool-ssd",
        "16MiB",
    ];
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 43 % 200)).collect();
    let mut first = {
        let mut a = args.clone();
        a.push("--kv-pool-second-sighting");
        support::serve(&model, &a)
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

    let mut second = support::serve(&model, &args);
    assert_eq!(complete(second.port, &prompt), (want, 0), "nothing was written down");
    second.child.kill().unwrap();
    second.child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&model);
}
