//! The KV pool's SSD tier: one preallocated file of fixed slots, each a header page and a
//! payload of one KV block, indexed in memory and rebuilt from the headers on open.
//!
//! Why this shape: a slot per block with a fixed size needs no allocator on disk and no
//! compaction, and a block of the default model (368,640 bytes = 90 pages) plus a 4 KiB header
//! keeps every slot page-aligned for direct I/O later. Correctness never depends on write
//! order or on `fsync`: a header names its key, the namespace it was written under (model,
//! KV layout, numerics, tenant scope — [`BlockHash::namespace`]), a sequence number and the
//! BLAKE3 of its payload, and is itself checksummed. A slot torn by a crash (new payload under
//! an old header, a half-written header) fails one of the checksums, so it is dropped at open
//! or at the load that finds it — a miss that is recomputed, never a hit. A block written under
//! other weights or numerics is never indexed. [`Slab::sync`] makes what was written durable;
//! without it a crash loses recent blocks, which a cache may.
//!
//! Not thread-safe by design: the pool's owning task holds the slab (`&mut self` everywhere).

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{BlockHash, KvError};

/// Bytes of a header page (the file's and each slot's).
pub const PAGE: u64 = 4096;

const FILE_MAGIC: &[u8; 8] = b"TPKVSLAB";
const SLOT_MAGIC: &[u8; 8] = b"TPKVSLT1";
const VERSION: u32 = 1;
/// Bytes of a slot header that its checksum covers (the checksum follows them).
const HEADER_BODY: usize = 116;
/// Bytes of an encoded header (its body and the body's BLAKE3).
pub(crate) const HEADER_BYTES: usize = HEADER_BODY + 32;

/// A slab's shape: how many slots, and the payload bytes each holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabGeometry {
    /// Slots in the file.
    pub slots: u32,
    /// Bytes of one block's payload (every block of a model has the same size).
    pub payload_bytes: u32,
}

impl SlabGeometry {
    /// Bytes from one slot to the next: the header page and the payload rounded up to pages.
    pub fn slot_bytes(&self) -> u64 {
        PAGE + u64::from(self.payload_bytes).div_ceil(PAGE) * PAGE
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> u64 {
        PAGE + u64::from(self.slots) * self.slot_bytes()
    }

    fn offset(&self, slot: u32) -> u64 {
        PAGE + u64::from(slot) * self.slot_bytes()
    }
}

/// What opening found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Blocks indexed from the slot headers.
    pub blocks: usize,
    /// Slots whose header failed its checksum (torn or never written) — free.
    pub torn: usize,
    /// Valid blocks written under another namespace — dropped, their slots free.
    pub foreign: usize,
}

/// Counters since open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlabStats {
    /// Loads that returned a verified block.
    pub hits: u64,
    /// Loads of a key not held.
    pub misses: u64,
    /// Loads of a held key whose slot failed verification (counted apart from misses, and the
    /// block dropped): never served.
    pub failed_loads: u64,
    /// Blocks pushed out to make room.
    pub evictions: u64,
    /// Payload bytes written.
    pub bytes_written: u64,
    /// Payload bytes read back by verified loads.
    pub bytes_read: u64,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    slot: u32,
    /// Recency: the tick of its last store or load (the eviction order's key).
    tick: u64,
}

/// The SSD tier's file and its in-memory index.
#[derive(Debug)]
pub struct Slab {
    path: PathBuf,
    file: File,
    geometry: SlabGeometry,
    namespace: BlockHash,
    index: HashMap<BlockHash, Entry>,
    /// Blocks by recency, oldest first.
    order: BTreeMap<u64, BlockHash>,
    free: Vec<u32>,
    tick: u64,
    seq: u64,
    stats: SlabStats,
}

/// The environment variable of the crash test's fault: `N` aborts the process after the `N`-th
/// slot payload it writes and before that slot's header (a crash mid-write, at a known point).
/// Testing only (`cli/tests/kv_pool.rs`); unset, it costs one load of a cached value per write.
pub const FAULT_ABORT_AT_ENV: &str = "TOKENPATH_FAULT_SLAB_ABORT_AT";

