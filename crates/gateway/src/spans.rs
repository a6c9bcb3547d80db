//! Engines' spans for the requests this gateway forwards (`--otlp-listen`): each request
//! continues the client's `traceparent` (or starts a fresh trace when the gateway receives
//! spans and the client sent none), every upstream leg carries it, and when the engine's span
//! comes back — after the request, in the engine's next export batch — its stages go into
//! `tokenpath_engine_span_stage_seconds`. A span that does not come within the wait counts as
//! `missing`; the receiver keeps only traces announced here, so nothing else can fill it.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use tokenpath_timeline::TraceParent;

use crate::AppState;

/// After a request's first span, how long its other spans (SGLang exports several) may take.
const SETTLE: Duration = Duration::from_secs(2);

/// The request's trace context: the client's, when it sent a valid one (an invalid one is
/// dropped, as W3C asks); a fresh one when this gateway receives engines' spans; else none.
pub(crate) fn context(app: &AppState, headers: &HeaderMap) -> Option<TraceParent> {
    let theirs = headers.get("traceparent").and_then(|v| v.to_str().ok()?.parse::<TraceParent>().ok());
    theirs.or_else(|| app.config.engine_spans.as_ref().map(|_| tokenpath_otlp::fresh_context()))
}

/// Announces `trace` to the receiver and, off the request's path, waits for its spans and
/// records them. Only forwarded requests: our own workers report their stages in `timing`.
pub(crate) fn await_spans(app: &Arc<AppState>, trace: Option<TraceParent>) {
    let (Some(spans), Some(trace), true) = (&app.config.engine_spans, trace, app.backend.forwards()) else {
        return;
    };
    if spans.store.expect(trace.trace_id).is_err() {
        return;
    }
    let (store, wait, app) = (spans.store.clone(), spans.wait, Arc::clone(app));
    tokio::spawn(async move {
        if let Ok(got) = store.take(trace.trace_id, wait, SETTLE).await {
            app.metrics.record_engine_spans(&got);
        }
    });
}
