//! The pool owner's state: the host-RAM tier's slots and index, the SSD tier behind it, and every
//! lease. Synchronous and clock-free (the caller passes `now`), so every rule here is tested
//! without a socket; [`super::server`] runs it on one thread and feeds it its clients' requests.
//!
//! The rules that keep hit rates from decaying (the recurring failure of the pools this copies):
//! a slot is pinned only by an open lease; every lease has a deadline and an owner, and ends on
//! release, on its deadline, or when its client goes away — so a worker killed mid-load pins
//! nothing a moment later. A block is indexed only after its checksum was checked against the
//! slot's bytes, and a lookup hands out a check of the slot's bytes so the reader checks its copy
//! too. The write path (reserve, write, commit) is in `owner/write.rs`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokenpath_protocol::pool::{PoolStats, PoolTier};

mod write;

pub use write::fast_check;

use super::seen::SeenOnce;
use crate::shm::SharedSlots;
use crate::store::BlockStore;
use crate::BlockHash;

/// Most blocks one lookup reads up from the stores below RAM (4,096 tokens of 16-token blocks).
pub const MAX_READ_UP: usize = 256;

/// A client connection's id (one per worker connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientId(pub u64);

/// A lease's id (0 is never one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(pub u64);

#[derive(Clone, Copy, Debug)]
enum Slot {
    Free,
    /// Reserved for a write lease.
    Writing,
    Held {
        key: BlockHash,
        checksum: [u8; 32],
        /// XXH3-64 of the bytes this owner wrote into the slot (what a reader checks its copy
        /// against: only the owner writes slots).
        check: u64,
        /// Open read leases on it.
        pins: u32,
        /// Not yet written down to the SSD tier.
        dirty: bool,
        /// Worth writing down: always, or under the second-sighting filter once it was seen a
        /// second time (a hit, or offered again after it left RAM).
        sighted: bool,
        /// Recency (its key in `lru` while unpinned).
        tick: u64,
    },
}

#[derive(Debug)]
enum LeaseKind {
    /// Slots, and the tier each block was found in (counted as a hit once the client says it
    /// used it).
    Read(Vec<(u32, PoolTier)>),
    Write(Vec<(u32, BlockHash)>),
}

#[derive(Debug)]
struct Lease {
    client: ClientId,
    started: Instant,
    deadline: Instant,
    kind: LeaseKind,
}

/// One leased block: its slot, the checksum its bytes must have, where it was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leased {
    /// Slot in the RAM tier.
    pub slot: u32,
    /// XXH3-64 of the bytes in the slot, as this owner wrote them.
    pub check: u64,
    /// RAM, or read up from SSD for this lookup.
    pub tier: PoolTier,
}

/// Why a request was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum OwnerError {
    /// No such lease, or not this client's, or not of that kind.
    NoLease,
    /// A commit's checksums do not match its reserved slots.
    BadCommit(String),
}

impl std::fmt::Display for OwnerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoLease => write!(f, "no such lease of this client (ended by its deadline?)"),
            Self::BadCommit(m) => write!(f, "bad commit: {m}"),
        }
    }
}

/// The owner's state.
#[derive(Debug)]
pub struct Owner {
    ram: SharedSlots,
    slots: Vec<Slot>,
    index: HashMap<BlockHash, u32>,
    /// Unpinned held slots by recency, oldest first.
    lru: BTreeMap<u64, u32>,
    free: Vec<u32>,
    /// Keys with a write lease out (a second writer of the same key gets no slot).
    writing: HashMap<BlockHash, LeaseId>,
    leases: HashMap<LeaseId, Lease>,
    /// Keys committed but not yet written down, oldest first.
    dirty: VecDeque<BlockHash>,
    next_lease: u64,
    tick: u64,
    /// The stores below RAM, in the order a block is looked for (SSD, then remote).
    lower: Vec<Box<dyn BlockStore>>,
    lease_for: Duration,
    /// Under the second-sighting filter, the keys seen once (bounded, oldest forgotten first);
    /// `None`: every block is written down.
    seen_once: Option<SeenOnce>,
    stats: PoolStats,
    buf: Vec<u8>,
}

