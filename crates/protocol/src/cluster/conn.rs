//! The connections between tokenpath processes: connect and prove the cluster secret, read
//! and write one control message, bound every wait on a peer, keep idle sockets checked by the
//! kernel. Both sides use it — a worker's server and KV sender, and the gateway's client of its
//! workers — so it sits beside the messages it carries rather than in either.

use crate::auth::ClusterSecret;
use crate::cluster::{decode_control, encode_control};
use crate::frame::{read_control_frame, write_frame, FrameKind};
use crate::ProtocolError;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// How long a peer may stay silent on a connection that waits for it (a request's events, a KV
/// transfer's next chunk or acknowledgement) before the connection is given up: a worker sends
/// [`crate::cluster::FromWorker::KeepAlive`] every [`KEEPALIVE`] while a request
/// waits, and a KV sender's chunks are one prefill step apart.
pub const PEER_IDLE: Duration = Duration::from_secs(15);
/// How often a worker says it is alive on a request connection with nothing else to send.
pub const KEEPALIVE: Duration = Duration::from_secs(5);

/// `fut`, or an error once it made no progress for [`PEER_IDLE`].
pub async fn within<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, ProtocolError>>,
) -> Result<T, ProtocolError> {
    within_for(PEER_IDLE, what, fut).await
}

/// `fut`, or an error once it made no progress for `idle` (a wait with a longer bound of its
/// own, such as the first KV of a request still queued on its prefill worker).
pub async fn within_for<T>(
    idle: Duration,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, ProtocolError>>,
) -> Result<T, ProtocolError> {
    tokio::time::timeout(idle, fut).await.map_err(|_| ProtocolError::Connection {
        message: format!("the peer sent nothing for {} s while {what}", idle.as_secs()),
    })?
}

/// Turns on TCP keepalive, so a peer whose host vanished without a reset is noticed by the
/// kernel even on a connection nobody writes to.
pub fn tcp_keepalive(s: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(s).set_tcp_keepalive(&ka) {
        tracing::debug!("cannot set TCP keepalive: {e}");
    }
}

/// Reads one control message; `Ok(None)` at a clean end of stream.
pub async fn read_control<R: AsyncRead + Unpin, T: for<'de> serde::Deserialize<'de>>(
    r: &mut R,
) -> Result<Option<T>, ProtocolError> {
    match read_control_frame(r).await? {
        None => Ok(None),
        Some(payload) => decode_control(&payload).map(Some),
    }
}

/// Opens a connection to another tokenpath process and proves (and checks) the cluster secret,
/// all within `timeout`: nothing is sent to a peer that has not proven it holds the secret.
pub async fn connect_authenticated(
    addr: &str,
    secret: &ClusterSecret,
    timeout: Duration,
) -> Result<TcpStream, ProtocolError> {
    let work = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| ProtocolError::Connection { message: format!("{addr}: {e}") })?;
        let _ = s.set_nodelay(true);
        tcp_keepalive(&s);
        let (mut rd, mut wr) = s.split();
        crate::auth::connect(&mut rd, &mut wr, secret).await?;
        Ok(s)
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ProtocolError::Connection { message: format!("{addr}: connecting timed out") })?
}

/// Writes one control message.
pub async fn write_control<W: AsyncWrite + Unpin, T: serde::Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), ProtocolError> {
    write_frame(w, FrameKind::Control, &encode_control(msg)?).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ends of every worker connection (accepted and connected) get keepalive with these
    /// timings: a peer whose host vanished is found in ~25 s even when nobody writes.
    #[tokio::test]
    async fn worker_sockets_get_tcp_keepalive() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), l.accept());
        let (client, (accepted, _)) = (client.unwrap(), accepted.unwrap());
        for s in [&client, &accepted] {
            let r = socket2::SockRef::from(s);
            assert!(!r.keepalive().unwrap(), "off until asked");
            tcp_keepalive(s);
            assert!(r.keepalive().unwrap());
            assert_eq!(r.tcp_keepalive_time().unwrap(), Duration::from_secs(10));
            assert_eq!(r.tcp_keepalive_interval().unwrap(), Duration::from_secs(5));
            assert_eq!(r.tcp_keepalive_retries().unwrap(), 3);
        }
    }
}
