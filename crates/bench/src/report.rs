//! A run's report: which records count (the steady-state window), the summary of every metric,
//! per-stage distributions, tail attribution and goodput, laid out so the JSON keys read
//! `metric_unit.stat` (`summary.ttft_ms.p99`, `stages.prefill_ms.p99`, `summary.goodput_rps`).

use crate::BenchError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use tokenpath_timeline::{
    goodput, tail_attribution, throughput, ClientRecord, Goodput, NOutSource, Outcome, SloSpec, Stage,
    StageSource, Summary, TailAttribution, TailMetric, Throughput, Window,
};

/// What to put in a report.
#[derive(Clone, Debug, Default)]
pub struct ReportOptions {
    /// Seconds after the first scheduled send that are warm-up (excluded).
    pub warmup_s: f64,
    /// Seconds before the last request ended that are drain (excluded).
    pub cooldown_s: f64,
    /// SLOs for goodput, if any.
    pub slo: Option<SloSpec>,
}

/// The summary block of a report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SummaryBlock {
    /// Requests that ended in the window.
    pub requests: u64,
    /// Of which completed.
    pub completed: u64,
    /// Of which failed.
    pub failed: u64,
    /// Client TTFT (`t_first − t_send`), ms.
    pub ttft_ms: Option<Summary>,
    /// TTFT from the schedule (`t_first − t_sched`), ms.
    pub ttft_from_sched_ms: Option<Summary>,
    /// Server-observed TTFT, ms, when the server sent `timing`.
    pub server_ttft_ms: Option<Summary>,
    /// TPOT, ms.
    pub tpot_ms: Option<Summary>,
    /// Chunk gap (time between token-bearing events), ms.
    pub chunk_gap_ms: Option<Summary>,
    /// Per-token ITL, ms.
    pub itl_ms: Option<Summary>,
    /// E2E (`t_last − t_send`), ms.
    pub e2e_ms: Option<Summary>,
    /// Client schedule lag (`t_send − t_sched`), ms.
    pub schedule_lag_ms: Option<Summary>,
    /// Rates over the window.
    #[serde(flatten)]
    pub throughput: Throughput,
    /// Good requests per second, when SLOs were given.
    pub goodput_rps: Option<f64>,
    /// Output tokens of good requests per second.
    pub token_goodput_per_s: Option<f64>,
    /// Fraction of requests meeting every SLO.
    pub attainment: Option<f64>,
}

/// A whole report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The steady-state window on the client's clock.
    pub window: Window,
    /// Every metric's summary.
    pub summary: SummaryBlock,
    /// Per-stage distributions from the server's `timing`, keyed `<stage>_ms`.
    pub stages: BTreeMap<String, Summary>,
    /// Where the p99 tails come from.
    pub tail: Vec<TailAttribution>,
    /// SLO detail (per-SLO attainment), when SLOs were given.
    pub goodput: Option<Goodput>,
    /// Failed requests by kind.
    pub errors: BTreeMap<String, u64>,
    /// Where N_out came from, by source.
    pub n_out_sources: BTreeMap<String, u64>,
    /// Things the reader must know to trust the numbers.
    pub notes: Vec<String>,
    /// Client token counts (with a tokenizer) against the server's `usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_check: Option<crate::tokens::TokenCheck>,
    /// Who measured each stage (`<stage>_ms` → source → requests), when an external engine
    /// did: `span` (its exported span), `engine` (its response body), `gateway` (our gateway's
    /// clock), `tokenpath` (a tokenpath process's own marks).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stage_sources: BTreeMap<String, BTreeMap<String, u64>>,
    /// How the requests' trace contexts joined engines' spans, when they carried one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spans: Option<crate::spans::SpanJoin>,
}

fn summarize(values: Vec<f64>) -> Option<Summary> {
    Summary::from_samples(&values)
}

const NS_PER_MS: f64 = 1e6;

/// A per-request latency distribution a report summarises and a comparison diffs, in ms. The
/// values come from the `timeline` crate's definitions; this only names and collects them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Client TTFT from send.
    Ttft,
    /// Client TTFT from the schedule.
    TtftFromSched,
    /// Server-observed TTFT.
    ServerTtft,
    /// TPOT.
    Tpot,
    /// Chunk gaps.
    ChunkGap,
    /// Per-token ITL.
    Itl,
    /// E2E.
    E2e,
    /// One server stage.
    Stage(Stage),
}

