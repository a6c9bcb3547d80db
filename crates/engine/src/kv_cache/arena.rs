//! The storage under [`super::KvCache`] and leases of blocks to another thread.
//!
//! The arena is one allocation shared (`Arc`) between the cache and any outstanding
//! [`KvLease`]. Nobody ever holds a reference to the whole arena: the cache and a lease each
//! build references to the ranges they own, so a network task can write a transfer's bytes
//! straight into reserved blocks while the batcher keeps computing on the others. Which ranges
//! belong to whom is the cache's bookkeeping (its `leased` flags), checked on every access that
//! could reach a leased block.

use super::BlockTable;
use half::f16;
use std::ptr::NonNull;
use std::sync::Arc;

/// A fixed, zero-initialised array of f16 values that hands out references to sub-ranges only.
pub(super) struct Arena {
    ptr: NonNull<f16>,
    len: usize,
}

// SAFETY: the arena is plain memory; every reference into it is created through `slice` /
// `slice_mut`, whose callers guarantee that no two live references to the same elements exist
// where one is mutable (the cache's `&self`/`&mut self` plus its lease flags; a lease's `&mut self`).
unsafe impl Send for Arena {}
// SAFETY: as above; shared references into disjoint or read-only ranges may cross threads.
unsafe impl Sync for Arena {}

impl Arena {
    /// `len` zeroed values (lazily mapped by the allocator: untouched blocks cost no memory).
    pub(super) fn zeroed(len: usize) -> Self {
        let boxed: Box<[f16]> = vec![f16::ZERO; len].into_boxed_slice();
        let raw = Box::into_raw(boxed);
        let ptr = NonNull::new(raw.cast::<f16>()).unwrap_or(NonNull::dangling());
        Self { ptr, len }
    }

    fn check(&self, off: usize, len: usize) {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "arena range out of bounds");
    }

    /// Elements `off..off + len`.
    ///
    /// # Safety
    /// No mutable reference to any of these elements may be live, or created while this one is.
    pub(super) unsafe fn slice(&self, off: usize, len: usize) -> &[f16] {
        self.check(off, len);
        // SAFETY: in bounds (checked); aliasing is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// Elements `off..off + len`, mutably.
    ///
    /// # Safety
    /// No other reference to any of these elements may be live, or created while this one is.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [f16] {
        self.check(off, len);
        // SAFETY: in bounds (checked); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("len", &self.len).finish()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a `Box<[f16]>` of this length, and the
        // last owner (this `Arc`'s) drops it once.
        drop(unsafe { Box::from_raw(raw) });
    }
}

/// Blocks of a sequence lent out of the cache for writing elsewhere (a decode worker's network
/// task receiving a KV transfer straight into them, with no intermediate buffer and no import
/// copy). While the lease lives the cache neither reads, writes, shares nor frees these blocks;
/// [`super::KvCache::end_lease`] gives the table back. A lease that is dropped instead keeps its
/// blocks out of use for the cache's lifetime, so its holder must always return it.
pub struct KvLease {
    pub(super) arena: Arc<Arena>,
    pub(super) table: BlockTable,
    pub(super) block_elems: usize,
}

impl std::fmt::Debug for KvLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvLease").field("blocks", &self.table.blocks().len()).finish()
    }
}

impl KvLease {
    /// Blocks lent.
    pub fn blocks(&self) -> usize {
        self.table.blocks().len()
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_elems * 2
    }

    /// The bytes of block `i` of the sequence (little-endian f16 once the lease is returned),
    /// for writing; `None` past the last block.
    pub fn block_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        let b = self.table.blocks().get(i)?;
        let off = b.0 as usize * self.block_elems;
        // SAFETY: the cache flagged this block leased when it built the lease (refusing blocks
        // anyone else referenced) and creates no reference to it until `end_lease`, which takes
        // the lease by value; `&mut self` keeps this the only reference the lease hands out.
        let elems = unsafe { self.arena.slice_mut(off, self.block_elems) };
        Some(bytemuck::cast_slice_mut(elems))
    }
}