impl Owner {
    /// An owner of `ram` (blocks of `block_bytes` each) with an optional SSD tier behind it.
    pub fn new(
        ram: SharedSlots,
        block_bytes: usize,
        lower: Vec<Box<dyn BlockStore>>,
        lease_for: Duration,
    ) -> Self {
        let n = ram.slots();
        Self {
            ram,
            slots: vec![Slot::Free; n as usize],
            index: HashMap::new(),
            lru: BTreeMap::new(),
            free: (0..n).rev().collect(),
            writing: HashMap::new(),
            leases: HashMap::new(),
            dirty: VecDeque::new(),
            next_lease: 1,
            tick: 0,
            stats: PoolStats {
                ram_slots: n,
                remote: lower.iter().any(|s| s.tier() == PoolTier::Remote),
                ..PoolStats::default()
            },
            lower,
            lease_for,
            seen_once: None,
            buf: vec![0; block_bytes],
        }
    }

    /// Turns the second-sighting filter on: a block offered for the first time is held in RAM
    /// but written down only once it is seen again (a hit, or offered again after it left RAM),
    /// so blocks nobody reuses never cost an SSD write. Remembers up to four times the pool's
    /// slots (RAM and below) of keys seen once.
    pub fn with_second_sighting(mut self) -> Self {
        let below: usize = self.lower.iter().map(|s| s.capacity()).sum();
        self.seen_once = Some(SeenOnce::new(4 * (self.slots.len() + below)));
        self.stats.second_sighting = true;
        self
    }

    /// The SSD tier asked for could not be opened: the pool runs on RAM and its stats say so.
    pub fn ssd_degraded(&mut self) {
        self.stats.ssd_degraded = true;
    }

    /// Names the pool (what [`PoolStats::id`] reports).
    pub fn set_id(&mut self, id: String) {
        self.stats.id = id;
    }

