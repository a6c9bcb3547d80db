//! Several runs' reports in one table, column per run: the `tokenpath demo` view (colocated next
//! to disaggregated), also usable for any set of saved runs. Only reads [`Report`]s, so every
//! number in it has the same definition as in the single-run table.

use crate::report::Report;
use std::fmt::Write as _;
use tokenpath_timeline::Summary;

fn cell(s: &Option<Summary>, p99: bool) -> String {
    s.as_ref().map_or_else(|| "—".to_owned(), |s| format!("{:.1}", if p99 { s.p99 } else { s.p50 }))
}

/// Renders `runs` (label, report) side by side, then where each run's p99s come from.
pub fn render(runs: &[(&str, &Report)]) -> String {
    let mut out = String::new();
    let w = 20usize;
    let _ = write!(out, "{:<30}", "metric");
    for (label, _) in runs {
        let _ = write!(out, "{label:>w$}");
    }
    out.push('\n');
    let mut row = |name: &str, f: &dyn Fn(&Report) -> String| {
        let _ = write!(out, "{name:<30}");
        for (_, r) in runs {
            let _ = write!(out, "{:>w$}", f(r));
        }
        out.push('\n');
    };
    row("requests ok / failed", &|r| format!("{} / {}", r.summary.completed, r.summary.failed));
    for (name, get) in [
        ("TTFT ms (client)", (|r: &Report| r.summary.ttft_ms) as fn(&Report) -> Option<Summary>),
        ("TPOT ms", |r: &Report| r.summary.tpot_ms),
        ("chunk gap ms", |r: &Report| r.summary.chunk_gap_ms),
        ("E2E ms", |r: &Report| r.summary.e2e_ms),
    ] {
        row(&format!("{name} p50"), &|r| cell(&get(r), false));
        row(&format!("{name} p99"), &|r| cell(&get(r), true));
    }
    row("input tok/s", &|r| format!("{:.1}", r.summary.throughput.input_tokens_per_s));
    row("  of which cached tok/s", &|r| format!("{:.1}", r.summary.throughput.cached_input_tokens_per_s));
    row("output tok/s", &|r| format!("{:.1}", r.summary.throughput.output_tokens_per_s));
    row("total tok/s", &|r| format!("{:.1}", r.summary.throughput.total_tokens_per_s));
    row("offered / achieved req/s", &|r| {
        format!("{:.2} / {:.2}", r.summary.throughput.offered_rps, r.summary.throughput.achieved_send_rps)
    });
    row("goodput req/s", &|r| r.summary.goodput_rps.map_or("—".into(), |g| format!("{g:.2}")));
    row("SLO attainment", &|r| r.summary.attainment.map_or("—".into(), |a| format!("{:.0}%", a * 100.0)));
    out.push_str("\nwhere each p99 comes from (share of the tail requests' time, by stage):\n");
    for (label, r) in runs {
        if r.tail.is_empty() {
            let _ = writeln!(out, "  {label}: no server timing in the records");
        }
        for t in &r.tail {
            let _ = writeln!(out, "  {label}: {t}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::ReportOptions;

    #[test]
    fn every_run_gets_a_column_and_empty_runs_render() {
        let rec = tokenpath_timeline::ClientRecord::new(tokenpath_timeline::RequestId(1), 0, 0, true);
        let r = Report::build(&[rec], &ReportOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        let t = render(&[("colocated", &r), ("pd-1p1d", &r)]);
        assert!(t.lines().next().is_some_and(|l| l.contains("colocated") && l.contains("pd-1p1d")));
        assert!(t.contains("chunk gap ms p99") && t.contains("SLO attainment"));
        assert!(t.contains("no server timing"));
    }
}
