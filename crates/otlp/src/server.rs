//! One port, both transports: `POST /v1/traces` (OTLP/HTTP, protobuf or JSON, optionally
//! gzip) on HTTP/1.1, `TraceService/Export` (OTLP/gRPC) on HTTP/2 with prior knowledge. Every
//! export is authenticated (when a token is set), bounded in size before and after inflation,
//! and timed out; the statuses each transport answers with are chosen in [`reply`] alone, as
//! OTLP's specification asks (the OpenAI API's statuses are the gateway's, invariant 9).

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use prost::Message;
use tokio::sync::oneshot;

use crate::decode::{decode_json, decode_protobuf, inflate_gzip, MAX_INFLATED};
use crate::grpc::{self, Code};
use crate::store::{SpanStore, StoreLimits};
use crate::OtlpError;

/// OTLP/HTTP's trace path.
pub const HTTP_TRACES_PATH: &str = "/v1/traces";
/// OTLP/gRPC's one method.
pub const GRPC_EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// How the receiver listens and what it accepts.
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    /// Where to listen (loopback unless the engines are elsewhere).
    pub listen: SocketAddr,
    /// When set, every export must carry `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Largest export body, before inflation.
    pub max_body: usize,
    /// Longest one export may take to arrive and be taken in.
    pub timeout: Duration,
    /// The span store's bounds.
    pub limits: StoreLimits,
}

impl ReceiverConfig {
    /// Defaults for `listen`: no token, 8 MiB bodies, 10 s per export.
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            token: None,
            max_body: 8 << 20,
            timeout: Duration::from_secs(10),
            limits: StoreLimits::default(),
        }
    }

    /// The same, requiring `token` (when set) on every export.
    pub fn with_token(self, token: Option<String>) -> Self {
        Self { token, ..self }
    }
}

/// A running receiver; dropping it stops the server.
#[derive(Debug)]
pub struct Receiver {
    /// The bound address (the port the OS chose for `:0`).
    pub addr: SocketAddr,
    /// The spans received.
    pub store: SpanStore,
    stop: Option<oneshot::Sender<()>>,
}

#[derive(Clone)]
struct App {
    store: SpanStore,
    token: Option<blake3::Hash>,
    max_body: usize,
    timeout: Duration,
}

impl Receiver {
    /// Binds and serves on the current runtime.
    pub async fn start(cfg: ReceiverConfig) -> Result<Self, OtlpError> {
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|source| OtlpError::Bind { addr: cfg.listen, source })?;
        let addr = listener.local_addr().map_err(|source| OtlpError::Bind { addr: cfg.listen, source })?;
        let store = SpanStore::start(cfg.limits);
        let app = App {
            store: store.clone(),
            token: cfg.token.as_deref().map(|t| blake3::hash(t.as_bytes())),
            max_body: cfg.max_body,
            timeout: cfg.timeout,
        };
        let router = Router::new()
            .route(HTTP_TRACES_PATH, post(http_export))
            .route(GRPC_EXPORT_PATH, post(grpc_export))
            .fallback(|headers: HeaderMap| async move {
                reply(
                    transport_of(&headers),
                    Err(OtlpError::Unsupported("path (only /v1/traces and TraceService/Export)".into())),
                )
            })
            // Bounded and timed out in the handlers, so a gRPC exporter hears a `grpc-status`.
            .layer(DefaultBodyLimit::disable())
            .with_state(app);
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let serve = axum::serve(listener, router).with_graceful_shutdown(async {
                let _ = stopped.await;
            });
            if let Err(e) = serve.await {
                tracing::warn!("OTLP receiver stopped: {e}");
            }
        });
        tracing::info!("OTLP receiver on {addr} (http {HTTP_TRACES_PATH}, grpc)");
        Ok(Self { addr, store, stop: Some(stop) })
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Transport {
    Http,
    HttpJson,
    Grpc,
}

/// Why an export was refused, before it was decoded.
enum Refused {
    Unauthenticated,
    Otlp(OtlpError),
}

impl From<OtlpError> for Refused {
    fn from(e: OtlpError) -> Self {
        Self::Otlp(e)
    }
}

fn authorized(app: &App, headers: &HeaderMap) -> bool {
    let Some(want) = app.token else { return true };
    let offered =
        headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    // blake3::Hash compares in constant time.
    offered.is_some_and(|t| blake3::hash(t.as_bytes()) == want)
}

/// The body, at most `max_body` bytes: a longer one is `TooLarge`, a broken one `Read`.
async fn body_bytes(app: &App, body: Body) -> Result<bytes::Bytes, OtlpError> {
    use http_body_util::BodyExt as _;
    match http_body_util::Limited::new(body, app.max_body).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(OtlpError::TooLarge { got: app.max_body + 1, limit: app.max_body })
        }
        Err(e) => Err(OtlpError::Read(e.to_string())),
    }
}

