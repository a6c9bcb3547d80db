//! The KV pool: one owner per host holds a host-RAM tier shared by every worker on the host and
//! the SSD tier behind it, and lends slots of the RAM tier to its clients under leases.
//!
//! Why this shape: the pools it learns from leak pins (hit rates that decay over hours), count
//! failed loads as hits, and lose state on restart. Here one thread owns every index and lease
//! ([`owner::Owner`], synchronous and tested without sockets); clients reach it over a Unix
//! socket in the pool's directory (checked to be the same user), get the RAM tier's memfd once,
//! and copy blocks straight between its slots and their own KV blocks — the bytes never cross
//! the socket. Every lease has a deadline and an owner connection, so a client that dies frees
//! what it held. Every block is checked by its BLAKE3 against what its writer computed, at
//! commit and again by the reader after its copy.
//!
//! Who owns the pool: the first process on the host to open it (`serve`, `worker`, or
//! `tokenpath kv-pool`) takes a lock file in the directory and hosts it on its own threads
//! ([`PoolHost`]); every other process connects. When the host goes away its clients see a
//! closed socket, serve misses meanwhile, and the next to reconnect hosts it again — the SSD
//! tier's blocks survive (the owner writes dirty blocks down when idle and on eviction).

pub mod client;
pub mod owner;
mod seen;
mod server;
mod writer;

pub use client::{PoolClient, ReadLease, Reservation};
pub use server::PoolHost;
pub use writer::{Fill, FillItem, PoolWriter, WriterCounters};

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::BlockHash;

/// How a pool is set up (the hosting process's flags; clients need only `dir`).
#[derive(Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// The pool's directory: its socket, lock and SSD slab (created if absent, mode 0700).
    pub dir: PathBuf,
    /// Bytes of the host-RAM tier.
    pub ram_bytes: u64,
    /// Bytes of the SSD tier's slab file (0: none).
    pub ssd_bytes: u64,
    /// How long a lease lives.
    pub lease: Duration,
    /// Write a block down from RAM only once seen twice (see [`owner::Owner::with_second_sighting`]).
    pub second_sighting: bool,
    /// A Valkey/Redis URL for the remote tier shared across hosts (none: no remote tier).
    pub remote: Option<String>,
    /// The secret the fleet's pools authenticate remote values with (needed with `remote`).
    pub remote_key: Option<String>,
    /// How long a block lives in the remote tier.
    pub remote_ttl: Duration,
}

impl PoolConfig {
    /// A pool in `dir` with the default sizes (512 MiB of RAM, 1 GiB of SSD, 10 s leases, no
    /// remote tier; remote blocks kept a day).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            ram_bytes: 512 << 20,
            ssd_bytes: 1 << 30,
            lease: Duration::from_secs(10),
            second_sighting: false,
            remote: None,
            remote_key: None,
            remote_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

impl std::fmt::Debug for PoolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The remote tier's URL may hold a password: never printed.
        f.debug_struct("PoolConfig")
            .field("dir", &self.dir)
            .field("ram_bytes", &self.ram_bytes)
            .field("ssd_bytes", &self.ssd_bytes)
            .field("lease", &self.lease)
            .field("second_sighting", &self.second_sighting)
            .field("remote", &self.remote.as_ref().map(|_| "<set>"))
            .field("remote_key", &self.remote_key.as_ref().map(|_| "<set>"))
            .field("remote_ttl", &self.remote_ttl)
            .finish()
    }
}

/// The file name stem of one namespace's pool in a directory (several models may share one).
fn stem(namespace: &BlockHash) -> String {
    let hex: String = namespace.0[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("pool-{hex}")
}

/// The socket a namespace's pool listens on.
pub fn socket_path(dir: &Path, namespace: &BlockHash) -> PathBuf {
    dir.join(format!("{}.sock", stem(namespace)))
}

/// Bytes from one RAM slot to the next: the block rounded up to pages.
pub fn slot_bytes(block_bytes: usize) -> usize {
    block_bytes.div_ceil(4096) * 4096
}
