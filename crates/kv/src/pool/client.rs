//! A worker's side of the pool: blocking calls from the batcher's own thread or the pool writer's
//! (a round trip is tens of microseconds on a Unix socket), the RAM tier mapped read-only once
//! per connection, blocks to store sent over the socket, and every failure a miss. A pool that
//! cannot be reached — not started yet, its host gone — costs the worker nothing but its hits:
//! the client retries a second later, and hosts the pool itself when nobody holds it (unless it
//! only connects: [`PoolClient::connect_only`]).

use std::fs::File;
use std::io::{self, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokenpath_protocol::frame::{
    read_control_frame_sync, write_control_frame_sync, write_frame_sync, FrameHeader, FrameKind,
    FRAME_HEADER_LEN,
};
use tokenpath_protocol::pool::{
    LeasedBlock, PoolReply, PoolRequest, PoolStats, WireKey, MAX_POOL_KEYS, MAX_POOL_WRITE, POOL_VERSION,
};

use super::{slot_bytes, socket_path, PoolConfig, PoolHost};
use crate::shm::SharedSlots;
use crate::BlockHash;

/// Longest wait for the pool's answer before the connection is dropped (and the call a miss).
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait before reconnecting after a failure.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Blocks leased for reading, in key order; give it back with [`PoolClient::release`].
#[derive(Debug, Default)]
pub struct ReadLease {
    id: u64,
    /// The leased blocks.
    pub blocks: Vec<LeasedBlock>,
}

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    ram: SharedSlots,
}

/// Slots the pool gave a write lease for: `slots[i]` is where `keys[i]` goes (`None`: the pool
/// holds it already, or had no room). Send the blocks with [`PoolClient::write`], then
/// [`PoolClient::commit`] with their checksums, or [`PoolClient::abandon`] — on the connection
/// that reserved them.
#[derive(Debug)]
pub struct Reservation {
    /// The write lease.
    pub lease: u64,
    /// Per key asked for, its slot.
    pub slots: Vec<Option<u32>>,
}

/// A connection to the host's pool, reconnecting (or hosting the pool) as needed.
#[derive(Debug)]
pub struct PoolClient {
    cfg: PoolConfig,
    namespace: BlockHash,
    block_bytes: usize,
    conn: Option<Conn>,
    host: Option<PoolHost>,
    /// Whether this client hosts the pool when nobody does (see [`PoolClient::connect_only`]).
    may_host: bool,
    retry_at: Option<Instant>,
}

impl PoolClient {
    /// A client of the pool of `namespace` in `cfg.dir`; connects (or hosts it) at once.
    pub fn new(cfg: PoolConfig, namespace: BlockHash, block_bytes: usize) -> Self {
        Self::start(cfg, namespace, block_bytes, true)
    }

    /// A client that only ever connects: it never hosts the pool itself, so a thread that must
    /// not stall (the batcher's) leaves hosting — scanning an SSD slab when the host died — to
    /// another client of the process.
    pub fn connect_only(cfg: PoolConfig, namespace: BlockHash, block_bytes: usize) -> Self {
        Self::start(cfg, namespace, block_bytes, false)
    }

    fn start(cfg: PoolConfig, namespace: BlockHash, block_bytes: usize, may_host: bool) -> Self {
        let mut me = Self { cfg, namespace, block_bytes, conn: None, host: None, may_host, retry_at: None };
        me.ensure();
        me
    }

    /// Connects (or hosts) now when no connection is up and the retry delay has passed.
    pub fn reconnect(&mut self) -> bool {
        self.ensure()
    }

    /// Whether this process hosts the pool.
    pub fn hosts(&self) -> bool {
        self.host.is_some()
    }

    /// How long a lease of this pool lives.
    pub fn lease_life(&self) -> Duration {
        self.cfg.lease
    }

    /// Whether a connection is up now.
    pub fn connected(&self) -> bool {
        self.conn.is_some()
    }

    fn ensure(&mut self) -> bool {
        if self.conn.is_some() {
            return true;
        }
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return false;
        }
        let socket = socket_path(&self.cfg.dir, &self.namespace);
        let mut conn = connect(&socket, self.namespace, self.block_bytes);
        if conn.is_err() && self.host.is_none() && self.may_host {
            match PoolHost::start(&self.cfg, self.namespace, self.block_bytes) {
                Ok(Some(host)) => {
                    self.host = Some(host);
                    conn = connect(&socket, self.namespace, self.block_bytes);
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("cannot host the KV pool: {e}"),
            }
        }
        match conn {
            Ok(c) => {
                self.conn = Some(c);
                self.retry_at = None;
                true
            }
            Err(e) => {
                tracing::warn!(socket = %socket.display(), "KV pool unreachable, serving without it for now: {e}");
                self.retry_at = Some(Instant::now() + RETRY_AFTER);
                false
            }
        }
    }

    fn call(&mut self, req: &PoolRequest) -> Option<PoolReply> {
        if !self.ensure() {
            return None;
        }
        let conn = self.conn.as_mut()?;
        if let Err(e) = write_control_frame_sync(&mut conn.stream, &req.encode()) {
            tracing::warn!("KV pool connection lost: {e}");
            self.lost();
            return None;
        }
        self.answer()
    }

