//! The mock engine's spans: when a request carries a `traceparent` and the mock was given an
//! OTLP endpoint, it exports one vLLM-shaped `llm_request` span per request, continuing the
//! caller's trace, with latencies it measured on its own clock — queue (arrival → the body's
//! first poll), prefill (→ the first content chunk), decode (→ the last) — over OTLP/HTTP or
//! OTLP/gRPC, as vLLM does. Each exported span is also logged (`{"span": ...}` lines) so a test
//! can check that what the bench joined is exactly what was sent.

use std::time::Instant;

use serde_json::json;
use tokenpath_timeline::{EngineSpan, TraceParent};

use super::Mock;

/// Where the mock exports its spans.
#[derive(Clone, Debug)]
pub struct MockOtlp {
    /// The receiver's base URL (`http://127.0.0.1:4318`).
    pub endpoint: String,
    /// OTLP/gRPC instead of OTLP/HTTP protobuf.
    pub grpc: bool,
}

/// One request's clock, exported when dropped (the body ended, or the client left).
pub(super) struct SpanClock {
    mock: std::sync::Arc<Mock>,
    trace: TraceParent,
    arrived: Instant,
    arrived_unix_ns: u64,
    polled: Option<Instant>,
    first: Option<Instant>,
    last: Option<Instant>,
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl SpanClock {
    pub(super) fn start(
        mock: &std::sync::Arc<Mock>,
        trace: TraceParent,
        prompt_tokens: u64,
        completion_tokens: u64,
    ) -> Self {
        Self {
            mock: std::sync::Arc::clone(mock),
            trace,
            arrived: Instant::now(),
            arrived_unix_ns: tokenpath_otlp::unix_ns(Instant::now()),
            polled: None,
            first: None,
            last: None,
            prompt_tokens,
            completion_tokens,
        }
    }

    /// The body was polled for the first time (the engine "scheduled" the request).
    pub(super) fn polled(&mut self) {
        self.polled.get_or_insert_with(Instant::now);
    }

    /// A content chunk went out.
    pub(super) fn content(&mut self) {
        let now = Instant::now();
        self.polled.get_or_insert(now);
        self.first.get_or_insert(now);
        self.last = Some(now);
    }
}

impl Drop for SpanClock {
    fn drop(&mut self) {
        let Some(otlp) = self.mock.config.otlp.clone() else { return };
        let end = Instant::now();
        let polled = self.polled.unwrap_or(end);
        let first = self.first.unwrap_or(end);
        let last = self.last.unwrap_or(end);
        let s = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
        let span = EngineSpan {
            trace_id: self.trace.trace_id,
            span_id: tokenpath_otlp::fresh_context().parent,
            parent: Some(self.trace.parent),
            name: "llm_request".into(),
            service: Some("tokenpath-mock".into()),
            start_unix_ns: self.arrived_unix_ns,
            end_unix_ns: self.arrived_unix_ns + end.saturating_duration_since(self.arrived).as_nanos() as u64,
            attributes: json!({
                "gen_ai.latency.time_in_queue": s(self.arrived, polled),
                "gen_ai.latency.time_in_model_prefill": s(polled, first),
                "gen_ai.latency.time_in_model_decode": s(first, last),
                "gen_ai.latency.time_to_first_token": s(self.arrived, first),
                "gen_ai.latency.e2e": s(self.arrived, last),
                "gen_ai.usage.prompt_tokens": self.prompt_tokens,
                "gen_ai.usage.completion_tokens": self.completion_tokens,
                "tokenpath_mock.unmapped": "kept raw",
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        };
        self.mock.log_line(&json!({ "span": span }));
        let body = tokenpath_otlp::encode_protobuf(std::slice::from_ref(&span));
        let client = self.mock.otlp_client.clone();
        // Exported after the answer, off its path, as an engine's batch exporter does.
        tokio::spawn(async move {
            let base = otlp.endpoint.trim_end_matches('/');
            let sent = if otlp.grpc {
                client
                    .post(format!("{base}{}", tokenpath_otlp::GRPC_EXPORT_PATH))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .body(tokenpath_otlp::grpc_frame(&body))
                    .send()
                    .await
            } else {
                client
                    .post(format!("{base}{}", tokenpath_otlp::HTTP_TRACES_PATH))
                    .header("content-type", "application/x-protobuf")
                    .body(body)
                    .send()
                    .await
            };
            if let Err(e) = sent {
                tracing::warn!("mock engine: span export failed: {e}");
            }
        });
    }
}
