//! `tokenpath serve` through the real binary on a tiny model file: it binds the port it was given
//! (0: any), answers the OpenAI API, and exits cleanly on SIGTERM. Plain HTTP/1.1 over a
//! `TcpStream` keeps this test free of an HTTP client dependency.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use std::process::Command;
use std::time::{Duration, Instant};
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};

use support::http;

#[test]
fn serve_answers_and_exits_cleanly_on_sigterm() {
    let model = std::env::temp_dir().join(format!("tp-cli-serve-{}.gguf", std::process::id()));
    std::fs::write(&model, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    let mut served = support::serve(&model, &["--served-model-name", "tiny", "--kv-tokens", "1024"]);
    let port = served.port;

    assert_eq!(http(port, "GET", "/health", "").0, 200);
    assert_eq!(http(port, "GET", "/ready", "").0, 200);
    let (status, body) = http(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"ignore_eos":true}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let (status, body) = http(port, "POST", "/v1/chat/completions", r#"{"model":"other","messages":[]}"#);
    assert!(status == 400 || status == 404, "{status} {body}");

    let term = Command::new("kill").args(["-TERM", &served.child.id().to_string()]).status().unwrap();
    assert!(term.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = served.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    let logs = served.logs();
    assert!(status.success(), "exit {status:?}\n{logs}");
    assert!(logs.contains("draining"), "{logs}");
    let _ = std::fs::remove_file(&model);
}

#[test]
fn serve_refuses_a_public_address_without_api_keys() {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["serve", "--host", "0.0.0.0", "--port", "0", "--model", "/nonexistent.gguf"])
        .env_remove("TOKENPATH_API_KEYS")
        .env_remove("TOKENPATH_ALLOW_OPEN_PUBLIC")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without API keys"), "{err}");
}

#[test]
fn worker_refuses_a_public_address_without_a_cluster_secret() {
    for listen in ["0.0.0.0:0", "[::]:0", "10.1.2.3:0"] {
        let out = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
            .args(["worker", "--listen", listen, "--model", "/nonexistent.gguf"])
            .env_remove("TOKENPATH_CLUSTER_SECRET")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{listen}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("without a cluster secret"), "{listen}: {err}");
    }
    // A secret too short to be one is refused too.
    let out = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["worker", "--listen", "0.0.0.0:0", "--model", "/nonexistent.gguf"])
        .env("TOKENPATH_CLUSTER_SECRET", "short")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16"));
}

/// The (soft, hard) open-file limits of process `pid`.
fn nofile(pid: u32) -> (u64, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let mut nums = line.split_whitespace().skip(3);
    (nums.next().unwrap().parse().unwrap(), nums.next().unwrap().to_owned())
}

/// Out of file descriptors, `accept` fails (EMFILE): the server logs it, keeps the connections it
/// has, and serves again once descriptors are free — it does not exit or spin.
#[test]
fn serve_survives_running_out_of_file_descriptors() {
    if Command::new("prlimit").arg("--version").output().is_err() {
        panic!("prlimit (util-linux) is needed for this test");
    }
    let model = std::env::temp_dir().join(format!("tp-cli-emfile-{}.gguf", std::process::id()));
    std::fs::write(&model, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    let mut served = support::serve(&model, &["--served-model-name", "tiny", "--kv-tokens", "1024"]);
    let (port, pid) = (served.port, served.child.id());
    assert_eq!(http(port, "GET", "/health", "").0, 200);
    let (soft, hard) = nofile(pid);
    let open = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    let low = format!("--nofile={}:{hard}", open + 2);
    assert!(Command::new("prlimit").args(["--pid", &pid.to_string(), &low]).status().unwrap().success());
    // More connections than descriptors left: the extra ones are never accepted.
    let held: Vec<std::net::TcpStream> =
        (0..16).filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).ok()).collect();
    std::thread::sleep(Duration::from_millis(500));
    drop(held);
    let back = format!("--nofile={soft}:{hard}");
    assert!(Command::new("prlimit").args(["--pid", &pid.to_string(), &back]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(30);
    while http(port, "GET", "/health", "").0 != 200 {
        assert!(Instant::now() < deadline, "the server did not come back after EMFILE");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, body) = http(
        port,
        "POST",
        "/v1/completions",
        r#"{"model":"tiny","prompt":"hi","max_tokens":2,"ignore_eos":true}"#,
    );
    assert_eq!(status, 200, "{body}");
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = served.child.wait();
    let logs = served.logs();
    assert!(logs.contains("accept failed"), "the EMFILE was logged:\n{logs}");
    let _ = std::fs::remove_file(&model);
}
