//! One request's calls to its upstreams, in its kind's sequence (the sources of each sequence
//! are in `docs/upstreams.md`):
//!
//! - colocated (`openai`, `tokenpath`, a lone vLLM decode server): the client's body, once.
//! - `vllm-pd`: the prefill leg gets `kv_transfer_params.do_remote_decode`, `stream: false`,
//!   `max_tokens: 1` (no `stream_options`, no `min_tokens`); its answer's `kv_transfer_params`
//!   go verbatim into the decode leg, which gets the client's body otherwise unchanged. One
//!   `X-Request-Id` on both. A prefill leg that fails (or answers without transfer params)
//!   falls back to decode-only: the decode server computes the prompt itself, as llm-d does.
//! - `sglang-pd`: the same body, with `bootstrap_host` (the prefill server's host),
//!   `bootstrap_port` and a random 63-bit `bootstrap_room`, goes to both at once; the decode
//!   leg is the answer, the prefill leg is drained beside it; either failing cancels the other.
//! - `trtllm-pd`: a `context_only` leg (`stream: false`), then its
//!   `choices[0].disaggregated_params` as `generation_only` with the client's body; an answer
//!   that already finished in the context leg is the answer.
//!
//! Until the first byte reaches the client nothing is lost by trying elsewhere: an upstream
//! that cannot be reached, times out, answers 5xx or breaks its stream before the first event
//! is counted against it and the request goes to another (at most [`MAX_ATTEMPTS`] tries); a
//! full one (429/503) is avoided without blame; a refusal of the request itself (4xx) goes back
//! to the client. After the first byte a failure ends the stream with an error event.

use super::endpoint::{Endpoint, InFlight};
use super::pool::{Pick, UpstreamPool};
use super::relay::{self, Ended, Opened, Prefill, PrefillLeg, Relay};
use super::{refusal, unreachable, UpstreamKind};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_protocol::forward::{ApiEndpoint, Forwarded};
use tokenpath_protocol::work::{validate_request, StreamSender, WorkRequest, WorkStream};
use tokenpath_protocol::{ProtocolError, SseDecoder};
use tokenpath_timeline::Stage;

/// How many upstreams (or pairs) one request tries before the client gets the last error.
pub const MAX_ATTEMPTS: usize = 3;
/// Largest error body read from an upstream.
const MAX_ERROR_BYTES: usize = 64 << 10;

/// Routes and starts `work` (see the module docs).
pub(super) async fn submit(pool: UpstreamPool, work: WorkRequest) -> Result<WorkStream, ProtocolError> {
    let c = &pool.inner.config;
    validate_request(&work, c.model_info.n_ctx, c.model_info.n_vocab)?;
    let Some(fwd) = work.forward.clone() else {
        return Err(ProtocolError::InvalidRequest {
            param: None,
            message: "an upstream backend needs the client's body".into(),
        });
    };
    let call = Call { pool: &pool, work: &work, fwd: &fwd, request_id: format!("tokenpath-{}", work.id.0) };
    let mut avoid: Vec<String> = Vec::new();
    // Nothing usable at all: none is up, come back later (the cluster says the same).
    let mut last = ProtocolError::NoWorker;
    for _ in 0..MAX_ATTEMPTS {
        let Some(pick) = pool.route(&work.prompt, work.cache_scope.as_deref(), &avoid).await else { break };
        match call.attempt(&pick).await {
            Ok(stream) => return Ok(stream),
            Err(f) => {
                let Some(url) = f.avoid else { return Err(f.error) };
                if f.blame {
                    pool.outcome(&url, false);
                }
                tracing::warn!(upstream = %url, "trying another upstream: {}", f.error);
                avoid.push(url);
                last = f.error;
            }
        }
    }
    Err(last)
}

/// Why an attempt did not start, and whether another upstream may be tried.
#[derive(Debug)]
struct Failure {
    error: ProtocolError,
    /// The upstream to avoid on the next try; `None`: the request itself was refused.
    avoid: Option<String>,
    /// Count it against the upstream (unreachable, timed out, 5xx, broken).
    blame: bool,
}

impl Failure {
    fn at(ep: &Endpoint, error: ProtocolError) -> Self {
        let (avoid, blame) = match error {
            ProtocolError::Unavailable { .. } => (true, true),
            ProtocolError::Overloaded { .. } => (true, false),
            _ => (false, false),
        };
        Self { error, avoid: avoid.then(|| ep.url().to_owned()), blame }
    }

