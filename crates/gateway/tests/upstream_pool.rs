//! The pool of upstreams through HTTP: which upstream a request goes to (prefix affinity within
//! the balance bound), what happens when one fails (ejection, a retry elsewhere only before the
//! client got a byte), run-time membership (the admin API, DNS discovery) and a stream that
//! outlives the first-byte timeout. Real sockets: fake engines on loopback, the gateway over them.
#![allow(clippy::unwrap_used)]

mod common;
mod fake_engine;

use common::Events;
use fake_engine::{base, chat, pool_config, pool_gateway, serve_pool, Fake, Mode, Persona};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokenpath_gateway::upstream::{UpstreamPool, UpstreamSpec, BALANCE_THRESHOLD, EJECT_AFTER};

/// A prompt of many router blocks (a long shared system message), then `tail`; `extra` fields.
fn long_prompt(tail: &str, extra: Value) -> Value {
    let prefix: String = (0..120).map(|i| format!("rule {i} of the house; ")).collect();
    let mut b =
        base(json!({"messages": [{"role": "system", "content": prefix}, {"role": "user", "content": tail}]}));
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

async fn admin(server: &common::Server, method: reqwest::Method, body: Option<Value>) -> reqwest::Response {
    let mut req =
        server.client.request(method, server.url("/admin/upstreams")).bearer_auth(common::ADMIN_KEY);
    if let Some(b) = body {
        req = req.json(&b);
    }
    req.send().await.unwrap()
}

async fn listed(server: &common::Server) -> Vec<Value> {
    let v: Value = admin(server, reqwest::Method::GET, None).await.json().await.unwrap();
    v["upstreams"].as_array().unwrap().clone()
}

async fn two() -> (Arc<Fake>, Arc<Fake>) {
    (fake_engine::start(Persona::Plain, "a").await, fake_engine::start(Persona::Plain, "b").await)
}

async fn wait_for(what: &str, mut ok: impl AsyncFnMut() -> bool) {
    for _ in 0..200 {
        if ok().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_stays_on_one_upstream_until_the_balance_bound() {
    let (a, b) = two().await;
    let specs = vec![UpstreamSpec::openai(&a.url), UpstreamSpec::openai(&b.url)];
    let (server, _pool) = pool_gateway(specs, Duration::from_secs(30)).await;
    for i in 0..6 {
        let resp = chat(&server, &long_prompt(&format!("question {i}"), json!({}))).await;
        assert_eq!(resp.status(), 200);
    }
    let (na, nb) = (a.count(), b.count());
    assert!((na, nb) == (6, 0) || (na, nb) == (0, 6), "one upstream has the prefix: {na} / {nb}");
    let (hot, cold) = if na == 6 { (&a, &b) } else { (&b, &a) };
    // Streams that stall on the hot upstream load it; past the bound the prefix goes elsewhere.
    hot.set_mode(Mode::StallAfterFirst);
    cold.set_mode(Mode::StallAfterFirst);
    let mut open = Vec::new();
    for i in 0..=BALANCE_THRESHOLD {
        let mut resp = chat(&server, &long_prompt(&format!("held {i}"), json!({"stream": true}))).await;
        assert_eq!(resp.status(), 200);
        resp.chunk().await.unwrap().unwrap();
        open.push(resp);
    }
    assert_eq!(hot.count(), 6 + BALANCE_THRESHOLD + 1, "within the bound the prefix wins");
    assert_eq!(cold.count(), 0);
    let mut resp = chat(&server, &long_prompt("one more", json!({"stream": true}))).await;
    resp.chunk().await.unwrap().unwrap();
    assert_eq!(cold.count(), 1, "past the bound the same prefix goes to the idle upstream");
    drop((open, resp));
    server.shutdown().await.unwrap();
}

/// Upstreams that name the same shared KV pool (`kv_pool`): past the balance bound, a prefix
/// routed to one of them goes to another member of its pool — which loads it from the pool —
/// before an upstream on no pool, listed earlier, that would compute it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_balance_bound_a_prefix_goes_to_another_upstream_on_the_same_kv_pool() {
    let (a, b) = two().await;
    let c = fake_engine::start(Persona::Plain, "c").await;
    let on = |url: &str, pool: Option<&str>| {
        UpstreamSpec::openai(url).on_kv_pool(pool.map(str::to_owned)).unwrap()
    };
    // `c` sits between the two pool members: ties go to the first listed.
    let specs = vec![on(&a.url, Some("rack-1")), on(&c.url, None), on(&b.url, Some("rack-1"))];
    let (server, _pool) = pool_gateway(specs, Duration::from_secs(30)).await;
    for i in 0..3 {
        assert_eq!(chat(&server, &long_prompt(&format!("question {i}"), json!({}))).await.status(), 200);
    }
    assert_eq!((a.count(), b.count(), c.count()), (3, 0, 0), "the first listed takes the prefix");
    for f in [&a, &b, &c] {
        f.set_mode(Mode::StallAfterFirst);
    }
    let mut open = Vec::new();
    for i in 0..=BALANCE_THRESHOLD {
        let mut resp = chat(&server, &long_prompt(&format!("held {i}"), json!({"stream": true}))).await;
        resp.chunk().await.unwrap().unwrap();
        open.push(resp);
    }
    assert_eq!(a.count(), 3 + BALANCE_THRESHOLD + 1, "within the bound the prefix stays");
    let mut resp = chat(&server, &long_prompt("one more", json!({"stream": true}))).await;
    resp.chunk().await.unwrap().unwrap();
    assert_eq!((b.count(), c.count()), (1, 0), "past the bound: the other member of the pool");
    let listed = listed(&server).await;
    assert!(listed.iter().any(|u| u["kv_pool"] == "rack-1"), "{listed:?}");
    assert!(UpstreamSpec::openai(&c.url).on_kv_pool(Some("two words".into())).is_err());
    drop((open, resp));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_upstream_is_retried_elsewhere_then_ejected() {
    let (a, b) = two().await;
    let specs = vec![UpstreamSpec::openai(&a.url), UpstreamSpec::openai(&b.url)];
    let (server, _pool) = pool_gateway(specs, Duration::from_secs(30)).await;
    a.set_mode(Mode::Fail500);
    // Short prompts share no router block: every choice is a tie, which the first member wins
    // while it is routable.
    let n = EJECT_AFTER as usize + 4;
    for i in 0..n {
        let resp =
            chat(&server, &base(json!({"messages": [{"role": "user", "content": format!("q{i}")}]}))).await;
        assert_eq!(resp.status(), 200, "the retry before the first byte hides the failure");
    }
    assert_eq!(a.count(), EJECT_AFTER as usize, "ejected after {EJECT_AFTER} failures in a row");
    assert_eq!(b.count(), n);
    let view = listed(&server).await;
    let bad = view.iter().find(|u| u["url"] == a.url.as_str()).unwrap();
    assert!(bad["ejected_for_s"].as_f64().unwrap() > 0.0, "{bad}");
    assert_eq!(bad["failures"], EJECT_AFTER);
    let good = view.iter().find(|u| u["url"] == b.url.as_str()).unwrap();
    assert_eq!(good["failures"], 0, "{good}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_the_first_byte_is_not_retried() {
    let (a, b) = two().await;
    a.set_mode(Mode::StallAfterFirst);
    b.set_mode(Mode::StallAfterFirst);
    let specs = vec![UpstreamSpec::openai(&a.url), UpstreamSpec::openai(&b.url)];
    let (server, _pool) = pool_gateway(specs, Duration::from_secs(1)).await;
    let resp = chat(&server, &base(json!({"stream": true}))).await;
    assert_eq!(resp.status(), 200);
    let events = Events::new(resp).rest().await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last["error"]["type"], "server_error", "the stream ends with an error: {last}");
    assert_eq!(common::streamed_text(&events), fake_engine::WORDS[0], "the byte the client had stands");
    assert_eq!(a.count() + b.count(), 1, "no second upstream once the client had a byte");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_adds_lists_and_removes_upstreams() {
    let (a, b) = two().await;
    let (server, _pool) = pool_gateway(vec![UpstreamSpec::openai(&a.url)], Duration::from_secs(30)).await;
    let anon = server.client.get(server.url("/admin/upstreams")).send().await.unwrap();
    assert_eq!(anon.status(), 401, "the admin API needs the admin key");
    let tenant = server.client.get(server.url("/admin/upstreams")).bearer_auth("sk-client-0001").send().await;
    assert_eq!(tenant.unwrap().status(), 403, "a tenant's key is not the admin key");
    let post = reqwest::Method::POST;
    for (body, param) in [
        (json!({"url": b.url, "kind": "tgi"}), "kind"),
        (json!({"url": b.url, "role": "prefill"}), "role"),
        (json!({"url": "file:///etc/passwd"}), "url"),
        (json!({"url": b.url, "extra": 1}), ""),
    ] {
        let resp = admin(&server, post.clone(), Some(body.clone())).await;
        assert_eq!(resp.status(), 400, "{body}");
        let e: Value = resp.json().await.unwrap();
        assert!(e["error"]["message"].is_string(), "{e}");
        if !param.is_empty() {
            assert_eq!(e["error"]["param"], param, "{e}");
        }
    }
    assert_eq!(listed(&server).await.len(), 1, "nothing half-added");
    let resp = admin(&server, post.clone(), Some(json!({"url": b.url, "kind": "openai"}))).await;
    assert_eq!(resp.status(), 200);
    let again = admin(&server, post, Some(json!({"url": format!("{}/", b.url)}))).await;
    assert_eq!(again.status(), 200, "the same upstream again is no error");
    wait_for("b healthy", async || {
        listed(&server).await.iter().any(|u| u["url"] == b.url.as_str() && u["healthy"] == true)
    })
    .await;
    let view = listed(&server).await;
    assert_eq!(view.len(), 2);
    assert_eq!(view.iter().find(|u| u["url"] == b.url.as_str()).unwrap()["source"], "admin");
    let del = reqwest::Method::DELETE;
    assert_eq!(admin(&server, del.clone(), Some(json!({"url": a.url}))).await.status(), 200);
    assert_eq!(admin(&server, del, Some(json!({"url": a.url}))).await.status(), 400, "gone already");
    for _ in 0..3 {
        assert_eq!(chat(&server, &base(json!({}))).await.status(), 200);
    }
    assert_eq!((a.count(), b.count()), (0, 3), "a removed upstream takes no requests");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_name_becomes_one_member_per_address() {
    let a = fake_engine::start(Persona::Plain, "a").await;
    let port = a.url.rsplit(':').next().unwrap().to_owned();
    let pool =
        UpstreamPool::new(pool_config(Duration::from_secs(10), Duration::from_secs(30)), vec![]).unwrap();
    pool.discover(UpstreamSpec::openai(format!("http://localhost:{port}")), Duration::from_millis(200))
        .unwrap();
    let server = serve_pool(pool.clone()).await;
    wait_for("the name resolved and probed", async || {
        pool.upstreams().await.iter().any(|u| u.url == a.url && u.healthy)
    })
    .await;
    let members = pool.upstreams().await;
    assert!(members.iter().all(|u| u.source == format!("dns:localhost:{port}")), "{members:?}");
    assert!(members.iter().all(|u| !u.url.contains("localhost")), "one member per address: {members:?}");
    let resp = chat(&server, &base(json!({}))).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(a.count(), 1);
    server.shutdown().await.unwrap();
}

/// Regression: the first-byte timeout was reqwest's whole-request timeout, which cut every
/// stream that lasted longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_first_byte_timeout_is_not_cut() {
    let slow = fake_engine::start_with_gap(Persona::Plain, "slow", Duration::from_millis(500)).await;
    let pool = UpstreamPool::new(
        pool_config(Duration::from_secs(1), Duration::from_secs(30)),
        vec![UpstreamSpec::openai(&slow.url)],
    )
    .unwrap();
    assert!(pool.wait_ready(Duration::from_secs(10)).await);
    let server = serve_pool(pool).await;
    let started = std::time::Instant::now();
    let resp = chat(&server, &base(json!({"stream": true}))).await;
    let events = Events::new(resp).rest().await.unwrap();
    assert!(started.elapsed() > Duration::from_secs(1), "the stream outlasted the timeout");
    assert_eq!(common::streamed_text(&events), fake_engine::WORDS.concat());
    assert!(events.iter().all(|e| e.get("error").is_none()), "{events:?}");
    server.shutdown().await.unwrap();
}
