//! The pool's host: a lock file that makes one process per host its owner, a Unix socket in the
//! pool's directory, a thread per client connection, and one owner thread that holds
//! [`Owner`] and does everything that touches the index, the leases or the SSD tier. Plain
//! threads, no runtime: the clients are a handful of workers, and the owner's SSD reads and
//! writes are blocking anyway. When idle the owner ends expired leases and writes dirty blocks
//! down to SSD; on shutdown it writes all of them.

use std::fs::File;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokenpath_protocol::frame::{
    read_control_frame_sync, read_frame_sync, write_control_frame_sync, FrameHeader, FrameKind,
};
use tokenpath_protocol::pool::{LeasedBlock, PoolReply, PoolRequest, WireKey, POOL_VERSION};

use super::owner::{ClientId, LeaseId, Owner};
use super::{slot_bytes, socket_path, stem, PoolConfig};
use crate::remote::RemoteStore;
use crate::shm::SharedSlots;
use crate::slab::{Slab, SlabGeometry, PAGE};
use crate::store::BlockStore;
use crate::{BlockHash, KvError};

/// Most client connections at once (a host's workers, and a margin).
const MAX_CLIENTS: usize = 256;
/// How long the owner waits for a request before doing its idle work.
const IDLE_TICK: Duration = Duration::from_millis(20);
/// Dirty blocks written down per idle turn.
const FLUSH_BATCH: usize = 4;
/// Longest a written-down block waits for `fsync` (the owner syncs after a burst, at most this
/// often, and when it stops).
const SYNC_EVERY: Duration = Duration::from_secs(1);
/// Longest wait for a new connection's hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// A client that stops reading its replies is cut off after this.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

enum Command {
    Request {
        client: ClientId,
        req: PoolRequest,
        reply: mpsc::Sender<PoolReply>,
    },
    /// One block of a write lease, to be written into its slot by the owner.
    Write {
        client: ClientId,
        lease: u64,
        index: usize,
        bytes: Vec<u8>,
        reply: mpsc::Sender<PoolReply>,
    },
    Gone(ClientId),
    Shutdown,
}

/// A running pool owned by this process; dropping it stops the pool (dirty blocks written down
/// first) and removes its socket.
#[derive(Debug)]
pub struct PoolHost {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    commands: mpsc::Sender<Command>,
    owner: Option<JoinHandle<()>>,
    acceptor: Option<JoinHandle<()>>,
    _lock: File,
}

fn io_err(path: &Path, source: io::Error) -> KvError {
    KvError::Io { path: path.to_owned(), source }
}

/// Takes the directory's lock for `namespace` without waiting; `None` when another live process
/// holds it (the lock dies with its process, so a crashed host never blocks the next).
fn try_lock(dir: &Path, namespace: &BlockHash) -> Result<Option<File>, KvError> {
    let path = dir.join(format!("{}.lock", stem(namespace)));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io_err(&path, e))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(Some(file)),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
        Err(e) => Err(io_err(&path, e.into())),
    }
}

/// Creates the pool's directory readable by this user only (its socket is the pool's door).
pub(super) fn make_dir(dir: &Path) -> Result<(), KvError> {
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| io_err(dir, e))?;
    }
    Ok(())
}

