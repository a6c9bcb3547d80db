//! The gateway's accept loop: HTTP/1 connections under limits `axum::serve` cannot set.
//!
//! `axum::serve` builds hyper's connection without a timer, which silently turns hyper's header
//! timeout off, and accepts every connection: a slowloris client (one header byte a minute) or
//! a few thousand idle sockets held the gateway's file descriptors until it stopped accepting.
//! Here every connection gets:
//! - a header deadline ([`HttpLimits::header_read`]) that also bounds how long a keep-alive
//!   connection may sit idle between requests (hyper starts it whenever it waits for a head);
//! - a body deadline ([`HttpLimits::body_read`]) for a request body that trickles in;
//! - a place under a cap ([`HttpLimits::max_connections`]): past it, new connections are
//!   closed at once, so the ones being served (and `/health`) keep answering;
//! - a write deadline ([`HttpLimits::write_stall`], `stall.rs`): a client that takes no bytes
//!   for that long is cut off and its request cancelled.
//!
//! An `accept()` error (EMFILE, ECONNABORTED, ...) is logged and retried after a short pause,
//! never fatal. Draining stops accepting and lets the open connections finish (hyper's graceful
//! shutdown: idle keep-alive connections close, running requests complete).

mod stall;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Limits of the HTTP listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Longest wait for a request's headers, counted from when the connection is ready for one
    /// (so also the longest a keep-alive connection stays idle).
    pub header_read: Duration,
    /// Longest a request's body may take to arrive.
    pub body_read: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest a response may wait for the client to take bytes before the connection is cut.
    pub write_stall: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(20),
            body_read: Duration::from_secs(60),
            max_connections: 1024,
            write_stall: Duration::from_secs(30),
        }
    }
}

/// Serves `router` on `listener` until `drain` resolves, then waits for the open connections
/// (the caller bounds that wait).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    drain: impl Future<Output = ()>,
) -> GracefulShutdown {
    let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(limits.body_read));
    let graceful = GracefulShutdown::new();
    let places = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(drain);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut drain => break,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors, or a connection reset before accept: keep serving the
                // connections already open and try again shortly.
                tracing::warn!("accept failed, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(place) = Arc::clone(&places).try_acquire_owned() else {
            tracing::debug!(%peer, "connection refused: at the connection cap");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read).keep_alive(true);
        let stream = stall::WriteDeadline::new(stream, limits.write_stall);
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
            drop(place);
        });
    }
    graceful
}