    fn broken(ep: &Endpoint, why: &str) -> Self {
        Self::at(ep, ProtocolError::Unavailable { message: format!("upstream {}: {why}", ep.url()) })
    }
}

/// One request's calls.
struct Call<'a> {
    pool: &'a UpstreamPool,
    work: &'a WorkRequest,
    fwd: &'a Forwarded,
    /// The same on every leg.
    request_id: String,
}

/// What the client gets.
enum Answer {
    Stream(Opened),
    Body(Value),
    Chunks(Vec<Value>),
}

impl Call<'_> {
    fn streams(&self) -> bool {
        self.fwd.body.get("stream").and_then(Value::as_bool).unwrap_or(false)
    }

    /// Whether the client set `stream_options.<key>` to `true` (`include_usage`; vLLM's
    /// `continuous_usage_stats`, usage on every chunk).
    fn client_stream_option(&self, key: &str) -> bool {
        self.fwd.body.get("stream_options").and_then(|o| o.get(key)).and_then(Value::as_bool).unwrap_or(false)
    }

    fn timeouts(&self) -> (Duration, Duration) {
        let c = &self.pool.inner.config;
        (c.first_byte_timeout, c.idle_timeout)
    }

    /// The client's body for `ep`: its model name, and usage forced on a stream — on every
    /// chunk from vLLM (`continuous_usage_stats`, which only vLLM takes), so output tokens are
    /// charged and timed exactly when it puts several in one event.
    fn body_for(&self, ep: &Endpoint) -> Map<String, Value> {
        let mut body = self.fwd.body.clone();
        if let Some(m) = &ep.spec.model {
            body.insert("model".into(), m.clone().into());
        }
        if self.streams() {
            let opts = body.entry("stream_options").or_insert_with(|| json!({}));
            if !opts.is_object() {
                // `null` (validated as "no options" already): replaced, so usage is forced.
                *opts = json!({});
            }
            if let Some(o) = opts.as_object_mut() {
                o.insert("include_usage".into(), true.into());
                if ep.spec.kind == UpstreamKind::VllmPd {
                    o.insert("continuous_usage_stats".into(), true.into());
                }
            }
        }
        body
    }

    /// Sends `body`, bounded until the response headers; a non-2xx is the upstream's refusal.
    async fn send(&self, ep: &Endpoint, body: &Map<String, Value>) -> Result<reqwest::Response, Failure> {
        let (first_byte, _) = self.timeouts();
        let req = ep.post(self.fwd.endpoint, &self.request_id, self.work.trace.as_ref(), body);
        let resp = match tokio::time::timeout(first_byte, req.send()).await {
            Err(_) => {
                let message =
                    format!("upstream {} sent no response headers in {} s", ep.url(), first_byte.as_secs());
                return Err(Failure::at(ep, ProtocolError::Unavailable { message }));
            }
            Ok(Err(e)) => return Err(Failure::at(ep, unreachable(ep.url(), &e))),
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let text = read_bounded(resp, MAX_ERROR_BYTES).await;
        Err(Failure::at(ep, refusal(ep.url(), status.as_u16(), &text)))
    }

    /// Sends `body` and waits for what the client will get first (the first event of a stream,
    /// the whole of a body): failures up to here may be retried elsewhere.
    async fn answer(
        &self,
        ep: &Endpoint,
        body: &Map<String, Value>,
        stream: bool,
    ) -> Result<Answer, Failure> {
        let resp = self.send(ep, body).await?;
        let (_, idle) = self.timeouts();
        if stream {
            relay::open(resp, idle).await.map(Answer::Stream).map_err(|m| Failure::broken(ep, &m))
        } else {
            relay::read_json(resp, idle).await.map(Answer::Body).map_err(|m| Failure::broken(ep, &m))
        }
    }

    async fn attempt(&self, pick: &Pick) -> Result<WorkStream, Failure> {
        match pick {
            Pick::One(ep) => {
                let held = ep.begin();
                let sent = Instant::now();
                let answer = self.answer(ep, &self.body_for(ep), self.streams()).await?;
                Ok(self.relay(ep, sent, answer, Prefill::None, vec![held]))
            }
            Pick::Pair { prefill, decode } => match prefill.spec.kind {
                UpstreamKind::SglangPd => self.sglang(prefill, decode).await,
                UpstreamKind::TrtllmPd => self.trtllm(prefill, decode).await,
                _ => self.vllm(prefill, decode).await,
            },
        }
    }

    /// A non-streamed prefill leg's JSON answer.
    async fn prefill_json(&self, ep: &Endpoint, body: &Map<String, Value>) -> Result<Value, Failure> {
        match self.answer(ep, body, false).await? {
            Answer::Body(v) => Ok(v),
            _ => Err(Failure::broken(ep, "no body")),
        }
    }

    async fn vllm(&self, prefill: &Arc<Endpoint>, decode: &Arc<Endpoint>) -> Result<WorkStream, Failure> {
        let mut p = self.fwd.body.clone();
        if let Some(m) = &prefill.spec.model {
            p.insert("model".into(), m.clone().into());
        }
        p.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        );
        p.insert("stream".into(), false.into());
        p.remove("stream_options");
        p.remove("min_tokens");
        p.remove("min_completion_tokens");
        p.insert("max_tokens".into(), 1.into());
        if p.contains_key("max_completion_tokens") {
            p.insert("max_completion_tokens".into(), 1.into());
        }
        let held = vec![prefill.begin()];
        let (leg, params) = match self.prefill_json(prefill, &p).await {
            Ok(v) => match v.get("kv_transfer_params").filter(|t| t.is_object()) {
                Some(t) => {
                    self.pool.outcome(prefill.url(), true);
                    (Prefill::Done(prefill_leg(&v)), Some(t.clone()))
                }
                None => {
                    tracing::warn!(upstream = %prefill.url(), "the prefill leg returned no kv_transfer_params: decode computes the prompt");
                    (Prefill::None, None)
                }
            },
            // The request itself was refused: the decode server would refuse it too.
            Err(f) if f.avoid.is_none() => return Err(f),
            Err(f) => {
                if f.blame {
                    self.pool.outcome(prefill.url(), false);
                }
                tracing::warn!("the prefill leg failed, decode computes the prompt: {}", f.error);
                (Prefill::None, None)
            }
        };
        drop(held);
        let mut d = self.body_for(decode);
        if let Some(t) = params {
            d.insert("kv_transfer_params".into(), t);
        }
        let held = decode.begin();
        let sent = Instant::now();
        let answer = self.answer(decode, &d, self.streams()).await?;
        Ok(self.relay(decode, sent, answer, leg, vec![held]))
    }

    async fn sglang(&self, prefill: &Arc<Endpoint>, decode: &Arc<Endpoint>) -> Result<WorkStream, Failure> {
        let mut room = [0u8; 8];
        getrandom::fill(&mut room).map_err(|e| {
            Failure::at(prefill, ProtocolError::Unavailable { message: format!("randomness: {e}") })
        })?;
        let room = u64::from_le_bytes(room) >> 1;
        let with_bootstrap = |ep: &Endpoint| {
            let mut b = self.body_for(ep);
            b.insert("bootstrap_host".into(), prefill.spec.host().into());
            b.insert("bootstrap_port".into(), prefill.spec.bootstrap_port.map_or(Value::Null, Value::from));
            b.insert("bootstrap_room".into(), room.into());
            b
        };
        let (pb, db) = (with_bootstrap(prefill), with_bootstrap(decode));
        let held = vec![prefill.begin(), decode.begin()];
        let sent = Instant::now();
        // Both at once; a leg that fails drops the other's response (its connection closes,
        // which cancels it) — neither waits out the engines' bootstrap timeouts.
        let (p, d) = tokio::join!(self.send(prefill, &pb), self.send(decode, &db));
        let (p, d) = match (p, d) {
            (Ok(p), Ok(d)) => (p, d),
            (Err(f), _) | (_, Err(f)) => return Err(f),
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let pool = self.pool.clone();
        let (url, (_, idle)) = (prefill.url().to_owned(), self.timeouts());
        tokio::spawn(async move {
            let mut done_tx = done_tx;
            let drained = tokio::select! {
                () = done_tx.closed() => return,
                r = drain(p, idle) => r,
            };
            if drained.is_err() {
                pool.outcome(&url, false);
            }
            let _ = done_tx.send(drained);
        });
        let (_, idle) = self.timeouts();
        let streams = self.streams();
        let open = async move {
            if streams {
                relay::open(d, idle).await.map(Answer::Stream)
            } else {
                relay::read_json(d, idle).await.map(Answer::Body)
            }
        };
        tokio::pin!(open);
        // A prefill leg that fails before the decode leg's first event leaves the decode engine
        // waiting out its bootstrap timeout; nothing has reached the client, so it is a failure
        // before the first byte (retried on another pair), and the decode leg is dropped.
        let mut done_rx = done_rx;
        let (answer, prefill_leg) = tokio::select! {
            a = &mut open => (a, None),
            r = &mut done_rx => match r {
                // Ended well before decode's first event: what a finished prefill leg is.
                Ok(Ok(leg)) => (open.await, Some(Prefill::Done(leg))),
                Ok(Err(m)) => return Err(Failure::broken(prefill, &m)),
                Err(_) => return Err(Failure::broken(prefill, "the prefill leg was lost")),
            },
        };
        let answer = answer.map_err(|m| Failure::broken(decode, &m))?;
        let prefill_leg = prefill_leg.unwrap_or(Prefill::Concurrent(done_rx));
        Ok(self.relay(decode, sent, answer, prefill_leg, held))
    }

    async fn trtllm(&self, prefill: &Arc<Endpoint>, decode: &Arc<Endpoint>) -> Result<WorkStream, Failure> {
        let mut p = self.fwd.body.clone();
        if let Some(m) = &prefill.spec.model {
            p.insert("model".into(), m.clone().into());
        }
        p.insert("disaggregated_params".into(), json!({"request_type": "context_only"}));
        p.insert("stream".into(), false.into());
        p.insert("stream_options".into(), Value::Null);
        let held = prefill.begin();
        let sent = Instant::now();
        let v = self.prefill_json(prefill, &p).await?;
        let Some(params) = v.pointer("/choices/0/disaggregated_params").and_then(Value::as_object) else {
            return Err(Failure::broken(
                prefill,
                "its context answer has no choices[0].disaggregated_params",
            ));
        };
        let finished = v
            .pointer("/choices/0/finish_reason")
            .and_then(Value::as_str)
            .is_some_and(|r| !matches!(r, "length" | "not_finished"));
        if finished {
            // The whole answer came from the context server (one token, or an immediate stop).
            let answer = if self.streams() {
                Answer::Chunks(as_chunks(&v, self.fwd.endpoint))
            } else {
                Answer::Body(v)
            };
            return Ok(self.relay(prefill, sent, answer, Prefill::None, vec![held]));
        }
        let mut params = params.clone();
        params.insert("request_type".into(), "generation_only".into());
        let leg = prefill_leg(&v);
        self.pool.outcome(prefill.url(), true);
        drop(held);
        let mut d = self.body_for(decode);
        d.insert("disaggregated_params".into(), Value::Object(params));
        let held = decode.begin();
        let sent = Instant::now();
        let answer = self.answer(decode, &d, self.streams()).await?;
        Ok(self.relay(decode, sent, answer, Prefill::Done(leg), vec![held]))
    }

    /// Starts relaying `answer` from `ep` to the client; the legs' counts end with it.
    fn relay(
        &self,
        ep: &Endpoint,
        sent: Instant,
        answer: Answer,
        prefill: Prefill,
        held: Vec<InFlight>,
    ) -> WorkStream {
        let inner = &self.pool.inner;
        let r = Relay {
            served_model_name: Arc::from(inner.config.served_model_name.as_str()),
            url: ep.url().to_owned(),
            arrived: self.work.arrived,
            admitted: self.work.admitted,
            sent,
            prompt_tokens: self.work.prompt.len() as u64,
            meter: self.work.meter.clone(),
            client_usage: self.client_stream_option("include_usage"),
            strip_chunk_usage: ep.spec.kind == UpstreamKind::VllmPd
                && !self.client_stream_option("continuous_usage_stats"),
            prefill,
        };
        let (tx, out) = WorkStream::channel(self.work.id);
        let pool = self.pool.clone();
        let url = ep.url().to_owned();
        let idle = inner.config.idle_timeout;
        inner.requests.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let ended = run(r, answer, &tx, idle).await;
            match ended {
                Ended::Finished => pool.outcome(&url, true),
                Ended::Failed => pool.outcome(&url, false),
                Ended::Gone | Ended::PrefillFailed => {}
            }
            drop(held);
            pool.inner.requests.fetch_sub(1, Ordering::Relaxed);
        });
        out
    }
}

