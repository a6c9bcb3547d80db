//! Same-host KV transfer through shared memory: a small ring the decode worker creates per
//! transfer, the prefill worker writes blocks into, and the decode worker copies out of straight
//! into its lent KV blocks. The TCP connection carries only the control messages (where each
//! chunk is, its checksum, which chunks were consumed). No kernel socket copy, no TCP stack; and
//! the ring is small enough (a few MB) to stay in cache, so each byte goes from the prefill
//! worker's export buffer to the decode worker's KV blocks through cache, not DRAM.
//!
//! Safety against the peer: the decode worker (which must never crash on a bad peer) maps only
//! the ring it created, sealed so that nobody can shrink it (a shrunk mapping would fault), and
//! bounds every offset and length from the wire against its own mapping before copying. It hashes
//! the bytes after copying them into its own blocks, so a peer that scribbles on the ring
//! meanwhile can only cause a checksum failure (and a recompute), never unchecked KV. The prefill
//! worker receives the memfd's descriptor through its door (`ring_door.rs`, `SCM_RIGHTS`; it
//! never opens a path a peer names) and maps it only after checking that it is sealed and
//! exactly the offered size. A ring is reused only for the process it was already passed to
//! (which may still have it mapped), so no prefill worker can read another's KV from it. Nobody
//! ever holds a reference into a ring, whose bytes another process may change at any moment:
//! only bounds-checked raw copies.
//!
//! Linux only (memfd seals, abstract Unix sockets); elsewhere, and whenever anything here
//! fails, the transfer goes over TCP.

use std::fs::File;
use std::io;
use tokenpath_kv::shm as sys;
use tokenpath_kv::shm::copy_unaliased as copy;

/// Ring size: a handful of in-flight chunks, small enough to stay cache-resident.
pub(crate) const RING_BYTES: usize = 8 << 20;
/// Target size of one chunk written into the ring.
pub(crate) const RING_CHUNK_TARGET_BYTES: usize = 1 << 20;

/// This host's identity for "same host": the kernel's boot id (shared by every process of this
/// boot of this machine; a peer in another pid namespace still fails to open the ring and falls
/// back to TCP).
pub(crate) fn host_id() -> Option<String> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    (!id.is_empty() && id.len() <= 64).then(|| id.to_owned())
}

fn bounds(offset: u64, len: usize, ring: usize) -> Result<usize, String> {
    let start = usize::try_from(offset).map_err(|_| "ring offset out of range".to_owned())?;
    match start.checked_add(len) {
        Some(end) if end <= ring => Ok(start),
        _ => Err(format!("ring chunk of {len} bytes at {offset} is outside the {ring}-byte ring")),
    }
}

/// The decode worker's ring: a sealed memfd it created and maps itself.
#[derive(Debug)]
pub(crate) struct OwnRing {
    file: File,
    map: memmap2::MmapRaw,
    /// The process its descriptor was passed to, once it was.
    pub(crate) shared_with: Option<u32>,
}

impl OwnRing {
    /// A new ring of `len` bytes, sealed against shrinking and growing, mapped and pre-faulted.
    pub(crate) fn create(len: usize) -> io::Result<Self> {
        let file = sys::sealed_memfd(len)?;
        let map = memmap2::MmapOptions::new().len(len).populate().map_raw(&file)?;
        Ok(Self { file, map, shared_with: None })
    }

    /// Its size.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// What the offer says, once the descriptor went through the door.
    pub(crate) fn offer(&self) -> tokenpath_protocol::cluster::RingOffer {
        tokenpath_protocol::cluster::RingOffer { len: self.map.len() as u64 }
    }

    /// The descriptor to pass.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.file.as_fd()
    }

    /// Copies `dst.len()` bytes at `offset` out of the ring (bounds from the wire checked here).
    pub(crate) fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        let start = bounds(offset, dst.len(), self.map.len())?;
        // SAFETY: `start..start + dst.len()` is inside the mapping (checked), which stays mapped
        // while `self` lives and cannot shrink (sealed); `dst` is private memory. The peer may
        // write the ring meanwhile: the bytes copied are then garbage, which the checksum over
        // `dst` (computed after this copy) rejects.
        unsafe { copy(dst.as_mut_ptr(), self.map.as_ptr().add(start), dst.len()) };
        Ok(())
    }
}

/// The prefill worker's mapping of a decode worker's ring.
#[derive(Debug)]
pub(crate) struct PeerRing {
    map: memmap2::MmapRaw,
    /// The memfd's (device, inode): unique among live files, and this mapping keeps it alive.
    key: (u64, u64),
}

