//! Contract tests of the PD upstream kinds over real sockets, against fake engines that speak
//! each protocol as the engines' sources define it (`fake_engine`): what each leg is sent
//! (fields, ids, order, concurrency), what the client gets back (the decode leg's tokens, the
//! prefill leg's cached tokens, one timeline with each stage's source), and the failures —
//! prefill 5xx, missing transfer params, a decode stall, a client that leaves — and the tenant
//! charged the decode leg's tokens only.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod common;
mod fake_engine;

use common::{Events, MODEL};
use fake_engine::{base, chat, pool_gateway};
use fake_engine::{Fake, Mode, Persona};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_gateway::upstream::{UpstreamKind, UpstreamSpec};
use tokenpath_protocol::cluster::WorkerRole;

fn spec(f: &Fake, kind: UpstreamKind, role: WorkerRole) -> UpstreamSpec {
    UpstreamSpec { kind, role, model: Some("big-model".into()), ..UpstreamSpec::openai(f.url.clone()) }
}

async fn pd_pair(
    p: Persona,
    d: Persona,
    kind: UpstreamKind,
    idle: Duration,
) -> (Arc<Fake>, Arc<Fake>, common::Server) {
    pd_pair_paced(p, d, kind, idle, Duration::from_millis(5)).await
}

/// An SGLang PD pair behind the gateway.
async fn sglang_pair(idle: Duration) -> (Arc<Fake>, Arc<Fake>, common::Server) {
    pd_pair(Persona::SglangPrefill, Persona::SglangDecode, UpstreamKind::SglangPd, idle).await
}

/// The same, the prefill engine pausing `prefill_gap` between its stream's events.
async fn pd_pair_paced(
    p: Persona,
    d: Persona,
    kind: UpstreamKind,
    idle: Duration,
    prefill_gap: Duration,
) -> (Arc<Fake>, Arc<Fake>, common::Server) {
    let pf = fake_engine::start_with_gap(p, "p", prefill_gap).await;
    let df = fake_engine::start(d, "d").await;
    let mut ps = spec(&pf, kind, WorkerRole::Prefill);
    if kind == UpstreamKind::SglangPd {
        ps.bootstrap_port = Some(8998);
    }
    let (server, _) = pool_gateway(vec![ps, spec(&df, kind, WorkerRole::Decode)], idle).await;
    (pf, df, server)
}

/// The `timing` of the last event that has one.
fn timing_of(events: &[Value]) -> Value {
    events.iter().rev().find_map(|e| e.get("timing").cloned()).expect("a timing object")
}

