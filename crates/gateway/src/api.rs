//! The OpenAI endpoints: parse and validate (protocol crate), check the model, tokenize, stamp
//! `admitted`, submit to the worker, then answer with one JSON body or an SSE stream.
//!
//! Chat and legacy completions share everything after parsing; [`Endpoint`] carries the few
//! differences (which prompt field errors name, how chunks and bodies are shaped), so the two
//! cannot drift apart. The `arrived` mark is the first thing a handler takes and `admitted` the
//! last thing before submission, so the `gateway` stage covers authentication, parsing,
//! validation and tokenization — all of this process's work before the queue. `arrived` is when
//! the handler starts, i.e. once the body has been received (upload time is the client's).

use crate::auth::Tenant;
use crate::error::Reject;
use crate::guard::Caller;
use crate::ratelimit::OutputMeter;
use crate::stream::{sse_response, SseFormat};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokenpath_protocol::forward::parse_forwarded;
use tokenpath_protocol::sampling::SamplingParams;
use tokenpath_protocol::work::{TokenMeter, TokenUsage, WorkEvent, WorkMode, WorkRequest};
use tokenpath_protocol::{
    chat_completion_id, completion_id, parse_chat_request, parse_completion_request, server_timing_header,
    ApiError, ChatCompletionResponse, ChatStream, CompletionResponse, CompletionStream, FinishReason,
    GenerationRequest, Prompt, ProtocolError, Usage,
};
use tokenpath_timeline::{ClientRecord, FinishReason as Finish, Nanos, RequestId, StreamEvent};

pub(crate) use tokenpath_protocol::forward::ApiEndpoint as Endpoint;

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(
    State(app): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let trace = crate::spans::context(&app, &headers, "chat");
    generate(app, Endpoint::Chat, caller.0, trace, body).await
}

/// `POST /v1/completions`.
pub(crate) async fn completions(
    State(app): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let trace = crate::spans::context(&app, &headers, "text_completion");
    generate(app, Endpoint::Completions, caller.0, trace, body).await
}

/// Bodies larger than this are parsed and tokenized on the blocking pool, so a long prompt
/// cannot stall the async threads that carry every other stream.
const INLINE_BODY_BYTES: usize = 16 * 1024;
/// Most large bodies parsed and tokenized at once; more wait for a turn (bounded CPU and memory
/// however many arrive together).
pub(crate) const MAX_CONCURRENT_TOKENIZATIONS: usize = 4;

async fn generate(
    app: Arc<AppState>,
    endpoint: Endpoint,
    tenant: Option<Tenant>,
    trace: Option<crate::spans::RequestTrace>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    app.metrics.record_tenant(tenant.as_ref().map_or(crate::metrics::ANONYMOUS_TENANT, |t| t.0.as_str()));
    // The request bucket (and the tenant's concurrency) first: a tenant out of budget costs a
    // refusal, not a parse and a tokenization.
    let pass = match crate::ratelimit::begin(&app, tenant.as_ref()) {
        Ok(p) => p,
        Err(reject) => {
            app.metrics.record_status(reject.status().as_u16(), "none");
            return reject.into_response();
        }
    };
    let admitted = if body.as_ref().map_or(0, Bytes::len) > INLINE_BODY_BYTES {
        let state = Arc::clone(&app);
        let t = tenant.clone();
        let Ok(_turn) = Arc::clone(&app.tokenizing).acquire_owned().await else {
            return server_error(&app, "the tokenization gate closed");
        };
        tokio::task::spawn_blocking(move || admit(&state, endpoint, body, arrived, t.as_ref(), pass, trace))
            .await
            .unwrap_or_else(|e| {
                tracing::error!("admission task failed: {e}");
                Err(Reject::new(ApiError::server_error(
                    "The server had an error while processing your request.",
                )))
            })
    } else {
        admit(&app, endpoint, body, arrived, tenant.as_ref(), pass, trace)
    };
    match admitted {
        Ok(admitted) => {
            crate::spans::await_spans(&app, admitted.trace.as_ref());
            respond(app, endpoint, admitted, arrived).await
        }
        Err(reject) => {
            app.metrics.record_status(reject.status().as_u16(), "none");
            reject.into_response()
        }
    }
}

/// A request that passed the gateway stage.
struct Admitted {
    id: RequestId,
    req: GenerationRequest,
    work: WorkRequest,
    /// Charges the tenant's output tokens as they are generated (shared with the producer).
    meter: Arc<OutputMeter>,
    /// Its place in its trace.
    trace: Option<crate::spans::RequestTrace>,
}

