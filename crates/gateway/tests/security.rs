//! Who may call what, over real HTTP on loopback (security review C2, H5, M7): the three
//! credentials are never interchangeable, an open gateway refuses what a browser could forge
//! across sites, the worker registry refuses role flips and has a cap, and a request without
//! credentials is refused before its body is read.

mod common;

use common::{engine, serve_gateway, start, ADMIN_KEY, MODEL};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::Duration;
use tokenpath_gateway::{AdminKey, ApiKeys, GatewayConfig};
use tokenpath_worker::WorkerConfig;

/// A gateway over an (empty) cluster, so registrations are accepted.
async fn cluster_gateway(config: GatewayConfig) -> common::Server {
    let gateway = common::cluster_gateway(GatewayConfig { served_model_name: MODEL.into(), ..config })
        .expect("gateway");
    serve_gateway(gateway).await
}

fn keys() -> ApiKeys {
    ApiKeys::parse("alice:sk-alice-0001").expect("keys")
}

async fn register(server: &common::Server, auth: Option<&str>, addr: &str, role: &str) -> (u16, Value) {
    let mut req = server
        .client
        .post(server.url("/admin/workers"))
        .header("content-type", "application/json")
        .body(json!({"addr": addr, "role": role}).to_string());
    if let Some(a) = auth {
        req = req.bearer_auth(a);
    }
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    (status, serde_json::from_slice(&resp.bytes().await.expect("body")).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_keys_never_open_the_admin_routes() -> anyhow::Result<()> {
    let admin = AdminKey::new(ADMIN_KEY).map_err(anyhow::Error::msg)?;
    let server =
        cluster_gateway(GatewayConfig { api_keys: keys(), admin_key: Some(admin), ..Default::default() })
            .await;
    let (status, body) = register(&server, Some("sk-alice-0001"), "127.0.0.1:9", "decode").await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["type"], "permission_error");
    assert_eq!(register(&server, None, "127.0.0.1:9", "decode").await.0, 401);
    assert_eq!(register(&server, Some("wrong-admin-key-0000"), "127.0.0.1:9", "decode").await.0, 401);
    let (status, body) = register(&server, Some(ADMIN_KEY), "127.0.0.1:9", "decode").await;
    assert_eq!(status, 200, "{body}");
    // The admin key is not a tenant key either.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let resp = server
        .client
        .post(server.url("/v1/chat/completions"))
        .bearer_auth(ADMIN_KEY)
        .header("content-type", "application/json")
        .body(chat.to_string())
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 401);
    for (auth, want) in [(Some("sk-alice-0001"), 403), (None, 401), (Some(ADMIN_KEY), 200)] {
        let mut req = server.client.get(server.url("/admin/workers"));
        if let Some(a) = auth {
            req = req.bearer_auth(a);
        }
        assert_eq!(req.send().await?.status().as_u16(), want, "GET /admin/workers with {auth:?}");
    }
    // A role flip of a known worker is refused, and the worker keeps its role.
    let (status, body) = register(&server, Some(ADMIN_KEY), "127.0.0.1:9", "prefill").await;
    assert_eq!(status, 409, "{body}");
    let (status, _) = register(&server, Some(ADMIN_KEY), "127.0.0.1:9", "decode").await;
    assert_eq!(status, 200, "registering again with the same role is harmless");
    let listed: Value = serde_json::from_slice(
        &server.client.get(server.url("/admin/workers")).bearer_auth(ADMIN_KEY).send().await?.bytes().await?,
    )?;
    assert_eq!(listed["workers"][0]["role"], "decode", "{listed}");
    // Addresses that are not host:port never reach the registry.
    for bad in ["nonsense", "a:b", "evil\nlog:80", &format!("{}:80", "a".repeat(300)), "host:0"] {
        assert_eq!(register(&server, Some(ADMIN_KEY), bad, "both").await.0, 400, "{bad:?}");
    }
    server.shutdown().await?;
    // The admin key may not be a tenant's key.
    let same = AdminKey::new("sk-alice-0001-long-enough").map_err(anyhow::Error::msg)?;
    let k = ApiKeys::parse("alice:sk-alice-0001-long-enough").map_err(anyhow::Error::msg)?;
    assert!(common::cluster_gateway(GatewayConfig {
        api_keys: k,
        admin_key: Some(same),
        ..Default::default()
    })
    .is_err());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_has_a_cap() -> anyhow::Result<()> {
    let admin = AdminKey::new(ADMIN_KEY).map_err(anyhow::Error::msg)?;
    let server = cluster_gateway(GatewayConfig { admin_key: Some(admin), ..Default::default() }).await;
    let cap = tokenpath_gateway::cluster::registry::MAX_WORKERS;
    for i in 0..cap {
        // Unroutable documentation addresses: polls fail fast and nobody is contacted.
        let (status, body) =
            register(&server, Some(ADMIN_KEY), &format!("192.0.2.1:{}", 1000 + i), "both").await;
        assert_eq!(status, 200, "#{i}: {body}");
    }
    let (status, body) = register(&server, Some(ADMIN_KEY), "192.0.2.2:1", "both").await;
    assert_eq!(status, 507, "{body}");
    let listed: Value = serde_json::from_slice(
        &server.client.get(server.url("/admin/workers")).bearer_auth(ADMIN_KEY).send().await?.bytes().await?,
    )?;
    assert_eq!(listed["workers"].as_array().map(Vec::len), Some(cap));
    assert_eq!(server.client.get(server.url("/health")).send().await?.status().as_u16(), 200);
    server.shutdown().await?;
    Ok(())
}

/// One raw HTTP/1.1 request: status and body.
fn raw(port: u16, head: &str, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    write!(s, "{head}content-length: {}\r\nconnection: close\r\n\r\n{body}", body.len()).expect("write");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_gateway_refuses_what_a_browser_could_forge() -> anyhow::Result<()> {
    let server = cluster_gateway(GatewayConfig::default()).await;
    let port: u16 = server.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let reg = r#"{"addr":"127.0.0.1:9","role":"both"}"#;
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).to_string();
    let cases: [(&str, &str, &str, u16); 8] = [
        // A "simple" cross-site POST (text/plain, no preflight).
        ("POST /admin/workers", "host: 127.0.0.1\r\ncontent-type: text/plain\r\n", reg, 415),
        ("POST /admin/workers", "host: 127.0.0.1\r\n", reg, 415),
        // DNS rebinding: the page's own name in Host.
        ("POST /admin/workers", "host: evil.example:8000\r\ncontent-type: application/json\r\n", reg, 403),
        ("GET /admin/workers", "host: evil.example\r\n", "", 403),
        ("GET /metrics", "host: evil.example\r\n", "", 403),
        (
            "POST /admin/workers",
            "host: 127.0.0.1\r\norigin: https://evil.example\r\ncontent-type: application/json\r\n",
            reg,
            403,
        ),
        ("POST /v1/chat/completions", "host: localhost\r\ncontent-type: text/plain\r\n", &chat, 415),
        (
            "POST /v1/chat/completions",
            "host: localhost\r\nsec-fetch-site: cross-site\r\ncontent-type: application/json\r\n",
            &chat,
            403,
        ),
    ];
    for (line, headers, body, want) in cases {
        let (status, text) = raw(port, &format!("{line} HTTP/1.1\r\n{headers}"), body);
        assert_eq!(status, want, "{line} {headers:?}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert!(v["error"]["message"].is_string(), "an OpenAI error body: {text}");
    }
    let listed: Value = serde_json::from_slice(
        &server.client.get(server.url("/admin/workers")).send().await?.bytes().await?,
    )?;
    assert_eq!(listed["workers"].as_array().map(Vec::len), Some(0), "nothing was registered: {listed}");
    // The same requests, same-site: served.
    let json_ct = "host: localhost:1\r\norigin: http://localhost:3000\r\ncontent-type: application/json\r\n";
    assert_eq!(raw(port, &format!("POST /admin/workers HTTP/1.1\r\n{json_ct}"), reg).0, 200);
    assert_eq!(raw(port, "GET /metrics HTTP/1.1\r\nhost: [::1]:8000\r\n", "").0, 200);
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_key_a_gateway_with_tenant_keys_serves_no_admin_route() -> anyhow::Result<()> {
    let config = GatewayConfig { served_model_name: MODEL.into(), api_keys: keys(), ..Default::default() };
    let server = serve_gateway(common::cluster_gateway(config)?).await;
    for auth in [None, Some("sk-alice-0001")] {
        let (status, _) = register(&server, auth, "127.0.0.1:9", "both").await;
        assert_eq!(status, 403, "{auth:?}");
    }
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_their_own_listener_are_not_on_the_api() -> anyhow::Result<()> {
    let config = GatewayConfig { metrics_elsewhere: true, ..Default::default() };
    let engine = engine();
    let worker = tokenpath_worker::Worker::spawn(std::sync::Arc::clone(&engine), WorkerConfig::default())?;
    let gateway =
        common::local_gateway(GatewayConfig { served_model_name: MODEL.into(), ..config }, &worker, engine)?;
    let ml = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let maddr = ml.local_addr()?;
    tokio::spawn(gateway.serve_metrics(ml));
    let server = serve_gateway(gateway).await;
    assert_eq!(server.client.get(server.url("/metrics")).send().await?.status().as_u16(), 404);
    let m = server.client.get(format!("http://{maddr}/metrics")).send().await?;
    assert_eq!(m.status().as_u16(), 200);
    assert!(m.text().await?.contains("tokenpath_"));
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_credentials_is_refused_before_its_body() -> anyhow::Result<()> {
    let server =
        start(WorkerConfig::default(), GatewayConfig { api_keys: keys(), ..Default::default() }).await;
    let port: u16 = server.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    // Announces 4 MB and sends none of it: the 401 comes anyway.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: 4000000\r\n\r\n"
    )?;
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf)?;
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    server.shutdown().await?;
    Ok(())
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
async fn a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized() -> anyhow::Result<()> {
    let keys = ApiKeys::from_toml_str(
        "[[key]]\ntenant = \"a\"\nkey = \"sk-a-000000001\"\n\n[[key]]\ntenant = \"one\"\nkey = \"sk-one-0000001\"\nrequests_per_minute = 1\n",
    )
    .map_err(anyhow::Error::msg)?;
    let server = start(WorkerConfig::default(), GatewayConfig { api_keys: keys, ..Default::default() }).await;
    let word = "a".repeat(4_000_000);
    let body = |prompt: &str| json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let post = |key: &'static str, b: String| {
        server
            .client
            .post(server.url("/v1/completions"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(b)
            .send()
    };
    let before = vm_hwm_kb();
    // 32 at once, a 4 MB one-word prompt each.
    let all = futures_util::future::join_all((0..32).map(|_| post("sk-a-000000001", body(&word)))).await;
    for r in all {
        let r = r?;
        assert_eq!(r.status().as_u16(), 400);
        let v: Value = serde_json::from_slice(&r.bytes().await?)?;
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    }
    let grew_mb = vm_hwm_kb().saturating_sub(before) / 1024;
    // The bodies themselves are 32 × 4 MB in flight; the tokenizer adds nothing near its old
    // ~0.5 GB per prompt.
    assert!(grew_mb < 512, "peak RSS grew by {grew_mb} MB");
    // A long word that does fit (just under the context's bytes) is tokenized in bounded pieces.
    let fits = "b".repeat(20_000);
    let r = post("sk-a-000000001", body(&fits)).await?;
    assert!(matches!(r.status().as_u16(), 200 | 400), "{}", r.status());
    // A tenant out of requests is refused before its prompt is even parsed.
    assert_eq!(post("sk-one-0000001", body("hello")).await?.status().as_u16(), 200);
    let r = post("sk-one-0000001", body(&word)).await?;
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(server.client.get(server.url("/health")).send().await?.status().as_u16(), 200);
    server.shutdown().await?;
    Ok(())
}

/// Reads until the server closes the connection (or answers): what it sent, or an error when
/// it kept the connection open past `within` (a generous bound, not a timing assertion).
fn read_until_closed(s: &mut std::net::TcpStream, within: Duration) -> Result<String, String> {
    s.set_read_timeout(Some(within)).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(String::from_utf8_lossy(&out).into_owned()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Ok(String::from_utf8_lossy(&out).into_owned())
            }
            Err(e) => return Err(format!("still open: {e}")),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_idle_clients_are_cut_off_and_health_keeps_answering() -> anyhow::Result<()> {
    let http = tokenpath_gateway::HttpLimits {
        // Long enough that the idle connections below still hold their places when the ninth
        // arrives on a loaded machine; short enough to watch the slowloris cut off.
        header_read: Duration::from_secs(4),
        body_read: Duration::from_secs(1),
        max_connections: 8,
        ..Default::default()
    };
    let server = start(WorkerConfig::default(), GatewayConfig { http, ..Default::default() }).await;
    let port: u16 = server.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    // Blocking sockets on a thread of their own: the runtime's threads stay free to serve.
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let connect = || std::net::TcpStream::connect(("127.0.0.1", port));
        let health = || raw(port, "GET /health HTTP/1.1\r\nhost: localhost\r\n", "").0;
        // Slowloris: a request line and then nothing.
        let mut slow = connect()?;
        slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\n")?;
        assert_eq!(health(), 200);
        read_until_closed(&mut slow, Duration::from_secs(30)).map_err(anyhow::Error::msg)?;
        // A body that trickles: announced 100 bytes, 10 sent.
        let mut trickle = connect()?;
        write!(
            trickle,
            "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
             content-length: 100\r\n\r\n{{\"model\":"
        )?;
        let answer = read_until_closed(&mut trickle, Duration::from_secs(30)).map_err(anyhow::Error::msg)?;
        assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 4"), "{answer}");
        // The connection cap: 8 places. 18 connections arrive and say nothing; then each asks
        // for /health. Those holding a place answer (an open connection still gets /health);
        // the rest were closed on arrival and get nothing.
        let idle: Vec<_> = (0..18).map(|_| connect()).collect::<Result<_, _>>()?;
        std::thread::sleep(Duration::from_millis(500));
        let mut answered = 0;
        for mut c in idle {
            let _ = c.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
            let got = read_until_closed(&mut c, Duration::from_secs(30)).map_err(anyhow::Error::msg)?;
            if got.starts_with("HTTP/1.1 200") {
                answered += 1;
            } else {
                assert!(got.is_empty(), "{got}");
            }
        }
        assert!((1..=8).contains(&answered), "{answered} of 18 connections were served with 8 places");
        // Their places are free again.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while health() != 200 {
            assert!(std::time::Instant::now() < deadline, "health never came back");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    })
    .await??;
    server.shutdown().await?;
    Ok(())
}

async fn cached_tokens(server: &common::Server, key: &str, prompt: &[u32]) -> anyhow::Result<u64> {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
    let resp = server
        .client
        .post(server.url("/v1/completions"))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    anyhow::ensure!(resp.status().as_u16() == 200, "status {}", resp.status());
    let v: Value = serde_json::from_slice(&resp.bytes().await?)?;
    Ok(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cannot_hit_or_probe_another_tenants_prefix() -> anyhow::Result<()> {
    let two = || ApiKeys::parse("alice:sk-alice-0001,bob:sk-bob-00002").expect("keys");
    let prompt: Vec<u32> = (0..64).map(|i| 40 + i).collect();
    // Default with keys: per tenant.
    let server =
        start(WorkerConfig::default(), GatewayConfig { api_keys: two(), ..Default::default() }).await;
    assert_eq!(cached_tokens(&server, "sk-alice-0001", &prompt).await?, 0);
    assert!(cached_tokens(&server, "sk-alice-0001", &prompt).await? >= 48, "alice reuses her own prefix");
    assert_eq!(cached_tokens(&server, "sk-bob-00002", &prompt).await?, 0, "bob learns nothing of alice's");
    assert!(cached_tokens(&server, "sk-bob-00002", &prompt).await? >= 48, "bob reuses his own");
    server.shutdown().await?;
    // Global, as configured: shared (and this test would see the leak).
    let config = GatewayConfig {
        api_keys: two(),
        prefix_cache_scope: Some(tokenpath_gateway::PrefixScope::Global),
        ..Default::default()
    };
    let server = start(WorkerConfig::default(), config).await;
    assert_eq!(cached_tokens(&server, "sk-alice-0001", &prompt).await?, 0);
    assert!(cached_tokens(&server, "sk-bob-00002", &prompt).await? >= 48);
    server.shutdown().await?;
    Ok(())
}

/// Hostile and malformed requests, one after another against one server: each gets a 4xx with
/// an OpenAI error body (or a well-formed answer), and the server answers `/ready` after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_inputs_get_4xx_json_and_the_server_stays_ready() -> anyhow::Result<()> {
    let server = start(WorkerConfig::default(), GatewayConfig::default()).await;
    let port: u16 = server.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let deep = "[".repeat(10_000) + &"]".repeat(10_000);
    let many_msgs: Vec<Value> = (0..5000).map(|_| json!({"role": "user", "content": "x"})).collect();
    let tools =
        json!({"model": MODEL, "messages": [{"role":"user","content":"hi"}], "tools": vec![0; 200_000]});
    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        b.to_string()
    };
    let bodies: Vec<(&str, String)> = vec![
        ("not json", "{".into()),
        ("deep nesting", deep),
        ("array body", "[]".into()),
        ("null body", "null".into()),
        ("wrong model", chat(json!({"model": "other"}))),
        ("unknown field", chat(json!({"frobnicate": 1}))),
        ("max_tokens 0", chat(json!({"max_tokens": 0}))),
        ("max_tokens huge", chat(json!({"max_tokens": u64::MAX}))),
        ("negative temperature", chat(json!({"temperature": -1}))),
        (
            "overflowing temperature",
            chat(json!({})).replacen("\"max_tokens\":2", "\"max_tokens\":2,\"temperature\":1e309", 1),
        ),
        ("top_p 2", chat(json!({"top_p": 2}))),
        ("n 5", chat(json!({"n": 5}))),
        ("5 stops", chat(json!({"stop": ["a", "b", "c", "d", "e"]}))),
        ("empty stop", chat(json!({"stop": [""]}))),
        ("long stop", chat(json!({"stop": ["s".repeat(5000)]}))),
        ("stop of wrong type", chat(json!({"stop": 7}))),
        ("empty messages", json!({"model": MODEL, "messages": []}).to_string()),
        ("bad role", json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).to_string()),
        (
            "content of wrong type",
            json!({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).to_string(),
        ),
        ("5000 messages", json!({"model": MODEL, "messages": many_msgs, "max_tokens": 1}).to_string()),
        ("200k-element tools", tools.to_string()),
        ("invalid utf-8", String::from_utf8_lossy(b"{\"model\":\"\xff\xfe\"}").into_owned()),
        ("seed out of range", chat(json!({"seed": -5}))),
        ("logprobs", chat(json!({"logprobs": true, "top_logprobs": 50}))),
    ];
    for (what, body) in &bodies {
        let (status, text) = raw(
            port,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n",
            body,
        );
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let well_formed = status == 200 && v["choices"].is_array();
        assert!(
            well_formed || ((400..500).contains(&status) && v["error"]["message"].is_string()),
            "{what}: {status} {text:.300}"
        );
        assert_eq!(
            raw(port, "GET /ready HTTP/1.1\r\nhost: localhost\r\n", "").0,
            200,
            "not ready after {what}"
        );
    }
    // Completions: prompts of every wrong shape.
    for (what, prompt) in [
        ("token ids out of vocabulary", json!([99_999_999])),
        ("negative token id", json!([-1])),
        ("empty prompt list", json!([])),
        ("nested lists", json!([[1, 2], [3]])),
        ("object prompt", json!({"a": 1})),
    ] {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
        let (status, text) = raw(
            port,
            "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n",
            &body,
        );
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let well_formed = status == 200 && v["choices"].is_array();
        assert!(
            well_formed || ((400..500).contains(&status) && v["error"]["message"].is_string()),
            "{what}: {status} {text:.300}"
        );
    }
    // Malformed HTTP itself: the connection is answered or closed, and the server goes on.
    for garbage in [
        "GARBAGE\r\n\r\n",
        "POST /v1/completions HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
        "GET / HTTP/9.9\r\n\r\n",
    ] {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.write_all(garbage.as_bytes())?;
        let _ = read_until_closed(&mut s, Duration::from_secs(30));
        assert_eq!(raw(port, "GET /ready HTTP/1.1\r\nhost: localhost\r\n", "").0, 200, "{garbage:?}");
    }
    server.shutdown().await?;
    Ok(())
}
