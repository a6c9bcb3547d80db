//! The shipped Grafana dashboard (`deploy/grafana/tokenpath-dashboard.json`) against the metrics
//! the gateway actually exports: every series a panel queries must appear in a rendered
//! `/metrics`, so renaming a metric without fixing the dashboard fails here instead of leaving
//! empty panels. The metrics are rendered from the gateway's own registry with every family
//! populated, rather than through a server, so the check is instant.

#![allow(clippy::unwrap_used)]

use serde_json::Value;
use std::collections::BTreeSet;
use tokenpath_gateway::metrics::{self, Metrics};
use tokenpath_timeline::{ClientRecord, RequestId, ServerTiming, Stage, StreamEvent};
use tokenpath_worker::{TokenUsage, WorkerStats};

fn dashboard() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/grafana/tokenpath-dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every panel, rows' nested panels included.
fn panels(v: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in v["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(panels(p));
    }
    out
}

/// The series names of a rendered exposition (`tokenpath_x_bucket`, `tokenpath_y_total`, ...).
fn exported() -> BTreeSet<String> {
    let m = Metrics::with_peak_flops(Some(1e11));
    let mut timing = ServerTiming::default();
    timing.stages_ms.insert(Stage::Queue, 1.0);
    timing.ttft_ms = Some(2.0);
    timing.e2e_ms = Some(3.0);
    let mut sent = ClientRecord::new(RequestId(1), 0, 0, true);
    sent.events = vec![StreamEvent { at_ns: 1_000, tokens: 1 }, StreamEvent { at_ns: 2_000, tokens: 1 }];
    let usage = TokenUsage { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 1 };
    m.record_finished("stop", usage, &timing, &sent);
    m.record_tenant("a");
    m.record_rate_limited("a", "input_tokens");
    let text = m.render(&WorkerStats::default());
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// The `tokenpath_*` identifiers of a PromQL expression.
fn names(expr: &str) -> Vec<&str> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tokenpath_"))
        .collect()
}

#[test]
fn every_panel_queries_exported_metrics() {
    let exported = exported();
    let dash = dashboard();
    let vars = dash["templating"]["list"].as_array().unwrap();
    assert!(
        vars.iter().any(|v| v["name"] == "DS_PROMETHEUS" && v["type"] == "datasource"),
        "the data source is the DS_PROMETHEUS variable"
    );
    let mut used = BTreeSet::new();
    let mut ids = BTreeSet::new();
    for p in panels(&dash) {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id in {p}");
        if p["type"] == "row" {
            continue;
        }
        let title = p["title"].as_str().unwrap();
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title} has no query");
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            let found = names(expr);
            assert!(!found.is_empty(), "{title}: {expr} queries no tokenpath metric");
            for n in found {
                assert!(exported.contains(n), "{title}: {n} is not exported; exported: {exported:?}");
                used.insert(n.to_owned());
            }
        }
    }
    // The families the dashboard exists to show are all on it.
    for name in [
        metrics::TTFT_SECONDS,
        metrics::TPOT_SECONDS,
        metrics::ITL_SECONDS,
        metrics::E2E_SECONDS,
        metrics::REQUEST_STAGE_SECONDS,
        metrics::PROMPT_TOKENS,
        metrics::GENERATION_TOKENS,
        metrics::CACHED_PROMPT_TOKENS,
        metrics::REQUESTS,
        metrics::TENANT_REQUESTS,
        metrics::RATE_LIMITED_REQUESTS,
        metrics::NUM_REQUESTS_WAITING,
        metrics::NUM_REQUESTS_RUNNING,
        metrics::KV_BLOCKS_USED,
        metrics::KV_BLOCKS_FREE,
        metrics::WORKER_BUSY_SECONDS,
        metrics::WORKER_FLOPS,
        metrics::WORKER_PEAK_FLOPS,
    ] {
        assert!(used.iter().any(|u| u.starts_with(name)), "no panel shows {name}");
    }
}