fn admit(
    app: &AppState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
    tenant: Option<&Tenant>,
    pass: crate::ratelimit::Pass,
    trace: Option<crate::spans::RequestTrace>,
) -> Result<Admitted, Reject> {
    if app.is_draining() {
        return Err(Reject::new(ApiError::overloaded("The server is shutting down.")));
    }
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Reject::too_large(app.config.max_body_bytes)
        } else {
            Reject::new(ApiError::invalid_request(e.body_text(), None))
        }
    })?;
    let (req, forward) = if app.backend.forwards() {
        // An upstream engine judges the fields we do not know; the ones we act on are checked.
        let (req, fwd) =
            parse_forwarded(endpoint, &body, &app.limits).map_err(|e| Reject::new(e.api_error()))?;
        (req, Some(Arc::new(fwd)))
    } else {
        let parsed = match endpoint {
            Endpoint::Chat => parse_chat_request(&body).and_then(|r| r.validate(&app.limits)),
            Endpoint::Completions => parse_completion_request(&body).and_then(|r| r.validate(&app.limits)),
        };
        (parsed.map_err(|e| Reject::new(e.api_error()))?, None)
    };
    if req.model != app.config.served_model_name {
        return Err(Reject::new(ApiError::model_not_found(&req.model)));
    }
    let prompt = tokenize(app, &req.prompt, endpoint, req.params.max_tokens)?;
    let id = RequestId(app.next_id.fetch_add(1, Ordering::Relaxed));
    let meter = Arc::new(crate::ratelimit::input(app, pass, tenant, id, prompt.len())?);
    let p = &req.params;
    let sampling = SamplingParams {
        temperature: p.temperature,
        top_k: 0,
        top_p: p.top_p,
        seed: p.seed,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
    };
    let work = WorkRequest {
        id,
        prompt,
        sampling,
        max_tokens: p.max_tokens,
        stop: p.stop.clone(),
        ignore_eos: p.ignore_eos,
        arrived,
        admitted: Instant::now(),
        mode: WorkMode::Full,
        meter: Some(Arc::clone(&meter) as Arc<dyn TokenMeter>),
        cache_scope: match app.config.prefix_cache_scope {
            Some(crate::PrefixScope::Global) => None,
            Some(crate::PrefixScope::Tenant) | None => tenant.map(|t| t.0.clone()),
        },
        forward,
        trace: trace.as_ref().map(crate::spans::RequestTrace::outgoing),
    };
    Ok(Admitted { id, req, work, meter, trace })
}