impl PoolHost {
    /// Hosts the pool of `namespace` in `cfg.dir` for blocks of `block_bytes`, unless another
    /// process already does (`Ok(None)`).
    pub fn start(
        cfg: &PoolConfig,
        namespace: BlockHash,
        block_bytes: usize,
    ) -> Result<Option<Self>, KvError> {
        make_dir(&cfg.dir)?;
        let Some(lock) = try_lock(&cfg.dir, &namespace)? else { return Ok(None) };
        let slot = slot_bytes(block_bytes);
        let slots = u32::try_from(cfg.ram_bytes / slot as u64).unwrap_or(u32::MAX);
        if slots == 0 {
            return Err(KvError::SlabGeometry(format!(
                "{} bytes of RAM hold no {slot}-byte block",
                cfg.ram_bytes
            )));
        }
        let (memfd, ram) = SharedSlots::create(slots, slot).map_err(|e| io_err(&cfg.dir, e))?;
        let mut lower: Vec<Box<dyn BlockStore>> = Vec::new();
        let ssd = open_ssd(cfg, namespace, block_bytes);
        let ssd_failed = ssd.is_err();
        if let Ok(Some(ssd)) = ssd {
            lower.push(Box::new(ssd));
        }
        if let Some(url) = &cfg.remote {
            let secret = cfg.remote_key.as_deref().unwrap_or_default();
            match RemoteStore::open(url, secret, namespace, block_bytes, cfg.remote_ttl) {
                Ok(r) => {
                    tracing::info!(server = ?r, "KV pool remote tier connected");
                    lower.push(Box::new(r));
                }
                Err(e) => {
                    tracing::warn!("the KV pool's remote tier cannot be used ({e}); running without it")
                }
            }
        }
        let mut owner = Owner::new(ram, block_bytes, lower, cfg.lease);
        if ssd_failed {
            owner.ssd_degraded();
        }
        if cfg.second_sighting {
            owner = owner.with_second_sighting();
        }
        let socket = socket_path(&cfg.dir, &namespace);
        owner.set_id(pool_id(&socket));
        let _ = std::fs::remove_file(&socket); // a dead host's (we hold the lock)
        let listener = UnixListener::bind(&socket).map_err(|e| io_err(&socket, e))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| io_err(&socket, e))?;
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let hello = Hello {
            namespace,
            block_bytes: block_bytes as u64,
            welcome: PoolReply::Welcome {
                slots,
                slot_bytes: slot as u64,
                map_bytes: slots as u64 * slot as u64,
                lease_ms: cfg.lease.as_millis() as u64,
            },
            memfd: Arc::new(memfd),
        };
        let owner = std::thread::Builder::new()
            .name("kv-pool-owner".into())
            .spawn(move || run_owner(owner, rx))
            .map_err(|e| io_err(&cfg.dir, e))?;
        let acceptor = {
            let (stop, tx) = (stop.clone(), tx.clone());
            std::thread::Builder::new()
                .name("kv-pool-accept".into())
                .spawn(move || accept(listener, stop, tx, Arc::new(hello)))
                .map_err(|e| io_err(&cfg.dir, e))?
        };
        tracing::info!(socket = %socket.display(), ram_slots = slots, "KV pool hosted here");
        Ok(Some(Self {
            socket,
            stop,
            commands: tx,
            owner: Some(owner),
            acceptor: Some(acceptor),
            _lock: lock,
        }))
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for PoolHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the acceptor out of `accept`.
        let _ = UnixStream::connect(&self.socket);
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        if let Some(t) = self.owner.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The pool's identity: this boot of this host, and its socket's absolute path.
fn pool_id(socket: &Path) -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let path = std::fs::canonicalize(socket.parent().unwrap_or(socket))
        .map(|d| d.join(socket.file_name().unwrap_or_default()))
        .unwrap_or_else(|_| socket.to_owned());
    let id = format!("{}:{}", boot.trim(), path.display());
    id.chars().take(tokenpath_protocol::pool::MAX_POOL_ID).collect()
}

/// The SSD tier (`Ok(None)`: none configured); `Err` when one was asked for and cannot be used
/// (logged here: the pool runs on RAM and its stats say so).
fn open_ssd(cfg: &PoolConfig, namespace: BlockHash, block_bytes: usize) -> Result<Option<Slab>, ()> {
    let Ok(payload_bytes) = u32::try_from(block_bytes) else { return Ok(None) };
    let slot = SlabGeometry { slots: 1, payload_bytes }.slot_bytes();
    let slots = u32::try_from(cfg.ssd_bytes.saturating_sub(PAGE) / slot).unwrap_or(u32::MAX);
    if slots == 0 {
        return Ok(None);
    }
    let path = cfg.dir.join(format!("{}.slab", stem(&namespace)));
    match Slab::open(&path, SlabGeometry { slots, payload_bytes }, namespace) {
        Ok((slab, report)) => {
            tracing::info!(
                path = %path.display(), blocks = report.blocks, torn = report.torn, foreign = report.foreign,
                "KV pool SSD tier opened"
            );
            Ok(Some(slab))
        }
        Err(e) => {
            tracing::warn!("the KV pool's SSD tier cannot be used ({e}); running on host RAM only");
            Err(())
        }
    }
}

