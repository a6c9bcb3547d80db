//! The operator's endpoints (`/admin/*`, behind the admin key in [`crate::guard`]): the
//! cluster's workers as the router sees them and workers registering at run time; the HTTP
//! upstreams of a pool, added and removed at run time.

use crate::error::Reject;
use crate::upstream::{Added, UpstreamSpec, MAX_UPSTREAMS};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use tokenpath_protocol::cluster::WorkerRole;
use tokenpath_protocol::ApiError;

/// `GET /admin/workers`: the cluster's workers as the router sees them.
pub(crate) async fn list_workers(State(app): State<Arc<AppState>>) -> Response {
    let workers: Vec<serde_json::Value> = app
        .cluster
        .as_ref()
        .map(|c| c.registry().workers())
        .unwrap_or_default()
        .iter()
        .map(|w| {
            serde_json::json!({
                "addr": w.addr,
                "role": w.role.to_string(),
                "up": w.up,
                "in_flight": w.in_flight,
                "stats": w.stats,
                "refused": w.refused,
            })
        })
        .collect();
    ([(header::CONTENT_TYPE, "application/json")], serde_json::json!({ "workers": workers }).to_string())
        .into_response()
}

/// `POST /admin/workers` with `{"addr": "host:port", "role": "prefill|decode|both"}`: a worker
/// registering at run time. It serves once its first health poll succeeds.
pub(crate) async fn register_worker(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Registration {
        addr: String,
        role: String,
    }
    let r: Registration = match json_body(body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let role = match r.role.parse::<WorkerRole>() {
        Ok(role) => role,
        Err(e) => return Reject::new(ApiError::invalid_request(e.to_string(), None)).into_response(),
    };
    if !worker_addr(&r.addr) {
        let message = "addr must be host:port that reaches the worker (an IP address other than \
                       0.0.0.0 or ::, or a DNS name, and a port)";
        return Reject::new(ApiError::invalid_request(message, None)).into_response();
    }
    let addr = r.addr;
    let Some(cluster) = app.cluster.as_ref() else {
        return Reject::new(ApiError::invalid_request(
            "this gateway runs a local worker; start it with --prefill/--decode or --cluster to accept workers",
            None,
        ))
        .into_response();
    };
    use crate::cluster::registry::Registered;
    match cluster.registry().register(addr.clone(), role).await {
        Ok(Registered::Added | Registered::Known) => (
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::json!({ "registered": addr, "role": role.to_string() }).to_string(),
        )
            .into_response(),
        Ok(Registered::Conflict(known)) => Reject::new(ApiError::conflict(format!(
            "{addr} is registered as a {known} worker; a worker's role cannot change while the gateway runs"
        )))
        .into_response(),
        Ok(Registered::Full) => Reject::insufficient_storage(format!(
            "the gateway already knows {} workers",
            crate::cluster::registry::MAX_WORKERS
        ))
        .into_response(),
        Err(e) => Reject::from_backend(&e, "addr").into_response(),
    }
}

/// `host:port` with a numeric port and a host that is an IP address or a DNS name (letters,
/// digits, `-`, `.`), bounded in length: nothing else reaches the registry or its logs.
fn worker_addr(addr: &str) -> bool {
    if addr.len() > crate::cluster::registry::MAX_ADDR_LEN {
        return false;
    }
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        // `0.0.0.0` / `::` is a worker's bind address, not one to dial (a worker that registered
        // it without --advertise is reachable only from its own host, by accident).
        return !sa.ip().is_unspecified() && sa.port() != 0;
    }
    let Some((host, port)) = addr.rsplit_once(':') else { return false };
    port.parse::<u16>().is_ok_and(|p| p > 0)
        && !host.is_empty()
        && host.split('.').all(|l| {
            !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// A JSON body of `T` (unknown fields refused), or the 400 that says why.
fn json_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, Box<Response>> {
    body.map_err(|e| e.body_text())
        .and_then(|b| serde_json::from_slice::<T>(&b).map_err(|e| e.to_string()))
        .map_err(|message| Box::new(Reject::new(ApiError::invalid_request(message, None)).into_response()))
}

fn no_pool() -> Response {
    Reject::new(ApiError::invalid_request(
        "this gateway does not front HTTP upstreams; start it with --upstream or [[upstream]] tables to accept them",
        None,
    ))
    .into_response()
}

fn json_ok(v: serde_json::Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// `GET /admin/upstreams`: the pool's upstreams (health, ejection, failures, legs in flight).
pub(crate) async fn list_upstreams(State(app): State<Arc<AppState>>) -> Response {
    let Some(pool) = app.upstreams.as_ref() else { return no_pool() };
    json_ok(serde_json::json!({ "upstreams": pool.upstreams().await }))
}

/// `POST /admin/upstreams` with `{"url", "kind", "role", "model", "bootstrap_port", "api_key"}`
/// (kind default `openai`, role default `both`): an upstream added at run time. It serves once
/// its health probe says yes.
pub(crate) async fn register_upstream(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Registration {
        url: String,
        #[serde(default)]
        kind: Option<String>,
        #[serde(default)]
        role: Option<String>,
        #[serde(default)]
        model: Option<String>,
        #[serde(default)]
        bootstrap_port: Option<u16>,
        #[serde(default)]
        api_key: Option<String>,
        #[serde(default)]
        kv_pool: Option<String>,
    }
    let r: Registration = match json_body(body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let Some(pool) = app.upstreams.as_ref() else { return no_pool() };
    let spec = match UpstreamSpec::from_parts(
        r.url,
        r.kind.as_deref(),
        r.role.as_deref(),
        r.model,
        r.bootstrap_port,
        r.api_key,
    )
    .and_then(|s| s.on_kv_pool(r.kv_pool))
    {
        Ok(spec) => spec,
        Err(e) => return Reject::from_backend(&e, "url").into_response(),
    };
    match pool.add(spec).await {
        Ok(Added::Added | Added::Known) => json_ok(serde_json::json!({ "registered": true })),
        Ok(Added::Conflict(why)) => Reject::new(ApiError::conflict(why)).into_response(),
        Ok(Added::Full) => {
            Reject::insufficient_storage(format!("the gateway already knows {MAX_UPSTREAMS} upstreams"))
                .into_response()
        }
        Err(e) => Reject::from_backend(&e, "url").into_response(),
    }
}

/// `DELETE /admin/upstreams` with `{"url": ...}`: the upstream takes no new requests (those in
/// flight finish).
pub(crate) async fn remove_upstream(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Removal {
        url: String,
    }
    let r: Removal = match json_body(body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let Some(pool) = app.upstreams.as_ref() else { return no_pool() };
    match pool.remove(&r.url).await {
        Ok(true) => json_ok(serde_json::json!({ "removed": true })),
        Ok(false) => Reject::new(ApiError::invalid_request(
            format!("no upstream at {:?}", tokenpath_protocol::cluster::peer_message(&r.url)),
            Some("url".into()),
        ))
        .into_response(),
        Err(e) => Reject::from_backend(&e, "url").into_response(),
    }
}