/// Checks that a passed descriptor is a sealed memfd of exactly the offered size: its key.
fn check_ring(file: &File, len: u64) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    if !(1..=64 << 20).contains(&len) {
        return Err(io::Error::other(format!("a ring of {len} bytes")));
    }
    let meta = file.metadata()?;
    if meta.len() != len || !sys::sealed_against_shrinking(file)? {
        return Err(io::Error::other("the offered ring is not a sealed memfd of its size"));
    }
    Ok((meta.dev(), meta.ino()))
}

impl PeerRing {
    /// Maps a passed ring after checking it is a sealed memfd of exactly that size (what
    /// [`PeerRings::open`] does when it keeps no mapping of that memfd).
    #[cfg(test)]
    pub(crate) fn open(file: &File, len: u64) -> io::Result<Self> {
        let key = check_ring(file, len)?;
        Self::map(file, key, len as usize)
    }

    fn map(file: &File, key: (u64, u64), len: usize) -> io::Result<Self> {
        let map = memmap2::MmapOptions::new().len(len).populate().map_raw(file)?;
        Ok(Self { map, key })
    }

    /// The ring's size.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Copies `src` into the ring at `offset`.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) -> Result<(), String> {
        let start = bounds(offset as u64, src.len(), self.map.len())?;
        // SAFETY: inside the mapping (checked), which cannot shrink (its seals were checked).
        unsafe { copy(self.map.as_mut_ptr().add(start), src.as_ptr(), src.len()) };
        Ok(())
    }
}

/// Peer rings kept mapped between transfers. A decode worker lends the same few rings (its
/// pool) transfer after transfer, and mapping one afresh costs ~1.5 ms here (the kernel filling
/// 8 MB of page tables, then tearing them down). Each cached mapping pins its memfd, so a
/// decode worker's ring stays allocated while this worker keeps it here, at most
/// [`MAX_PEER_RINGS`] of them (64 MB each at most).
const MAX_PEER_RINGS: usize = 4;

enum PeerCmd {
    Take { key: (u64, u64), reply: tokio::sync::oneshot::Sender<Option<PeerRing>> },
    Give(PeerRing),
}

/// The prefill worker's mappings of decode workers' rings, owned by one task like [`RingPool`].
/// An offer is still opened and checked every time (cheap: an open and two fcntl/fstat calls);
/// only the mapping is reused, and only for the very same memfd: its (device, inode) cannot
/// name another file while a cached mapping holds this one open, and its seals cannot be
/// removed.
#[derive(Clone, Debug)]
pub(crate) struct PeerRings {
    tx: tokio::sync::mpsc::UnboundedSender<PeerCmd>,
}

impl std::fmt::Debug for PeerCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerCmd::Take { .. } => "Take",
            PeerCmd::Give(_) => "Give",
        })
    }
}

impl PeerRings {
    /// Starts the cache's task on the current runtime.
    pub(crate) fn start() -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<PeerCmd>();
        tokio::spawn(async move {
            // Least recently given back first.
            let mut kept: std::collections::VecDeque<PeerRing> = std::collections::VecDeque::new();
            while let Some(cmd) = rx.recv().await {
                match cmd {
                    PeerCmd::Take { key, reply } => {
                        let found = kept.iter().position(|r| r.key == key).and_then(|i| kept.remove(i));
                        if let Err(Some(ring)) = reply.send(found) {
                            kept.push_back(ring);
                        }
                    }
                    PeerCmd::Give(ring) => {
                        kept.retain(|r| r.key != ring.key);
                        kept.push_back(ring);
                        while kept.len() > MAX_PEER_RINGS {
                            kept.pop_front();
                        }
                    }
                }
            }
        });
        Self { tx }
    }

    /// Takes a passed ring after checking that it is a sealed memfd of exactly the offered
    /// size, reusing this memfd's mapping when one is kept, else mapping it (pre-faulted).
    pub(crate) async fn open(&self, file: File, len: u64) -> io::Result<PeerRing> {
        let key = check_ring(&file, len)?;
        let (reply, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(PeerCmd::Take { key, reply }).is_ok() {
            if let Ok(Some(ring)) = rx.await {
                if ring.len() as u64 == len {
                    return Ok(ring);
                }
            }
        }
        PeerRing::map(&file, key, len as usize)
    }

    /// Keeps a ring's mapping for a later transfer to the same decode worker.
    pub(crate) fn give(&self, ring: PeerRing) {
        let _ = self.tx.send(PeerCmd::Give(ring));
    }
}