impl Metric {
    /// Every metric, stages last.
    pub fn all() -> Vec<Metric> {
        let mut v = vec![
            Metric::Ttft,
            Metric::TtftFromSched,
            Metric::ServerTtft,
            Metric::Tpot,
            Metric::ChunkGap,
            Metric::Itl,
            Metric::E2e,
        ];
        v.extend(Stage::ALL.map(Metric::Stage));
        v
    }

    /// Short name used by `compare` and `--fail-if` (`ttft`, `tpot`, `prefill`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::TtftFromSched => "ttft_from_sched",
            Metric::ServerTtft => "server_ttft",
            Metric::Tpot => "tpot",
            Metric::ChunkGap => "chunk_gap",
            Metric::Itl => "itl",
            Metric::E2e => "e2e",
            Metric::Stage(s) => s.name(),
        }
    }

    /// The values of the completed requests `ok`, ms.
    pub fn samples(self, ok: &[&ClientRecord]) -> Vec<f64> {
        let ms = |ns: u64| ns as f64 / NS_PER_MS;
        match self {
            Metric::Ttft => ok.iter().filter_map(|r| r.ttft_ns()).map(ms).collect(),
            Metric::TtftFromSched => ok.iter().filter_map(|r| r.ttft_from_sched_ns()).map(ms).collect(),
            Metric::ServerTtft => ok.iter().filter_map(|r| r.server.as_ref()?.ttft_ms).collect(),
            Metric::Tpot => ok.iter().filter_map(|r| r.tpot_ns()).map(|v| v / NS_PER_MS).collect(),
            Metric::ChunkGap => ok.iter().flat_map(|r| r.chunk_gaps_ns()).map(ms).collect(),
            Metric::Itl => ok.iter().flat_map(|r| r.per_token_itl_ns()).map(|v| v / NS_PER_MS).collect(),
            Metric::E2e => ok.iter().filter_map(|r| r.e2e_ns()).map(ms).collect(),
            Metric::Stage(s) => ok.iter().filter_map(|r| r.server.as_ref()?.stage_ms(s)).collect(),
        }
    }
}

