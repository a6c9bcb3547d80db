//! A worker on the network: the server side a `tokenpath worker` process runs ([`server`]); the
//! gateway's client of it is in the gateway crate. One request per TCP connection, so
//! a closed connection IS the cancellation (gateway → worker) and the failure signal (worker →
//! gateway), with nothing to multiplex or time out by hand. Frames and messages come from the
//! protocol crate; this module only moves them.

pub mod bench;
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

pub(crate) use tokenpath_protocol::cluster::conn::{
    connect_authenticated, read_control, tcp_keepalive, within, write_control,
};
pub use tokenpath_protocol::cluster::conn::{KEEPALIVE, PEER_IDLE};

use crate::WorkerStats;
use tokenpath_protocol::cluster::StatsMsg;

/// This worker's stats message.
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
        stats: s.clone(),
        draining: false,
        model: None,
    }
}