fn run_owner(mut owner: Owner, rx: mpsc::Receiver<Command>) {
    let mut synced = Instant::now();
    let mut unsynced = false;
    let syncing = Arc::new(AtomicBool::new(false));
    loop {
        // Dirty blocks are written down between requests, a few at a time, so a lookup never
        // waits behind more than a few block writes and a crash loses only the newest blocks.
        let next = if owner.dirty() > 0 {
            match rx.try_recv() {
                Ok(c) => Ok(c),
                Err(mpsc::TryRecvError::Empty) => Err(mpsc::RecvTimeoutError::Timeout),
                Err(mpsc::TryRecvError::Disconnected) => Err(mpsc::RecvTimeoutError::Disconnected),
            }
        } else {
            rx.recv_timeout(IDLE_TICK)
        };
        let cmd = match next {
            Ok(c) => c,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                owner.expire(Instant::now());
                unsynced |= owner.flush(FLUSH_BATCH) > 0;
                // Durable against power loss too, once a burst is written (a killed process
                // loses nothing the kernel already has).
                if unsynced
                    && owner.dirty() == 0
                    && synced.elapsed() >= SYNC_EVERY
                    && !syncing.swap(true, Ordering::SeqCst)
                {
                    // On a thread of its own (one at a time): a lookup must not wait behind an
                    // `fsync`.
                    let files = owner.files_for_sync();
                    let done = syncing.clone();
                    let spawned = std::thread::Builder::new().name("kv-pool-sync".into()).spawn(move || {
                        for f in files {
                            if let Err(e) = f.sync_data() {
                                tracing::warn!("KV pool SSD sync failed: {e}");
                            }
                        }
                        done.store(false, Ordering::SeqCst);
                    });
                    if spawned.is_err() {
                        syncing.store(false, Ordering::SeqCst);
                    }
                    (synced, unsynced) = (Instant::now(), false);
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let now = Instant::now();
        owner.expire(now);
        match cmd {
            Command::Request { client, req, reply } => {
                let _ = reply.send(answer(&mut owner, client, req, now));
            }
            Command::Write { client, lease, index, bytes, reply } => {
                let r = match owner.write(client, LeaseId(lease), index, &bytes) {
                    Ok(()) => PoolReply::Done,
                    Err(e) => PoolReply::Error { message: e.to_string() },
                };
                let _ = reply.send(r);
            }
            Command::Gone(client) => owner.drop_client(client),
            Command::Shutdown => break,
        }
    }
    let n = owner.dirty();
    owner.flush(usize::MAX);
    owner.sync();
    tracing::debug!(written = n, "KV pool stopped");
}

fn keys(w: &[WireKey]) -> Vec<BlockHash> {
    w.iter().map(|k| BlockHash(k.0)).collect()
}

fn answer(owner: &mut Owner, client: ClientId, req: PoolRequest, now: Instant) -> PoolReply {
    let refuse = |e: super::owner::OwnerError| PoolReply::Error { message: e.to_string() };
    match req {
        PoolRequest::Hello { .. } => PoolReply::Error { message: "hello twice".into() },
        PoolRequest::Lookup { keys: k } => match owner.lookup(client, &keys(&k), now) {
            Some((lease, got)) => PoolReply::Lease {
                lease: lease.0,
                blocks: got
                    .into_iter()
                    .map(|b| LeasedBlock { slot: b.slot, check: b.check, tier: b.tier })
                    .collect(),
            },
            None => PoolReply::Lease { lease: 0, blocks: Vec::new() },
        },
        PoolRequest::Reserve { keys: k } => match owner.reserve(client, &keys(&k), now) {
            Some((lease, slots)) => PoolReply::Reserved { lease: lease.0, slots },
            None => PoolReply::Reserved { lease: 0, slots: vec![None; k.len()] },
        },
        PoolRequest::Commit { lease, checksums } => {
            let sums: Vec<[u8; 32]> = checksums.iter().map(|c| c.0).collect();
            match owner.commit(client, LeaseId(lease), &sums) {
                Ok((stored, failed)) => PoolReply::Committed { stored, failed },
                Err(e) => refuse(e),
            }
        }
        PoolRequest::Release { lease, used } => match owner.release(client, LeaseId(lease), used) {
            Ok(()) => PoolReply::Done,
            Err(e) => refuse(e),
        },
        PoolRequest::Abandon { lease } => match owner.release(client, LeaseId(lease), 0) {
            Ok(()) => PoolReply::Done,
            Err(e) => refuse(e),
        },
        PoolRequest::Stats => PoolReply::Stats(owner.stats(now)),
        // Its blocks come as frames of their own (`serve_client`).
        PoolRequest::Write { .. } => PoolReply::Error { message: "a write without its blocks".into() },
    }
}

/// What a client's `Hello` must match, and what it gets back.
struct Hello {
    namespace: BlockHash,
    block_bytes: u64,
    welcome: PoolReply,
    memfd: Arc<File>,
}

fn accept(listener: UnixListener, stop: Arc<AtomicBool>, tx: mpsc::Sender<Command>, hello: Arc<Hello>) {
    let clients = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut next = 1u64;
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors, say: wait a moment rather than spin.
                tracing::warn!("KV pool accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if let Err(e) = same_user(&stream) {
            tracing::warn!("KV pool refused a connection: {e}");
            continue;
        }
        if clients.load(Ordering::SeqCst) >= MAX_CLIENTS {
            tracing::warn!("KV pool refused a connection: {MAX_CLIENTS} clients already");
            continue;
        }
        let client = ClientId(next);
        next += 1;
        let (tx, hello, clients, clients_after) =
            (tx.clone(), hello.clone(), clients.clone(), clients.clone());
        clients.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new().name("kv-pool-client".into()).spawn(move || {
            if let Err(e) = serve_client(stream, client, &tx, &hello) {
                tracing::debug!(client = client.0, "KV pool client ended: {e}");
            }
            let _ = tx.send(Command::Gone(client));
            clients.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            tracing::warn!("KV pool could not start a client thread");
            clients_after.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn same_user(stream: &UnixStream) -> io::Result<()> {
    let cred = rustix::net::sockopt::socket_peercred(stream)?;
    let me = rustix::process::geteuid();
    if cred.uid != me {
        return Err(io::Error::other(format!("peer runs as uid {}, not {}", cred.uid.as_raw(), me.as_raw())));
    }
    Ok(())
}

fn serve_client(
    mut stream: UnixStream,
    client: ClientId,
    tx: &mpsc::Sender<Command>,
    hello: &Hello,
) -> io::Result<()> {
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    // A connection that says nothing holds a client place for at most this long.
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let first = read_control_frame_sync(&mut stream).map_err(io::Error::other)?;
    stream.set_read_timeout(None)?;
    let first = first.ok_or_else(|| io::Error::other("closed before hello"))?;
    match PoolRequest::decode(&first).map_err(io::Error::other)? {
        PoolRequest::Hello { version, namespace, block_bytes }
            if version == POOL_VERSION
                && namespace.0 == hello.namespace.0
                && block_bytes == hello.block_bytes =>
        {
            send_with_fd(&stream, &hello.welcome.encode(), &hello.memfd)?;
        }
        PoolRequest::Hello { version, block_bytes, .. } => {
            let message = format!(
                "this pool speaks version {POOL_VERSION} for blocks of {} bytes of its own namespace; \
                 the client: version {version}, {block_bytes}-byte blocks",
                hello.block_bytes
            );
            let _ = write_control_frame_sync(&mut stream, &PoolReply::Error { message }.encode());
            return Err(io::Error::other("hello refused"));
        }
        _ => return Err(io::Error::other("the first message was not hello")),
    }
    let (reply_tx, reply_rx) = mpsc::channel();
    while let Some(bytes) = read_control_frame_sync(&mut stream).map_err(io::Error::other)? {
        let reply = match PoolRequest::decode(&bytes) {
            Ok(PoolRequest::Write { lease, first, count }) => {
                write_blocks(&mut stream, client, tx, hello.block_bytes, (lease, first, count))?
            }
            Ok(req) => {
                tx.send(Command::Request { client, req, reply: reply_tx.clone() })
                    .map_err(|_| io::Error::other("the pool stopped"))?;
                reply_rx.recv().map_err(|_| io::Error::other("the pool stopped"))?
            }
            Err(e) => PoolReply::Error { message: e.to_string() },
        };
        write_control_frame_sync(&mut stream, &reply.encode()).map_err(io::Error::other)?;
    }
    Ok(())
}

/// Reads a write's `count` blocks (KV-chunk frames, each exactly one block) and has the owner
/// write each into its slot; the answer is the first refusal, or `Done`. A frame that is not one
/// block ends the connection (the stream is out of step).
fn write_blocks(
    stream: &mut UnixStream,
    client: ClientId,
    tx: &mpsc::Sender<Command>,
    block_bytes: u64,
    (lease, first, count): (u64, u32, u32),
) -> io::Result<PoolReply> {
    let (reply_tx, reply_rx) = mpsc::channel();
    let mut answer = PoolReply::Done;
    for i in 0..count {
        let bytes = read_frame_sync(stream, FrameKind::KvChunk)
            .map_err(io::Error::other)?
            .ok_or_else(|| io::Error::other("closed inside a write"))?;
        if bytes.len() as u64 != block_bytes {
            return Err(io::Error::other(format!("a {}-byte block in a pool of {block_bytes}", bytes.len())));
        }
        let index = first as usize + i as usize;
        tx.send(Command::Write { client, lease, index, bytes, reply: reply_tx.clone() })
            .map_err(|_| io::Error::other("the pool stopped"))?;
        let r = reply_rx.recv().map_err(|_| io::Error::other("the pool stopped"))?;
        if matches!(answer, PoolReply::Done) && !matches!(r, PoolReply::Done) {
            answer = r;
        }
    }
    Ok(answer)
}

/// Sends one control frame with `fd` attached to its first bytes (`SCM_RIGHTS`).
fn send_with_fd(mut stream: &UnixStream, payload: &[u8], fd: &File) -> io::Result<()> {
    use std::io::Write;
    let header = FrameHeader::for_payload(FrameKind::Control, payload).map_err(io::Error::other)?.encode();
    let mut frame = header.to_vec();
    frame.extend_from_slice(payload);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds = [fd.as_fd()];
    cmsg.push(SendAncillaryMessage::ScmRights(&fds));
    let n = rustix::net::sendmsg(stream, &[IoSlice::new(&frame)], &mut cmsg, SendFlags::NOSIGNAL)?;
    stream.write_all(&frame[n..])
}
