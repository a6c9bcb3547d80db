//! Spans out: our own request timeline as OTLP spans, and the task that ships them.
//!
//! [`request_spans`] turns one request's `ServerTiming` into a root span (arrival → end, the
//! gateway's clock) and one child per stage, laid end to end in path order — a stage is by
//! definition the interval between two consecutive marks, so its place follows from the
//! durations before it. [`SpanExporter`] is an owning task: spans are handed over without
//! waiting (a full queue drops them and counts), batched, and POSTed as OTLP/HTTP protobuf;
//! an unreachable collector costs log lines, never a request.

use std::time::Duration;

use serde_json::json;
use tokenpath_timeline::{EngineSpan, ServerTiming, SpanId, Stage, StageSource, TraceId, TraceParent};
use tokio::sync::mpsc;

/// The root span's name; children are `tokenpath.<stage>`.
pub const REQUEST_SPAN: &str = "tokenpath.request";
/// Spans waiting to be shipped, at most.
const QUEUE: usize = 8192;
/// Spans per export, at most.
const BATCH: usize = 512;
/// Longest a span waits for its batch.
const LINGER: Duration = Duration::from_millis(500);

/// The service name of a gateway's spans.
pub const GATEWAY_SERVICE: &str = "tokenpath";
/// The service name of a worker's spans.
pub const WORKER_SERVICE: &str = "tokenpath-worker";

/// One request's spans in `trace`: `caller` is the client's span (the root's parent) when it
/// sent one, `root` the root span's id (the parent every engine leg and worker was given),
/// `arrived_unix_ns` the arrival on the wall clock, `attrs` the root's attributes beyond the
/// timing's (the caller's GenAI ones: operation, model, usage, finish reason). Stages a worker
/// already exported (`timing.exported`) are left out: each stage's span comes from the process
/// that ran it.
pub fn request_spans(
    trace: TraceId,
    caller: Option<SpanId>,
    root: SpanId,
    arrived_unix_ns: u64,
    timing: &ServerTiming,
    attrs: serde_json::Map<String, serde_json::Value>,
) -> Vec<EngineSpan> {
    let under_root = TraceParent::new(trace, root);
    let (kids, cursor) =
        lay_out(under_root, arrived_unix_ns, timing, GATEWAY_SERVICE, |s| !timing.exported.contains(&s));
    let end = timing.e2e_ms.map_or(cursor, |e| arrived_unix_ns.saturating_add(ns(e))).max(cursor);
    let mut attrs = attrs;
    attrs.insert("tokenpath.cached_tokens".into(), json!(timing.cached_tokens));
    attrs.insert("process.pid".into(), json!(std::process::id()));
    if let Some(t) = timing.ttft_ms {
        attrs.insert("gen_ai.server.time_to_first_token".into(), json!(t / 1e3));
    }
    let mut out = Vec::with_capacity(1 + kids.len());
    out.push(EngineSpan {
        trace_id: trace,
        span_id: root,
        parent: caller,
        name: REQUEST_SPAN.into(),
        service: Some(GATEWAY_SERVICE.into()),
        start_unix_ns: arrived_unix_ns,
        end_unix_ns: end,
        attributes: attrs,
    });
    out.extend(kids);
    out
}

/// A worker's spans for the stages it ran (`stages`, read from `timing`), children of
/// `ctx.parent` (the gateway's root span) and laid end to end so the last one ends at
/// `end_unix_ns`: a worker's stages are consecutive marks on its clock ending where it reports
/// them (the handoff, the transfer's acknowledgement, the last token).
pub fn worker_spans(
    ctx: TraceParent,
    end_unix_ns: u64,
    timing: &ServerTiming,
    stages: &[Stage],
) -> Vec<EngineSpan> {
    let keep = |s: Stage| stages.contains(&s);
    let total: u64 = timing.stages_ms.iter().filter(|(s, _)| keep(**s)).map(|(_, ms)| ns(*ms)).sum();
    lay_out(ctx, end_unix_ns.saturating_sub(total), timing, WORKER_SERVICE, keep).0
}

/// A stage longer than a day is an engine's garbage, not a duration: clamped, never an
/// overflow.
fn ns(ms: f64) -> u64 {
    (ms.clamp(0.0, 86_400_000.0) * 1e6).round() as u64
}

/// One span per stage of `timing` that `keep` takes, in path order from `start_unix_ns`, each
/// a child of `ctx.parent`; and where the last ended.
fn lay_out(
    ctx: TraceParent,
    start_unix_ns: u64,
    timing: &ServerTiming,
    service: &str,
    keep: impl Fn(Stage) -> bool,
) -> (Vec<EngineSpan>, u64) {
    let mut cursor = start_unix_ns;
    let mut kids = Vec::new();
    for stage in Stage::ALL {
        let Some(ms) = timing.stages_ms.get(&stage).filter(|_| keep(stage)) else { continue };
        let start = cursor;
        cursor = cursor.saturating_add(ns(*ms));
        let source = match timing.sources.get(&stage) {
            None => "tokenpath",
            Some(StageSource::Engine) => "engine",
            Some(StageSource::Gateway) => "gateway",
            Some(StageSource::Span) => "span",
        };
        let mut attrs = json!({
            "tokenpath.stage": stage.name(),
            "tokenpath.source": source,
            "tokenpath.duration_ms": ms,
            "process.pid": std::process::id(),
        });
        // Who ran it: in PD the prefill worker up to the transfer, the decode worker after; a
        // colocated worker (`both`) all of it; the gateway's stage is no worker's.
        let role = match stage {
            Stage::Gateway => None,
            Stage::Prefill | Stage::Queue | Stage::KvLoad | Stage::KvTransfer => Some("prefill"),
            Stage::DecodeQueue | Stage::Decode => Some("decode"),
        };
        if let Some(w) = role.and_then(|r| timing.workers.get(r).or_else(|| timing.workers.get("both"))) {
            attrs["tokenpath.worker"] = json!(w.0);
        }
        kids.push(EngineSpan {
            trace_id: ctx.trace_id,
            span_id: crate::fresh_context().parent,
            parent: Some(ctx.parent),
            name: format!("tokenpath.{}", stage.name()),
            service: Some(service.into()),
            start_unix_ns: start,
            end_unix_ns: cursor,
            attributes: attrs.as_object().cloned().unwrap_or_default(),
        });
    }
    (kids, cursor)
}