async fn run(r: Relay, answer: Answer, tx: &StreamSender, idle: Duration) -> Ended {
    match answer {
        Answer::Stream(opened) => r.stream(opened, tx, idle).await,
        Answer::Body(v) => match r.settled(idle, tx).await {
            Ok(r) => r.body(v, tx),
            Err(end) => end,
        },
        Answer::Chunks(c) => match r.settled(idle, tx).await {
            Ok(r) => r.replay(c, tx),
            Err(end) => end,
        },
    }
}

/// What a prefill leg's JSON answer tells: its cached tokens and its engine's queue and
/// prefill times (vLLM's `metrics`).
fn prefill_leg(v: &Value) -> PrefillLeg {
    let mut engine = BTreeMap::new();
    tokenpath_timeline::engines::body_stages(v, &mut engine);
    engine.retain(|s, _| matches!(s, Stage::Queue | Stage::Prefill));
    PrefillLeg {
        done: Instant::now(),
        cached_tokens: v.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64),
        engine,
    }
}

/// Reads a concurrent prefill leg to its end (SSE or JSON, bounded, no silence over `idle`);
/// its cached tokens when it reported usage.
async fn drain(resp: reqwest::Response, idle: Duration) -> Result<PrefillLeg, String> {
    use futures_util::StreamExt as _;
    let mut bytes = resp.bytes_stream();
    let mut sse = SseDecoder::new();
    let (mut events, mut whole, mut total) = (Vec::new(), Vec::new(), 0usize);
    let (mut cached, mut answered) = (None, false);
    loop {
        let chunk = match tokio::time::timeout(idle, bytes.next()).await {
            Err(_) => return Err(format!("no byte for {} s", idle.as_secs())),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(format!("reading it: {e}")),
            Ok(Some(Ok(b))) => b,
        };
        total += chunk.len();
        if total > super::MAX_BODY_BYTES {
            return Err(format!("over {} bytes", super::MAX_BODY_BYTES));
        }
        if whole.len() < MAX_ERROR_BYTES {
            whole.extend_from_slice(&chunk);
        }
        if sse.feed(&chunk, &mut events).is_ok() {
            for ev in events.drain(..) {
                answered = true;
                if let Ok(v) = serde_json::from_str::<Value>(&ev.data) {
                    if v.get("error").is_some() {
                        return Err("it streamed an error".into());
                    }
                    cached = cached
                        .or(v.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64));
                }
            }
        }
    }
    if let Ok(v) = serde_json::from_slice::<Value>(&whole) {
        answered = true;
        cached = cached.or(v.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64));
    }
    if !answered {
        // Headers, then the end: the engine gave up on the prompt without saying so.
        return Err("its answer ended before any event or body".into());
    }
    Ok(PrefillLeg { done: Instant::now(), cached_tokens: cached, engine: BTreeMap::new() })
}

