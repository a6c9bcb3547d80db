//! One request against any OpenAI-compatible server, observed the way the metric definitions
//! need: every SSE event is recorded with the time it was read and the number of generated tokens
//! it carried (0 for role-only, empty, usage and keep-alive events), so the `timeline` crate, not
//! this code, decides what the first token is.

use crate::tokens::{PromptMessage, Role};
use crate::workload::RequestSpec;
use futures_util::StreamExt as _;
use std::time::{Duration, Instant};
use tokenpath_protocol::{parse_response_body, parse_stream_chunk, SseDecoder};
use tokenpath_timeline::{ClientRecord, Nanos, Outcome, RequestId, StreamEvent, TraceParent};

/// Where and how to send.
#[derive(Debug, Clone)]
pub struct Target {
    /// Base URL, e.g. `http://127.0.0.1:8000`.
    pub url: String,
    /// Model name to put in requests; empty = the first one the server lists.
    pub model: String,
    /// Bearer key, if the server wants one.
    pub api_key: Option<String>,
    /// Stream (SSE) or not.
    pub stream: bool,
    /// Send `ignore_eos: true` so outputs run to `max_tokens` (vLLM, SGLang, llama.cpp server and
    /// tokenpath accept it; OpenAI rejects it).
    pub ignore_eos: bool,
    /// Give up on a request after this long.
    pub timeout: Duration,
    /// Which API the requests go to.
    pub endpoint: Endpoint,
}

/// The OpenAI API a bench talks to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions` with `messages` (the server applies its chat template).
    #[default]
    Chat,
    /// `/v1/completions` with the raw `prompt` (the messages' text joined, no template).
    Completions,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "chat" => Ok(Self::Chat),
            "completions" => Ok(Self::Completions),
            _ => Err(format!("unknown endpoint {s:?}: expected chat or completions")),
        }
    }
}

/// What a request's answer said, beside its record.
#[derive(Debug, Clone, Default)]
pub struct Answer {
    /// The generated text (empty on failure): a multi-turn session's next prompt carries it.
    pub text: String,
    /// Text and reasoning text of every event, concatenated.
    pub spoken: String,
    /// Where each of the record's events ends in `spoken` (one entry per event, in order).
    pub ends: Vec<usize>,
}

/// An error and its causes, outermost first: reqwest's own message ("error sending request for
/// url ...") says nothing of why (a connection the server closed, a reset, a refused connect).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// Whether `e` is hyper's "connection closed before message completed" on sending: the server
/// closed an idle pooled connection before any byte of an answer.
fn closed_before_answer(e: &reqwest::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(c) = cause {
        if let Some(h) = c.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message();
        }
        cause = c.source();
    }
    false
}

fn since(t0: Instant) -> Nanos {
    t0.elapsed().as_nanos() as Nanos
}

/// Sends `spec` as request `id` and records what happened. `t0` is the run's origin and
/// `t_sched` when the arrival process meant to send (`None` in a closed loop: the send is the
/// schedule).
pub async fn send(
    client: &reqwest::Client,
    target: &Target,
    id: u64,
    spec: &RequestSpec,
    t0: Instant,
    t_sched: Option<Nanos>,
) -> ClientRecord {
    let messages = messages_of(spec, &[]);
    let ask = Ask { id, messages: &messages, max_tokens: spec.max_tokens, t_sched, trace: None };
    send_chat(client, target, ask, t0).await.0
}

/// One request to send.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// Its id within the run.
    pub id: u64,
    /// The chat messages (joined for the completions endpoint).
    pub messages: &'a [PromptMessage],
    /// `max_tokens`.
    pub max_tokens: u32,
    /// When the arrival process meant to send (`None` in a closed loop: the send is the
    /// schedule).
    pub t_sched: Option<Nanos>,
    /// Sent as `traceparent`, and kept on the record, so the engine's span joins it.
    pub trace: Option<TraceParent>,
}

/// The messages of `spec` after the earlier turns `history` (system message first).
pub fn messages_of(spec: &RequestSpec, history: &[PromptMessage]) -> Vec<PromptMessage> {
    let mut m = Vec::with_capacity(history.len() + 2);
    if let Some(sys) = &spec.system {
        m.push(PromptMessage::new(Role::System, sys.clone()));
    }
    m.extend_from_slice(history);
    m.push(PromptMessage::new(Role::User, spec.prompt.clone()));
    m
}