fn source(t: &Value, stage: &str) -> Option<String> {
    t["sources"][stage].as_str().map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_pd_sends_the_prefill_legs_transfer_params_verbatim_to_decode() {
    let (pf, df, server) =
        pd_pair(Persona::VllmPrefill, Persona::VllmDecode, UpstreamKind::VllmPd, Duration::from_secs(10))
            .await;
    let body = base(json!({"stream": true, "min_tokens": 2, "stream_options": {"include_usage": true},
        "max_completion_tokens": 3}));
    let resp = chat(&server, &body).await;
    assert_eq!(resp.status(), 200);
    let events = Events::new(resp).rest().await.unwrap();
    let (p, d) = (pf.got(), df.got());
    assert_eq!((p.len(), d.len()), (1, 1));
    let (p, d) = (&p[0], &d[0]);
    // The prefill leg: do_remote_decode, not streamed, one token, no stream_options/min_tokens.
    assert_eq!(p.body["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(p.body["kv_transfer_params"]["do_remote_prefill"], false);
    assert_eq!((p.body["stream"].clone(), p.body["max_tokens"].clone()), (json!(false), json!(1)));
    assert_eq!(p.body["max_completion_tokens"], 1);
    assert!(p.body.get("stream_options").is_none() && p.body.get("min_tokens").is_none(), "{}", p.body);
    // The decode leg: the client's body with the prefill's params, verbatim; one request id.
    let params = &d.body["kv_transfer_params"];
    assert_eq!(params["remote_engine_id"], "engine-p");
    assert_eq!(params["remote_block_ids"], json!([[3, 4, 5]]));
    assert_eq!(
        (params["remote_host"].clone(), params["remote_port"].clone()),
        (json!("10.1.2.3"), json!(5600))
    );
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!((d.body["stream"].clone(), d.body["min_tokens"].clone()), (json!(true), json!(2)));
    assert_eq!(d.body["max_completion_tokens"], 3);
    assert_eq!(d.body["stream_options"]["include_usage"], true);
    assert_eq!(d.body["stream_options"]["continuous_usage_stats"], true, "usage on every chunk, forced");
    assert_eq!(d.body["model"], "big-model");
    assert!(p.request_id.is_some() && p.request_id == d.request_id, "one X-Request-Id on both legs");
    assert_eq!(params["remote_request_id"], json!(p.request_id), "the prefill saw the same id");
    assert!(p.at <= d.at, "prefill first");
    assert_eq!(p.auth.as_deref(), Some("Bearer upstream-key"));
    // The client: decode's tokens, the prefill's cached tokens, one timeline.
    assert_eq!(common::streamed_text(&events), fake_engine::WORDS.concat());
    let usage = events.iter().find_map(|e| e.get("usage").filter(|u| u.is_object())).unwrap();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 16, "cached from the prefill leg");
    assert!(events.iter().all(|e| e["model"] == MODEL));
    let t = timing_of(&events);
    assert_eq!(t["cached_tokens"], 16);
    assert_eq!(t["stages_ms"]["queue"], 2.5);
    assert_eq!(t["stages_ms"]["prefill"], 8.0);
    assert_eq!(source(&t, "prefill").as_deref(), Some("engine"), "{t}");
    assert_eq!(source(&t, "decode_queue").as_deref(), Some("gateway"), "{t}");
    assert_eq!(source(&t, "decode").as_deref(), Some("gateway"), "{t}");
    assert!(t["stages_ms"].get("kv_transfer").is_none(), "never invented: {t}");
    // The forced per-chunk usage counted each token, then was taken off the content chunks (the
    // client asked for the usage chunk only); a client that asks for it gets it.
    let with_usage = events.iter().filter(|e| e.get("usage").is_some()).count();
    assert_eq!(with_usage, 1, "only the usage chunk: {events:?}");
    let body = base(json!({"stream": true, "stream_options": {"include_usage": true,
        "continuous_usage_stats": true}}));
    let events = Events::new(chat(&server, &body).await).rest().await.unwrap();
    let counts: Vec<u64> = events
        .iter()
        .filter(|e| e["choices"].as_array().is_some_and(|c| !c.is_empty()))
        .filter_map(|e| e["usage"]["completion_tokens"].as_u64())
        .collect();
    assert_eq!(counts, [1, 2, 3], "{events:?}");
    // Not streamed: the same sequence, the body rewritten the same way.
    let resp = chat(&server, &base(json!({}))).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
    assert_eq!(v["choices"][0]["message"]["content"], fake_engine::WORDS.concat());
    assert_eq!(df.got()[2].body["kv_transfer_params"]["remote_engine_id"], "engine-p");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_pd_falls_back_to_decode_only_when_the_prefill_leg_fails() {
    let (pf, df, server) =
        pd_pair(Persona::VllmPrefill, Persona::VllmDecode, UpstreamKind::VllmPd, Duration::from_secs(10))
            .await;
    for mode in [Mode::Fail500, Mode::NoParams] {
        pf.set_mode(mode);
        let resp = chat(&server, &base(json!({"stream": true}))).await;
        assert_eq!(resp.status(), 200, "{mode:?}");
        let events = Events::new(resp).rest().await.unwrap();
        assert_eq!(common::streamed_text(&events), fake_engine::WORDS.concat());
        let d = df.got().pop().unwrap();
        assert!(d.body.get("kv_transfer_params").is_none(), "decode computes the prompt: {}", d.body);
        let t = timing_of(&events);
        assert_eq!(source(&t, "prefill").as_deref(), Some("gateway"), "{t}");
    }
    assert_eq!(pf.count(), 2);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pd_sends_one_body_with_one_room_to_both_legs_at_once() {
    let (pf, df, server) = sglang_pair(Duration::from_secs(10)).await;
    let resp = chat(&server, &base(json!({"stream": true, "stream_options": {"include_usage": true}}))).await;
    assert_eq!(resp.status(), 200);
    let events = Events::new(resp).rest().await.unwrap();
    assert_eq!(common::streamed_text(&events), fake_engine::WORDS.concat());
    let (p, d) = (pf.got().pop().unwrap(), df.got().pop().unwrap());
    assert_eq!(p.body, d.body, "the same body to both");
    assert_eq!(p.body["bootstrap_host"], "127.0.0.1");
    assert_eq!(p.body["bootstrap_port"], 8998);
    let room = p.body["bootstrap_room"].as_u64().unwrap();
    assert!(room < 1 << 63);
    assert!(p.at.max(d.at) - p.at.min(d.at) < Duration::from_secs(1), "sent at once");
    assert_eq!(p.request_id, d.request_id);
    let usage = events.iter().find_map(|e| e.get("usage").filter(|u| u.is_object())).unwrap();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 2, "the prefill leg's count");
    // Another request, another room.
    let resp = chat(&server, &base(json!({}))).await;
    assert_eq!(resp.status(), 200);
    assert_ne!(pf.got().pop().unwrap().body["bootstrap_room"].as_u64().unwrap(), room);
    server.shutdown().await.unwrap();
}

/// Regression: the decode leg's usage came before the (slower) prefill leg ended, and the
/// client was told the decode engine's count (every transferred token) as cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pd_waits_for_a_slow_prefill_leg_before_usage() {
    let (_pf, _df, server) = pd_pair_paced(
        Persona::SglangPrefill,
        Persona::SglangDecode,
        UpstreamKind::SglangPd,
        Duration::from_secs(10),
        Duration::from_millis(150),
    )
    .await;
    for stream in [true, false] {
        let body = base(json!({"stream": stream, "stream_options": {"include_usage": true}}));
        let body = if stream { body } else { base(json!({})) };
        let resp = chat(&server, &body).await;
        assert_eq!(resp.status(), 200);
        let events =
            if stream { Events::new(resp).rest().await.unwrap() } else { vec![resp.json().await.unwrap()] };
        let usage = events.iter().find_map(|e| e.get("usage").filter(|u| u.is_object())).unwrap();
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"], 2,
            "stream {stream}: the prefill leg's count"
        );
        let t = timing_of(&events);
        assert!(t["stages_ms"]["prefill"].is_number(), "{t}");
        assert_eq!(source(&t, "prefill").as_deref(), Some("gateway"), "the prefill leg's end, measured: {t}");
    }
    server.shutdown().await.unwrap();
}

/// Regression: a prefill leg whose stream ended without an event, while the decode leg waited
/// for its KV, left the client waiting for the decode leg's idle timeout. Nothing had reached
/// the client: the request fails at once (it is retried on another pair when there is one),
/// and the decode leg is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pd_fails_fast_when_the_prefill_leg_ends_before_the_first_event() {
    let (pf, df, server) = sglang_pair(Duration::from_secs(600)).await;
    pf.set_mode(Mode::CloseBeforeFirst);
    df.set_mode(Mode::StallBeforeFirst);
    let resp = tokio::time::timeout(Duration::from_secs(60), chat(&server, &base(json!({"stream": true}))))
        .await
        .expect("an answer, not the decode leg's idle timeout");
    assert!(resp.status().is_server_error(), "{}", resp.status());
    wait_for(|| df.cut.load(Ordering::SeqCst) == 1, "the decode leg cancelled").await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pd_cancels_the_other_leg_when_one_fails() {
    let (pf, df, server) = sglang_pair(Duration::from_secs(10)).await;
    // The prefill refuses: the decode leg (waiting on its room) is dropped, the client told.
    pf.set_mode(Mode::Fail500);
    df.set_mode(Mode::StallBeforeFirst);
    let resp = chat(&server, &base(json!({"stream": true}))).await;
    assert_eq!(resp.status(), 500);
    wait_for(|| df.cut.load(Ordering::SeqCst) == 1, "the decode leg cancelled").await;
    // The decode leg ends while the prefill leg still streams: the answer stands (after a
    // bounded wait for the prefill), its cached count unknown, the prefill leg cancelled.
    pf.set_mode(Mode::StallAfterFirst);
    df.set_mode(Mode::Normal);
    let before = pf.cut.load(Ordering::SeqCst);
    let resp = chat(&server, &base(json!({"stream": true}))).await;
    assert_eq!(resp.status(), 200);
    let events = Events::new(resp).rest().await.unwrap();
    assert_eq!(common::streamed_text(&events), fake_engine::WORDS.concat(), "decode's answer stands");
    assert!(events.last().is_some_and(|e| e.get("error").is_none()), "{events:?}");
    wait_for(|| pf.cut.load(Ordering::SeqCst) == before + 1, "the prefill leg dropped with the request")
        .await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_and_a_stalled_decode_leave_nothing_open() {
    let (pf, df, server) = sglang_pair(Duration::from_secs(1)).await;
    pf.set_mode(Mode::StallAfterFirst);
    df.set_mode(Mode::StallAfterFirst);
    let resp = chat(&server, &base(json!({"stream": true}))).await;
    let mut ev = Events::new(resp);
    assert!(ev.next().await.unwrap().is_some(), "the first chunk arrives");
    drop(ev);
    wait_for(|| pf.cut.load(Ordering::SeqCst) == 1 && df.cut.load(Ordering::SeqCst) == 1, "both legs closed")
        .await;
    // A decode leg that goes silent ends the client's stream with an error after the idle bound.
    pf.set_mode(Mode::Normal);
    let started = Instant::now();
    let resp = chat(&server, &base(json!({"stream": true}))).await;
    let mut ev = Events::new(resp);
    let mut error = false;
    while let Some(d) = ev.next().await.unwrap() {
        error |= d.contains("\"error\"");
    }
    assert!(error && started.elapsed() < Duration::from_secs(20));
    wait_for(|| df.cut.load(Ordering::SeqCst) == 2, "the stalled decode leg closed").await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_pd_runs_context_only_then_generation_only() {
    let (pf, df, server) =
        pd_pair(Persona::TrtContext, Persona::TrtGeneration, UpstreamKind::TrtllmPd, Duration::from_secs(10))
            .await;
    let resp = chat(&server, &base(json!({"stream": true}))).await;
    assert_eq!(resp.status(), 200);
    let events = Events::new(resp).rest().await.unwrap();
    assert_eq!(common::streamed_text(&events), fake_engine::WORDS.concat());
    let (p, d) = (pf.got().pop().unwrap(), df.got().pop().unwrap());
    assert_eq!(p.body["disaggregated_params"], json!({"request_type": "context_only"}));
    assert_eq!((p.body["stream"].clone(), p.body["stream_options"].clone()), (json!(false), Value::Null));
    let g = &d.body["disaggregated_params"];
    assert_eq!(g["request_type"], "generation_only");
    assert_eq!(
        (g["ctx_request_id"].clone(), g["encoded_opaque_state"].clone()),
        (json!(42), json!("b3BhcXVl"))
    );
    assert_eq!(g["first_gen_tokens"], json!([11]));
    assert_eq!(d.body["stream"], true);
    // An answer that finished in the context leg is the answer (as a stream when asked).
    let resp = chat(&server, &base(json!({"stream": true, "finish_in_context": true}))).await;
    assert_eq!(resp.status(), 200);
    let events = Events::new(resp).rest().await.unwrap();
    assert_eq!(common::streamed_text(&events), " tok0");
    assert_eq!(df.count(), 1, "no generation leg");
    // A context server that fails: blamed, no other pair to try, a 500.
    pf.set_mode(Mode::Fail500);
    assert_eq!(chat(&server, &base(json!({"stream": true}))).await.status(), 500);
    server.shutdown().await.unwrap();
}

async fn wait_for(ok: impl Fn() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// In PD only the decode leg's tokens are the tenant's output: a budget of 4 output tokens a
/// minute admits a second request after one that generated 3 (the fakes' answer), and refuses
/// a third. Charging the prefill leg's token too (vLLM's `max_tokens: 1` answer, SGLang's
/// streamed prefill) would refuse the second; charging nothing would admit the third.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_pd_the_tenant_is_charged_the_decode_legs_tokens_only() {
    let keys = r#"
[[key]]
tenant = "alice"
key = "sk-client-0001"
output_tokens_per_minute = 4
"#;
    for (p, d, kind) in [
        (Persona::VllmPrefill, Persona::VllmDecode, UpstreamKind::VllmPd),
        (Persona::SglangPrefill, Persona::SglangDecode, UpstreamKind::SglangPd),
    ] {
        let (pf, df) = (fake_engine::start(p, "p").await, fake_engine::start(d, "d").await);
        let mut ps = spec(&pf, kind, WorkerRole::Prefill);
        if kind == UpstreamKind::SglangPd {
            ps.bootstrap_port = Some(8998);
        }
        let pool = tokenpath_gateway::upstream::UpstreamPool::new(
            fake_engine::pool_config(Duration::from_secs(10), Duration::from_secs(10)),
            vec![ps, spec(&df, kind, WorkerRole::Decode)],
        )
        .unwrap();
        assert!(pool.wait_ready(Duration::from_secs(10)).await);
        let server =
            fake_engine::serve_pool_with_keys(pool, tokenpath_gateway::ApiKeys::from_toml_str(keys).unwrap())
                .await;
        for (i, want) in [200, 200, 429].into_iter().enumerate() {
            let resp = chat(&server, &base(json!({"stream": true}))).await;
            assert_eq!(resp.status().as_u16(), want, "{kind:?}, request {i}");
            if want == 200 {
                let events = Events::new(resp).rest().await.unwrap();
                assert_eq!(common::streamed_text(&events), fake_engine::WORDS.concat(), "{kind:?}");
            }
        }
        assert!(pf.count() >= 2, "{kind:?}: the prefill leg ran");
        server.shutdown().await.unwrap();
    }
}
