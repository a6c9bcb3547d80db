//! Shared by the CLI's process tests: start `tokenpath serve` on a free port and learn the port
//! from its log line, with stderr drained on a thread so the server never blocks on a full pipe;
//! find the default model; write a GGUF's tokenizer as Hugging Face files (`hf_json.rs`).
#![allow(dead_code, clippy::unwrap_used)]

pub mod hf_json;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;

/// The default model (`scripts/setup --model`), or `None` with a note on stderr when it is absent
/// outside CI; under CI (`CI` set) `scripts/test` has fetched it and its absence is a failure.
pub fn default_model() -> Option<std::path::PathBuf> {
    let p = tokenpath_engine::default_model_path();
    if p.is_file() {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "default model missing at {} under CI: scripts/test should have fetched it",
        p.display()
    );
    eprintln!("SKIP: default model not found at {} (run scripts/setup --model)", p.display());
    None
}

/// A process's peak resident memory (`VmHWM`), KiB.
pub fn vm_hwm_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The cluster secret the test processes share (servers and workers alike).
pub const TEST_CLUSTER_SECRET: &str = "tokenpath-test-cluster-secret";

/// A running `tokenpath serve`.
pub struct Served {
    pub child: Child,
    pub port: u16,
    /// Every log line the server writes, returned when it exits.
    logs: Option<JoinHandle<Vec<String>>>,
}

impl Served {
    /// The server's log lines, once it has exited.
    pub fn logs(&mut self) -> String {
        self.logs.take().map(|h| h.join().unwrap().join("\n")).unwrap_or_default()
    }
}

/// Starts `tokenpath serve --port 0 --model MODEL EXTRA...`.
pub fn serve(model: &Path, extra: &[&str]) -> Served {
    serve_on(0, model, extra)
}

/// [`serve`] on `port` (0: any free one).
pub fn serve_on(port: u16, model: &Path, extra: &[&str]) -> Served {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["serve", "--port", &port.to_string()])
        .args(extra)
        .arg("--model")
        .arg(model)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env("TOKENPATH_CLUSTER_SECRET", TEST_CLUSTER_SECRET)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The log line announcing the address carries the port the OS picked.
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut before = Vec::new();
    let port = loop {
        let line = lines.next().expect("server exited before listening").unwrap();
        if let Some(rest) = line.split("serving the OpenAI API on http://127.0.0.1:").nth(1) {
            break rest.split('/').next().unwrap().parse().unwrap();
        }
        before.push(line);
    };
    let logs = std::thread::spawn(move || before.into_iter().chain(lines.map_while(Result::ok)).collect());
    Served { child, port, logs: Some(logs) }
}

impl Drop for Served {
    /// A test that panics leaves no server behind (one would hold the test's output pipe open).
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One plain HTTP/1.1 request over a `TcpStream` (no client dependency): status and body.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// A `tokenpath worker` process; killed on drop.
pub struct WorkerProc {
    pub child: Child,
    pub addr: String,
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `tokenpath worker --role ROLE --model MODEL EXTRA...` with the test cluster secret
/// and reads its address.
pub fn worker(model: &Path, role: &str, extra: &[&str]) -> WorkerProc {
    worker_with_secret(model, role, extra, TEST_CLUSTER_SECRET)
}

/// [`worker`] with another cluster secret.
pub fn worker_with_secret(model: &Path, role: &str, extra: &[&str], secret: &str) -> WorkerProc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["worker", "--role", role, "--listen", "127.0.0.1:0"])
        .args(extra)
        .arg("--model")
        .arg(model)
        .env("NO_COLOR", "1")
        .env("TOKENPATH_CLUSTER_SECRET", secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next().expect("worker exited before listening").unwrap();
    let addr = line.strip_prefix("tokenpath worker listening on ").expect("address line").trim().to_owned();
    std::thread::spawn(move || lines.for_each(drop));
    WorkerProc { child, addr }
}

impl Served {
    /// Kills the server (and, through its guard, any worker processes it started).
    pub fn stop(mut self) {
        self.stop_ref();
    }

    /// [`stop`](Self::stop), keeping the handle (for its logs).
    pub fn stop_ref(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while self.child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.wait();
    }
}

/// The pids of `parent`'s children (from /proc).
pub fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}