/// The request body: only the fields that are set (a strict server — vllm-router, SGLang's
/// gateway, OpenAI itself — refuses `"ignore_eos": null` or `"stream_options": null`).
fn chat_body(target: &Target, messages: &[PromptMessage], max_tokens: u32) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": target.model,
        "max_tokens": max_tokens,
        "stream": target.stream,
    });
    match target.endpoint {
        Endpoint::Chat => {
            let messages: Vec<serde_json::Value> = messages
                .iter()
                .map(|m| serde_json::json!({"role": m.role.as_str(), "content": m.content}))
                .collect();
            body["messages"] = messages.into();
        }
        // No template on this API: the texts in order, a blank line between them.
        Endpoint::Completions => {
            let prompt: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
            body["prompt"] = prompt.join("\n\n").into();
        }
    }
    if target.stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    if target.ignore_eos {
        body["ignore_eos"] = serde_json::Value::Bool(true);
    }
    body
}

/// Like [`send`] with explicit chat messages and trace context; also returns what the answer
/// said.
pub async fn send_chat(
    client: &reqwest::Client,
    target: &Target,
    ask: Ask<'_>,
    t0: Instant,
) -> (ClientRecord, Answer) {
    let t_send = since(t0);
    let mut rec = ClientRecord::new(RequestId(ask.id), ask.t_sched.unwrap_or(t_send), t_send, target.stream);
    rec.trace_id = ask.trace.map(|t| t.trace_id);
    let body = chat_body(target, ask.messages, ask.max_tokens);
    let mut answer = Answer::default();
    let fut = exchange(client, target, body, ask.trace, &mut rec, &mut answer, t0);
    match tokio::time::timeout(target.timeout, fut).await {
        Ok(Ok(())) => {}
        Ok(Err((kind, message))) => {
            answer = Answer::default();
            rec.outcome = Outcome::Failed { kind, message }
        }
        Err(_) => {
            rec.outcome = Outcome::Failed {
                kind: "timeout".into(),
                message: format!("no end after {:?}", target.timeout),
            }
        }
    }
    if !rec.is_ok() {
        answer = Answer::default();
    }
    rec.t_done.get_or_insert(since(t0));
    (rec, answer)
}

type Failure = (String, String);

async fn exchange(
    client: &reqwest::Client,
    target: &Target,
    body: serde_json::Value,
    trace: Option<TraceParent>,
    rec: &mut ClientRecord,
    answer: &mut Answer,
    t0: Instant,
) -> Result<(), Failure> {
    let url = format!("{}{}", target.url.trim_end_matches('/'), target.endpoint.path());
    let mut req = client.post(url).json(&body);
    if let Some(tp) = trace {
        req = req.header("traceparent", tp.to_string());
    }
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    // A kept-alive connection the server closed just as the request went out (llama.cpp's
    // server does this under load) never reached it: one retry, on a fresh connection (the
    // pool has dropped the closed one). Any other failure is the server's and is recorded.
    let again = req.try_clone();
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) if closed_before_answer(&e) && again.is_some() => {
            again.expect("checked").send().await.map_err(|e| ("connect".to_owned(), chain(&e)))?
        }
        Err(e) => return Err(("connect".to_owned(), chain(&e))),
    };
    let status = resp.status();
    if !status.is_success() {
        let body = read_bounded(resp, MAX_ERROR_BODY).await.unwrap_or_default();
        let body = String::from_utf8_lossy(&body);
        return Err((format!("http_{}", status.as_u16()), body.chars().take(300).collect()));
    }
    if !target.stream {
        let bytes = read_bounded(resp, MAX_RESPONSE_BODY).await?;
        let at = since(t0);
        let view = parse_response_body(&bytes).map_err(|e| ("bad_response".to_owned(), e.to_string()))?;
        if let Some(err) = view.error {
            return Err(("server_error".into(), err.message));
        }
        let n = view.usage.as_ref().map_or(1, |u| u.completion_tokens as u32);
        rec.events.push(StreamEvent { at_ns: at, tokens: n });
        answer.text.push_str(&view.text);
        answer.spoken = format!("{}{}", view.reasoning_text, view.text);
        answer.ends.push(answer.spoken.len());
        rec.usage = view.usage.as_ref().map(|u| u.to_timeline());
        rec.server = view.timing;
        return finish_reason(rec, view.finish_reason);
    }
    let mut sse = SseDecoder::new();
    let mut events = Vec::new();
    let mut stream = resp.bytes_stream();
    let mut finish = None;
    let mut done = false;
    let mut counted = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ("stream_error".to_owned(), chain(&e)))?;
        let at = since(t0);
        let fed = sse.feed(&chunk, &mut events);
        for ev in events.drain(..) {
            let view = parse_stream_chunk(&ev.data).map_err(|e| ("bad_event".to_owned(), e.to_string()))?;
            if view.done {
                done = true;
                continue;
            }
            if let Some(err) = view.error {
                return Err(("stream_error".into(), err.message));
            }
            // How many tokens this event carries: the growth of the cumulative usage a server
            // streams on every chunk (vLLM's `continuous_usage_stats`), else one per
            // content-bearing event; the final `usage` stays the truth for N_out.
            let tokens = match &view.usage {
                Some(u) if view.carries_tokens() && u.completion_tokens > counted => {
                    u32::try_from(u.completion_tokens - counted).unwrap_or(u32::MAX)
                }
                _ => u32::from(view.carries_tokens()),
            };
            counted += u64::from(tokens);
            rec.events.push(StreamEvent { at_ns: at, tokens });
            if answer.spoken.len() + view.text.len() + view.reasoning_text.len() > MAX_RESPONSE_BODY {
                return Err((
                    "too_large".into(),
                    format!("the streamed text passed {MAX_RESPONSE_BODY} bytes"),
                ));
            }
            answer.text.push_str(&view.text);
            answer.spoken.push_str(&view.reasoning_text);
            answer.spoken.push_str(&view.text);
            answer.ends.push(answer.spoken.len());
            if let Some(u) = &view.usage {
                rec.usage = Some(u.to_timeline());
            }
            if view.timing.is_some() {
                rec.server = view.timing;
            }
            if view.finish_reason.is_some() {
                finish = view.finish_reason;
            }
        }
        fed.map_err(|e| ("bad_stream".to_owned(), e.to_string()))?;
    }
    rec.t_done = Some(since(t0));
    if !done {
        return Err(("stream_cut".into(), "the stream ended without [DONE]".into()));
    }
    finish_reason(rec, finish)
}

