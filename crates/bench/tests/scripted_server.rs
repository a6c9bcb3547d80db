//! The load generator against a scripted SSE server on loopback: the traps the metric definitions
//! exist for (a role-only first chunk, usage in a separate chunk, timing on the last chunk, an
//! HTTP error) go over a real socket, and the records must come out as the definitions say.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use axum::response::{IntoResponse, Response};
use axum::routing::post;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenpath_bench::arrival::Arrival;
use tokenpath_bench::client::Target;
use tokenpath_bench::report::{Report, ReportOptions};
use tokenpath_bench::run::{run, RunConfig};
use tokenpath_bench::workload::Workload;
use tokenpath_timeline::{NOutSource, Outcome};

const FIRST_TOKEN_DELAY: Duration = Duration::from_millis(40);

async fn chat(counter: Arc<AtomicU64>) -> Response {
    let n = counter.fetch_add(1, Ordering::SeqCst);
    if n % 3 == 2 {
        let body =
            r#"{"error":{"message":"overloaded","type":"server_overloaded","param":null,"code":null}}"#;
        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, [("content-type", "application/json")], body)
            .into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(16);
    tokio::spawn(async move {
        let chunk = |delta: &str, finish: &str| {
            format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}]}}\n\n"
            )
        };
        let _ = tx.send(Ok(chunk(r#"{"role":"assistant"}"#, "null"))).await; // role only
        let _ = tx.send(Ok(": keep-alive\n\n".into())).await;
        tokio::time::sleep(FIRST_TOKEN_DELAY).await;
        let _ = tx.send(Ok(chunk(r#"{"content":"Hel"}"#, "null"))).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let _ = tx.send(Ok(chunk(r#"{"content":"lo, w"}"#, "null"))).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let _ = tx.send(Ok(chunk(r#"{"content":"orld"}"#, "null"))).await;
        let _ = tx.send(Ok(chunk("{}", "\"length\""))).await;
        let usage = r#"data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13},"timing":{"stages_ms":{"queue":1.5,"prefill":30.0,"decode":10.0}}}"#;
        let _ = tx.send(Ok(format!("{usage}\n\n"))).await;
        let _ = tx.send(Ok("data: [DONE]\n\n".into())).await;
    });
    let stream = tokio_stream_from(rx);
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(axum::body::Body::from_stream(stream))
        .unwrap()
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<String, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<String, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// Serves `app` on a fresh loopback port.
async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// `num_requests` fixed requests (16 in, 4 out) at 50/s against `addr`.
fn config(addr: std::net::SocketAddr, stream: bool, num_requests: usize, timeout: Duration) -> RunConfig {
    RunConfig {
        target: Target {
            url: format!("http://{addr}"),
            model: "m".into(),
            api_key: None,
            stream,
            ignore_eos: false,
            timeout,
            endpoint: tokenpath_bench::client::Endpoint::Chat,
        },
        workload: Workload::Fixed { input: 16, output: 4 },
        arrival: Arrival::Constant { rate: 50.0 },
        concurrency: None,
        num_requests,
        seed: 1,
        duration: None,
        ramp: None,
        tokenizer: None,
        send_counter: None,
        traces: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_follow_the_definitions_over_a_real_socket() {
    let counter = Arc::new(AtomicU64::new(0));
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post({
            let c = counter.clone();
            move || chat(c.clone())
        }),
    );
    let addr = serve(app).await;
    let cfg = config(addr, true, 6, Duration::from_secs(30));
    let mut seen = 0;
    let records = run(&cfg, &mut |_, _, _| seen += 1).await.unwrap();
    assert_eq!((records.len(), seen), (6, 6));
    let failed: Vec<_> = records.iter().filter(|r| !r.is_ok()).collect();
    assert_eq!(failed.len(), 2);
    assert!(matches!(&failed[0].outcome, Outcome::Failed { kind, .. } if kind == "http_503"));
    for r in records.iter().filter(|r| r.is_ok()) {
        // The role-only chunk and the keep-alive arrive at once; the first token only after the
        // scripted delay, so a definition that took the role chunk would measure less.
        assert!(r.ttft_ns().unwrap() >= FIRST_TOKEN_DELAY.as_nanos() as u64, "{:?}", r.ttft_ns());
        assert_eq!(r.n_out(), Some((4, NOutSource::Usage)));
        assert_eq!(r.chunk_gaps_ns().len(), 2);
        assert!(r.tpot_ns().is_some());
        assert_eq!(r.server.as_ref().unwrap().stage_ms(tokenpath_timeline::Stage::Prefill), Some(30.0));
        assert!(r.t_sched <= r.t_send && r.t_send <= r.t_done.unwrap());
    }
    let report = Report::build(&records, &ReportOptions::default()).unwrap();
    assert_eq!(report.errors["http_503"], 2);
    assert_eq!(report.summary.completed, 4);
    assert!(report.stages.contains_key("prefill_ms"));

    // Closed loop, 2 clients: never more than 2 requests in flight, no schedule lag by definition.
    let closed = RunConfig { concurrency: Some(2), num_requests: 6, ..cfg };
    let records = run(&closed, &mut |_, _, _| {}).await.unwrap();
    assert_eq!(records.len(), 6);
    assert!(records.iter().all(|r| r.t_sched == r.t_send));
    for r in &records {
        let overlapping =
            records.iter().filter(|o| o.t_send <= r.t_send && o.t_done.unwrap() > r.t_send).count();
        assert!(overlapping <= 2, "{overlapping} in flight at once");
    }
}

/// A server that answers every request with a body far larger than any real answer.
async fn flood(stream: bool) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(4);
    tokio::spawn(async move {
        if stream {
            let piece = format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}},\"finish_reason\":null}}]}}\n\n",
                "x".repeat(60_000)
            );
            for _ in 0..2_000 {
                if tx.send(Ok(piece.clone())).await.is_err() {
                    return;
                }
            }
        } else {
            let _ = tx
                .send(Ok(
                    "{\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"".into()
                ))
                .await;
            let piece = "x".repeat(1 << 20);
            for _ in 0..200 {
                if tx.send(Ok(piece.clone())).await.is_err() {
                    return;
                }
            }
        }
    });
    let ct = if stream { "text/event-stream" } else { "application/json" };
    Response::builder()
        .header("content-type", ct)
        .body(axum::body::Body::from_stream(tokio_stream_from(rx)))
        .unwrap()
}

fn vm_hwm_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_sends_too_much_fails_the_request_not_the_bench() {
    for stream in [false, true] {
        let app = axum::Router::new().route("/v1/chat/completions", post(move || flood(stream)));
        let addr = serve(app).await;
        let cfg = config(addr, stream, 2, Duration::from_secs(60));
        let before = vm_hwm_kb();
        let records = run(&cfg, &mut |_, _, _| {}).await.unwrap();
        assert!(
            records.iter().all(|r| matches!(&r.outcome, Outcome::Failed { kind, .. } if kind == "too_large")),
            "stream {stream}: {:?}",
            records.iter().map(|r| &r.outcome).collect::<Vec<_>>()
        );
        // 120-200 MB offered per request; the bench holds at most its 64 MB bound of each.
        let grew_mb = vm_hwm_kb().saturating_sub(before) / 1024;
        assert!(grew_mb < 400, "stream {stream}: peak RSS grew by {grew_mb} MB");
    }
}
