//! The self-contained HTML report: one page, one or several runs side by side (a colocated run
//! next to a PD-disaggregated one), opened from a file with no network.
//!
//! Everything is inline — CSS, SVG drawn here as text, and a few lines of script that only check
//! the plots after layout (each figure gets `data-drawn`, the number of its elements with a
//! non-empty bounding box) — and a Content-Security-Policy forbids any fetch, so a page that works
//! once works anywhere, forever. The numbers come from [`Report`] and [`Metric::samples`], i.e.
//! from the `timeline` definitions; this module decides only which records are shown (the
//! report's window, completed requests) and how. Every string from a run (labels, error kinds,
//! notes) is escaped.

mod plots;

use crate::report::{Metric, Report, ReportOptions};
use crate::BenchError;
use plots::{Bar, Segment, Series};
use std::fmt::Write as _;
use std::path::Path;
use tokenpath_timeline::{ms, ClientRecord, Stage, Summary, OTHER_COMPONENT};

/// One run on the page: its label, its report and the completed requests of its window.
#[derive(Debug, Clone)]
pub struct RunView {
    /// Shown in legends and table headers.
    pub label: String,
    /// The run's report (window, summary, stages, tail, errors, notes).
    pub report: Report,
    ok: Vec<ClientRecord>,
}

impl RunView {
    /// Builds the report of `records` under `opts` and keeps what the plots need.
    pub fn new(
        label: impl Into<String>,
        records: &[ClientRecord],
        opts: &ReportOptions,
    ) -> Result<Self, BenchError> {
        Ok(Self::from_report(label, Report::build(records, opts)?, records))
    }

    /// A run whose report is already built (by `tokenpath bench`) from `records`.
    pub fn from_report(label: impl Into<String>, report: Report, records: &[ClientRecord]) -> Self {
        let ok = report.window.ended_in(records).filter(|r| r.is_ok()).cloned().collect();
        Self { label: label.into(), report, ok }
    }

    fn samples(&self, m: Metric) -> Vec<f64> {
        let refs: Vec<&ClientRecord> = self.ok.iter().collect();
        m.samples(&refs)
    }
}

/// How to lay the page out.
#[derive(Debug, Clone)]
pub struct HtmlOptions {
    /// Page title.
    pub title: String,
    /// Requests shown in each run's waterfall (the slowest by E2E).
    pub slowest: usize,
}

impl Default for HtmlOptions {
    fn default() -> Self {
        Self { title: "tokenpath bench report".into(), slowest: 20 }
    }
}

/// Escapes text for HTML element content and quoted attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const RUN_COLORS: [&str; 8] =
    ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];

fn run_color(i: usize) -> &'static str {
    RUN_COLORS[i % RUN_COLORS.len()]
}

fn stage_color(s: Stage) -> &'static str {
    match s {
        Stage::Gateway => "#9c9c9c",
        Stage::Queue => "#f2b134",
        Stage::KvLoad => "#86bcb6",
        Stage::Prefill => "#4e79a7",
        Stage::KvTransfer => "#b07aa1",
        Stage::DecodeQueue => "#ff9da7",
        Stage::Decode => "#59a14f",
    }
}