/// The prompt's token ids. Text that cannot fit the context is refused before it is tokenized
/// or as soon as its count passes `n_ctx` (the tokenizer's contract): the cost of a refusal never
/// grows with the prompt past that bound.
fn tokenize(
    app: &AppState,
    prompt: &Prompt,
    endpoint: Endpoint,
    max_tokens: Option<u32>,
) -> Result<Vec<u32>, Reject> {
    let n_ctx = app.backend.model().n_ctx;
    let ids = match prompt {
        Prompt::Chat(messages) => app.tokenizer.chat_prompt(messages, n_ctx),
        Prompt::Text(text) => app.tokenizer.text_prompt(text, n_ctx),
        Prompt::Tokens(ids) => Ok(ids.clone()),
    };
    ids.map_err(|e| {
        let e = match e {
            ProtocolError::ContextOverflow { prompt_tokens, limit, .. } => ProtocolError::ContextOverflow {
                prompt_tokens,
                max_tokens: max_tokens.map_or(0, |m| m as usize),
                limit,
            },
            e => e,
        };
        Reject::from_backend(&e, endpoint.prompt_param())
    })
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The wire finish reason and the metrics label of a worker finish reason.
pub(crate) fn finish_reason(r: Finish) -> (FinishReason, &'static str) {
    match r {
        Finish::Stop => (FinishReason::Stop, "stop"),
        Finish::Length => (FinishReason::Length, "length"),
        Finish::Cancelled => (FinishReason::Other("cancelled".into()), "cancelled"),
    }
}

/// The OpenAI usage object of a worker usage.
pub(crate) fn usage(u: TokenUsage) -> Usage {
    Usage::new(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
}

/// Nanoseconds since `arrived`.
pub(crate) fn since(arrived: Instant) -> Nanos {
    Nanos::try_from(arrived.elapsed().as_nanos()).unwrap_or(Nanos::MAX)
}

async fn respond(app: Arc<AppState>, endpoint: Endpoint, admitted: Admitted, arrived: Instant) -> Response {
    let Admitted { id, req, work, meter, trace } = admitted;
    let mut stream = match app.backend.submit(work).await {
        Ok(s) => s,
        Err(e) => {
            if matches!(
                e,
                ProtocolError::Overloaded { .. } | ProtocolError::Stopped | ProtocolError::NoWorker
            ) {
                // Refused before any work: the tenant gets its request and prompt back.
                meter.refund();
            }
            let reject = Reject::from_backend(&e, endpoint.prompt_param());
            app.metrics.record_status(reject.status().as_u16(), "none");
            return reject.into_response();
        }
    };
    let created = unix_now();
    let model = app.config.served_model_name.clone();
    if req.params.stream {
        let include_usage = req.params.include_usage;
        let format = match endpoint {
            _ if app.backend.forwards() => SseFormat::Upstream,
            Endpoint::Chat => {
                SseFormat::Chat(ChatStream::new(chat_completion_id(id.0), created, model, include_usage))
            }
            Endpoint::Completions => SseFormat::Completion(CompletionStream::new(
                completion_id(id.0),
                created,
                model,
                include_usage,
            )),
        };
        return sse_response(app, format, stream, meter, id, arrived, trace);
    }
    let mut text = String::new();
    // An upstream's own response body, passed on whole (forwarding backends).
    let mut upstream_body: Option<String> = None;
    let mut sent = ClientRecord::new(id, 0, 0, true);
    // Dropped with the handler when the client goes away before the body: counted as 499
    // ("client closed request"); the dropped `stream` cancels the work on the worker.
    let mut guard = CancelGuard { app: &app, armed: true };
    loop {
        let event = stream.next().await;
        if !matches!(event, Some(WorkEvent::Text { .. } | WorkEvent::Body { .. })) {
            guard.armed = false;
        }
        match event {
            Some(WorkEvent::Text { delta, tokens }) => {
                sent.events.push(StreamEvent { at_ns: since(arrived), tokens });
                text.push_str(&delta);
            }
            Some(WorkEvent::Body { json }) => upstream_body = Some(json),
            Some(WorkEvent::Finished { reason, usage: u, timing }) => {
                meter.settle(u.completion_tokens);
                meter.settle_input(u.prompt_tokens);
                let (wire_reason, label) = finish_reason(reason);
                log_finished(id, label, u, &timing);
                sent.usage = Some(usage(u).to_timeline());
                app.metrics.record_finished(label, u, &timing, &sent);
                crate::spans::finished(&app, trace.as_ref(), arrived, &timing, u, label);
                let header_value = HeaderValue::from_str(&server_timing_header(&timing)).ok();
                // Both endpoints answer with one choice and the timeline; only the response type and
                // the id prefix differ.
                macro_rules! respond {
                    ($response:ident, $id:expr) => {
                        serde_json::to_vec(&$response {
                            timing: Some(timing),
                            ..$response::new($id, created, model, text, wire_reason, usage(u))
                        })
                    };
                }
                let body = match (upstream_body.take(), endpoint) {
                    (Some(json), _) => Ok(json.into_bytes()),
                    (None, Endpoint::Chat) => respond!(ChatCompletionResponse, chat_completion_id(id.0)),
                    (None, Endpoint::Completions) => respond!(CompletionResponse, completion_id(id.0)),
                };
                let body = match body {
                    Ok(b) => b,
                    Err(e) => return server_error(&app, &format!("serializing the response failed: {e}")),
                };
                let mut resp = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
                if let Some(v) = header_value {
                    resp.headers_mut().insert("server-timing", v);
                }
                return resp;
            }
            Some(WorkEvent::Failed { message }) => return server_error(&app, &message),
            Some(WorkEvent::Kv { .. } | WorkEvent::Handoff { .. } | WorkEvent::Chunk { .. }) => {
                return server_error(&app, "a stream-only event reached a non-streamed response")
            }
            None => return server_error(&app, "the worker stopped before the request finished"),
        }
    }
}

/// One log line per finished request.
pub(crate) fn log_finished(
    id: RequestId,
    finish: &str,
    u: TokenUsage,
    timing: &tokenpath_timeline::ServerTiming,
) {
    tracing::debug!(
        request = %id,
        finish,
        prompt_tokens = u.prompt_tokens,
        completion_tokens = u.completion_tokens,
        ttft_ms = timing.ttft_ms,
        e2e_ms = timing.e2e_ms,
        "request finished"
    );
}

/// Records a non-streamed request whose client went away before its response.
struct CancelGuard<'a> {
    app: &'a AppState,
    armed: bool,
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.app.metrics.record_status(499, "cancelled");
        }
    }
}

fn server_error(app: &AppState, message: &str) -> Response {
    tracing::error!("request failed: {message}");
    let reject =
        Reject::new(ApiError::server_error("The server had an error while processing your request."));
    app.metrics.record_status(reject.status().as_u16(), "none");
    reject.into_response()
}

/// `GET /v1/models`.
pub(crate) async fn models(State(app): State<Arc<AppState>>) -> Response {
    let body = serde_json::json!({
        "object": "list",
        "data": [{
            "id": app.config.served_model_name,
            "object": "model",
            "created": app.started_unix,
            "owned_by": "tokenpath",
            "max_model_len": app.backend.model().n_ctx,
        }],
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// `GET /health`: the process is alive.
pub(crate) async fn health() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], "{\"status\":\"ok\"}").into_response()
}

/// `GET /ready`: the model is loaded, the worker runs and the server is not draining.
pub(crate) async fn ready(State(app): State<Arc<AppState>>) -> Response {
    let (status, text) = if !app.backend.is_ready() {
        (StatusCode::SERVICE_UNAVAILABLE, "worker_down")
    } else if app.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else {
        (StatusCode::OK, "ready")
    };
    (status, [(header::CONTENT_TYPE, "application/json")], format!("{{\"status\":\"{text}\"}}"))
        .into_response()
}

/// `GET /metrics`.
pub(crate) async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    let text = app.metrics.render(&app.backend.stats());
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
        .into_response()
}

/// Any other path.
pub(crate) async fn fallback(uri: Uri) -> Response {
    Reject::no_route(uri.path()).into_response()
}