    /// Reads the pool's answer to what was sent.
    fn answer(&mut self) -> Option<PoolReply> {
        let conn = self.conn.as_mut()?;
        let result = read_control_frame_sync(&mut conn.stream)
            .map_err(|e| e.to_string())
            .and_then(|b| b.ok_or_else(|| "the pool closed the connection".to_owned()))
            .and_then(|b| PoolReply::decode(&b).map_err(|e| e.to_string()));
        match result {
            Ok(PoolReply::Error { message }) => {
                tracing::warn!("the KV pool refused a request: {message}");
                None
            }
            Ok(reply) => Some(reply),
            Err(e) => {
                tracing::warn!("KV pool connection lost: {e}");
                self.lost();
                None
            }
        }
    }

    fn lost(&mut self) {
        self.conn = None;
        self.retry_at = Some(Instant::now() + RETRY_AFTER);
    }

    /// Leases the longest run of held blocks from `keys[0]` (empty when none, or no pool).
    pub fn lookup(&mut self, keys: &[BlockHash]) -> ReadLease {
        let keys: Vec<WireKey> = keys.iter().take(MAX_POOL_KEYS).map(|k| WireKey(k.0)).collect();
        if keys.is_empty() {
            return ReadLease::default();
        }
        let asked = keys.len();
        match self.call(&PoolRequest::Lookup { keys }) {
            Some(PoolReply::Lease { lease, mut blocks }) if lease != 0 => {
                // Never more blocks than keys asked for, whatever the pool says.
                blocks.truncate(asked);
                ReadLease { id: lease, blocks }
            }
            _ => ReadLease::default(),
        }
    }

    /// Copies a leased block into `dst` (one block's bytes) and checks it: `false` — never use
    /// `dst` then — when the connection is gone or the bytes are not the block's.
    pub fn load(&self, block: &LeasedBlock, dst: &mut [u8]) -> bool {
        let Some(conn) = &self.conn else { return false };
        dst.len() == self.block_bytes
            && conn.ram.copy_out(block.slot, dst).is_ok()
            && super::owner::fast_check(dst) == block.check
    }

    /// [`PoolClient::load`] of many blocks at once, spread over the machine's cores (copy and
    /// check are memory-bound; a 4,096-token prefix is 94 MB): `bufs[i]` gets `blocks[i]` —
    /// straight into the worker's KV blocks, with no staging copy.
    /// Per block, whether it loaded and checked out.
    pub fn load_all<B: AsMut<[u8]> + Send>(&self, blocks: &[LeasedBlock], bufs: &mut [B]) -> Vec<bool> {
        use rayon::prelude::*;
        blocks.par_iter().zip(bufs.par_iter_mut()).map(|(b, dst)| self.load(b, dst.as_mut())).collect()
    }

    /// The RAM tier's mapping, read-only (only the owner writes the tier); exposed for tests
    /// that play a rogue client.
    pub fn slots(&self) -> Option<&SharedSlots> {
        self.conn.as_ref().map(|c| &c.ram)
    }

    /// Ends a read lease (a lease of a lost connection ended with it).
    /// `used`: the lease's blocks this client copied and whose check passed, from the first
    /// (what the pool counts as hits).
    pub fn release(&mut self, lease: ReadLease, used: usize) {
        if lease.id != 0 && self.conn.is_some() {
            let used = u32::try_from(used.min(lease.blocks.len())).unwrap_or(u32::MAX);
            let _ = self.call(&PoolRequest::Release { lease: lease.id, used });
        }
    }

