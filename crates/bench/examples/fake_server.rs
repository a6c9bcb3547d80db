//! A fast OpenAI-compatible SSE server with no model, for benchmarking load generators
//! (`scripts/bench-client`): it answers every chat or completions request at once with a short
//! streamed reply, so the client, not the server, is what gets measured.
//!
//! It is an example of `tokenpath-bench` rather than a library type or a CLI subcommand because
//! only the benchmark script needs it: it stays out of the shipped binary and out of the library's
//! API, and it reuses the dev-dependencies (axum, tokio) the scripted-server test already has.
//! The reply has as many tokens as the request's `max_tokens` (capped, default 4), one token per
//! SSE event, then a `usage` chunk and `[DONE]`, so a client's token counts can be checked against
//! `usage`. Every event of a reply is written at once (no sleeps) unless `--token-delay-us` asks
//! for a gap between tokens. The runtime is single-threaded by default: pinned to one core with
//! `taskset`, one thread is the cheapest way to use it.
//!
//!     cargo run --release -p tokenpath-bench --example fake_server -- --port 0 [--threads N]
//!
//! prints `port=<P>` on stdout once it listens on 127.0.0.1 (or `--host`), then serves until killed.

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use std::io::Write as _;
use std::time::Duration;

/// The model name `/v1/models` lists.
const MODEL: &str = "fake";
/// Longest reply, whatever `max_tokens` says: keeps one request's cost bounded.
const MAX_REPLY_TOKENS: u64 = 256;
/// Reply length when the request gives no `max_tokens`.
const DEFAULT_REPLY_TOKENS: u64 = 4;

#[derive(Clone, Copy, Debug)]
struct Opts {
    host: std::net::Ipv4Addr,
    port: u16,
    threads: usize,
    token_delay: Duration,
}