/// What the exporter speaks, from its content type (for an answer it can read).
fn transport_of(headers: &HeaderMap) -> Transport {
    let ctype = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    if ctype.starts_with("application/grpc") {
        Transport::Grpc
    } else if ctype.starts_with("application/json") {
        Transport::HttpJson
    } else {
        Transport::Http
    }
}

/// `work`, or a timeout after the receiver's bound.
async fn timed<F: std::future::Future<Output = Result<(), Refused>>>(
    app: &App,
    work: F,
) -> Result<(), Refused> {
    tokio::time::timeout(app.timeout, work).await.unwrap_or(Err(OtlpError::Timeout(app.timeout).into()))
}

async fn http_export(State(app): State<App>, headers: HeaderMap, body: Body) -> Response {
    let ctype = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    let transport = if ctype.starts_with("application/json") { Transport::HttpJson } else { Transport::Http };
    let result = timed(&app, async {
        if !authorized(&app, &headers) {
            return Err(Refused::Unauthenticated);
        }
        if transport == Transport::Http && !ctype.starts_with("application/x-protobuf") {
            return Err(OtlpError::Unsupported(format!("content type {ctype:?}")).into());
        }
        let raw = body_bytes(&app, body).await?;
        let raw = match headers.get("content-encoding").and_then(|v| v.to_str().ok()) {
            None | Some("identity") => raw.to_vec(),
            Some("gzip") => inflate_gzip(&raw, MAX_INFLATED)?,
            Some(other) => return Err(OtlpError::Unsupported(format!("content encoding {other:?}")).into()),
        };
        let spans =
            if transport == Transport::HttpJson { decode_json(&raw)? } else { decode_protobuf(&raw)? };
        app.store.add(spans)?;
        Ok(())
    })
    .await;
    answer(transport, result)
}

async fn grpc_export(State(app): State<App>, headers: HeaderMap, body: Body) -> Response {
    let result = timed(&app, async {
        if !headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|c| c.starts_with("application/grpc"))
        {
            return Err(OtlpError::Unsupported("content type (gRPC needs application/grpc)".into()).into());
        }
        if !authorized(&app, &headers) {
            return Err(Refused::Unauthenticated);
        }
        let raw = body_bytes(&app, body).await?;
        let (compressed, msg) = grpc::unframe(&raw)?;
        let inflated;
        let msg = if compressed {
            match headers.get("grpc-encoding").and_then(|v| v.to_str().ok()) {
                Some("gzip") => {
                    inflated = inflate_gzip(msg, MAX_INFLATED)?;
                    &inflated[..]
                }
                other => return Err(OtlpError::Unsupported(format!("grpc-encoding {other:?}")).into()),
            }
        } else {
            msg
        };
        app.store.add(decode_protobuf(msg)?)?;
        Ok(())
    })
    .await;
    answer(Transport::Grpc, result)
}

fn answer(transport: Transport, result: Result<(), Refused>) -> Response {
    match result {
        Ok(()) => reply(transport, Ok(())),
        Err(Refused::Otlp(e)) => reply(transport, Err(e)),
        Err(Refused::Unauthenticated) => {
            if transport == Transport::Grpc {
                grpc::error(Code::Unauthenticated, "missing or wrong bearer token")
            } else {
                plain(
                    StatusCode::UNAUTHORIZED,
                    "application/json",
                    b"{\"error\":\"missing or wrong bearer token\"}".to_vec(),
                )
            }
        }
    }
}

/// Every status this receiver answers with.
fn reply(transport: Transport, result: Result<(), OtlpError>) -> Response {
    let e = match result {
        Ok(()) => {
            let empty = ExportTraceServiceResponse::default();
            return match transport {
                Transport::Grpc => grpc::ok(&empty.encode_to_vec()),
                Transport::Http => plain(StatusCode::OK, "application/x-protobuf", empty.encode_to_vec()),
                Transport::HttpJson => plain(StatusCode::OK, "application/json", b"{}".to_vec()),
            };
        }
        Err(e) => e,
    };
    tracing::debug!("OTLP export refused: {e}");
    let message = e.to_string();
    let (status, code) = match e {
        OtlpError::Decode(_) => (StatusCode::BAD_REQUEST, Code::InvalidArgument),
        OtlpError::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, Code::ResourceExhausted),
        OtlpError::Read(_) => (StatusCode::BAD_REQUEST, Code::DataLoss),
        OtlpError::Timeout(_) => (StatusCode::REQUEST_TIMEOUT, Code::DeadlineExceeded),
        OtlpError::Unsupported(_) => (StatusCode::UNSUPPORTED_MEDIA_TYPE, Code::Unimplemented),
        OtlpError::Bind { .. } | OtlpError::Stopped => (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable),
    };
    match transport {
        Transport::Grpc => grpc::error(code, &message),
        Transport::Http | Transport::HttpJson => {
            let body = serde_json::json!({ "error": message }).to_string().into_bytes();
            plain(status, "application/json", body)
        }
    }
}

fn plain(status: StatusCode, ctype: &'static str, body: Vec<u8>) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", HeaderValue::from_static(ctype));
    r
}
