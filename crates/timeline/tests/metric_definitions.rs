//! Invariant 1 (ARCHITECTURE.md): metric definitions live only in `timeline`. Outside this
//! crate nobody computes a TTFT or an E2E from raw timestamps: the gateway's own part goes
//! through `ServerTiming::gateway_part`, a worker's through its `ServerTimeline`, the bench's
//! through `ClientRecord`. A scan of every other crate's library sources for the shapes such a
//! re-derivation takes (`ttft_ms = Some(ms(...))`, `e2e_ms = ...duration_since...`).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::path::{Path, PathBuf};

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

/// Whether `line` gives a TTFT or E2E a value computed on the spot from a clock.
fn derives(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    ["ttft_ms", "e2e_ms"].iter().any(|field| {
        code.split(field).skip(1).any(|rest| {
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
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for krate in std::fs::read_dir(&crates).unwrap().map(Result::unwrap) {
        let src = krate.path().join("src");
        if krate.file_name() != "timeline" && src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    assert!(files.len() > 100, "the scan found the workspace's sources ({} files)", files.len());
    let found: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            // Unit tests below a file's `#[cfg(test)]` may build timings by hand.
            let lib = text.split("#[cfg(test)]").next().unwrap_or("").to_owned();
            lib.lines()
                .enumerate()
                .filter(|(_, l)| derives(l))
                .map(|(i, l)| format!("{}:{}: {}", f.display(), i + 1, l.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(found.is_empty(), "TTFT or E2E derived outside timeline:\n{}", found.join("\n"));
}

#[test]
fn the_scan_recognizes_a_re_derivation() {
    assert!(derives("            t.ttft_ms = Some(ms(first.saturating_duration_since(self.arrived)));"));
    assert!(derives("        t.e2e_ms = Some(since(Instant::now().duration_since(a)));"));
    assert!(derives("let e2e_ms = start.elapsed().as_secs_f64() * 1e3;"));
    assert!(!derives("        s.ttft_ms = s.ttft_ms.or(from_span.ttft_ms);"));
    assert!(!derives("        ttft_ms = timing.ttft_ms,"));
    assert!(!derives("    if t.ttft_ms == Some(ms(3)) {"));
}