const OTHER_COLOR: &str = "#d4d4d4";
const TO_FIRST_COLOR: &str = "#76b7b2";
const STREAMING_COLOR: &str = "#edc948";

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}\
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}\
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}\
th:first-child,td:first-child{text-align:left}thead th{background:#f4f4f4}\
.plots{display:flex;flex-wrap:wrap;gap:16px}figure.plot{margin:0;border:1px solid #e4e4e4;padding:8px}\
figcaption{font-weight:600;margin-bottom:4px}svg text{font-size:11px;fill:#444}\
.grid{stroke:#eee}.tick,.axis{stroke:#888}.mark{stroke:#000;stroke-width:2}\
.legend span{margin-right:14px;font-size:12px}.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}\
.note{color:#8a5a00;font-size:13px;margin:4px 0}";

/// After layout, counts each figure's drawn elements (non-empty bounding box) into `data-drawn`.
const CHECK_SCRIPT: &str = "for(const f of document.querySelectorAll('figure.plot')){let n=0;\
for(const e of f.querySelectorAll('[data-series]')){if(e.getBBox){const b=e.getBBox();if(b.width>0||b.height>0)n++;}}\
f.setAttribute('data-drawn',String(n));}document.body.setAttribute('data-checked','1');";

/// Renders the page for `runs` (which may be empty: the page then says so).
pub fn render(runs: &[RunView], opts: &HtmlOptions) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let _ = write!(
        out,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'\">\
<title>{t}</title><style>{STYLE}</style></head><body data-runs=\"{n}\"><h1>{t}</h1>",
        t = esc(&opts.title),
        n = runs.len()
    );
    if runs.is_empty() {
        out.push_str(r#"<p class="note">no runs to show</p>"#);
    } else {
        let labels: Vec<String> = runs.iter().map(|r| esc(&r.label)).collect();
        let _ = write!(out, "<p>runs: {}</p>", labels.join(", "));
        summary_table(&mut out, runs);
        out.push_str(r#"<h2>Latency distributions</h2><div class="plots">"#);
        for (id, title, metric) in [
            ("plot-cdf-ttft", "TTFT (from send), CDF", Metric::Ttft),
            ("plot-cdf-tpot", "TPOT, CDF", Metric::Tpot),
            ("plot-cdf-e2e", "E2E, CDF", Metric::E2e),
        ] {
            out.push_str(&plots::cdf(id, title, "ms", &series(runs, metric)));
        }
        let gaps = series(runs, Metric::ChunkGap);
        let upper =
            gaps.iter().filter_map(|s| Summary::from_samples(&s.values)).map(|s| s.p999).fold(0.0, f64::max);
        out.push_str(&plots::histogram("plot-chunk-gap-hist", "Chunk gap, histogram", "ms", upper, &gaps));
        out.push_str("</div><h2>Tails (log scales)</h2><div class=\"plots\">");
        out.push_str(&plots::ccdf(
            "plot-ccdf-ttft",
            "TTFT (from send), tail",
            "ms",
            &series(runs, Metric::Ttft),
        ));
        out.push_str(&plots::ccdf("plot-ccdf-chunk-gap", "Chunk gap, tail", "ms", &gaps));
        out.push_str("</div><h2>Server stages</h2><div class=\"plots\">");
        out.push_str(&stage_plot(runs));
        out.push_str("</div><h2>Slowest requests</h2><div class=\"plots\">");
        for (i, run) in runs.iter().enumerate() {
            out.push_str(&waterfall(i, run, opts.slowest));
        }
        out.push_str("</div>");
    }
    let _ = writeln!(out, "<script>{CHECK_SCRIPT}</script></body></html>");
    out
}

/// Writes `html` to `path`.
pub fn write_html(path: &Path, html: &str) -> Result<(), BenchError> {
    std::fs::write(path, html)
        .map_err(|source| BenchError::Write { path: path.display().to_string(), source })
}

/// One label per run file: the labels given, in order, then each remaining file's stem; a label
/// already taken gets ` (2)`, ` (3)`, ... so every run stays distinguishable.
pub fn run_labels(files: &[&Path], given: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let base = given.get(i).cloned().unwrap_or_else(|| {
            f.file_stem().map_or_else(|| f.display().to_string(), |s| s.to_string_lossy().into_owned())
        });
        let mut label = base.clone();
        let mut k = 2;
        while out.contains(&label) {
            label = format!("{base} ({k})");
            k += 1;
        }
        out.push(label);
    }
    out
}

fn series(runs: &[RunView], m: Metric) -> Vec<Series<'_>> {
    runs.iter()
        .enumerate()
        .map(|(i, r)| Series { label: &r.label, color: run_color(i), values: r.samples(m) })
        .collect()
}

fn cell(s: Option<&Summary>, f: fn(&Summary) -> f64) -> String {
    s.map_or_else(|| "–".into(), |s| format!("{:.1}", f(s)))
}

fn summary_table(out: &mut String, runs: &[RunView]) {
    out.push_str(r#"<h2>Summary</h2><table id="summary-table"><thead><tr><th>metric</th>"#);
    for r in runs {
        let _ = write!(out, "<th>{}</th>", esc(&r.label));
    }
    out.push_str("</tr></thead><tbody>");
    let mut row = |name: &str, f: &dyn Fn(&Report) -> String| {
        let _ = write!(out, "<tr><td>{}</td>", esc(name));
        for r in runs {
            let _ = write!(out, "<td>{}</td>", esc(&f(&r.report)));
        }
        out.push_str("</tr>");
    };
    row("requests (completed / failed)", &|r| {
        format!("{} ({} / {})", r.summary.requests, r.summary.completed, r.summary.failed)
    });
    row("window, s", &|r| format!("{:.1}", r.summary.throughput.window_s));
    type Get = fn(&Report) -> Option<&Summary>;
    let metrics: [(&str, Get); 7] = [
        ("TTFT (from send)", |r| r.summary.ttft_ms.as_ref()),
        ("TTFT (server)", |r| r.summary.server_ttft_ms.as_ref()),
        ("TPOT", |r| r.summary.tpot_ms.as_ref()),
        ("chunk gap", |r| r.summary.chunk_gap_ms.as_ref()),
        ("ITL (per token)", |r| r.summary.itl_ms.as_ref()),
        ("E2E", |r| r.summary.e2e_ms.as_ref()),
        ("client schedule lag", |r| r.summary.schedule_lag_ms.as_ref()),
    ];
    for (name, get) in metrics {
        row(&format!("{name} p50 ms"), &|r| cell(get(r), |s| s.p50));
        row(&format!("{name} p99 ms"), &|r| cell(get(r), |s| s.p99));
    }
    for stage in Stage::ALL {
        let key = format!("{}_ms", stage.name());
        if runs.iter().any(|r| r.report.stages.contains_key(&key)) {
            row(&format!("{} p50 / p99 ms", stage.name()), &|r| {
                r.stages.get(&key).map_or_else(|| "–".into(), |s| format!("{:.1} / {:.1}", s.p50, s.p99))
            });
        }
    }
    row("requests/s (offered)", &|r| {
        let t = &r.summary.throughput;
        format!("{:.2} ({:.2})", t.requests_per_s, t.offered_rps)
    });
    row("output tok/s", &|r| format!("{:.1}", r.summary.throughput.output_tokens_per_s));
    row("goodput req/s (attainment)", &|r| match (r.summary.goodput_rps, r.summary.attainment) {
        (Some(g), Some(a)) => format!("{g:.2} ({:.1}%)", a * 100.0),
        _ => "no SLO".into(),
    });
    out.push_str("</tbody></table>");
    for r in runs {
        let lines: Vec<String> = r
            .report
            .tail
            .iter()
            .map(ToString::to_string)
            .chain(r.report.errors.iter().map(|(k, n)| format!("errors {k}: {n}")))
            .chain(r.report.notes.iter().map(|n| format!("note: {n}")))
            .collect();
        if !lines.is_empty() {
            let _ = write!(
                out,
                r#"<p class="run-notes" data-series="{}"><b>{}</b>"#,
                esc(&r.label),
                esc(&r.label)
            );
            for l in lines {
                let _ = write!(out, "<br>{}", esc(&l));
            }
            out.push_str("</p>");
        }
    }
}

fn stage_legend() -> Vec<(&'static str, &'static str)> {
    Stage::ALL.iter().map(|s| (s.name(), stage_color(*s))).collect()
}

fn stage_plot(runs: &[RunView]) -> String {
    let mut bars = Vec::new();
    let mut missing = Vec::new();
    for r in runs {
        if r.report.stages.is_empty() {
            missing.push(format!(
                "{}: no server timing (the server sent no `timing`), no stage breakdown",
                r.label
            ));
            continue;
        }
        for (stat, get) in
            [("p50", (|s: &Summary| s.p50) as fn(&Summary) -> f64), ("p99", |s: &Summary| s.p99)]
        {
            let segments: Vec<Segment> = Stage::ALL
                .iter()
                .filter_map(|st| {
                    let s = r.report.stages.get(&format!("{}_ms", st.name()))?;
                    Some(Segment { name: st.name().into(), color: stage_color(*st), ms: get(s) })
                })
                .collect();
            let parts: Vec<String> = segments.iter().map(|s| format!("{} {:.1}", s.name, s.ms)).collect();
            bars.push(Bar {
                row: format!("{} {stat}", r.label),
                series: &r.label,
                key: stat.into(),
                title: format!("{} {stat} per stage (ms): {}", r.label, parts.join(", ")),
                segments,
                mark_ms: None,
            });
        }
    }
    if bars.is_empty() && !missing.is_empty() {
        missing.insert(0, "no server timing in any run".into());
    }
    plots::stacked_bars(
        "plot-stages",
        "stages",
        "Per-stage latency at p50 and p99 (each stage's own percentile, stacked)",
        &bars,
        &missing,
        &stage_legend(),
    )
}

/// The `n` slowest completed requests by E2E, each split into its server stages (plus what no
/// stage accounts for) or, without server timing, into waiting for the first token and streaming.
fn waterfall(idx: usize, run: &RunView, n: usize) -> String {
    let mut slow: Vec<(&ClientRecord, f64)> =
        run.ok.iter().filter_map(|r| Some((r, ms(r.e2e_ns()?)))).collect();
    slow.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.id.cmp(&b.0.id)));
    slow.truncate(n);
    let mut any_timing = false;
    let bars: Vec<Bar<'_>> = slow
        .iter()
        .map(|(r, e2e)| {
            let ttft = r.ttft_ns().map(ms);
            let mut segments: Vec<Segment> = r.server.as_ref().map_or_else(Vec::new, |t| {
                Stage::ALL
                    .iter()
                    .filter_map(|s| {
                        Some(Segment { name: s.name().into(), color: stage_color(*s), ms: t.stage_ms(*s)? })
                    })
                    .collect()
            });
            if segments.is_empty() {
                match ttft {
                    Some(t) => {
                        segments.push(Segment {
                            name: "to first token".into(),
                            color: TO_FIRST_COLOR,
                            ms: t,
                        });
                        segments.push(Segment {
                            name: "streaming".into(),
                            color: STREAMING_COLOR,
                            ms: e2e - t,
                        });
                    }
                    None => {
                        segments.push(Segment { name: "response".into(), color: TO_FIRST_COLOR, ms: *e2e })
                    }
                }
            } else {
                any_timing = true;
                let staged: f64 = segments.iter().map(|s| s.ms).sum();
                segments.push(Segment { name: OTHER_COMPONENT.into(), color: OTHER_COLOR, ms: e2e - staged });
            }
            let ttft_text = ttft.map_or_else(String::new, |t| format!(", TTFT {t:.1} ms"));
            Bar {
                row: format!("#{} @ {:.2} s", r.id.0, r.t_send as f64 / 1e9),
                series: &run.label,
                key: r.id.0.to_string(),
                title: format!("request {}: E2E {e2e:.1} ms{ttft_text}", r.id.0),
                segments,
                mark_ms: ttft,
            }
        })
        .collect();
    let mut legend = if any_timing { stage_legend() } else { Vec::new() };
    if any_timing {
        legend.push((OTHER_COMPONENT, OTHER_COLOR));
    }
    if bars.iter().any(|b| b.segments.iter().any(|s| s.name == "to first token" || s.name == "response")) {
        legend.push(("to first token", TO_FIRST_COLOR));
        legend.push(("streaming", STREAMING_COLOR));
    }
    legend.push(("| client TTFT", "#000"));
    let mut missing = Vec::new();
    if bars.is_empty() {
        missing.push(format!("{}: no completed request to show", run.label));
    } else if !any_timing {
        missing.push(format!("{}: no server timing: requests split into client-side phases only", run.label));
    }
    let title = format!("{}: the {} slowest requests by E2E (ms since send)", run.label, bars.len());
    plots::stacked_bars(&format!("plot-waterfall-{idx}"), "waterfall", &title, &bars, &missing, &legend)
}

#[cfg(test)]
mod tests;