    /// How long a lease lives.
    pub fn lease_for(&self) -> Duration {
        self.lease_for
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn open_lease(&mut self, client: ClientId, now: Instant, kind: LeaseKind) -> LeaseId {
        let id = LeaseId(self.next_lease);
        self.next_lease += 1;
        self.leases.insert(id, Lease { client, started: now, deadline: now + self.lease_for, kind });
        id
    }

    /// Leases the longest run of held blocks from `keys[0]` on, reading SSD-tier blocks up into
    /// RAM as it goes. `None` when the first key is not held.
    pub fn lookup(
        &mut self,
        client: ClientId,
        keys: &[BlockHash],
        now: Instant,
    ) -> Option<(LeaseId, Vec<Leased>)> {
        let mut got: Vec<Leased> = Vec::new();
        let mut read_up = 0;
        for key in keys {
            let found = match self.index.get(key).copied() {
                Some(slot) => Some((slot, PoolTier::Host)),
                // One lookup reads at most MAX_READ_UP blocks up: the owner serves every client
                // of the host, none may hold it for long.
                None if read_up < MAX_READ_UP => {
                    read_up += 1;
                    self.read_up(key)
                }
                None => None,
            };
            let Some((slot, tier)) = found else { break };
            self.sighted_again(slot);
            let Slot::Held { check, pins, tick, .. } = &mut self.slots[slot as usize] else { break };
            if *pins == 0 {
                self.lru.remove(tick);
            }
            *pins += 1;
            got.push(Leased { slot, check: *check, tier });
        }
        if got.is_empty() {
            self.stats.misses += 1;
            return None;
        }
        let slots = got.iter().map(|b| (b.slot, b.tier)).collect();
        Some((self.open_lease(client, now, LeaseKind::Read(slots)), got))
    }

    /// `key` from the first store below RAM that has it into a RAM slot (checked by the store),
    /// or `None`.
    fn read_up(&mut self, key: &BlockHash) -> Option<(u32, PoolTier)> {
        if !self.lower.iter().any(|s| s.may_hold(key)) {
            return None;
        }
        // Taking a slot may write a dirty block down and take a failed store out of `lower`:
        // the stores are walked only after it.
        let slot = self.take_slot()?;
        let mut found = None;
        for i in 0..self.lower.len() {
            if !self.lower[i].may_hold(key) {
                continue;
            }
            let store = &mut self.lower[i];
            let failed_before = store.failed_loads();
            let got = store.get_into(key, &mut self.buf);
            self.stats.failed += store.failed_loads().saturating_sub(failed_before);
            match got {
                Ok(Some(sum)) => {
                    found = Some((sum, store.tier()));
                    break;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("KV pool {:?} read failed: {e}", store.tier()),
            }
        }
        // The store verified the bytes against `checksum`; they go into RAM as they are.
        let Some((checksum, tier)) = found.filter(|_| self.ram.copy_in(slot, &self.buf).is_ok()) else {
            self.release_slot(slot);
            return None;
        };
        let tick = self.next_tick();
        // Read up from a remote tier: not on this host's SSD yet.
        let dirty = tier == PoolTier::Remote && self.lower.iter().any(|s| s.tier() == PoolTier::Ssd);
        let check = fast_check(&self.buf);
        self.slots[slot as usize] =
            Slot::Held { key: *key, checksum, check, pins: 0, dirty, sighted: true, tick };
        self.lru.insert(tick, slot);
        self.index.insert(*key, slot);
        if dirty {
            self.dirty.push_back(*key);
        }
        Some((slot, tier))
    }

    /// A held block seen a second time (a hit, or offered again): worth writing down now.
    fn sighted_again(&mut self, slot: u32) {
        if let Slot::Held { key, dirty, sighted, .. } = &mut self.slots[slot as usize] {
            if !*sighted {
                *sighted = true;
                if *dirty {
                    self.dirty.push_back(*key);
                }
            }
        }
    }

    fn release_slot(&mut self, slot: u32) {
        self.slots[slot as usize] = Slot::Free;
        self.free.push(slot);
    }

    /// A free slot, evicting the least recently used unpinned block (written down first when
    /// dirty) when none is free. `None` when every slot is pinned or being written.
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let (_, slot) = self.lru.pop_first()?;
        let Slot::Held { key, checksum, dirty, sighted, .. } = self.slots[slot as usize] else { return None };
        if dirty && sighted {
            self.write_down(slot, key, checksum);
        } else if dirty {
            // Seen once and leaving RAM: remembered (already, at its commit), not written.
            self.stats.filtered += 1;
        }
        self.index.remove(&key);
        self.stats.evictions_ram += 1;
        self.slots[slot as usize] = Slot::Writing;
        Some(slot)
    }

    /// Writes a held block down to every store below RAM that lacks it (after checking its
    /// bytes still are the block). An SSD that fails is taken out: the pool runs on what is left
    /// and says so (a remote tier that fails skips itself for a while).
    fn write_down(&mut self, slot: u32, key: BlockHash, checksum: [u8; 32]) {
        if let Slot::Held { dirty, .. } = &mut self.slots[slot as usize] {
            *dirty = false;
        }
        if self.lower.iter().all(|s| s.holds(&key)) {
            return;
        }
        if self.ram.copy_out(slot, &mut self.buf).is_err() || *blake3::hash(&self.buf).as_bytes() != checksum
        {
            self.stats.failed += 1;
            return;
        }
        let mut i = 0;
        while i < self.lower.len() {
            let store = &mut self.lower[i];
            if store.holds(&key) {
                i += 1;
                continue;
            }
            match store.put(key, &self.buf) {
                Ok(()) => {
                    match store.tier() {
                        PoolTier::Remote => self.stats.written_remote += 1,
                        _ => self.stats.written_ssd += 1,
                    }
                    i += 1;
                }
                Err(e) => {
                    tracing::warn!("the KV pool's {:?} tier failed ({e}); running without it", store.tier());
                    if store.tier() == PoolTier::Ssd {
                        self.stats.ssd_degraded = true;
                    }
                    self.lower.remove(i);
                }
            }
        }
    }

    fn end_read(&mut self, slots: &[(u32, PoolTier)]) {
        for &(slot, _) in slots {
            let tick = self.next_tick();
            if let Slot::Held { pins, tick: t, .. } = &mut self.slots[slot as usize] {
                *pins = pins.saturating_sub(1);
                if *pins == 0 {
                    *t = tick;
                    self.lru.insert(tick, slot);
                }
            }
        }
    }

    fn end(&mut self, lease: Lease) {
        match lease.kind {
            LeaseKind::Read(slots) => self.end_read(&slots),
            LeaseKind::Write(given) => self.end_write(&given),
        }
    }

    /// Ends a lease of this client's (a read lease's release, a write lease's abandon); `used`:
    /// a read lease's blocks the client copied and checked, from the first — the hits. A lease
    /// ended by its deadline or its client's going away counts none.
    pub fn release(&mut self, client: ClientId, lease: LeaseId, used: u32) -> Result<(), OwnerError> {
        match self.leases.get(&lease) {
            Some(l) if l.client == client => {}
            _ => return Err(OwnerError::NoLease),
        }
        let l = self.leases.remove(&lease).ok_or(OwnerError::NoLease)?;
        if let LeaseKind::Read(slots) = &l.kind {
            for (_, tier) in slots.iter().take(used as usize) {
                match tier {
                    PoolTier::Host => self.stats.hits_ram += 1,
                    PoolTier::Ssd => self.stats.hits_ssd += 1,
                    PoolTier::Remote => self.stats.hits_remote += 1,
                }
            }
        }
        self.end(l);
        Ok(())
    }

    /// Ends every lease past its deadline.
    pub fn expire(&mut self, now: Instant) {
        let late: Vec<LeaseId> =
            self.leases.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| *id).collect();
        self.end_all(late);
    }

