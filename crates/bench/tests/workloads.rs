//! The new workloads and the rate search against a scripted SSE server on loopback: a
//! multi-turn session's later prompts carry exactly the earlier prompts and the answers the
//! server really returned (and each turn counts as sent on the progress bar when it goes out), a
//! trace's timestamps become the schedule, and `--find-max-rate` stays within its probe budget and
//! answers with a rate that passed.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use axum::response::Response;
use axum::routing::post;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenpath_bench::arrival::Arrival;
use tokenpath_bench::client::Target;
use tokenpath_bench::progress::{LiveStats, Snapshot};
use tokenpath_bench::report::ReportOptions;
use tokenpath_bench::run::{run, RunConfig};
use tokenpath_bench::search::{find_max_rate, SearchConfig};
use tokenpath_bench::workload::Workload;

type Seen = Arc<Mutex<Vec<(serde_json::Value, String)>>>;

async fn chat(counter: Arc<AtomicU64>, seen: Seen, body: String) -> Response {
    let req: serde_json::Value = serde_json::from_str(&body).unwrap();
    let n = counter.fetch_add(1, Ordering::SeqCst);
    if req["model"] == "fail" {
        return Response::builder().status(503).body(axum::body::Body::from("{}")).unwrap();
    }
    let answer = format!("answer number {n}");
    seen.lock().unwrap().push((req["messages"].clone(), answer.clone()));
    let chunk = |delta: serde_json::Value| {
        let c = serde_json::json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
        format!("data: {c}\n\n")
    };
    let mut out = chunk(serde_json::json!({"role": "assistant"}));
    for piece in answer.split_inclusive(' ') {
        out.push_str(&chunk(serde_json::json!({"content": piece})));
    }
    out.push_str(
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3,\"total_tokens\":12}}\n\n",
    );
    out.push_str("data: [DONE]\n\n");
    tokio::time::sleep(Duration::from_millis(5)).await;
    Response::builder().header("content-type", "text/event-stream").body(axum::body::Body::from(out)).unwrap()
}

async fn server() -> (String, Seen) {
    server_with(Arc::new(|| {})).await
}

