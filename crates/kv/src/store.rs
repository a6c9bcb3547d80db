//! The seam between the pool's RAM tier and what lies below it: one trait for block stores,
//! implemented by the SSD slab ([`crate::slab::Slab`]) and by a Valkey/Redis server
//! ([`crate::remote::RemoteStore`]) that a fleet shares across hosts. The pool's owner writes a
//! block down to every store below RAM and reads one back up from the first that has it.
//!
//! The contract every store keeps, whatever it is: a block is returned only after it was checked
//! against its key, the namespace it was written under and its checksum; a failed check is a
//! miss, counted apart (`failed_loads`), never a hit.

use tokenpath_protocol::pool::PoolTier;

use crate::{BlockHash, KvError};

/// A store of KV blocks below the pool's RAM tier.
pub trait BlockStore: Send + std::fmt::Debug {
    /// The tier's name in stats and metrics (`ssd`, `remote`).
    fn tier(&self) -> PoolTier;
    /// Whether it probably holds `key` (a load may still miss or fail). Local and cheap: a
    /// store that would need a round trip answers `true` and lets `get` decide.
    fn may_hold(&self, key: &BlockHash) -> bool;
    /// Whether it surely holds `key` already (writing it down again would be wasted).
    fn holds(&self, key: &BlockHash) -> bool;
    /// `key`'s block, checked, copied into `dst` (one block's bytes); its BLAKE3 — verified —
    /// when found, `Ok(None)` when absent or when it failed its check (`dst` is then garbage).
    fn get_into(&mut self, key: &BlockHash, dst: &mut [u8]) -> Result<Option<[u8; 32]>, KvError>;
    /// Stores `payload` as `key`'s block (the store evicts what it must).
    fn put(&mut self, key: BlockHash, payload: &[u8]) -> Result<(), KvError>;
    /// Blocks held (as far as this process knows).
    fn blocks(&self) -> usize;
    /// Blocks it can hold (0: unbounded or unknown).
    fn capacity(&self) -> usize;
    /// Loads that failed their check.
    fn failed_loads(&self) -> u64;
    /// Makes what was written durable, where that means something.
    fn sync(&self) -> Result<(), KvError>;
    /// A file to `fsync` on another thread instead (none: nothing to sync, or `sync` is cheap).
    fn file_for_sync(&self) -> Option<std::fs::File> {
        None
    }
}

impl BlockStore for crate::slab::Slab {
    fn tier(&self) -> PoolTier {
        PoolTier::Ssd
    }

    fn may_hold(&self, key: &BlockHash) -> bool {
        self.contains(key)
    }

    fn holds(&self, key: &BlockHash) -> bool {
        self.contains(key)
    }

    fn get_into(&mut self, key: &BlockHash, dst: &mut [u8]) -> Result<Option<[u8; 32]>, KvError> {
        crate::slab::Slab::get_into(self, key, dst)
    }

    fn put(&mut self, key: BlockHash, payload: &[u8]) -> Result<(), KvError> {
        crate::slab::Slab::put(self, key, payload).map(|_| ())
    }

    fn blocks(&self) -> usize {
        crate::slab::Slab::len(self)
    }

    fn capacity(&self) -> usize {
        crate::slab::Slab::capacity(self)
    }

    fn failed_loads(&self) -> u64 {
        self.stats().failed_loads
    }

    fn sync(&self) -> Result<(), KvError> {
        crate::slab::Slab::sync(self)
    }

    fn file_for_sync(&self) -> Option<std::fs::File> {
        crate::slab::Slab::file_for_sync(self)
    }
}