fn crash_point() {
    use std::sync::atomic::{AtomicU64, Ordering};
    static AT: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    static WRITTEN: AtomicU64 = AtomicU64::new(0);
    let at = AT.get_or_init(|| std::env::var(FAULT_ABORT_AT_ENV).ok().and_then(|v| v.parse().ok()));
    if let Some(at) = *at {
        if WRITTEN.fetch_add(1, Ordering::Relaxed) + 1 >= at {
            tracing::error!("{FAULT_ABORT_AT_ENV}: aborting between a slot's payload and its header");
            std::process::abort();
        }
    }
}

/// Reserves the file's blocks on the device up front (`fallocate`), so a full disk shows when
/// the slab is made — the pool then runs on RAM and says so — never as a failed write later. A
/// filesystem without `fallocate` gets a sparse file instead (and a failed write is handled as
/// one: the tier is taken out).
fn preallocate(file: &File, bytes: u64) -> std::io::Result<()> {
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, bytes) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::OPNOTSUPP) => {
            tracing::warn!("this filesystem cannot preallocate the KV pool's slab: a sparse file instead");
            file.set_len(bytes)
        }
        Err(e) => Err(e.into()),
    }
}

impl Slab {
    /// Opens the slab at `path` for blocks of `namespace`, creating and preallocating it when
    /// absent; an existing file must have this geometry. The index is rebuilt from the slot
    /// headers: torn slots and other namespaces' blocks are dropped.
    pub fn open(
        path: &Path,
        geometry: SlabGeometry,
        namespace: BlockHash,
    ) -> Result<(Self, OpenReport), KvError> {
        if geometry.slots == 0 || geometry.payload_bytes == 0 {
            return Err(KvError::SlabGeometry(format!("{geometry:?} holds nothing")));
        }
        let io = |e| KvError::Io { path: path.to_path_buf(), source: e };
        let file =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let head = file_header(&geometry);
        if len == 0 {
            preallocate(&file, geometry.file_bytes()).map_err(io)?;
            file.write_all_at(&head, 0).map_err(io)?;
        } else {
            let mut found = vec![0u8; head.len()];
            let read = file.read_exact_at(&mut found, 0);
            if read.is_err() || found != head || len > geometry.file_bytes() {
                return Err(KvError::SlabGeometry(format!(
                    "{} was made for another geometry than {geometry:?} (or is not a slab)",
                    path.display()
                )));
            }
            if len < geometry.file_bytes() {
                // Ours, cut short (a copy interrupted, a full disk): grown back; the scan keeps
                // the slots whose headers survived, and a payload that was cut fails its check.
                tracing::warn!(path = %path.display(), bytes = len, "the KV pool's slab file was cut short; keeping what is whole");
                preallocate(&file, geometry.file_bytes()).map_err(io)?;
            }
        }
        let mut slab = Self {
            path: path.to_path_buf(),
            file,
            geometry,
            namespace,
            index: HashMap::new(),
            order: BTreeMap::new(),
            free: Vec::new(),
            tick: 0,
            seq: 0,
            stats: SlabStats::default(),
        };
        let report = slab.scan()?;
        Ok((slab, report))
    }

    /// Rebuilds the index from every slot header (newest sequence wins a key held twice).
    fn scan(&mut self) -> Result<OpenReport, KvError> {
        let mut report = OpenReport::default();
        let mut best: HashMap<BlockHash, (u64, u32)> = HashMap::new();
        let mut page = vec![0u8; HEADER_BODY + 32];
        for slot in 0..self.geometry.slots {
            self.file.read_exact_at(&mut page, self.geometry.offset(slot)).map_err(|e| self.io(e))?;
            match Header::decode(&page) {
                Some(h) if h.namespace == self.namespace && h.payload_len == self.geometry.payload_bytes => {
                    self.seq = self.seq.max(h.seq);
                    if let Some((seq, old)) = best.insert(h.key, (h.seq, slot)) {
                        // Keep the newer copy; the older slot is free.
                        if seq > h.seq {
                            best.insert(h.key, (seq, old));
                            self.free.push(slot);
                        } else {
                            self.free.push(old);
                        }
                    }
                }
                Some(_) => {
                    report.foreign += 1;
                    self.free.push(slot);
                }
                None => {
                    report.torn += 1;
                    self.free.push(slot);
                }
            }
        }
        // Oldest written first, so recency starts as write order.
        let mut held: Vec<(u64, u32, BlockHash)> =
            best.into_iter().map(|(k, (seq, slot))| (seq, slot, k)).collect();
        held.sort_unstable();
        for (_, slot, key) in held {
            self.touch(key, slot);
        }
        report.blocks = self.index.len();
        // Lowest slots first when taking free ones (pop from the end).
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        Ok(report)
    }

