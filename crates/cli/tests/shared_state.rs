//! Invariant 10 (ARCHITECTURE.md): shared mutable state lives in an owning task. A lock is an
//! exception that must be named: every file whose library code holds a `Mutex` or `RwLock` is
//! listed here with the reason it is not a task, and a new lock fails this test until it is.
//! (Atomics are the invariant's other exception; they need no list: they cannot hold a map.)

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

/// Whether the library part of `text` (above any `#[cfg(test)]`) declares or makes a lock.
fn holds_a_lock(text: &str) -> bool {
    let lib = text.split("#[cfg(test)]").next().unwrap_or("");
    lib.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .any(|code| ["Mutex<", "RwLock<", "Mutex::new", "RwLock::new"].iter().any(|lock| code.contains(lock)))
}

#[test]
fn every_lock_in_library_code_is_a_listed_exception() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap().map(Result::unwrap) {
        let src = krate.path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    assert!(files.len() > 100, "the scan found the workspace's sources ({} files)", files.len());
    let mut locked: Vec<String> = files
        .iter()
        .filter(|f| holds_a_lock(&std::fs::read_to_string(f).unwrap()))
        .map(|f| f.strip_prefix(&root).unwrap().to_string_lossy().into_owned())
        .collect();
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
fn the_scan_sees_a_lock_in_library_code_only() {
    assert!(holds_a_lock("struct S { m: std::sync::Mutex<u32> }"));
    assert!(holds_a_lock("let l = RwLock::new(3);"));
    assert!(!holds_a_lock("// a Mutex<u32> would do here\nstruct S;"));
    assert!(!holds_a_lock("struct S;\n#[cfg(test)]\nmod tests { static M: Mutex<u8> = Mutex::new(0); }"));
}