/// `at` on the wall clock, in ns since the Unix epoch (now, less how long ago `at` was).
pub fn unix_ns(at: std::time::Instant) -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    (now as u64).saturating_sub(at.elapsed().as_nanos() as u64)
}

/// A handle to the exporting task; cheap to clone.
#[derive(Clone, Debug)]
pub struct SpanExporter {
    tx: mpsc::Sender<Vec<EngineSpan>>,
}

impl SpanExporter {
    /// Starts the task (on the current runtime) shipping to `endpoint` (a collector's base URL
    /// or its full `/v1/traces` URL), with `token` as a bearer token when set.
    pub fn start(endpoint: &str, token: Option<String>) -> Self {
        let url = if endpoint.ends_with(crate::HTTP_TRACES_PATH) {
            endpoint.to_owned()
        } else {
            format!("{}{}", endpoint.trim_end_matches('/'), crate::HTTP_TRACES_PATH)
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(rx, url, token));
        Self { tx }
    }

    /// Hands `spans` over; when the queue is full they are dropped (and logged), never waited on.
    pub fn export(&self, spans: Vec<EngineSpan>) {
        if self.tx.try_send(spans).is_err() {
            tracing::debug!("span export queue full: spans dropped");
        }
    }
}

async fn run(mut rx: mpsc::Receiver<Vec<EngineSpan>>, url: String, token: Option<String>) {
    let client = match reqwest::Client::builder().timeout(Duration::from_secs(5)).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("span exporter: {e}");
            return;
        }
    };
    while let Some(first) = rx.recv().await {
        let mut batch = first;
        let mut closed = false;
        let until = tokio::time::Instant::now() + LINGER;
        while batch.len() < BATCH {
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some(more)) => batch.extend(more),
                Ok(None) => {
                    closed = true;
                    break;
                }
                Err(_) => break,
            }
        }
        let mut req = client
            .post(&url)
            .header("content-type", "application/x-protobuf")
            .body(crate::encode_protobuf(&batch));
        if let Some(t) = &token {
            req = req.bearer_auth(t);
        }
        match req.send().await {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => tracing::warn!("span export to {url}: HTTP {}", r.status()),
            Err(e) => tracing::warn!("span export to {url}: {e}"),
        }
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requests_stages_become_children_laid_end_to_end_under_one_root() {
        let ctx: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap();
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Gateway, 0.5);
        t.stages_ms.insert(Stage::Queue, 2.0);
        t.stages_ms.insert(Stage::Prefill, 10.25);
        t.stages_ms.insert(Stage::Decode, 40.0);
        t.e2e_ms = Some(53.0);
        let root = SpanId([3; 8]);
        let spans =
            request_spans(ctx.trace_id, Some(ctx.parent), root, 1_000_000_000, &t, Default::default());
        assert_eq!(spans.len(), 5);
        assert_eq!((spans[0].name.as_str(), spans[0].parent), (REQUEST_SPAN, Some(ctx.parent)));
        assert_eq!(spans[0].end_unix_ns - spans[0].start_unix_ns, 53_000_000);
        let kids = &spans[1..];
        assert!(kids.iter().all(|s| s.parent == Some(root) && s.trace_id == ctx.trace_id));
        let names: Vec<&str> = kids.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["tokenpath.gateway", "tokenpath.queue", "tokenpath.prefill", "tokenpath.decode"]);
        assert_eq!(kids[2].end_unix_ns - kids[2].start_unix_ns, 10_250_000);
        assert!(kids.windows(2).all(|w| w[0].end_unix_ns == w[1].start_unix_ns));
    }

    #[test]
    fn a_workers_stages_end_where_it_reports_them_and_the_gateway_leaves_them_out() {
        let ctx: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap();
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Gateway, 0.5);
        t.stages_ms.insert(Stage::Queue, 2.0);
        t.stages_ms.insert(Stage::Prefill, 10.0);
        t.stages_ms.insert(Stage::Decode, 40.0);
        let spans = worker_spans(ctx, 5_000_000_000, &t, &[Stage::Queue, Stage::Prefill]);
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["tokenpath.queue", "tokenpath.prefill"]);
        assert_eq!(spans[1].end_unix_ns, 5_000_000_000);
        assert_eq!(spans[0].start_unix_ns, 5_000_000_000 - 12_000_000);
        assert_eq!(spans[0].end_unix_ns, spans[1].start_unix_ns);
        assert!(spans
            .iter()
            .all(|s| s.parent == Some(ctx.parent) && s.service.as_deref() == Some(WORKER_SERVICE)));
        t.exported.extend([Stage::Queue, Stage::Prefill]);
        let gw = request_spans(ctx.trace_id, None, SpanId([4; 8]), 1, &t, Default::default());
        let names: Vec<&str> = gw.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, [REQUEST_SPAN, "tokenpath.gateway", "tokenpath.decode"]);
    }
}
