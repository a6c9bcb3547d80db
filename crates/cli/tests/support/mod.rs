//! Shared by the CLI's process tests: start `tokenpath serve` on a free port and learn the port
//! from its log line, with stderr drained on a thread so the server never blocks on a full pipe.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;

/// A running `tokenpath serve`.
pub struct Served {
    pub child: Child,
    pub port: u16,
    /// Every log line the server writes after announcing its address, returned when it exits.
    pub logs: JoinHandle<Vec<String>>,
}

/// Starts `tokenpath serve --port 0 --model MODEL EXTRA...`.
pub fn serve(model: &Path, extra: &[&str]) -> Served {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["serve", "--port", "0"])
        .args(extra)
        .arg("--model")
        .arg(model)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The log line announcing the address carries the port the OS picked.
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let port = loop {
        let line = lines.next().expect("server exited before listening").unwrap();
        if let Some(rest) = line.split("http://127.0.0.1:").nth(1) {
            break rest.split('/').next().unwrap().parse().unwrap();
        }
    };
    let logs = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    Served { child, port, logs }
}