/// A finished non-streamed answer as the chunks of a stream: one with the choices (each
/// `message` becomes its `delta`), then the usage.
fn as_chunks(v: &Value, endpoint: ApiEndpoint) -> Vec<Value> {
    let object = match endpoint {
        ApiEndpoint::Chat => "chat.completion.chunk",
        ApiEndpoint::Completions => "text_completion",
    };
    let mut c = v.clone();
    let usage = c.as_object_mut().and_then(|o| o.remove("usage"));
    c["object"] = object.into();
    if let Some(choices) = c.get_mut("choices").and_then(Value::as_array_mut) {
        for ch in choices.iter_mut().filter_map(Value::as_object_mut) {
            ch.remove("disaggregated_params");
            if let Some(m) = ch.remove("message") {
                ch.insert("delta".into(), m);
            }
        }
    }
    let mut out = vec![c];
    if let Some(u) = usage {
        out.push(json!({"id": v.get("id"), "object": object, "created": v.get("created"),
                        "model": v.get("model"), "choices": [], "usage": u}));
    }
    out
}

/// An error body, at most `limit` bytes of it.
async fn read_bounded(mut resp: reqwest::Response, limit: usize) -> String {
    let mut body = Vec::new();
    while let Ok(Ok(Some(chunk))) = tokio::time::timeout(Duration::from_secs(5), resp.chunk()).await {
        body.extend_from_slice(&chunk[..chunk.len().min(limit - body.len())]);
        if body.len() >= limit {
            break;
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_body_becomes_a_stream_of_a_choice_and_its_usage() {
        let v = json!({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                         "finish_reason": "stop", "disaggregated_params": {"x": 1}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}});
        let c = as_chunks(&v, ApiEndpoint::Chat);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0]["object"], "chat.completion.chunk");
        assert_eq!(c[0]["choices"][0]["delta"]["content"], "Hi");
        assert!(c[0]["choices"][0].get("disaggregated_params").is_none());
        assert!(c[0].get("usage").is_none());
        assert_eq!(c[1]["usage"]["completion_tokens"], 1);
        assert_eq!(c[1]["choices"], json!([]));
    }
}