impl Report {
    /// Builds the report of `records` under `opts`.
    pub fn build(records: &[ClientRecord], opts: &ReportOptions) -> Result<Report, BenchError> {
        let start = records.iter().map(|r| r.t_sched).min().ok_or(BenchError::NoRequests)?;
        let end = records.iter().filter_map(|r| r.t_end().or(Some(r.t_send))).max().unwrap_or(start) + 1;
        let s2ns = |s: f64| (s.max(0.0) * 1e9) as u64;
        let window = Window::new(start + s2ns(opts.warmup_s), end.saturating_sub(s2ns(opts.cooldown_s)))?;
        let in_window: Vec<&ClientRecord> = window.ended_in(records).collect();
        let ok: Vec<&ClientRecord> = in_window.iter().copied().filter(|r| r.is_ok()).collect();
        let ms = |ns: u64| ns as f64 / NS_PER_MS;

        let tput = throughput(records, window);
        let good = opts.slo.as_ref().map(|spec| goodput(records, window, spec));
        let summary = SummaryBlock {
            requests: in_window.len() as u64,
            completed: tput.completed,
            failed: tput.failed,
            ttft_ms: summarize(Metric::Ttft.samples(&ok)),
            ttft_from_sched_ms: summarize(Metric::TtftFromSched.samples(&ok)),
            server_ttft_ms: summarize(Metric::ServerTtft.samples(&ok)),
            tpot_ms: summarize(Metric::Tpot.samples(&ok)),
            chunk_gap_ms: summarize(Metric::ChunkGap.samples(&ok)),
            itl_ms: summarize(Metric::Itl.samples(&ok)),
            e2e_ms: summarize(Metric::E2e.samples(&ok)),
            schedule_lag_ms: summarize(in_window.iter().map(|r| ms(r.schedule_lag_ns())).collect()),
            throughput: tput,
            goodput_rps: good.as_ref().map(|g| g.goodput_rps),
            token_goodput_per_s: good.as_ref().map(|g| g.token_goodput_per_s),
            attainment: good.as_ref().map(|g| g.attainment),
        };

        let mut stages = BTreeMap::new();
        for stage in Stage::ALL {
            if let Some(s) = summarize(Metric::Stage(stage).samples(&ok)) {
                stages.insert(format!("{}_ms", stage.name()), s);
            }
        }
        let stage_sources = stage_sources(&ok);
        let ok_owned: Vec<ClientRecord> = ok.iter().map(|r| (*r).clone()).collect();
        let tail = [TailMetric::Ttft, TailMetric::E2e]
            .into_iter()
            .filter_map(|m| tail_attribution(&ok_owned, m, 99.0))
            .collect();

        let mut errors = BTreeMap::new();
        for r in &in_window {
            if let Outcome::Failed { kind, .. } = &r.outcome {
                *errors.entry(kind.clone()).or_insert(0) += 1;
            }
        }
        let mut n_out_sources = BTreeMap::new();
        for r in &ok {
            let key = match r.n_out().map(|(_, s)| s) {
                Some(NOutSource::Usage) => "usage",
                Some(NOutSource::Retokenized) => "retokenized",
                Some(NOutSource::Events) => "stream_events",
                None => "unknown",
            };
            *n_out_sources.entry(key.to_owned()).or_insert(0) += 1;
        }

        let mut notes = Vec::new();
        if n_out_sources.keys().any(|k| k != "usage") {
            notes.push("some responses had no `usage`: their output token counts are estimates".to_owned());
        }
        if summary.ttft_ms.is_some_and(|s| s.p999_low_samples) {
            notes
                .push("fewer than 1000 samples: p99.9 is the largest few values, not a tail estimate".into());
        }
        if stages.is_empty() {
            notes.push("the server sent no `timing`: no per-stage breakdown".into());
        }
        let unsplit = ok.iter().filter(|r| tokens_unsplit(r)).count();
        if unsplit > 0 {
            notes.push(format!(
                "{unsplit} streamed responses had more tokens than content events and no usage per \
                 chunk: the split is unknown, so their ITL is per event (the chunk gap), not per token"
            ));
        }
        let spans = crate::spans::SpanJoin::of(&in_window);
        if let Some(j) = spans.filter(|j| j.joined < j.sent) {
            notes.push(format!(
                "{} of {} requests got no span from the engine (not exported, not sampled, or later \
                 than the wait): their stages are the server's `timing` or absent",
                j.sent - j.joined,
                j.sent
            ));
        }
        let token_check = crate::tokens::TokenCheck::of(in_window.iter().copied());
        if token_check.is_none() {
            notes.push(
                "no tokenizer given: prompt lengths are approximate; the server's `usage` is the truth"
                    .into(),
            );
        } else if in_window.iter().all(|r| r.prompt_tokens_hint.is_none()) {
            notes.push(
                "the tokenizer has no chat template: prompt token counts were not checked against `usage`"
                    .into(),
            );
        }
        Ok(Report {
            window,
            summary,
            stages,
            tail,
            goodput: good,
            errors,
            n_out_sources,
            notes,
            token_check,
            stage_sources,
            spans,
        })
    }

