//! A worker on the network: the server side a `tokenpath worker` process runs ([`server`]) and
//! the client side the gateway uses to reach it ([`client`]). One request per TCP connection, so
//! a closed connection IS the cancellation (gateway → worker) and the failure signal (worker →
//! gateway), with nothing to multiplex or time out by hand. Frames and messages come from the
//! protocol crate; this module only moves them.

pub mod bench;
pub mod client;
mod kv;
mod kv_frames;
pub(crate) use kv_frames::{frame_blocks, frame_sums};
mod kv_recv;
mod ring_door;
mod shm;

pub use kv::KvTransport;
/// The prefill side's door for a same-host ring (public for tests that play a prefill peer).
pub use ring_door::Door as KvDoor;
pub mod server;

use std::time::Duration;
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_protocol::cluster::{decode_control, encode_control, SamplingMsg, StatsMsg, UsageMsg};
use tokenpath_protocol::frame::{read_control_frame, write_frame, FrameKind};
use tokenpath_protocol::ProtocolError;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::{TokenUsage, WorkerStats};
use tokenpath_engine::sampling::{SamplerState, SamplingParams};
use tokenpath_protocol::cluster::SamplerPos;

/// How long a peer may stay silent on a connection that waits for it (a request's events, a KV
/// transfer's next chunk or acknowledgement) before the connection is given up: a worker sends
/// [`tokenpath_protocol::cluster::FromWorker::KeepAlive`] every [`KEEPALIVE`] while a request
/// waits, and a KV sender's chunks are one prefill step apart.
pub const PEER_IDLE: Duration = Duration::from_secs(15);
/// How often a worker says it is alive on a request connection with nothing else to send.
pub const KEEPALIVE: Duration = Duration::from_secs(5);

/// `fut`, or an error once it made no progress for [`PEER_IDLE`].
pub(crate) async fn within<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, ProtocolError>>,
) -> Result<T, ProtocolError> {
    tokio::time::timeout(PEER_IDLE, fut).await.map_err(|_| ProtocolError::Connection {
        message: format!("the peer sent nothing for {} s while {what}", PEER_IDLE.as_secs()),
    })?
}

/// Turns on TCP keepalive, so a peer whose host vanished without a reset is noticed by the
/// kernel even on a connection nobody writes to.
pub(crate) fn tcp_keepalive(s: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(s).set_tcp_keepalive(&ka) {
        tracing::debug!("cannot set TCP keepalive: {e}");
    }
}

/// Reads one control message; `Ok(None)` at a clean end of stream.
pub(crate) async fn read_control<R: AsyncRead + Unpin, T: for<'de> serde::Deserialize<'de>>(
    r: &mut R,
) -> Result<Option<T>, ProtocolError> {
    match read_control_frame(r).await? {
        None => Ok(None),
        Some(payload) => decode_control(&payload).map(Some),
    }
}

/// Opens a connection to another tokenpath process and proves (and checks) the cluster secret,
/// all within `timeout`: nothing is sent to a peer that has not proven it holds the secret.
pub(crate) async fn connect_authenticated(
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
        tokenpath_protocol::auth::connect(&mut rd, &mut wr, secret).await?;
        Ok(s)
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ProtocolError::Connection { message: format!("{addr}: connecting timed out") })?
}

/// Writes one control message.
pub(crate) async fn write_control<W: AsyncWrite + Unpin, T: serde::Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), ProtocolError> {
    write_frame(w, FrameKind::Control, &encode_control(msg)?).await
}

pub(crate) fn usage_msg(u: TokenUsage) -> UsageMsg {
    UsageMsg {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_tokens: u.cached_tokens,
    }
}

/// The worker-side usage of a message.
pub fn usage_of(u: UsageMsg) -> TokenUsage {
    TokenUsage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_tokens: u.cached_tokens,
    }
}

/// Wire form of sampling parameters.
pub fn sampling_msg(p: &SamplingParams) -> SamplingMsg {
    SamplingMsg {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        seed: p.seed,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
    }
}

pub(crate) fn sampling_params(m: &SamplingMsg) -> SamplingParams {
    SamplingParams {
        temperature: m.temperature,
        top_k: m.top_k,
        top_p: m.top_p,
        seed: m.seed,
        presence_penalty: m.presence_penalty,
        frequency_penalty: m.frequency_penalty,
    }
}

pub(crate) fn sampler_pos(s: SamplerState) -> SamplerPos {
    SamplerPos { seed: s.seed, word_pos: s.word_pos }
}

pub(crate) fn sampler_state(p: SamplerPos) -> SamplerState {
    SamplerState { seed: p.seed, word_pos: p.word_pos }
}

pub(crate) fn stats_msg(
    s: &WorkerStats,
    role: &str,
    id: &str,
    n_ctx: usize,
    block_size: usize,
    in_flight: usize,
) -> StatsMsg {
    StatsMsg {
        role: role.to_owned(),
        worker_id: id.to_owned(),
        n_ctx: n_ctx as u64,
        block_size: block_size as u64,
        in_flight: in_flight as u64,
        waiting: s.waiting as u64,
        running: s.running as u64,
        kv_blocks_used: s.kv_blocks_used as u64,
        kv_blocks_free: s.kv_blocks_free as u64,
        busy_seconds: s.busy_seconds,
        uptime_seconds: s.uptime_seconds,
        flops: s.flops,
        prompt_tokens_computed: s.prompt_tokens_computed,
        prompt_tokens_cached: s.prompt_tokens_cached,
        generated_tokens: s.generated_tokens,
        kv_fallbacks: s.kv_fallbacks,
        draining: false,
    }
}

/// A stats message as worker stats (the gateway renders remote workers like local ones).
pub fn stats_of(m: &StatsMsg) -> WorkerStats {
    WorkerStats {
        waiting: m.waiting as usize,
        running: m.running as usize,
        kv_blocks_used: m.kv_blocks_used as usize,
        kv_blocks_free: m.kv_blocks_free as usize,
        busy_seconds: m.busy_seconds,
        uptime_seconds: m.uptime_seconds,
        flops: m.flops,
        prompt_tokens_computed: m.prompt_tokens_computed,
        prompt_tokens_cached: m.prompt_tokens_cached,
        generated_tokens: m.generated_tokens,
        kv_fallbacks: m.kv_fallbacks,
        ..WorkerStats::default()
    }
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
