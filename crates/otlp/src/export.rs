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
use tokenpath_timeline::{EngineSpan, ServerTiming, SpanId, Stage, StageSource, TraceId};
use tokio::sync::mpsc;

/// The root span's name; children are `tokenpath.<stage>`.
pub const REQUEST_SPAN: &str = "tokenpath.request";
/// Spans waiting to be shipped, at most.
const QUEUE: usize = 8192;
/// Spans per export, at most.
const BATCH: usize = 512;
/// Longest a span waits for its batch.
const LINGER: Duration = Duration::from_millis(500);

/// One request's spans in `trace`: `caller` is the client's span (the root's parent) when it
/// sent one, `root` the root span's id (the parent every engine leg was given),
/// `arrived_unix_ns` the arrival on the wall clock.
pub fn request_spans(
    trace: TraceId,
    caller: Option<SpanId>,
    root: SpanId,
    arrived_unix_ns: u64,
    timing: &ServerTiming,
    usage: (u64, u64),
) -> Vec<EngineSpan> {
    // A stage longer than a day is an engine's garbage, not a duration: clamped, never an
    // overflow.
    let ns = |ms: f64| (ms.clamp(0.0, 86_400_000.0) * 1e6).round() as u64;
    let mut cursor = arrived_unix_ns;
    let mut out = Vec::with_capacity(1 + timing.stages_ms.len());
    let mut kids = Vec::new();
    for stage in Stage::ALL {
        let Some(ms) = timing.stages_ms.get(&stage) else { continue };
        let start = cursor;
        cursor = cursor.saturating_add(ns(*ms));
        let source = match timing.sources.get(&stage) {
            None => "tokenpath",
            Some(StageSource::Engine) => "engine",
            Some(StageSource::Gateway) => "gateway",
            Some(StageSource::Span) => "span",
        };
        let mut attrs =
            json!({"tokenpath.stage": stage.name(), "tokenpath.source": source, "tokenpath.duration_ms": ms});
        if let Some(w) = timing.workers.get(match stage {
            Stage::Prefill | Stage::Queue => "prefill",
            _ => "decode",
        }) {
            attrs["tokenpath.worker"] = json!(w.0);
        }
        kids.push(EngineSpan {
            trace_id: trace,
            span_id: crate::fresh_context().parent,
            parent: Some(root),
            name: format!("tokenpath.{}", stage.name()),
            service: Some("tokenpath".into()),
            start_unix_ns: start,
            end_unix_ns: cursor,
            attributes: attrs.as_object().cloned().unwrap_or_default(),
        });
    }
    let end = timing.e2e_ms.map_or(cursor, |e| arrived_unix_ns.saturating_add(ns(e))).max(cursor);
    let mut attrs = json!({
        "gen_ai.usage.input_tokens": usage.0,
        "gen_ai.usage.output_tokens": usage.1,
        "tokenpath.cached_tokens": timing.cached_tokens,
    });
    if let Some(t) = timing.ttft_ms {
        attrs["gen_ai.server.time_to_first_token"] = json!(t / 1e3);
    }
    out.push(EngineSpan {
        trace_id: trace,
        span_id: root,
        parent: caller,
        name: REQUEST_SPAN.into(),
        service: Some("tokenpath".into()),
        start_unix_ns: arrived_unix_ns,
        end_unix_ns: end,
        attributes: attrs.as_object().cloned().unwrap_or_default(),
    });
    out.extend(kids);
    out
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
    use tokenpath_timeline::TraceParent;

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
        let spans = request_spans(ctx.trace_id, Some(ctx.parent), root, 1_000_000_000, &t, (12, 8));
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
}