/// Idle rings kept for the next transfers: a fresh ring costs ~8 ms here (the kernel allocating
/// and zeroing its pages), a reused one nothing.
const MAX_IDLE_RINGS: usize = 4;

enum PoolCmd {
    Take { len: usize, peer: u32, reply: tokio::sync::oneshot::Sender<Option<OwnRing>> },
    Give(OwnRing),
}

/// The decode worker's idle rings, owned by one task (handle + commands, like every piece of
/// shared state here). A ring goes back after its transfer; its old bytes are harmless, since the
/// receiver copies only chunks announced in the current transfer and checks each one's checksum.
/// A ring already passed to one process is lent again only to that process (it may keep the
/// mapping and could read whatever the next transfer puts there); the others get one never passed.
#[derive(Clone, Debug)]
pub(crate) struct RingPool {
    tx: tokio::sync::mpsc::UnboundedSender<PoolCmd>,
}

impl std::fmt::Debug for PoolCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PoolCmd::Take { .. } => "Take",
            PoolCmd::Give(_) => "Give",
        })
    }
}

impl RingPool {
    /// Starts the pool's task on the current runtime, with one ring of `warm` bytes made ahead
    /// (when given) so the first transfer does not pay for it.
    pub(crate) fn start(warm: Option<usize>) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<PoolCmd>();
        tokio::spawn(async move {
            let mut idle: Vec<OwnRing> = Vec::new();
            while let Some(cmd) = rx.recv().await {
                match cmd {
                    PoolCmd::Take { len, peer, reply } => {
                        let fits = |r: &OwnRing, to: Option<u32>| r.len() == len && r.shared_with == to;
                        let found = idle
                            .iter()
                            .position(|r| fits(r, Some(peer)))
                            .or_else(|| idle.iter().position(|r| fits(r, None)))
                            .map(|i| idle.swap_remove(i));
                        if let Err(Some(ring)) = reply.send(found) {
                            idle.push(ring);
                        }
                    }
                    PoolCmd::Give(ring) => {
                        idle.push(ring);
                        if idle.len() > MAX_IDLE_RINGS {
                            // Drop a ring passed to someone before a fresh one.
                            let i = idle.iter().position(|r| r.shared_with.is_some()).unwrap_or(0);
                            idle.swap_remove(i);
                        }
                    }
                }
            }
        });
        let pool = Self { tx };
        if let Some(len) = warm {
            let p = pool.clone();
            tokio::spawn(async move {
                if let Ok(Ok(ring)) = tokio::task::spawn_blocking(move || OwnRing::create(len)).await {
                    p.give(ring);
                }
            });
        }
        pool
    }

    /// A ring of `len` bytes for process `peer`: an idle one passed to it before or never
    /// passed, else a new one (made off the async threads).
    pub(crate) async fn take(&self, len: usize, peer: u32) -> io::Result<OwnRing> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(PoolCmd::Take { len, peer, reply }).is_ok() {
            if let Ok(Some(ring)) = rx.await {
                return Ok(ring);
            }
        }
        tokio::task::spawn_blocking(move || OwnRing::create(len)).await.map_err(io::Error::other)?
    }

    /// Puts a ring back for a later transfer.
    pub(crate) fn give(&self, ring: OwnRing) {
        let _ = self.tx.send(PoolCmd::Give(ring));
    }
}

/// Where the sender places chunks in a ring: in order, wrapping to the start when a chunk would
/// not fit before the end, never over a chunk the receiver has not consumed yet.
#[derive(Debug)]
pub(crate) struct RingSpace {
    len: usize,
    head: usize,
    in_flight: std::collections::VecDeque<(usize, usize)>,
    freed: u32,
}

impl RingSpace {
    pub(crate) fn new(len: usize) -> Self {
        Self { len, head: 0, in_flight: std::collections::VecDeque::new(), freed: 0 }
    }

    /// Where a chunk of `n` bytes goes, or `None` until the receiver frees space. `n` must fit
    /// the ring.
    pub(crate) fn place(&mut self, n: usize) -> Option<usize> {
        if n > self.len {
            return None;
        }
        let start = if self.head + n <= self.len { self.head } else { 0 };
        let clear = self.in_flight.iter().all(|&(o, l)| start + n <= o || o + l <= start);
        clear.then(|| {
            self.head = start + n;
            self.in_flight.push_back((start, n));
            start
        })
    }