    /// Stores `payload` as `key`'s block, evicting the least recently used block when full.
    /// Returns the key evicted, if any.
    pub fn put(&mut self, key: BlockHash, payload: &[u8]) -> Result<Option<BlockHash>, KvError> {
        if payload.len() != self.geometry.payload_bytes as usize {
            return Err(KvError::SlabGeometry(format!(
                "a {}-byte block for {}-byte slots",
                payload.len(),
                self.geometry.payload_bytes
            )));
        }
        let mut evicted = None;
        let slot = match self.index.get(&key) {
            // Rewritten in place: the new header's higher sequence number supersedes nothing
            // else, and a crash mid-write leaves a slot that fails its checksum.
            Some(e) => e.slot,
            None => match self.free.pop() {
                Some(s) => s,
                None => {
                    let (_, old) =
                        self.order.pop_first().ok_or_else(|| KvError::SlabGeometry("no slots".into()))?;
                    let e = self.index.remove(&old).expect("ordered keys are indexed");
                    self.stats.evictions += 1;
                    evicted = Some(old);
                    e.slot
                }
            },
        };
        if let Some(e) = self.index.remove(&key) {
            self.order.remove(&e.tick);
        }
        self.seq += 1;
        let header = Header {
            seq: self.seq,
            key,
            namespace: self.namespace,
            payload_len: self.geometry.payload_bytes,
            checksum: *blake3::hash(payload).as_bytes(),
        };
        let at = self.geometry.offset(slot);
        // Payload first, then the header that vouches for it.
        if let Err(e) = self.file.write_all_at(payload, at + PAGE).and_then(|()| {
            crash_point();
            self.file.write_all_at(&header.encode(), at)
        }) {
            // The slot's state is unknown: never indexed, and free for the next write.
            self.free.push(slot);
            return Err(self.io(e));
        }
        self.stats.bytes_written += payload.len() as u64;
        self.touch(key, slot);
        Ok(evicted)
    }

    /// `key`'s block, verified against its header; `Ok(None)` when not held or when the slot
    /// fails verification (then dropped and counted in [`SlabStats::failed_loads`]).
    pub fn get(&mut self, key: &BlockHash) -> Result<Option<Vec<u8>>, KvError> {
        let mut payload = vec![0u8; self.geometry.payload_bytes as usize];
        Ok(self.get_into(key, &mut payload)?.map(|_| payload))
    }

    /// [`Slab::get`] into `dst` (one payload's bytes, reused by the caller: no allocation per
    /// load), returning the payload's verified BLAKE3. `dst` holds garbage unless `Some`.
    pub fn get_into(&mut self, key: &BlockHash, dst: &mut [u8]) -> Result<Option<[u8; 32]>, KvError> {
        let Some(e) = self.index.get(key).copied() else {
            self.stats.misses += 1;
            return Ok(None);
        };
        if dst.len() != self.geometry.payload_bytes as usize {
            return Err(KvError::SlabGeometry(format!(
                "a {}-byte buffer for {}-byte blocks",
                dst.len(),
                self.geometry.payload_bytes
            )));
        }
        let at = self.geometry.offset(e.slot);
        let mut page = [0u8; HEADER_BODY + 32];
        let read =
            self.file.read_exact_at(&mut page, at).and_then(|()| self.file.read_exact_at(dst, at + PAGE));
        let checksum = read.is_ok().then(|| Header::decode(&page)).flatten().filter(|h| {
            h.key == *key
                && h.namespace == self.namespace
                && h.payload_len == self.geometry.payload_bytes
                && h.checksum == *blake3::hash(dst).as_bytes()
        });
        let Some(header) = checksum else {
            // Cleared (best effort) so a reopen does not index it again; dropped either way.
            let _ = self.file.write_all_at(&[0u8; HEADER_BODY + 32], at);
            self.drop_entry(key);
            self.stats.failed_loads += 1;
            if let Err(err) = read {
                return Err(self.io(err));
            }
            return Ok(None);
        };
        self.stats.hits += 1;
        self.stats.bytes_read += dst.len() as u64;
        self.order.remove(&e.tick);
        self.touch(*key, e.slot);
        Ok(Some(header.checksum))
    }