    /// A plain-text table for the terminal.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let s = &self.summary;
        let t = &s.throughput;
        let _ = writeln!(
            out,
            "window {:.1} s: {} requests ({} completed, {} failed)",
            t.window_s, s.requests, s.completed, s.failed
        );
        let _ = writeln!(
            out,
            "{:<22}{:>10}{:>10}{:>10}{:>10}{:>10}{:>8}",
            "metric (ms)", "mean", "p50", "p90", "p99", "max", "n"
        );
        let rows: [(&str, &Option<Summary>); 8] = [
            ("TTFT (from send)", &s.ttft_ms),
            ("TTFT (from schedule)", &s.ttft_from_sched_ms),
            ("TTFT (server)", &s.server_ttft_ms),
            ("TPOT", &s.tpot_ms),
            ("chunk gap", &s.chunk_gap_ms),
            ("ITL (per token)", &s.itl_ms),
            ("E2E", &s.e2e_ms),
            ("client schedule lag", &s.schedule_lag_ms),
        ];
        let named = |k: &String| match self.stage_sources.get(k) {
            Some(by) => format!("{k} [{}]", by.keys().cloned().collect::<Vec<_>>().join("+")),
            None => k.clone(),
        };
        let stage_rows = self.stages.iter().map(|(k, v)| (named(k), v));
        let top = rows.iter().filter_map(|(n, s)| Some(((*n).to_owned(), s.as_ref()?)));
        for (name, sum) in top.chain(stage_rows) {
            let _ = writeln!(
                out,
                "{:<22}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>8}",
                name, sum.mean, sum.p50, sum.p90, sum.p99, sum.max, sum.count
            );
        }
        if let Some(j) = &self.spans {
            let _ = writeln!(
                out,
                "engine spans: {} of {} requests joined by trace id ({} with stages)",
                j.joined, j.sent, j.timed
            );
        }
        let _ = writeln!(
            out,
            "requests/s {:.2} (offered {:.2}, sent {:.2}) | input tok/s {:.1} (cached {:.1}) | output tok/s {:.1} | total tok/s {:.1}",
            t.requests_per_s, t.offered_rps, t.achieved_send_rps, t.input_tokens_per_s,
            t.cached_input_tokens_per_s, t.output_tokens_per_s, t.total_tokens_per_s
        );
        if let Some(g) = &self.goodput {
            let per: Vec<String> = g.per_slo.iter().map(|(m, a)| format!("{m} {:.1}%", a * 100.0)).collect();
            let _ = writeln!(
                out,
                "goodput {:.2} req/s, {:.1} tok/s; attainment {:.1}% ({})",
                g.goodput_rps,
                g.token_goodput_per_s,
                g.attainment * 100.0,
                per.join(", ")
            );
        }
        for a in &self.tail {
            let _ = writeln!(out, "{a}");
        }
        for (kind, n) in &self.errors {
            let _ = writeln!(out, "errors {kind}: {n}");
        }
        if let Some(c) = &self.token_check {
            let _ = writeln!(
                out,
                "tokens vs usage: prompt {} of {} differ (max {}), output {} of {} differ (max {})",
                c.prompt.disagree,
                c.prompt.compared,
                c.prompt.max_abs_diff,
                c.output.disagree,
                c.output.compared,
                c.output.max_abs_diff
            );
        }
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        out
    }
}

/// Who measured each stage, counted over `ok`; empty when every stage was a tokenpath
/// process's own (the common case, not worth a column).
fn stage_sources(ok: &[&ClientRecord]) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for r in ok {
        let Some(s) = &r.server else { continue };
        for stage in s.stages_ms.keys() {
            let src = s.sources.get(stage).map_or("tokenpath", |x| match x {
                StageSource::Span => "span",
                StageSource::Engine => "engine",
                StageSource::Gateway => "gateway",
            });
            *out.entry(format!("{}_ms", stage.name())).or_default().entry(src.to_owned()).or_insert(0) += 1;
        }
    }
    if out.values().all(|by| by.len() == 1 && by.contains_key("tokenpath")) {
        out.clear();
    }
    out
}

/// Reads records from a bench JSON file (an object with a `requests` array) or from JSON Lines
/// (one record per line).
pub fn load_records(path: &std::path::Path) -> Result<Vec<ClientRecord>, BenchError> {
    let name = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| BenchError::Read { path: name.clone(), source })?;
    let bad = |line: usize, e: serde_json::Error| BenchError::BadRecord {
        path: name.clone(),
        line,
        reason: e.to_string(),
    };
    if text.trim_start().starts_with('{') {
        if let Ok(doc) = serde_json::from_str::<serde_json::Value>(&text) {
            if let Some(reqs) = doc.get("requests") {
                return serde_json::from_value(reqs.clone()).map_err(|e| bad(0, e));
            }
        }
    }
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| bad(i + 1, e)))
        .collect()
}

