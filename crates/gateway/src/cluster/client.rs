//! The gateway's side of a worker connection: open a request and read its events, or poll stats.

use std::time::Duration;
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_protocol::cluster::conn::{connect_authenticated, read_control, within, write_control};
use tokenpath_protocol::cluster::{peer_message, FromWorker, GenerateMsg, RejectKind, StatsMsg, ToWorker};
use tokenpath_protocol::ProtocolError;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

fn remote(addr: &str, e: impl std::fmt::Display) -> ProtocolError {
    ProtocolError::Unavailable { message: format!("remote worker {addr}: {e}") }
}

async fn connect(addr: &str, secret: &ClusterSecret, timeout: Duration) -> Result<TcpStream, ProtocolError> {
    connect_authenticated(addr, secret, timeout).await.map_err(|e| remote(addr, e))
}

/// Asks the worker at `addr` for its stats (health checks and routing).
pub async fn stats(addr: &str, secret: &ClusterSecret, timeout: Duration) -> Result<StatsMsg, ProtocolError> {
    let work = async {
        let (mut rd, mut wr) = connect(addr, secret, timeout).await?.into_split();
        write_control(&mut wr, &ToWorker::Stats).await.map_err(|e| remote(addr, e))?;
        match read_control::<_, FromWorker>(&mut rd).await.map_err(|e| remote(addr, e))? {
            Some(FromWorker::Stats(s)) => Ok(s),
            other => Err(remote(addr, format!("expected stats, got {other:?}"))),
        }
    };
    tokio::time::timeout(timeout, work).await.map_err(|_| remote(addr, "stats timed out"))?
}

/// One request's connection to a worker. Dropping it cancels the request on the worker.
#[derive(Debug)]
pub struct RemoteRequest {
    addr: String,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
}

impl RemoteRequest {
    /// Opens a request; the worker's refusal comes back as the matching [`ProtocolError`].
    pub async fn open(
        addr: &str,
        secret: &ClusterSecret,
        msg: GenerateMsg,
        timeout: Duration,
    ) -> Result<Self, ProtocolError> {
        let (mut rd, mut wr) = connect(addr, secret, timeout).await?.into_split();
        write_control(&mut wr, &ToWorker::Generate(msg)).await.map_err(|e| remote(addr, e))?;
        let first = tokio::time::timeout(timeout, read_control::<_, FromWorker>(&mut rd))
            .await
            .map_err(|_| remote(addr, "no answer in time"))?
            .map_err(|e| remote(addr, e))?;
        match first {
            Some(FromWorker::Accepted) => Ok(Self { addr: addr.to_owned(), rd, wr }),
            Some(FromWorker::Rejected { kind, message }) => Err({
                let message = peer_message(&message);
                match kind {
                    RejectKind::Overloaded => ProtocolError::Overloaded { max: 0 },
                    RejectKind::ContextOverflow | RejectKind::Invalid => {
                        ProtocolError::InvalidRequest { param: None, message }
                    }
                    RejectKind::Unavailable => remote(addr, message),
                }
            }),
            other => Err(remote(addr, format!("expected accepted, got {other:?}"))),
        }
    }

    /// The worker's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The next event; `Ok(None)` when the worker closed the connection. Keepalives are taken
    /// here; a worker silent for [`tokenpath_protocol::cluster::conn::PEER_IDLE`] (hung, stopped, partitioned) is an error.
    pub async fn next(&mut self) -> Result<Option<FromWorker>, ProtocolError> {
        loop {
            match within("waiting for the worker", read_control(&mut self.rd)).await {
                Ok(Some(FromWorker::KeepAlive)) => continue,
                other => return other.map_err(|e| remote(&self.addr, e)),
            }
        }
    }

    /// Sends a message on the request's connection (the handoff to a decode worker).
    pub async fn send(&mut self, msg: &ToWorker) -> Result<(), ProtocolError> {
        write_control(&mut self.wr, msg).await.map_err(|e| remote(&self.addr, e))
    }
}
