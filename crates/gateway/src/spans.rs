//! Engines' spans for the requests this gateway forwards (`--otlp-listen`): each request
//! continues the client's `traceparent` (or starts a fresh trace when the gateway receives
//! spans and the client sent none), every upstream leg carries it, and when the engine's span
//! comes back — after the request, in the engine's next export batch — its stages go into
//! `tokenpath_engine_span_stage_seconds`. A span that does not come within the wait counts as
//! `missing`; the receiver keeps only traces announced here, so nothing else can fill it.
//! With `--otlp-endpoint`, the request's own timeline goes out too: a root span (the legs are
//! its children's siblings, parented to it) and one span per stage.

use std::sync::Arc;
use std::time::Instant;

use axum::http::HeaderMap;
use tokenpath_protocol::work::TokenUsage;
use tokenpath_timeline::{ServerTiming, SpanId, TraceId, TraceParent};

use crate::AppState;

/// One request's place in its trace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RequestTrace {
    /// The trace (the client's, or fresh).
    trace: TraceId,
    /// The client's span, when it sent a context: our root span's parent.
    caller: Option<SpanId>,
    /// Our root span, when we export spans.
    root: Option<SpanId>,
    /// The parent every leg is given: our root span, else the client's span, else (a fresh
    /// trace we do not export) a fresh id.
    legs_parent: SpanId,
    /// The client's sampling decision, kept (a fresh trace is sampled).
    sampled: bool,
    /// The GenAI operation: `chat` or `text_completion`.
    operation: &'static str,
}

impl RequestTrace {
    /// The context the request's legs carry: under our root span when we export one, else the
    /// client's as it came.
    pub(crate) fn outgoing(&self) -> TraceParent {
        TraceParent { trace_id: self.trace, parent: self.legs_parent, sampled: self.sampled }
    }
}

/// The request's trace: the client's, when it sent a valid context (an invalid one is dropped,
/// as W3C asks); a fresh one when this gateway receives engines' spans or exports its own;
/// else none.
pub(crate) fn context(app: &AppState, headers: &HeaderMap, operation: &'static str) -> Option<RequestTrace> {
    let theirs = headers.get("traceparent").and_then(|v| v.to_str().ok()?.parse::<TraceParent>().ok());
    let exporting = app.config.span_export.is_some();
    let root = exporting.then(|| tokenpath_otlp::fresh_context().parent);
    let (trace, caller, sampled) = match theirs {
        Some(tp) => (tp.trace_id, Some(tp.parent), tp.sampled),
        None if exporting || app.config.engine_spans.is_some() => {
            (tokenpath_otlp::fresh_context().trace_id, None, true)
        }
        None => return None,
    };
    let legs_parent = root.or(caller).unwrap_or_else(|| tokenpath_otlp::fresh_context().parent);
    Some(RequestTrace { trace, caller, root, legs_parent, sampled, operation })
}

/// A request finished (`finish` its reason, as the API names it): with `--otlp-endpoint`, its
/// timeline goes out as a root span, with the OpenTelemetry GenAI attributes that apply to a
/// server (`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.response.finish_reasons`,
/// `gen_ai.usage.*`), and one span per stage.
pub(crate) fn finished(
    app: &AppState,
    trace: Option<&RequestTrace>,
    arrived: Instant,
    timing: &ServerTiming,
    usage: TokenUsage,
    finish: &str,
) {
    let (Some(exporter), Some(t)) = (&app.config.span_export, trace) else { return };
    let Some(root) = t.root else { return };
    let attrs = serde_json::json!({
        "gen_ai.operation.name": t.operation,
        "gen_ai.request.model": app.config.served_model_name,
        "gen_ai.response.finish_reasons": [finish],
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
    });
    let attrs = attrs.as_object().cloned().unwrap_or_default();
    let spans = tokenpath_otlp::request_spans(
        t.trace,
        t.caller,
        root,
        tokenpath_otlp::unix_ns(arrived),
        timing,
        attrs,
    );
    exporter.export(spans);
}

/// Announces `trace` to the receiver and, off the request's path, waits for its spans and
/// records them. Only forwarded requests: our own workers report their stages in `timing`.
pub(crate) fn await_spans(app: &Arc<AppState>, trace: Option<&RequestTrace>) {
    let (Some(spans), Some(trace), true) = (&app.config.engine_spans, trace, app.backend.forwards()) else {
        return;
    };
    let id = trace.trace;
    if spans.store.expect(id).is_err() {
        return;
    }
    let (store, wait, app) = (spans.store.clone(), spans.wait, Arc::clone(app));
    tokio::spawn(async move {
        if let Ok(got) = store.take(id, wait, tokenpath_otlp::SETTLE).await {
            app.metrics.record_engine_spans(&got);
        }
    });
}
