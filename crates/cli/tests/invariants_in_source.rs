//! Invariants checked on the sources themselves (ARCHITECTURE.md), each a scan of every crate's
//! library code (above any `#[cfg(test)]`):
//! - 1: metric definitions live only in `timeline`. Outside it nobody computes a TTFT or an E2E
//!   from raw timestamps: the gateway's own part goes through `ServerTiming::gateway_part`, a
//!   worker's through its `ServerTimeline`, the bench's through `ClientRecord`. The scan looks for
//!   the shapes such a re-derivation takes (`ttft_ms = Some(ms(...))`, `e2e_ms = ...elapsed()...`).
//! - 10: shared mutable state lives in an owning task. A lock is an exception that must be named:
//!   every file holding a `Mutex` or `RwLock` is listed here with the reason it is not a task, and
//!   a new lock fails the scan until it is. (Atomics, the other exception, cannot hold a map.)

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::path::{Path, PathBuf};

/// Where a lock is allowed, and why an owning task would be worse there. Each is held for a
/// lookup or a few writes, never across an `.await` (a `std::sync` guard is not `Send`, so an
/// async task cannot keep it over one).
const ALLOWED: &[(&str, &str)] = &[
    ("crates/bench/src/mock/mod.rs", "the mock engine's request log: one line appended per request"),
    ("crates/bench/src/progress.rs", "the progress bar's histograms, shared with its drawing thread"),
    ("crates/cli/src/demo.rs", "the demo's child PIDs, read by its signal handler"),
    ("crates/cli/src/topology.rs", "a supervised child between its supervisor thread and its guard"),
    ("crates/engine/src/quant/matrix.rs", "a parallel region's task slots, each taken once"),
    (
        "crates/engine/src/tokenizer/prompt.rs",
        "the chat template's skeleton memo beside a synchronous tokenizer",
    ),
    ("crates/engine/src/tokenizer/sandbox.rs", "the template sandbox's idle children and their count"),
    ("crates/engine/src/tokenizer/vocab.rs", "the tokenizer's word memo, held for one lookup"),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every crate's library sources but those of `except`, as (path from the root, the code above
/// any `#[cfg(test)]`: unit tests may build what the library may not).
fn library_code(except: &[&str]) -> Vec<(String, String)> {
    let root = root();
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap().map(Result::unwrap) {
        let src = krate.path().join("src");
        if src.is_dir() && !except.iter().any(|e| krate.file_name() == *e) {
            rust_files(&src, &mut files);
        }
    }
    assert!(files.len() > 100, "the scan found the workspace's sources ({} files)", files.len());
    files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            let lib = text.split("#[cfg(test)]").next().unwrap_or("").to_owned();
            (f.strip_prefix(&root).unwrap().to_string_lossy().into_owned(), lib)
        })
        .collect()
}

/// A line without its comment.
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// Whether `line` gives a TTFT or E2E a value computed on the spot from a clock.
fn derives(line: &str) -> bool {
    ["ttft_ms", "e2e_ms"].iter().any(|field| {
        code(line).split(field).skip(1).any(|rest| {
            let rest = rest.trim_start();
            rest.starts_with('=')
                && !rest.starts_with("==")
                && ["ms(", "duration_since", "elapsed(", "as_nanos", "as_secs"]
                    .iter()
                    .any(|c| rest.contains(c))
        })
    })
}

#[test]
fn no_crate_but_timeline_derives_ttft_or_e2e_from_a_clock() {
    let found: Vec<String> = library_code(&["timeline"])
        .iter()
        .flat_map(|(file, lib)| {
            lib.lines()
                .enumerate()
                .filter(|(_, l)| derives(l))
                .map(|(i, l)| format!("{file}:{}: {}", i + 1, l.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(found.is_empty(), "TTFT or E2E derived outside timeline (invariant 1):\n{}", found.join("\n"));
}

#[test]
fn the_scan_recognizes_a_re_derivation() {
    assert!(derives("            t.ttft_ms = Some(ms(first.saturating_duration_since(self.arrived)));"));
    assert!(derives("        t.e2e_ms = Some(since(Instant::now().duration_since(a)));"));
    assert!(derives("let e2e_ms = start.elapsed().as_secs_f64() * 1e3;"));
    assert!(!derives("        s.ttft_ms = s.ttft_ms.or(from_span.ttft_ms);"));
    assert!(!derives("        ttft_ms = timing.ttft_ms,"));
    assert!(!derives("    if t.ttft_ms == Some(ms(3)) {"));
    assert!(!derives("    // t.ttft_ms = Some(ms(first.elapsed()));"));
}

/// Whether library code declares or makes a lock.
fn holds_a_lock(lib: &str) -> bool {
    lib.lines()
        .map(code)
        .any(|c| ["Mutex<", "RwLock<", "Mutex::new", "RwLock::new"].iter().any(|l| c.contains(l)))
}

#[test]
fn every_lock_in_library_code_is_a_listed_exception() {
    let mut locked: Vec<String> =
        library_code(&[]).into_iter().filter(|(_, lib)| holds_a_lock(lib)).map(|(f, _)| f).collect();
    locked.sort();
    let listed: Vec<&str> = ALLOWED.iter().map(|(f, _)| *f).collect();
    let unlisted: Vec<&String> = locked.iter().filter(|f| !listed.contains(&f.as_str())).collect();
    assert!(
        unlisted.is_empty(),
        "a lock outside an owning task (invariant 10): {unlisted:?} — make it a task, or list it here with why"
    );
    let stale: Vec<&&str> = listed.iter().filter(|f| !locked.iter().any(|l| l == *f)).collect();
    assert!(stale.is_empty(), "listed but holding no lock any more: {stale:?}");
}

#[test]
fn the_scan_sees_a_lock_in_code_only() {
    assert!(holds_a_lock("struct S { m: std::sync::Mutex<u32> }"));
    assert!(holds_a_lock("let l = RwLock::new(3);"));
    assert!(!holds_a_lock("// a Mutex<u32> would do here\nstruct S;"));
}
