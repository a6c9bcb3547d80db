//! The HTML report in a real browser: `tokenpath report A B C --html` writes one page with three
//! runs (colocated, PD-disaggregated, a server without `timing`), headless Chromium loads it from
//! a file with its network-free policy, runs the page's own check script, and the dumped DOM must
//! show every plot drawn (`data-drawn` = elements with a non-empty bounding box after layout).
//!
//! Chromium is Debian's `chromium`, installed by `scripts/setup --deps`. Without it this test
//! fails (a report nobody can see is not tested) unless `TOKENPATH_SKIP_CHROMIUM=1` is set.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokenpath_timeline::{ClientRecord, Outcome, RequestId, ServerTiming, Stage, StreamEvent, Usage};

const BIN: &str = env!("CARGO_BIN_EXE_tokenpath");
const MS: u64 = 1_000_000;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-html-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A run of 40 requests written as JSON Lines through the timeline crate's own types. `pd` adds a
/// KV transfer stage; `timing: false` is a server that sends no `timing` (llama.cpp, vLLM).
fn run_file(path: &Path, timing: bool, pd: bool) {
    let body: String = (0..40u64)
        .map(|i| {
            let send = i * 25;
            let ttft = 30 + (i * 7) % 23 + if pd { 8 } else { 0 };
            let mut r = ClientRecord::new(RequestId(i), send * MS, send * MS, true);
            r.events.push(StreamEvent { at_ns: (send + 2) * MS, tokens: 0 }); // role-only
            let mut at = send + ttft;
            for k in 0..8 {
                r.events.push(StreamEvent { at_ns: at * MS, tokens: 1 });
                at += if pd { 9 } else { 12 + (i + k) % 5 };
            }
            r.usage = Some(Usage { prompt_tokens: 200, completion_tokens: 8, cached_tokens: None });
            if timing {
                let mut t = ServerTiming::default();
                t.stages_ms.insert(Stage::Gateway, 0.3);
                t.stages_ms.insert(Stage::Queue, (ttft as f64) * 0.3);
                t.stages_ms.insert(Stage::Prefill, (ttft as f64) * 0.5);
                if pd {
                    t.stages_ms.insert(Stage::KvTransfer, 6.0);
                }
                t.stages_ms.insert(Stage::DecodeQueue, 1.0);
                t.stages_ms.insert(Stage::Decode, 70.0);
                r.server = Some(t);
            }
            if i == 39 {
                r.outcome = Outcome::Failed { kind: "stream_error".into(), message: "<cut>".into() };
            }
            serde_json::to_string(&r).unwrap() + "\n"
        })
        .collect();
    std::fs::write(path, body).unwrap();
}

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TOKENPATH_CHROMIUM") {
        return Some(p.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| ["chromium", "chromium-browser"].map(|n| d.join(n)))
        .find(|p| p.is_file())
}

