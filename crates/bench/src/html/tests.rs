//! Unit tests of the HTML generator: structure, escaping, empty and timing-less runs.

#![allow(clippy::unwrap_used)]

use super::*;
use tokenpath_timeline::{Outcome, RequestId, ServerTiming, StreamEvent, Usage};

const MS: u64 = 1_000_000;

fn rec(id: u64, send_ms: u64, first_ms: u64, n: u64, timing: bool) -> ClientRecord {
    let mut r = ClientRecord::new(RequestId(id), send_ms * MS, send_ms * MS, true);
    r.events.push(StreamEvent { at_ns: (send_ms + 1) * MS, tokens: 0 });
    for k in 0..n {
        r.events.push(StreamEvent { at_ns: (first_ms + 10 * k + id % 3) * MS, tokens: 1 });
    }
    r.usage = Some(Usage { prompt_tokens: 40, completion_tokens: n, cached_tokens: None });
    if timing {
        let mut t = ServerTiming::default();
        let ttft = (first_ms - send_ms) as f64;
        t.stages_ms.insert(Stage::Gateway, 0.2);
        t.stages_ms.insert(Stage::Queue, ttft * 0.3);
        t.stages_ms.insert(Stage::Prefill, ttft * 0.6);
        t.stages_ms.insert(Stage::Decode, (10 * (n - 1)) as f64);
        r.server = Some(t);
    }
    r
}

fn run(label: &str, timing: bool) -> RunView {
    let recs: Vec<ClientRecord> = (0..30).map(|i| rec(i, i * 50, i * 50 + 20 + i % 7, 6, timing)).collect();
    RunView::new(label, &recs, &ReportOptions::default()).unwrap()
}

fn count(html: &str, needle: &str) -> usize {
    html.matches(needle).count()
}

#[test]
fn every_plot_has_a_stable_id_and_drawn_elements_per_run() {
    let html = render(&[run("colocated", true), run("pd", true)], &HtmlOptions::default());
    for id in ["plot-cdf-ttft", "plot-cdf-tpot", "plot-cdf-e2e", "plot-chunk-gap-hist", "plot-stages"] {
        assert_eq!(count(&html, &format!(r#"id="{id}""#)), 1, "{id}");
    }
    assert!(html.contains(r#"id="plot-waterfall-0""#) && html.contains(r#"id="plot-waterfall-1""#));
    // One CDF path per run and metric, and the TTFT tail's.
    assert_eq!(count(&html, r#"data-series="pd" data-points="30""#), 4);
    // p50 and p99 bars with four stages each, per run.
    assert_eq!(count(&html, r#"data-stage="prefill" data-stat="p99""#), 2);
    // 20 slowest requests per run, each with its stages and the remainder.
    assert_eq!(count(&html, r#"data-stat="" "#), 0);
    assert_eq!(count(&html, r#"<g class="bar" data-series="colocated""#), 2 + 20);
    assert!(html.contains(r#"id="summary-table""#));
    assert!(!html.contains("no server timing"));
    // The tails on log scales, with each run's p50 / p99 / p99.9 marked in that order.
    for id in ["plot-ccdf-ttft", "plot-ccdf-chunk-gap"] {
        assert_eq!(count(&html, &format!(r#"id="{id}""#)), 1, "{id}");
    }
    let marks: Vec<f64> = ["p50", "p99", "p99.9"]
        .iter()
        .map(|m| {
            let at = html.find(&format!(r#"data-series="pd" data-mark="{m}" data-value=""#)).unwrap();
            let rest = &html[at..];
            let v = rest.split("data-value=\"").nth(1).unwrap().split('"').next().unwrap();
            v.parse().unwrap()
        })
        .collect();
    assert!(marks[0] > 0.0 && marks[0] <= marks[1] && marks[1] <= marks[2], "{marks:?}");
    // Nothing the browser would fetch.
    assert!(!html.contains("http://") && !html.contains("https://") && !html.contains(" src="));
}

#[test]
fn labels_and_notes_are_escaped() {
    let evil = r#"<script>alert("x")</script> & 'q'"#;
    let html = render(&[run(evil, true)], &HtmlOptions { title: "<b>t</b>".into(), slowest: 3 });
    assert!(!html.contains("<script>alert"), "label must not become markup");
    assert!(html.contains("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;q&#39;"));
    assert!(html.contains("<title>&lt;b&gt;t&lt;/b&gt;</title>"));
    assert_eq!(count(&html, "<script>"), 1, "only the page's own check script");
    assert_eq!(esc("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&#39;");
}

#[test]
fn empty_page_and_run_without_completed_requests() {
    let html = render(&[], &HtmlOptions::default());
    assert!(html.contains(r#"data-runs="0""#) && html.contains("no runs to show"));
    assert!(html.ends_with("</html>\n"));

    let mut recs: Vec<ClientRecord> = (0..3).map(|i| rec(i, i * 10, i * 10 + 5, 2, false)).collect();
    for r in &mut recs {
        r.outcome = Outcome::Failed { kind: "http_503".into(), message: "busy".into() };
    }
    let failed = RunView::new("all-failed", &recs, &ReportOptions::default()).unwrap();
    let html = render(&[failed], &HtmlOptions::default());
    assert_eq!(count(&html, "no samples: no completed request"), 4, "3 CDFs and the histogram");
    assert!(html.contains("all-failed: no completed request to show"));
    assert!(html.contains("errors http_503: 3"));
    assert_eq!(count(&html, "data-points="), 0);
}

#[test]
fn run_without_timing_renders_with_a_note() {
    let html = render(&[run("with", true), run("llama.cpp", false)], &HtmlOptions::default());
    assert!(html.contains("llama.cpp: no server timing (the server sent no `timing`)"));
    assert_eq!(count(&html, r#"data-series="llama.cpp" data-stage="prefill""#), 0);
    assert_eq!(count(&html, r#"data-series="with" data-stage="prefill""#), 2 + 20);
    // The waterfall falls back to the client-side phases.
    assert_eq!(count(&html, r#"data-series="llama.cpp" data-stage="to first token""#), 20);
    assert!(html.contains("llama.cpp: no server timing: requests split into client-side phases only"));

    let html = render(&[run("only", false)], &HtmlOptions::default());
    assert!(html.contains("no server timing in any run"));
}

#[test]
fn waterfall_stages_add_up_to_e2e() {
    let r = run("a", true);
    let html = waterfall(0, &r, 1);
    // The slowest request is the one with the largest TTFT offset and jitter: E2E = sum of parts.
    let values: Vec<f64> =
        html.split(r#"data-value=""#).skip(1).filter_map(|s| s.split('"').next()?.parse().ok()).collect();
    let e2e = r.ok.iter().filter_map(|r| r.e2e_ns()).max().map(ms).unwrap();
    let ttft_mark = values.last().copied().unwrap();
    let parts: f64 = values[..values.len() - 1].iter().sum();
    assert!((parts - e2e).abs() < 0.01, "{parts} vs {e2e}");
    assert!(ttft_mark > 0.0 && ttft_mark < e2e);
}

#[test]
fn labels_default_to_file_stems_and_stay_distinct() {
    let files = [Path::new("out/colocated.json"), Path::new("b/pd.jsonl"), Path::new("c/pd.json")];
    assert_eq!(run_labels(&files, &[]), ["colocated", "pd", "pd (2)"]);
    assert_eq!(run_labels(&files, &["A".into()]), ["A", "pd", "pd (2)"]);
    assert_eq!(run_labels(&files[..1], &["x".into(), "y".into()]), ["x"]);
}
