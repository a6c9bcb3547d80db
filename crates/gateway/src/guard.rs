//! Who may call what, decided in one middleware before any handler runs and before a byte of
//! the body is read (a client without credentials never makes the gateway buffer 4 MB).
//!
//! Three kinds of route:
//! - the API (`/v1/*`): a tenant key when keys are configured; the tenant travels to the handler
//!   as a [`Caller`] extension;
//! - the operator's routes (`/admin/*`, and `/metrics` unless it has its own listener): the admin
//!   key (`--admin-key`) when one is configured — a tenant key gets 403, never access; without
//!   one, only a gateway bound to loopback and without tenant keys serves them;
//! - probes (`/health`, `/ready`): always open.
//!
//! Whatever a route needs no credential for is reachable by any web page the operator's browser
//! opens (a "simple" cross-site `POST` with `Content-Type: text/plain` needs no preflight, and DNS
//! rebinding lets a page read the answers). So such routes also demand what a browser cannot
//! forge across sites: a `Host` naming loopback (when bound to loopback), no foreign `Origin` or
//! `Sec-Fetch-Site: cross-site`, and `application/json` bodies.

use crate::auth::{AuthFailure, Tenant};
use crate::error::Reject;
use crate::AppState;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use tokenpath_protocol::ApiError;

/// The API caller's tenant (`None`: the API is open), put there by [`guard`].
#[derive(Clone, Debug)]
pub(crate) struct Caller(pub(crate) Option<Tenant>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Api,
    Admin,
    Probe,
}

fn classify(path: &str, metrics_elsewhere: bool) -> Class {
    if path.starts_with("/v1/") {
        Class::Api
    } else if path.starts_with("/admin/") || path == "/admin" || (path == "/metrics" && !metrics_elsewhere) {
        Class::Admin
    } else {
        Class::Probe
    }
}

fn authentication(f: AuthFailure) -> Reject {
    Reject::new(ApiError::authentication(match f {
        AuthFailure::Missing => "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
        AuthFailure::Wrong => "Incorrect API key provided.",
    }))
}

/// The middleware (see the module docs).
pub(crate) async fn guard(State(app): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let class = classify(req.uri().path(), app.config.metrics_elsewhere);
    let auth = req.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    let outcome = match class {
        Class::Probe => Ok(None),
        Class::Api => {
            let tenant = app.config.api_keys.check(auth).map_err(authentication);
            let open = app.config.api_keys.is_empty();
            tenant
                .and_then(
                    |t| if open { same_site(&app, req.method(), req.headers()).map(|()| t) } else { Ok(t) },
                )
                .map(|t| Some(Caller(t)))
        }
        Class::Admin => admin(&app, req.method(), req.headers(), auth).map(|()| None),
    };
    match outcome {
        Ok(caller) => {
            if let Some(c) = caller {
                req.extensions_mut().insert(c);
            }
            next.run(req).await
        }
        Err(reject) => {
            app.metrics.record_status(reject.status().as_u16(), "none");
            reject.into_response()
        }
    }
}

fn admin(app: &AppState, method: &Method, headers: &HeaderMap, auth: Option<&[u8]>) -> Result<(), Reject> {
    match &app.config.admin_key {
        Some(key) => match key.check(auth) {
            Ok(()) => Ok(()),
            Err(f) => {
                if matches!(app.config.api_keys.check(auth), Ok(Some(_))) {
                    Err(Reject::new(ApiError::permission("A tenant API key cannot use the admin routes.")))
                } else {
                    Err(authentication(f))
                }
            }
        },
        // A gateway with tenant keys has chosen to authenticate: its operator routes need their
        // own credential, never none.
        None if app.is_loopback() && app.config.api_keys.is_empty() => same_site(app, method, headers),
        None => Err(Reject::new(ApiError::permission(
            "The admin routes need an admin key (--admin-key / TOKENPATH_ADMIN_KEY) on a gateway that has \
             API keys or is not bound to loopback (or serve /metrics with --metrics-listen).",
        ))),
    }
}

/// Whether `host` (a `Host` header or an origin's host, port stripped) names loopback.
fn loopback_name(host: &str) -> bool {
    let h = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => {
            host.rsplit_once(':')
                .map_or(host, |(h, p)| if p.bytes().all(|b| b.is_ascii_digit()) { h } else { host })
        }
    };
    let h = h.trim_end_matches('.').to_ascii_lowercase();
    h == "localhost"
        || h.ends_with(".localhost")
        || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn forbidden(message: &str) -> Reject {
    Reject::new(ApiError::permission(message))
}

/// The checks a browser cannot pass across sites (see the module docs).
fn same_site(app: &AppState, method: &Method, headers: &HeaderMap) -> Result<(), Reject> {
    let text = |name: header::HeaderName| headers.get(name).map(|v| v.to_str().unwrap_or("\u{fffd}"));
    if app.is_loopback() {
        let host = text(header::HOST).unwrap_or("");
        if !loopback_name(host) {
            return Err(forbidden("This server answers only requests addressed to localhost."));
        }
    }
    if let Some(origin) = text(header::ORIGIN) {
        let host = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
        if !host.is_some_and(loopback_name) {
            return Err(forbidden("Cross-origin requests are not accepted."));
        }
    }
    if text(header::HeaderName::from_static("sec-fetch-site")) == Some("cross-site") {
        return Err(forbidden("Cross-site requests are not accepted."));
    }
    if method == Method::POST {
        let json = text(header::CONTENT_TYPE).is_some_and(|ct| {
            ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
        });
        if !json {
            return Err(Reject::new(ApiError::unsupported_media_type(
                "The request body must be sent with 'Content-Type: application/json'.",
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names() {
        for h in [
            "localhost",
            "localhost:8000",
            "127.0.0.1",
            "127.0.0.1:1",
            "[::1]:80",
            "[::1]",
            "a.localhost:3",
            "LOCALHOST.",
        ] {
            assert!(loopback_name(h), "{h}");
        }
        for h in [
            "evil.example",
            "evil.example:8000",
            "127.0.0.1.evil.example",
            "localhost.evil",
            "[::2]:1",
            "",
            "10.0.0.1",
            "localhostx",
        ] {
            assert!(!loopback_name(h), "{h}");
        }
    }

    #[test]
    fn routes_are_classified_by_path() {
        assert_eq!(classify("/v1/chat/completions", false), Class::Api);
        assert_eq!(classify("/admin/workers", false), Class::Admin);
        assert_eq!(classify("/metrics", false), Class::Admin);
        assert_eq!(classify("/metrics", true), Class::Probe);
        assert_eq!(classify("/health", false), Class::Probe);
    }
}