/// Most bytes of an error body the bench reads (the rest is never wanted).
const MAX_ERROR_BODY: usize = 64 << 10;
/// Most bytes of one response's body or streamed text: a server (buggy or hostile) that sends
/// more fails that request instead of growing the bench without bound.
const MAX_RESPONSE_BODY: usize = 64 << 20;

/// A response body, read chunk by chunk up to `max` bytes.
async fn read_bounded(resp: reqwest::Response, max: usize) -> Result<Vec<u8>, Failure> {
    let mut out = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ("read".to_owned(), chain(&e)))?;
        if out.len() + chunk.len() > max {
            return Err(("too_large".into(), format!("the response body passed {max} bytes")));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

fn finish_reason(
    rec: &mut ClientRecord,
    reason: Option<tokenpath_protocol::FinishReason>,
) -> Result<(), Failure> {
    rec.outcome = Outcome::Ok { finish_reason: reason.map(|r| r.as_str().to_owned()) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_names_its_causes() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("error sending request")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset"));
        assert_eq!(chain(&e), "error sending request: connection reset");
    }

    /// Regression: every body carried `"ignore_eos": null` (and `"stream_options": null` when not
    /// streaming), which strict servers answer with 400 or 422.
    #[test]
    fn a_body_carries_only_the_fields_that_are_set() {
        let mut t = Target {
            url: String::new(),
            model: "m".into(),
            api_key: None,
            stream: false,
            ignore_eos: false,
            timeout: Duration::from_secs(1),
            endpoint: Endpoint::Chat,
        };
        let b = chat_body(&t, &[], 4);
        // Sorted: the map's order depends on serde_json's `preserve_order`, which another crate
        // of the workspace may switch on.
        let mut keys: Vec<&str> =
            b.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
        keys.sort_unstable();
        assert_eq!(keys, ["max_tokens", "messages", "model", "stream"]);
        t.stream = true;
        t.ignore_eos = true;
        let b = chat_body(&t, &[], 4);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert!(!b.to_string().contains("null"), "{b}");
        t.endpoint = Endpoint::Completions;
        let m = [PromptMessage::new(Role::System, "Be brief."), PromptMessage::new(Role::User, "Hi")];
        let b = chat_body(&t, &m, 4);
        assert_eq!(b["prompt"], "Be brief.\n\nHi");
        assert!(b.get("messages").is_none());
    }
}