/// Loads `page` in headless Chromium and returns the DOM after the page's scripts ran.
fn dump_dom(browser: &Path, page: &Path, profile: &Path) -> String {
    let out_path = profile.with_extension("dom.html");
    let mut child = Command::new(browser)
        .args(["--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish rendering {} in 120 s", page.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "chromium failed: {status}");
    std::fs::read_to_string(out_path).unwrap()
}

/// The value of `attr` in the opening tag of the element with `id`.
fn attr(dom: &str, id: &str, attr: &str) -> Option<String> {
    let at = dom.find(&format!(r#"id="{id}""#))?;
    let start = dom[..at].rfind('<')?;
    let tag = &dom[start..start + dom[start..].find('>')?];
    let v = tag.split(&format!(r#" {attr}=""#)).nth(1)?;
    Some(v.split('"').next()?.to_owned())
}

#[test]
fn report_html_of_three_runs_is_drawn_in_headless_chromium() {
    let d = dir("report");
    let (colo, pd, plain) = (d.join("colocated.jsonl"), d.join("pd.jsonl"), d.join("plain.jsonl"));
    run_file(&colo, true, false);
    run_file(&pd, true, true);
    run_file(&plain, false, false);
    let page = d.join("report.html");
    let out = Command::new(BIN)
        .arg("report")
        .args([&colo, &pd, &plain])
        .args(["--label", "colocated", "--label", "pd <disagg>", "--label", "llama.cpp"])
        .arg("--html")
        .arg(&page)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("== colocated ==") && stdout.contains("== pd <disagg> =="), "{stdout}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("pd &lt;disagg&gt;") && !html.contains("pd <disagg>"), "labels escaped");

    let Some(browser) = chromium() else {
        if std::env::var("TOKENPATH_SKIP_CHROMIUM").as_deref() == Ok("1") {
            eprintln!("TOKENPATH_SKIP_CHROMIUM=1: not rendering the HTML report in a browser");
            return;
        }
        panic!(
            "chromium not found: run `scripts/setup --deps` (installs Debian's chromium), point \
             TOKENPATH_CHROMIUM at a binary, or set TOKENPATH_SKIP_CHROMIUM=1 to skip this check"
        );
    };
    let dom = dump_dom(&browser, &page, &d.join("profile"));
    assert!(dom.contains(r#"data-checked="1""#), "the page's check script did not run:\n{dom:.2000}");
    let drawn = |id: &str| -> usize {
        attr(&dom, id, "data-drawn")
            .unwrap_or_else(|| panic!("{id}: no data-drawn (plot missing?)"))
            .parse()
            .unwrap()
    };
    for id in ["plot-cdf-ttft", "plot-cdf-tpot", "plot-cdf-e2e"] {
        assert_eq!(drawn(id), 3, "{id}: one curve per run");
    }
    // The tails on log scales: a curve and its p50 / p99 / p99.9 marks per run.
    for id in ["plot-ccdf-ttft", "plot-ccdf-chunk-gap"] {
        assert_eq!(drawn(id), 3 * 4, "{id}: a curve and three marks per run");
    }
    assert!(drawn("plot-chunk-gap-hist") >= 3, "histogram bars");
    // Two runs with timing: 2 bars (p50, p99) each, plus their stage rectangles.
    assert!(drawn("plot-stages") >= 2 * 2 * 5, "stage bars");
    for i in 0..3 {
        assert!(drawn(&format!("plot-waterfall-{i}")) >= 20, "waterfall {i}");
    }
    assert!(dom.contains(r#"data-series="pd &lt;disagg&gt;" data-stage="kv_transfer""#));
    assert!(dom.contains("llama.cpp: no server timing"));
    assert!(dom.contains(r#"id="summary-table""#) && dom.contains("errors stream_error: 1"));
    // And looked at: a screenshot of the whole page, kept in the tests' output directory.
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report.png");
    let _ = std::fs::remove_file(&shot);
    let status = Command::new(&browser)
        .args(["--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", d.join("profile-shot").display()))
        .arg("--window-size=1300,3600")
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "chromium's screenshot failed: {status}");
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 20_000, "a real picture: {} bytes", png.len());
    eprintln!("screenshot of the report: {}", shot.display());
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn bench_html_flag_writes_a_page_without_drawing_progress_into_a_pipe() {
    let d = dir("bench");
    let (page, json) = (d.join("bench.html"), d.join("nobody.json"));
    // Nothing listens on port 9 of loopback: every request fails fast, the page still renders.
    let out = Command::new(BIN)
        .args(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--workload", "fixed:8:2"])
        .args(["--rate", "200", "--num-requests", "4", "--timeout-s", "5"])
        .arg("--out")
        .arg(&json)
        .arg("--html")
        .arg(&page)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("in flight") && !err.contains('\r'), "no progress bar into a pipe: {err}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("<title>tokenpath bench: nobody</title>"), "label from the --out stem");
    assert!(html.contains("nobody: no completed request to show"));
    std::fs::remove_dir_all(d).unwrap();
}
