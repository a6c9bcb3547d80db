//! Server-sent events for streamed responses.
//!
//! The body is a stream that owns the request's [`WorkStream`]: when the client disconnects,
//! hyper drops the body, the `WorkStream` is dropped with it, and the worker cancels the sequence
//! and frees its KV blocks at its next step — cancellation needs no extra signalling. A guard in
//! the state records the cancellation in the metrics when the stream ends without its closing
//! event. Chunks are rendered by the protocol crate; the last chunk before `[DONE]` carries
//! `timing` (and `usage` with `include_usage`).

use crate::api::{finish_reason, log_finished, since, usage};
use crate::ratelimit::OutputMeter;
use crate::AppState;
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokenpath_protocol::work::{TokenUsage, WorkEvent, WorkStream};
use tokenpath_protocol::{sse_data, sse_event, ApiError, ChatStream, CompletionStream, SSE_DONE};
use tokenpath_timeline::{ClientRecord, RequestId, ServerTiming, StreamEvent};

/// Most bytes of ready pieces sent in one body frame.
const COALESCE_BYTES: usize = 64 << 10;

/// How chunks of one endpoint are shaped.
#[derive(Debug)]
pub(crate) enum SseFormat {
    Chat(ChatStream),
    Completion(CompletionStream),
    /// An upstream's chunks, passed on as they come (they carry their own role, finish and
    /// usage chunks).
    Upstream,
}

impl SseFormat {
    fn opening(&self) -> Option<String> {
        match self {
            SseFormat::Chat(s) => Some(sse_event(&s.role_chunk())),
            SseFormat::Completion(_) | SseFormat::Upstream => None,
        }
    }

    fn text(&self, delta: String) -> String {
        match self {
            SseFormat::Chat(s) => sse_event(&s.content_chunk(delta)),
            SseFormat::Completion(s) => sse_event(&s.text_chunk(delta)),
            SseFormat::Upstream => String::new(),
        }
    }

    fn closing(
        &self,
        reason: tokenpath_protocol::FinishReason,
        u: TokenUsage,
        timing: ServerTiming,
    ) -> Vec<String> {
        match self {
            SseFormat::Chat(s) => s.finish(reason, usage(u), Some(timing)).iter().map(sse_event).collect(),
            SseFormat::Completion(s) => {
                s.finish(reason, usage(u), Some(timing)).iter().map(sse_event).collect()
            }
            SseFormat::Upstream => Vec::new(),
        }
    }
}

/// The state the body stream owns.
struct SseState {
    app: Arc<AppState>,
    format: SseFormat,
    work: WorkStream,
    /// Charges the tenant's output tokens as they are generated.
    meter: Arc<OutputMeter>,
    pending: VecDeque<String>,
    arrived: Instant,
    sent: ClientRecord,
    /// The closing event was seen (finished or failed): nothing left to record on drop.
    closed: bool,
    /// Its place in its trace (the spans it exports when it finishes).
    trace: Option<crate::spans::RequestTrace>,
}

impl Drop for SseState {
    fn drop(&mut self) {
        if !self.closed {
            tracing::debug!(request = %self.work.id(), "client went away; request cancelled");
            self.app.metrics.record_status(200, "cancelled");
        }
    }
}

impl SseState {
    /// What the client gets next: the next piece, with every piece already waiting behind it
    /// (up to [`COALESCE_BYTES`]) in the same body frame — an engine that sends a burst of
    /// events in one read is answered with one write, not one per event. Nothing waits to be
    /// coalesced: a piece goes out as soon as it is there.
    async fn next_frame(&mut self) -> Option<String> {
        let mut out = self.next_piece().await?;
        while out.len() < COALESCE_BYTES {
            match self.ready_piece() {
                Some(p) => out.push_str(&p),
                None => break,
            }
        }
        Some(out)
    }

    /// The next piece of the body; `None` when the stream is over.
    async fn next_piece(&mut self) -> Option<String> {
        if let Some(p) = self.pending.pop_front() {
            return Some(p);
        }
        if self.closed {
            return None;
        }
        let event = self.work.next().await;
        Some(self.piece_of(event))
    }

    /// A piece that is ready now, if any.
    fn ready_piece(&mut self) -> Option<String> {
        if let Some(p) = self.pending.pop_front() {
            return Some(p);
        }
        if self.closed {
            return None;
        }
        let event = self.work.try_next()?;
        Some(self.piece_of(Some(event)))
    }

    /// The piece an event becomes (`None`: the producer went away).
    fn piece_of(&mut self, event: Option<WorkEvent>) -> String {
        match event {
            Some(WorkEvent::Text { delta, tokens }) => {
                self.sent.events.push(StreamEvent { at_ns: since(self.arrived), tokens });
                self.format.text(delta)
            }
            Some(WorkEvent::Chunk { json, tokens }) => {
                if tokens > 0 {
                    self.sent.events.push(StreamEvent { at_ns: since(self.arrived), tokens });
                }
                sse_data(&json)
            }
            Some(WorkEvent::Finished { reason, usage: u, timing }) => {
                self.closed = true;
                self.meter.settle(u.completion_tokens);
                self.meter.settle_input(u.prompt_tokens);
                let (wire, label) = finish_reason(reason);
                log_finished(self.work.id(), label, u, &timing);
                self.sent.usage = Some(usage(u).to_timeline());
                self.app.metrics.record_finished(label, u, &timing, &self.sent);
                crate::spans::finished(&self.app, self.trace.as_ref(), self.arrived, &timing, u, label);
                self.pending.extend(self.format.closing(wire, u, timing));
                self.pending.push_back(SSE_DONE.to_owned());
                self.pending.pop_front().unwrap_or_default()
            }
            Some(WorkEvent::Failed { message }) => self.fail(&message),
            Some(WorkEvent::Kv { .. } | WorkEvent::Handoff { .. } | WorkEvent::Body { .. }) => {
                self.fail("a non-stream event reached the client's stream")
            }
            None => self.fail("the worker stopped before the request finished"),
        }
    }

    /// An in-stream error event (the status line was already sent), then the end.
    fn fail(&mut self, message: &str) -> String {
        tracing::error!(request = %self.work.id(), "streamed request failed: {message}");
        self.closed = true;
        self.app.metrics.record_status(500, "none");
        let err = ApiError::server_error("The server had an error while processing your request.");
        self.pending.push_back(SSE_DONE.to_owned());
        sse_event(&err.body)
    }
}

/// A `text/event-stream` response fed by `work`.
pub(crate) fn sse_response(
    app: Arc<AppState>,
    format: SseFormat,
    work: WorkStream,
    meter: Arc<OutputMeter>,
    id: RequestId,
    arrived: Instant,
    trace: Option<crate::spans::RequestTrace>,
) -> Response {
    let mut pending = VecDeque::new();
    pending.extend(format.opening());
    let state = SseState {
        app,
        format,
        work,
        meter,
        pending,
        arrived,
        sent: ClientRecord::new(id, 0, 0, true),
        closed: false,
        trace,
    };
    let body = futures_util::stream::unfold(state, |mut st| async move {
        let piece = st.next_frame().await?;
        Some((Ok::<_, Infallible>(Bytes::from(piece)), st))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}