/// The scripted server, calling `on_request` as each request arrives (before answering it).
async fn server_with(on_request: Arc<dyn Fn() + Send + Sync>) -> (String, Seen) {
    let counter = Arc::new(AtomicU64::new(0));
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: String| {
            on_request();
            chat(counter.clone(), s.clone(), body)
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

fn target(url: &str, model: &str) -> Target {
    Target {
        url: url.into(),
        model: model.into(),
        api_key: None,
        stream: true,
        ignore_eos: false,
        timeout: Duration::from_secs(20),
        endpoint: tokenpath_bench::client::Endpoint::Chat,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_prompts_carry_the_real_answers() {
    let (url, seen) = server().await;
    let w: Workload = "multi-turn:3:5-10:2-3".parse().unwrap();
    let cfg = RunConfig::new(target(&url, "m"), w, Arrival::Poisson { rate: 50.0 }, 9, 3);
    let records = run(&cfg, &mut |_, _, _| {}).await.unwrap();
    assert_eq!(records.len(), 9);
    assert!(records.iter().all(|r| r.is_ok()));
    // Turns of a session are sequential: turn t+1 is sent after turn t ended, and scheduled then.
    for s in 0..3 {
        for t in 0..2 {
            let (a, b) = (&records[s * 3 + t], &records[s * 3 + t + 1]);
            assert!(b.t_send >= a.t_done.unwrap() && b.t_sched >= a.t_done.unwrap());
        }
    }
    let seen = seen.lock().unwrap();
    let mut later_turns = 0;
    for (messages, _) in seen.iter() {
        let m = messages.as_array().unwrap();
        assert_eq!(m.len() % 2, 1, "user, (assistant, user)*");
        if m.len() > 1 {
            later_turns += 1;
            // Exactly one earlier request had the same history and got the answer quoted here.
            let earlier = &m[..m.len() - 2];
            let answer = m[m.len() - 2]["content"].as_str().unwrap();
            assert_eq!(m[m.len() - 2]["role"], "assistant");
            assert!(
                seen.iter().any(|(p, a)| p.as_array().unwrap().as_slice() == earlier && a == answer),
                "turn with {} messages quotes an answer the server did not give to that prompt",
                m.len()
            );
        }
    }
    assert_eq!(later_turns, 6);
}

/// The live progress bar's "sent" is what the run really sent. Regression: it was derived from
/// the precomputed schedule, which for a multi-turn workload holds only the session starts, so a
/// session's later turns (sent when the previous turn ended) were never counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_counts_each_turn_when_it_is_sent() {
    let stats = Arc::new(LiveStats::new(4));
    let at_arrival: Arc<Mutex<Vec<Snapshot>>> = Arc::default();
    let (s, a) = (stats.clone(), at_arrival.clone());
    let (url, _) = server_with(Arc::new(move || a.lock().unwrap().push(s.snapshot()))).await;
    let w: Workload = "multi-turn:4:5-10:2-3".parse().unwrap();
    let mut cfg = RunConfig::new(target(&url, "m"), w, Arrival::Poisson { rate: 50.0 }, 4, 3);
    cfg.send_counter = Some(stats.send_counter());
    let records = run(&cfg, &mut |_, total, rec| {
        stats.set_total(total);
        stats.record(rec);
    })
    .await
    .unwrap();
    assert_eq!(records.len(), 4);
    assert!(records.iter().all(|r| r.is_ok()));
    // One session of four turns: when the server sees turn k, exactly k + 1 requests have been
    // sent, and the one being answered is in flight.
    let seen = at_arrival.lock().unwrap().clone();
    assert_eq!(seen.iter().map(|s| s.sent).collect::<Vec<_>>(), [1, 2, 3, 4], "{seen:?}");
    assert!(seen.iter().all(|s| s.in_flight >= 1), "{seen:?}");
    let end = stats.snapshot();
    assert_eq!((end.sent, end.done, end.in_flight), (4, 4, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_timestamps_are_the_schedule() {
    let (url, _) = server().await;
    let path = std::env::temp_dir().join(format!("tp-trace-{}.jsonl", std::process::id()));
    std::fs::write(
        &path,
        "{\"timestamp\": 100.0, \"prompt\": \"Hello there\", \"output_tokens\": 3}\n\
         {\"timestamp\": 100.05, \"prompt_tokens\": 20, \"output_tokens\": 2}\n\
         {\"timestamp\": 100.2, \"prompt_tokens\": 5, \"output_tokens\": 2}\n",
    )
    .unwrap();
    let w: Workload = format!("trace:{}", path.display()).parse().unwrap();
    let cfg = RunConfig::new(target(&url, "m"), w, Arrival::Poisson { rate: 1.0 }, 100, 0);
    let records = run(&cfg, &mut |_, _, _| {}).await.unwrap();
    let sched: Vec<u64> = records.iter().map(|r| r.t_sched / 1_000_000).collect();
    assert_eq!(sched, vec![0, 50, 200]);
    std::fs::remove_file(&path).unwrap();
    let bad = std::env::temp_dir().join(format!("tp-trace-bad-{}.jsonl", std::process::id()));
    std::fs::write(
        &bad,
        "{\"timestamp\": 1, \"prompt_tokens\": 5, \"output_tokens\": 2}\n{\"timestamp\": 2}\n",
    )
    .unwrap();
    let err = format!("trace:{}", bad.display()).parse::<Workload>().unwrap_err().to_string();
    assert!(err.contains(":2:"), "{err}");
    std::fs::remove_file(&bad).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_search_is_bounded_and_answers_a_passing_rate() {
    let (url, _) = server().await;
    let search = |start: f64| SearchConfig {
        start_rate: start,
        attainment: 0.9,
        slo: "e2e:10s".parse().unwrap(),
        max_probes: 3,
        tolerance: 0.1,
        report: ReportOptions::default(),
    };
    let w: Workload = "shared-prefix:2:20:5-10:2-3".parse().unwrap();
    let base = RunConfig::new(target(&url, "m"), w, Arrival::Constant { rate: 1.0 }, 4, 0);
    let mut lines = Vec::new();
    let res =
        find_max_rate(&base, &search(20.0), &mut |_, _, _| {}, &mut |p| lines.push(p.rate)).await.unwrap();
    assert_eq!(lines, vec![20.0, 40.0, 80.0], "grows while passing, within the budget");
    assert_eq!(res.max_rate, Some(80.0));
    assert!(res.first_failing_rate.is_none() && res.probes.iter().all(|p| p.passed));

    // A server that fails everything: the search shrinks and finds nothing.
    let base = RunConfig { target: target(&url, "fail"), ..base };
    let res = find_max_rate(&base, &search(40.0), &mut |_, _, _| {}, &mut |_| {}).await.unwrap();
    assert_eq!(res.probes.iter().map(|p| p.rate).collect::<Vec<_>>(), vec![40.0, 20.0, 10.0]);
    assert_eq!(res.max_rate, None);
    assert!(res.probes.iter().all(|p| p.attainment == 0.0 && !p.passed));
}
