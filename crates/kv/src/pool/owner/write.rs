//! The owner's write path: a client reserves slots for the keys the pool lacks, sends the blocks
//! (only the owner writes the RAM tier), and commits them with their checksums; a slot is indexed
//! only when its bytes match.

use super::{ClientId, Lease, LeaseId, LeaseKind, Owner, OwnerError, Slot};
use crate::BlockHash;
use std::time::Instant;

impl Owner {
    /// Write slots for the keys not held (per key: a slot, or `None` when held, being written
    /// by another lease, or when no slot is free). `None` when no slot was given at all.
    pub fn reserve(
        &mut self,
        client: ClientId,
        keys: &[BlockHash],
        now: Instant,
    ) -> Option<(LeaseId, Vec<Option<u32>>)> {
        let mut out = Vec::with_capacity(keys.len());
        let mut given = Vec::new();
        for key in keys {
            if let Some(&slot) = self.index.get(key) {
                self.sighted_again(slot);
            }
            let held = self.index.contains_key(key)
                || self.writing.contains_key(key)
                || given.iter().any(|(_, k)| k == key)
                || self.lower.iter().any(|s| s.holds(key));
            let slot = if held { None } else { self.take_slot() };
            if let Some(s) = slot {
                self.slots[s as usize] = Slot::Writing;
                given.push((s, *key));
            }
            out.push(slot);
        }
        if given.is_empty() {
            return None;
        }
        let keys: Vec<BlockHash> = given.iter().map(|(_, k)| *k).collect();
        let id = self.open_lease(client, now, LeaseKind::Write(given));
        for k in keys {
            self.writing.insert(k, id);
        }
        Some((id, out))
    }

    /// Writes block `index` of write lease `lease` into its slot: only the owner writes the RAM
    /// tier (clients map it read-only), so what a reader copies out is what was written here.
    pub fn write(
        &mut self,
        client: ClientId,
        lease: LeaseId,
        index: usize,
        bytes: &[u8],
    ) -> Result<(), OwnerError> {
        let slot = match self.leases.get(&lease) {
            Some(Lease { client: c, kind: LeaseKind::Write(given), .. }) if *c == client => {
                given.get(index).map(|(slot, _)| *slot)
            }
            _ => return Err(OwnerError::NoLease),
        };
        let Some(slot) = slot else {
            return Err(OwnerError::BadCommit(format!("no slot {index} in this lease")));
        };
        if bytes.len() != self.buf.len() {
            return Err(OwnerError::BadCommit(format!(
                "{} bytes for a {}-byte block",
                bytes.len(),
                self.buf.len()
            )));
        }
        self.ram.copy_in(slot, bytes).map_err(OwnerError::BadCommit)
    }

    /// Indexes a write lease's slots whose bytes have the checksums the writer computed (in
    /// the order the slots were given); the others are freed. Returns (stored, failed).
    pub fn commit(
        &mut self,
        client: ClientId,
        lease: LeaseId,
        checksums: &[[u8; 32]],
    ) -> Result<(u32, u32), OwnerError> {
        match self.leases.get(&lease) {
            Some(l) if l.client == client && matches!(l.kind, LeaseKind::Write(_)) => {}
            _ => return Err(OwnerError::NoLease),
        }
        let Some(Lease { kind: LeaseKind::Write(given), .. }) = self.leases.remove(&lease) else {
            return Err(OwnerError::NoLease);
        };
        if checksums.len() != given.len() {
            self.end_write(&given);
            return Err(OwnerError::BadCommit(format!(
                "{} checksums for {} slots",
                checksums.len(),
                given.len()
            )));
        }
        let (mut stored, mut failed) = (0, 0);
        for ((slot, key), want) in given.iter().zip(checksums) {
            self.writing.remove(key);
            if self.index.contains_key(key) {
                // Indexed meanwhile (read up from a remote tier for another client's lookup):
                // one slot per key; this copy is given back.
                self.release_slot(*slot);
                continue;
            }
            let ok =
                self.ram.copy_out(*slot, &mut self.buf).is_ok() && blake3::hash(&self.buf).as_bytes() == want;
            if !ok {
                failed += 1;
                self.release_slot(*slot);
                continue;
            }
            let tick = self.next_tick();
            let dirty = !self.lower.is_empty();
            let sighted = !dirty || self.seen_once.as_mut().is_none_or(|s| s.sight(*key));
            let check = fast_check(&self.buf);
            self.slots[*slot as usize] =
                Slot::Held { key: *key, checksum: *want, check, pins: 0, dirty, sighted, tick };
            self.lru.insert(tick, *slot);
            self.index.insert(*key, *slot);
            if dirty && sighted {
                self.dirty.push_back(*key);
            }
            stored += 1;
        }
        self.stats.stored += u64::from(stored);
        self.stats.failed += u64::from(failed);
        Ok((stored, failed))
    }

    pub(super) fn end_write(&mut self, given: &[(u32, BlockHash)]) {
        for (slot, key) in given {
            self.writing.remove(key);
            self.release_slot(*slot);
        }
    }
}

/// The check a reader makes of its copy of a RAM slot: XXH3-64 (memory speed; the slot's bytes
/// can only be the owner's, so it guards against a bug, not an adversary).
pub fn fast_check(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}