fn parse_args() -> Result<Opts, String> {
    let mut o =
        Opts { host: std::net::Ipv4Addr::LOCALHOST, port: 0, threads: 1, token_delay: Duration::ZERO };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--host" => o.host = val()?.parse().map_err(|e| format!("--host: {e}"))?,
            "--port" => o.port = val()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--threads" => {
                o.threads = val()?.parse().map_err(|e| format!("--threads: {e}"))?;
                if o.threads == 0 {
                    return Err("--threads must be at least 1".into());
                }
            }
            "--token-delay-us" => {
                o.token_delay =
                    Duration::from_micros(val()?.parse().map_err(|e| format!("--token-delay-us: {e}"))?)
            }
            "-h" | "--help" => {
                println!("fake_server [--host 127.0.0.1] [--port 0] [--threads 1] [--token-delay-us 0]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(o)
}

/// What the reply depends on, read leniently from the request body.
struct Asked {
    stream: bool,
    tokens: u64,
    prompt_tokens: u64,
}

fn asked(body: &[u8]) -> Result<Asked, String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("bad JSON body: {e}"))?;
    let tokens = v
        .get("max_completion_tokens")
        .or_else(|| v.get("max_tokens"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(DEFAULT_REPLY_TOKENS)
        .clamp(1, MAX_REPLY_TOKENS);
    // No tokenizer here: a prompt "token" is a whitespace-separated word, which is all a client
    // benchmark needs (the count is consistent between the reply and `usage`).
    let words = |s: &str| s.split_whitespace().count() as u64;
    let prompt_tokens = match (v.get("messages"), v.get("prompt")) {
        (Some(serde_json::Value::Array(msgs)), _) => msgs
            .iter()
            .map(|m| match m.get("content") {
                Some(serde_json::Value::String(s)) => words(s),
                Some(serde_json::Value::Array(parts)) => {
                    parts.iter().filter_map(|p| p.get("text")?.as_str()).map(words).sum()
                }
                _ => 0,
            })
            .sum(),
        (_, Some(serde_json::Value::String(s))) => words(s),
        (_, Some(serde_json::Value::Array(a))) => a.len() as u64,
        _ => 0,
    };
    let stream = v.get("stream").and_then(serde_json::Value::as_bool).unwrap_or(false);
    Ok(Asked { stream, tokens, prompt_tokens })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

fn usage_json(a: &Asked) -> String {
    format!(
        r#"{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{}}}"#,
        a.prompt_tokens,
        a.tokens,
        a.prompt_tokens + a.tokens
    )
}

/// Every SSE event of a streamed reply, in order.
fn stream_events(kind: Kind, a: &Asked) -> Vec<Bytes> {
    let (object, id) = match kind {
        Kind::Chat => ("chat.completion.chunk", "chatcmpl-fake"),
        Kind::Completion => ("text_completion", "cmpl-fake"),
    };
    let event = |choice: &str| {
        Bytes::from(format!(
            "data: {{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{choice}]}}\n\n"
        ))
    };
    let mut out = Vec::with_capacity(a.tokens as usize + 4);
    if kind == Kind::Chat {
        out.push(event(r#"{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}"#));
    }
    for i in 0..a.tokens {
        let last = i + 1 == a.tokens;
        let finish = if last { r#""length""# } else { "null" };
        let choice = match kind {
            Kind::Chat => {
                format!(r#"{{"index":0,"delta":{{"content":" tok{i}"}},"finish_reason":{finish}}}"#)
            }
            Kind::Completion => format!(r#"{{"index":0,"text":" tok{i}","finish_reason":{finish}}}"#),
        };
        out.push(event(&choice));
    }
    // Usage always comes on a stream (as with vLLM's include_usage): a client that does not read
    // it skips one more event.
    out.push(Bytes::from(format!(
        "data: {{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[],\"usage\":{}}}\n\n",
        usage_json(a)
    )));
    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
    out
}

fn full_reply(kind: Kind, a: &Asked) -> String {
    let text: String = (0..a.tokens).map(|i| format!(" tok{i}")).collect();
    let usage = usage_json(a);
    match kind {
        Kind::Chat => format!(
            r#"{{"id":"chatcmpl-fake","object":"chat.completion","created":0,"model":"{MODEL}","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"length"}}],"usage":{usage}}}"#
        ),
        Kind::Completion => format!(
            r#"{{"id":"cmpl-fake","object":"text_completion","created":0,"model":"{MODEL}","choices":[{{"index":0,"text":"{text}","finish_reason":"length"}}],"usage":{usage}}}"#
        ),
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}});
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

async fn reply(kind: Kind, delay: Duration, body: Bytes) -> Response {
    let a = match asked(&body) {
        Ok(a) => a,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    if !a.stream {
        return ([(header::CONTENT_TYPE, "application/json")], full_reply(kind, &a)).into_response();
    }
    let events = stream_events(kind, &a);
    let body = if delay.is_zero() {
        // One write for the whole reply: the cheapest stream a server can send.
        Body::from(events.concat())
    } else {
        let s = futures_util::stream::unfold((events.into_iter(), true), move |(mut it, first)| async move {
            let ev = it.next()?;
            if !first {
                tokio::time::sleep(delay).await;
            }
            Some((Ok::<_, std::io::Error>(ev), (it, false)))
        });
        Body::from_stream(s)
    };
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

async fn models() -> Response {
    let body = format!(
        r#"{{"object":"list","data":[{{"id":"{MODEL}","object":"model","created":0,"owned_by":"tokenpath"}}]}}"#
    );
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn serve(o: Opts) -> Result<(), Box<dyn std::error::Error>> {
    let d = o.token_delay;
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(move |b: Bytes| reply(Kind::Chat, d, b)))
        .route("/v1/completions", post(move |b: Bytes| reply(Kind::Completion, d, b)))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind((o.host, o.port)).await?;
    let port = listener.local_addr()?.port();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port={port}")?;
    stdout.flush()?;
    drop(stdout);
    axum::serve(listener, app).await?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let o = parse_args().map_err(|e| format!("fake_server: {e}"))?;
    let rt = if o.threads == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(o.threads).enable_all().build()?
    };
    rt.block_on(serve(o))
}