    /// Ends every lease of a client that went away.
    pub fn drop_client(&mut self, client: ClientId) {
        let gone: Vec<LeaseId> =
            self.leases.iter().filter(|(_, l)| l.client == client).map(|(id, _)| *id).collect();
        self.end_all(gone);
    }

    fn end_all(&mut self, ids: Vec<LeaseId>) {
        for id in ids {
            if let Some(l) = self.leases.remove(&id) {
                self.stats.leases_expired += 1;
                self.end(l);
            }
        }
    }

    /// Writes up to `max` dirty blocks down to the SSD tier (what the owner does when idle, so
    /// a crash loses only the last moments' blocks). Returns how many were written.
    pub fn flush(&mut self, max: usize) -> usize {
        let mut n = 0;
        while n < max && !self.lower.is_empty() {
            let Some(key) = self.dirty.pop_front() else { break };
            let Some(&slot) = self.index.get(&key) else { continue };
            if let Slot::Held { key, checksum, dirty: true, sighted: true, .. } = self.slots[slot as usize] {
                self.write_down(slot, key, checksum);
                n += 1;
            }
        }
        if self.lower.is_empty() {
            // Nothing below RAM any more (a failed SSD): nothing to write down.
            self.dirty.clear();
        }
        n
    }

    /// Makes what was written down durable (`fsync`).
    pub fn sync(&self) {
        for s in &self.lower {
            if let Err(e) = s.sync() {
                tracing::warn!("KV pool {:?} sync failed: {e}", s.tier());
            }
        }
    }

    /// Files to `fsync` off the owner's thread (see [`BlockStore::file_for_sync`]).
    pub fn files_for_sync(&self) -> Vec<std::fs::File> {
        self.lower.iter().filter_map(|s| s.file_for_sync()).collect()
    }

    /// Dirty blocks waiting to be written down.
    pub fn dirty(&self) -> usize {
        self.dirty.len()
    }

    /// The counters now.
    pub fn stats(&self, now: Instant) -> PoolStats {
        let pinned = self.slots.iter().filter(|s| matches!(s, Slot::Held { pins, .. } if *pins > 0)).count();
        let oldest = self.leases.values().map(|l| now.saturating_duration_since(l.started)).max();
        let ssd = self.lower.iter().find(|s| s.tier() == PoolTier::Ssd);
        PoolStats {
            ram_blocks: self.index.len() as u32,
            ssd_slots: ssd.map_or(0, |s| s.capacity() as u32),
            ssd_blocks: ssd.map_or(0, |s| s.blocks() as u32),
            leases: self.leases.len() as u32,
            pinned: pinned as u32,
            oldest_lease_ms: oldest.map_or(0, |d| d.as_millis() as u64),
            ..self.stats.clone()
        }
    }
}

#[cfg(test)]
#[path = "owner_tests.rs"]
mod tests;