    /// Whether `key` is held (not verified: a load may still fail).
    pub fn contains(&self, key: &BlockHash) -> bool {
        self.index.contains_key(key)
    }

    /// Forgets `key`: its header is cleared (a reopen does not bring it back) and its slot is
    /// free. `false` when it was not held.
    pub fn remove(&mut self, key: &BlockHash) -> Result<bool, KvError> {
        let Some(e) = self.index.get(key).copied() else { return Ok(false) };
        self.file
            .write_all_at(&[0u8; HEADER_BODY + 32], self.geometry.offset(e.slot))
            .map_err(|e| self.io(e))?;
        self.drop_entry(key);
        Ok(true)
    }

    /// Makes every write so far durable.
    pub fn sync(&self) -> Result<(), KvError> {
        self.file.sync_data().map_err(|e| self.io(e))
    }

    /// A second descriptor of the file, for an `fsync` on another thread (an `fsync` of a slab
    /// with many dirty pages takes tens of milliseconds; the pool's owner must not wait on it).
    pub fn file_for_sync(&self) -> Option<File> {
        self.file.try_clone().ok()
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Slots in the file.
    pub fn capacity(&self) -> usize {
        self.geometry.slots as usize
    }

    /// Counters since open.
    pub fn stats(&self) -> SlabStats {
        self.stats
    }

    fn touch(&mut self, key: BlockHash, slot: u32) {
        self.tick += 1;
        self.index.insert(key, Entry { slot, tick: self.tick });
        self.order.insert(self.tick, key);
    }

    fn drop_entry(&mut self, key: &BlockHash) {
        if let Some(e) = self.index.remove(key) {
            self.order.remove(&e.tick);
            self.free.push(e.slot);
        }
    }

    fn io(&self, e: std::io::Error) -> KvError {
        KvError::Io { path: self.path.clone(), source: e }
    }
}

/// The file's first page: magic, version and geometry.
fn file_header(g: &SlabGeometry) -> Vec<u8> {
    let mut h = Vec::with_capacity(32);
    h.extend_from_slice(FILE_MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&g.slots.to_le_bytes());
    h.extend_from_slice(&g.payload_bytes.to_le_bytes());
    h.extend_from_slice(&g.slot_bytes().to_le_bytes());
    h
}

/// A slot header: `magic, seq, key, namespace, payload_len, checksum`, then the BLAKE3 of
/// those bytes.
#[derive(Debug, PartialEq)]
pub(crate) struct Header {
    pub(crate) seq: u64,
    pub(crate) key: BlockHash,
    pub(crate) namespace: BlockHash,
    pub(crate) payload_len: u32,
    pub(crate) checksum: [u8; 32],
}

impl Header {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_BODY + 32);
        b.extend_from_slice(SLOT_MAGIC);
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.key.0);
        b.extend_from_slice(&self.namespace.0);
        b.extend_from_slice(&self.payload_len.to_le_bytes());
        b.extend_from_slice(&self.checksum);
        debug_assert_eq!(b.len(), HEADER_BODY);
        let sum = blake3::hash(&b);
        b.extend_from_slice(sum.as_bytes());
        b
    }

    /// `None` unless `b` starts with a whole, checksummed slot header.
    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..HEADER_BODY + 32)?;
        if &b[..8] != SLOT_MAGIC || blake3::hash(&b[..HEADER_BODY]).as_bytes() != &b[HEADER_BODY..] {
            return None;
        }
        let arr = |r: std::ops::Range<usize>| -> [u8; 32] { b[r].try_into().expect("32 bytes") };
        Some(Self {
            seq: u64::from_le_bytes(b[8..16].try_into().ok()?),
            key: BlockHash(arr(16..48)),
            namespace: BlockHash(arr(48..80)),
            payload_len: u32::from_le_bytes(b[80..84].try_into().ok()?),
            checksum: arr(84..116),
        })
    }
}

#[cfg(test)]
#[path = "slab_tests.rs"]
mod tests;
