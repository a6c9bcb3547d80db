//! The storage under [`super::KvCache`] and leases of blocks to another thread.
//!
//! The arena is one allocation shared (`Arc`) between the cache and any outstanding
//! [`KvLease`]. Nobody ever holds a reference to the whole arena: the cache and a lease each
//! build references to the ranges they own, so a network task can write a transfer's bytes
//! straight into reserved blocks while the batcher keeps computing on the others. Which ranges
//! belong to whom is the cache's bookkeeping (its `leased` flags), checked on every access that
//! could reach a leased block.

use super::BlockTable;
use crate::error::{EngineError, Result};
use half::f16;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

/// Values on a 4 KiB page.
const PAGE_VALUES: usize = 4096 / std::mem::size_of::<f16>();

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
    /// `len` zeroed values, taken from the system now: every page is touched here, so the
    /// cache's memory is fixed at start and a machine without it fails at start, not under load.
    /// [`EngineError::OutOfMemory`] when the arena is larger than the machine's physical memory
    /// or the allocator refuses it — a cache sized from a model's million-token context must not
    /// abort the process (`vec!` would).
    pub(super) fn zeroed(len: usize) -> Result<Self> {
        let layout = Self::layout(len)?;
        let physical = crate::model::physical_memory();
        let refused = EngineError::OutOfMemory { what: "the KV cache", bytes: layout.size() };
        if physical > 0 && layout.size() > physical {
            return Err(refused);
        }
        if layout.size() == 0 {
            return Ok(Self { ptr: NonNull::dangling(), len });
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }.cast::<f16>()).ok_or(refused)?;
        for off in (0..len).step_by(PAGE_VALUES) {
            // SAFETY: `off < len`, inside the allocation; nothing else refers to it yet.
            // Volatile: a store of zero into memory the allocator zeroed is otherwise removable.
            unsafe { ptr.as_ptr().add(off).write_volatile(f16::ZERO) };
        }
        Ok(Self { ptr, len })
    }

    fn layout(len: usize) -> Result<Layout> {
        Layout::array::<f16>(len)
            .map_err(|_| EngineError::OutOfMemory { what: "the KV cache", bytes: len.saturating_mul(2) })
    }

    /// Whether every value is zero (a test's look at a fresh arena).
    #[cfg(test)]
    pub(super) fn all_zero(&self) -> bool {
        // SAFETY: a test's arena with no other reference into it.
        unsafe { self.slice(0, self.len) }.iter().all(|v| v.to_bits() == 0)
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
        // `zeroed` built this layout from the same length, so it is valid here too.
        if let Ok(layout) = Self::layout(self.len) {
            if layout.size() > 0 {
                // SAFETY: `ptr` came from `alloc_zeroed` with this layout (`zeroed`), and the last
                // owner (this `Arc`'s) drops it once.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
            }
        }
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