    /// The receiver has consumed `chunks` chunks in all; more than were placed is a protocol error.
    pub(crate) fn free_upto(&mut self, chunks: u32) -> Result<(), String> {
        while self.freed < chunks {
            self.in_flight.pop_front().ok_or("the decode worker freed ring chunks never written")?;
            self.freed += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_space_never_overlaps_unconsumed_chunks() {
        let mut r = RingSpace::new(10);
        assert_eq!(r.place(4), Some(0));
        assert_eq!(r.place(4), Some(4));
        assert_eq!(r.place(4), None, "would wrap onto chunk 0");
        r.free_upto(1).unwrap();
        assert_eq!(r.place(4), Some(0), "wraps once chunk 0 is consumed");
        assert_eq!(r.place(3), None);
        r.free_upto(3).unwrap();
        assert_eq!(r.place(3), Some(4));
        assert!(r.free_upto(9).is_err(), "more freed than written");
        assert_eq!(RingSpace::new(10).place(11), None, "a chunk larger than the ring");
    }

    #[test]
    fn a_ring_refuses_offsets_and_lengths_outside_it() {
        let Ok(ring) = OwnRing::create(1 << 16) else { return }; // no memfd here: TCP only
        let mut buf = vec![0u8; 16];
        assert!(ring.copy_out((1 << 16) - 16, &mut buf).is_ok());
        assert!(ring.copy_out((1 << 16) - 15, &mut buf).is_err());
        assert!(ring.copy_out(u64::MAX, &mut buf).is_err());
        assert!(ring.copy_out(u64::MAX - 3, &mut buf).is_err());
        let peer = PeerRing::open(&ring.file, 1 << 16).unwrap();
        peer.copy_in(100, b"hello").unwrap();
        assert!(peer.copy_in(1 << 16, b"x").is_err());
        assert!(peer.copy_in(usize::MAX, b"x").is_err());
        let mut got = [0u8; 5];
        ring.copy_out(100, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        // Not a ring: another size, a plain file (it could shrink under the mapping).
        assert!(PeerRing::open(&ring.file, (1 << 16) + 1).is_err());
        let path = std::env::temp_dir().join(format!("tp-not-a-ring-{}", std::process::id()));
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        assert!(PeerRing::open(&f, 4096).is_err(), "a file that could shrink under the mapping");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn peer_rings_reuse_a_mapping_only_for_the_same_memfd() {
        let Ok(a) = OwnRing::create(1 << 16) else { return }; // no memfd here: TCP only
        let b = OwnRing::create(1 << 16).unwrap();
        let fd = |r: &OwnRing| r.file.try_clone().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let peers = PeerRings::start();
            let first = peers.open(fd(&a), 1 << 16).await.unwrap();
            let at = first.map.as_ptr() as usize;
            first.copy_in(0, b"kept").unwrap();
            peers.give(first);
            let again = peers.open(fd(&a), 1 << 16).await.unwrap();
            assert_eq!(again.map.as_ptr() as usize, at, "the same memfd: the kept mapping");
            let other = peers.open(fd(&b), 1 << 16).await.unwrap();
            assert_ne!(other.key, again.key, "another memfd: its own mapping");
            other.copy_in(0, b"else").unwrap();
            let (mut got_a, mut got_b) = ([0u8; 4], [0u8; 4]);
            a.copy_out(0, &mut got_a).unwrap();
            b.copy_out(0, &mut got_b).unwrap();
            assert_eq!((&got_a, &got_b), (b"kept", b"else"));
            // A ring is checked again even when a mapping is kept.
            peers.give(again);
            assert!(peers.open(fd(&a), (1 << 16) + 1).await.is_err());
        });
    }

    /// Security review L9: a ring passed to one prefill process is never lent to another.
    #[test]
    fn a_ring_passed_to_one_process_is_lent_again_only_to_it() {
        use std::os::unix::fs::MetadataExt;
        if OwnRing::create(1 << 16).is_err() {
            return; // no memfd here: TCP only
        }
        let ino = |r: &OwnRing| r.file.metadata().unwrap().ino();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let pool = RingPool::start(None);
            let mut r = pool.take(1 << 16, 100).await.unwrap();
            let first = ino(&r);
            r.shared_with = Some(100);
            pool.give(r);
            let other = pool.take(1 << 16, 200).await.unwrap();
            assert_ne!(ino(&other), first, "process 200 gets a ring process 100 never had");
            let same = pool.take(1 << 16, 100).await.unwrap();
            assert_eq!(ino(&same), first, "process 100 gets its own ring back");
        });
    }
}