    /// Stores the blocks of `keys` the pool lacks: `block(i)` gives the bytes of `keys[i]`, and
    /// is called only for the blocks the pool gave a slot. Returns how many it indexed.
    pub fn store(&mut self, keys: &[BlockHash], mut block: impl FnMut(usize) -> Vec<u8>) -> u32 {
        let Some(r) = self.reserve(keys) else { return 0 };
        let blocks: Vec<Vec<u8>> =
            r.slots.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| block(i)).collect();
        let parts: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        self.put(r.lease, &parts).unwrap_or(0)
    }

    /// Ends write lease `lease` with `blocks` (one per slot it gave, in key order): written,
    /// hashed and committed — `Some(indexed)` — or, when they could not all be written, abandoned
    /// (`None`).
    pub fn put(&mut self, lease: u64, blocks: &[&[u8]]) -> Option<u32> {
        if !self.write(lease, blocks) {
            self.abandon(lease);
            return None;
        }
        let sums: Vec<blake3::Hash> = blocks.iter().map(|b| blake3::hash(b)).collect();
        Some(self.commit(lease, &sums))
    }

    /// Asks for slots to write the blocks of `keys` into (at most [`MAX_POOL_KEYS`] of them);
    /// `None` when the pool cannot be reached or gave nothing.
    pub fn reserve(&mut self, keys: &[BlockHash]) -> Option<Reservation> {
        let wire: Vec<WireKey> = keys.iter().take(MAX_POOL_KEYS).map(|k| WireKey(k.0)).collect();
        if wire.is_empty() {
            return None;
        }
        let asked = wire.len();
        let Some(PoolReply::Reserved { lease, slots }) = self.call(&PoolRequest::Reserve { keys: wire })
        else {
            return None;
        };
        if lease == 0 {
            return None;
        }
        if self.conn.is_some() && slots.len() == asked {
            return Some(Reservation { lease, slots });
        }
        // Not an answer to this request (or the connection went): nothing is written.
        self.abandon(lease);
        None
    }

    /// Sends the blocks of write lease `lease`, one per slot it gave, in key order: the owner
    /// writes them into the slots (clients map the RAM tier read-only). `false`: not all were
    /// written (the lease is then only good to abandon).
    pub fn write(&mut self, lease: u64, blocks: &[&[u8]]) -> bool {
        // The lease lives on this connection: a new one could not write it.
        if blocks.iter().any(|b| b.len() != self.block_bytes) || self.conn.is_none() {
            return false;
        }
        for (n, chunk) in blocks.chunks(MAX_POOL_WRITE).enumerate() {
            let first = u32::try_from(n * MAX_POOL_WRITE).unwrap_or(u32::MAX);
            let count = chunk.len() as u32;
            let Some(conn) = self.conn.as_mut() else { return false };
            let sent = write_control_frame_sync(
                &mut conn.stream,
                &PoolRequest::Write { lease, first, count }.encode(),
            )
            .and_then(|()| {
                chunk.iter().try_for_each(|b| write_frame_sync(&mut conn.stream, FrameKind::KvChunk, b))
            });
            if let Err(e) = sent {
                tracing::warn!("KV pool connection lost: {e}");
                self.lost();
                return false;
            }
            if !matches!(self.answer(), Some(PoolReply::Done)) {
                return false;
            }
        }
        true
    }

    /// Ends a write lease: the blocks written into its slots, with `checksums` (one per slot
    /// given, in key order), are indexed. Returns how many were.
    fn commit(&mut self, lease: u64, checksums: &[blake3::Hash]) -> u32 {
        let checksums = checksums.iter().map(|h| WireKey(*h.as_bytes())).collect();
        match self.call(&PoolRequest::Commit { lease, checksums }) {
            Some(PoolReply::Committed { stored, .. }) => stored,
            _ => 0,
        }
    }

    /// Ends a write lease with nothing stored.
    pub fn abandon(&mut self, lease: u64) {
        if self.conn.is_some() {
            let _ = self.call(&PoolRequest::Abandon { lease });
        }
    }

    /// The pool's counters, when it answers.
    pub fn stats(&mut self) -> Option<PoolStats> {
        match self.call(&PoolRequest::Stats) {
            Some(PoolReply::Stats(s)) => Some(s),
            _ => None,
        }
    }
}

fn connect(socket: &std::path::Path, namespace: BlockHash, block_bytes: usize) -> io::Result<Conn> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(CALL_TIMEOUT))?;
    stream.set_write_timeout(Some(CALL_TIMEOUT))?;
    let hello = PoolRequest::Hello {
        version: POOL_VERSION,
        namespace: WireKey(namespace.0),
        block_bytes: block_bytes as u64,
    };
    write_control_frame_sync(&mut stream, &hello.encode()).map_err(io::Error::other)?;
    let (payload, fd) = read_with_fd(&mut stream)?;
    match PoolReply::decode(&payload).map_err(io::Error::other)? {
        PoolReply::Welcome { slots, slot_bytes: sb, map_bytes, .. } => {
            let file = fd.ok_or_else(|| io::Error::other("the pool's welcome came without its memory"))?;
            if sb != slot_bytes(block_bytes) as u64 || map_bytes != u64::from(slots) * sb {
                return Err(io::Error::other(format!(
                    "the pool's slots are {sb} bytes, blocks here {block_bytes}"
                )));
            }
            let ram = SharedSlots::open(&file, slots, sb as usize)?;
            Ok(Conn { stream, ram })
        }
        PoolReply::Error { message } => Err(io::Error::other(message)),
        other => Err(io::Error::other(format!("the pool answered hello with {other:?}"))),
    }
}

/// Reads one control frame whose first bytes may carry a descriptor (`SCM_RIGHTS`).
fn read_with_fd(stream: &mut UnixStream) -> io::Result<(Vec<u8>, Option<File>)> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let got =
        rustix::net::recvmsg(&*stream, &mut [IoSliceMut::new(&mut h)], &mut cmsg, RecvFlags::CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    if got.bytes == 0 {
        return Err(io::Error::other("the pool closed the connection"));
    }
    stream.read_exact(&mut h[got.bytes..])?;
    let header = FrameHeader::decode(&h).map_err(io::Error::other)?;
    if header.kind != FrameKind::Control {
        return Err(io::Error::other("the pool sent a frame that is not a control message"));
    }
    let mut payload = vec![0u8; header.len as usize];
    stream.read_exact(&mut payload)?;
    header.verify(&payload).map_err(io::Error::other)?;
    // One descriptor is expected; any other is closed here (dropped).
    let fd = if fds.len() == 1 { fds.pop().map(File::from) } else { None };
    Ok((payload, fd))
}