/// A streamed response whose `usage` counts more tokens than it had content events, each counted
/// as one: the server put several tokens in an event and did not say how many.
fn tokens_unsplit(r: &ClientRecord) -> bool {
    let content: Vec<u32> = r.events.iter().map(|e| e.tokens).filter(|&t| t > 0).collect();
    r.streamed
        && content.iter().all(|&t| t == 1)
        && r.usage.as_ref().is_some_and(|u| u.completion_tokens > content.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_timeline::{RequestId, ServerTiming, StreamEvent, Usage};

    const MS: u64 = 1_000_000;

    fn rec(id: u64, send_ms: u64, first_ms: u64, n: u32) -> ClientRecord {
        let mut r = ClientRecord::new(RequestId(id), send_ms * MS, send_ms * MS, true);
        r.events.push(StreamEvent { at_ns: (send_ms + 1) * MS, tokens: 0 });
        for i in 0..u64::from(n) {
            r.events.push(StreamEvent { at_ns: (first_ms + 10 * i) * MS, tokens: 1 });
        }
        r.usage = Some(Usage { prompt_tokens: 50, completion_tokens: u64::from(n), cached_tokens: None });
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Queue, (first_ms - send_ms) as f64 * 0.5);
        t.stages_ms.insert(Stage::Prefill, (first_ms - send_ms) as f64 * 0.5);
        r.server = Some(t);
        r
    }

    #[test]
    fn report_keys_and_window() {
        let mut records: Vec<ClientRecord> = (0..20).map(|i| rec(i, i * 100, i * 100 + 40, 5)).collect();
        records[19].outcome = Outcome::Failed { kind: "http_503".into(), message: "overloaded".into() };
        let opts =
            ReportOptions { warmup_s: 0.25, slo: Some("ttft:45ms".parse().unwrap()), ..Default::default() };
        let report = Report::build(&records, &opts).unwrap();
        // Requests 0 and 1 end before 250 ms (80 ms + 40 tokens...): warm-up excluded.
        assert_eq!(report.summary.requests, 18);
        assert_eq!(report.summary.failed, 1);
        assert_eq!(report.errors["http_503"], 1);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["summary"]["ttft_ms"]["p99"], 40.0);
        assert_eq!(json["summary"]["tpot_ms"]["p50"], 10.0);
        assert_eq!(json["stages"]["prefill_ms"]["p99"], 20.0);
        assert!(json["summary"]["output_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert_eq!(json["summary"]["attainment"], 17.0 / 18.0);
        assert!(report.render_table().contains("TTFT p99 tail"));
    }

    #[test]
    fn notes_say_what_the_token_check_could_not_cover() {
        let note = |records: &[ClientRecord], part: &str| {
            let r = Report::build(records, &ReportOptions::default()).unwrap();
            r.notes.iter().any(|n| n.contains(part))
        };
        let plain: Vec<ClientRecord> = (0..3).map(|i| rec(i, i * 10, i * 10 + 30, 2)).collect();
        assert!(note(&plain, "no tokenizer given") && !note(&plain, "no chat template"));
        // A tokenizer without a chat template: outputs re-tokenized, prompts not counted.
        let mut no_template = plain.clone();
        for r in &mut no_template {
            r.retokenized_output = Some(2);
        }
        assert!(note(&no_template, "no chat template") && !note(&no_template, "no tokenizer given"));
        let check = Report::build(&no_template, &ReportOptions::default()).unwrap().token_check.unwrap();
        assert_eq!((check.prompt.compared, check.output.compared), (0, 3));
        let mut with_template = no_template;
        for r in &mut with_template {
            r.prompt_tokens_hint = Some(50);
        }
        assert!(!note(&with_template, "no chat template") && !note(&with_template, "no tokenizer given"));
    }

    #[test]
    fn loads_jsonl_and_bench_json_and_names_bad_lines() {
        let dir = std::env::temp_dir().join(format!("tp-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let recs = vec![rec(1, 0, 30, 3), rec(2, 10, 50, 2)];
        let jsonl: String = recs.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
        std::fs::write(dir.join("a.jsonl"), &jsonl).unwrap();
        assert_eq!(load_records(&dir.join("a.jsonl")).unwrap(), recs);
        let doc = serde_json::json!({ "summary": {}, "requests": recs });
        std::fs::write(dir.join("b.json"), doc.to_string()).unwrap();
        assert_eq!(load_records(&dir.join("b.json")).unwrap(), recs);
        std::fs::write(dir.join("c.jsonl"), format!("{jsonl}{{\"id\": 3}}\n")).unwrap();
        let err = load_records(&dir.join("c.jsonl")).unwrap_err();
        assert!(err.to_string().contains(":3:"), "{err}");
        assert!(matches!(Report::build(&[], &ReportOptions::default()), Err(BenchError::NoRequests)));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
