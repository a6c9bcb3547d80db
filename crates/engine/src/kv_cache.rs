//! The paged KV cache: fixed-size blocks of f16 keys and values, a block table per sequence, and
//! an allocator with reference counts so a prefix can be shared by several sequences.
//!
//! One contiguous arena holds every block (`[block][layer][k|v][…]`), so a block is one
//! contiguous run of bytes: exporting a sequence's KV to another process is a copy of whole blocks,
//! and a block's lifetime is a counter, not an allocation. Within a block each KV head's keys and
//! values are one contiguous run (head-major), keys stored dimension by dimension: decode
//! attention reads a head's block as two sequential 2 KB runs (at 64 values per head and 16
//! slots) and scores sixteen positions per vector instruction with no horizontal sums — 1.5× the
//! speed of token-major rows at 16 sequences × 512 tokens of context, where attention reads more
//! bytes than the weights (docs/engine.md). All mutation goes through `&mut self`;
//! the worker that owns an engine owns its cache, so there is no lock here. The one way bytes get
//! into the arena from another thread is a [`KvLease`]: a sequence's reserved blocks lent to a
//! network task that receives a KV transfer straight into them (`arena.rs`). Blocks as wire
//! bytes — export, import, writes from a transfer or the KV pool — are in `bytes.rs`; where a
//! value lives inside a block, in `layout.rs`.

mod arena;
mod bytes;
mod layout;

use crate::error::{EngineError, Result};
use arena::Arena;
pub use arena::KvLease;
use half::f16;
pub use layout::KvLayout;
use std::sync::Arc;

/// Index of a block in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// The blocks of one sequence and how many tokens they hold.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    len: usize,
}

impl BlockTable {
    /// Tokens whose K and V are stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The blocks, in sequence order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }
}

/// The arena and its allocator.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    data: Arc<Arena>,
    refs: Vec<u32>,
    /// Blocks lent out in a [`KvLease`]: the cache creates no reference into them.
    leased: Vec<bool>,
    free: Vec<BlockId>,
    /// When tracked ([`KvCache::track_shared`]): blocks whose reference count went from 1 to 2
    /// (`true`) or from 2 to 1 (`false`), in order, until drained — how a prefix index learns
    /// which of its blocks a sequence uses without scanning the arena.
    shared_changes: Option<Vec<(BlockId, bool)>>,
}

impl KvCache {
    /// A cache of `num_blocks` blocks. The arena is allocated up front: memory use is fixed and
    /// known at start, never grown under load.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Result<Self> {
        if layout.block_size == 0
            || layout.kv_dim == 0
            || layout.n_layer == 0
            || num_blocks == 0
            || layout.head_dim == 0
            || !layout.kv_dim.is_multiple_of(layout.head_dim)
        {
            return Err(EngineError::InvalidArgument(format!(
                "empty KV cache layout {layout:?} × {num_blocks}"
            )));
        }
        let elems = layout
            .block_elems()
            .checked_mul(num_blocks)
            .filter(|&n| num_blocks <= u32::MAX as usize && n <= isize::MAX as usize / 2)
            .ok_or_else(|| {
                EngineError::InvalidArgument(format!("KV cache of {num_blocks} blocks is too large"))
            })?;
        Ok(Self {
            layout,
            data: Arc::new(Arena::zeroed(elems)?),
            refs: vec![0; num_blocks],
            leased: vec![false; num_blocks],
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            shared_changes: None,
        })
    }

    /// The cache's shape.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Blocks in the arena.
    pub fn total_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks not referenced by anyone.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks referenced at least once.
    pub fn used_blocks(&self) -> usize {
        self.total_blocks() - self.free_blocks()
    }

    /// Starts recording blocks whose reference count passes 1 (the owner must drain them with
    /// [`KvCache::drain_shared_changes`]).
    pub fn track_shared(&mut self) {
        self.shared_changes.get_or_insert_with(Vec::new);
    }

    /// Hands every recorded change (block, now shared) to `f`, in order, and forgets them.
    pub fn drain_shared_changes(&mut self, mut f: impl FnMut(BlockId, bool)) {
        if let Some(log) = self.shared_changes.as_mut() {
            for (b, shared) in log.drain(..) {
                f(b, shared);
            }
        }
    }

    /// Reference count of a block.
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refs.get(b.0 as usize).copied().unwrap_or(0)
    }

    fn check(&self, b: BlockId) -> Result<usize> {
        let i = b.0 as usize;
        match self.refs.get(i) {
            Some(_) if self.leased[i] => {
                Err(EngineError::InvalidArgument(format!("block {} is leased", b.0)))
            }
            Some(&r) if r > 0 => Ok(i),
            Some(_) => Err(EngineError::InvalidArgument(format!("block {} is not allocated", b.0))),
            None => Err(EngineError::InvalidArgument(format!("block {} does not exist", b.0))),
        }
    }

    /// Takes a free block with reference count 1.
    pub fn allocate(&mut self) -> Result<BlockId> {
        let b = self.free.pop().ok_or(EngineError::KvCacheFull { needed: 1, free: 0 })?;
        self.refs[b.0 as usize] = 1;
        Ok(b)
    }

    /// Adds a reference to an allocated block (sharing a prefix).
    pub fn retain(&mut self, b: BlockId) -> Result<()> {
        let i = self.check(b)?;
        self.refs[i] += 1;
        if self.refs[i] == 2 {
            if let Some(log) = self.shared_changes.as_mut() {
                log.push((b, true));
            }
        }
        Ok(())
    }

    /// Drops a reference; the block is free again when none remain.
    pub fn release(&mut self, b: BlockId) -> Result<()> {
        let i = self.check(b)?;
        self.refs[i] -= 1;
        if self.refs[i] == 1 {
            if let Some(log) = self.shared_changes.as_mut() {
                log.push((b, false));
            }
        }
        if self.refs[i] == 0 {
            self.free.push(b);
        }
        Ok(())
    }

    /// Grows `table` so it can hold `new_len` tokens, all or nothing: when the cache cannot
    /// supply every block needed, nothing is allocated and the table is unchanged.
    pub fn reserve(&mut self, table: &mut BlockTable, new_len: usize) -> Result<()> {
        let need_blocks = new_len.div_ceil(self.layout.block_size);
        let missing = need_blocks.saturating_sub(table.blocks.len());
        if missing > self.free.len() {
            return Err(EngineError::KvCacheFull { needed: missing, free: self.free.len() });
        }
        for _ in 0..missing {
            let b = self.allocate()?;
            table.blocks.push(b);
        }
        Ok(())
    }

    /// Releases the blocks of `table` beyond the first `keep` (rolling back a failed reserve).
    pub(crate) fn truncate_blocks(&mut self, table: &mut BlockTable, keep: usize) {
        while table.blocks.len() > keep {
            if let Some(b) = table.blocks.pop() {
                // Blocks reserved by this table are allocated; a failure here would mean the
                // allocator's books are already wrong, and there is nothing better to do.
                let _ = self.release(b);
            }
        }
    }

    /// Marks `n` more tokens as stored (after their K/V were written).
    pub(crate) fn advance(&self, table: &mut BlockTable, n: usize) {
        table.len += n;
        debug_assert!(table.len <= table.blocks.len() * self.layout.block_size);
    }

    /// Releases every block of `table` and empties it.
    pub fn free_table(&mut self, table: &mut BlockTable) -> Result<()> {
        for b in table.blocks.drain(..) {
            self.release(b)?;
        }
        table.len = 0;
        Ok(())
    }

    /// Tables only name leased blocks when a caller kept a copy of a table it lent; touching
    /// them then is a bug in the caller, and a panic rather than a data race.
    fn assert_not_leased(&self, b: BlockId) {
        assert!(!self.is_leased(b), "block {} is leased", b.0);
    }

    fn is_leased(&self, b: BlockId) -> bool {
        self.leased.get(b.0 as usize).copied().unwrap_or(false)
    }

    /// Whole block `b`, read-only.
    fn block(&self, b: BlockId) -> &[f16] {
        self.assert_not_leased(b);
        let elems = self.layout.block_elems();
        // SAFETY: as in `head`.
        unsafe { self.data.slice(b.0 as usize * elems, elems) }
    }

    /// Bytes of one whole block on the wire (f16, little-endian).
    pub fn block_bytes(&self) -> usize {
        self.layout.block_bytes()
    }

    /// A table of `blocks` (already holding full, written blocks — a cached prefix), each
    /// retained once more. All or nothing.
    pub fn share(&mut self, blocks: &[BlockId]) -> Result<BlockTable> {
        for (i, &b) in blocks.iter().enumerate() {
            if let Err(e) = self.retain(b) {
                for &done in &blocks[..i] {
                    let _ = self.release(done);
                }
                return Err(e);
            }
        }
        Ok(BlockTable { blocks: blocks.to_vec(), len: blocks.len() * self.layout.block_size })
    }

    /// Declares that the first `n_tokens` tokens of `table` hold valid K/V (after
    /// [`KvCache::write_blocks`] filled them).
    pub fn set_len(&self, table: &mut BlockTable, n_tokens: usize) -> Result<()> {
        if n_tokens > table.blocks.len() * self.layout.block_size {
            return Err(EngineError::InvalidArgument(format!(
                "{n_tokens} tokens do not fit {} blocks",
                table.blocks.len()
            )));
        }
        table.len = n_tokens;
        Ok(())
    }

    /// Lends the blocks of `table` (taken out of it, leaving it empty) for writing from another
    /// thread: a transfer received straight into the cache. Every block must be referenced by
    /// this table alone (a shared prefix block or one already leased is refused, and `table` is
    /// left as it was). The cache keeps away from the blocks until [`KvCache::end_lease`].
    pub fn lease(&mut self, table: &mut BlockTable) -> Result<KvLease> {
        if let Some(b) = table.blocks.iter().find(|b| self.refcount(**b) != 1 || self.is_leased(**b)) {
            return Err(EngineError::InvalidArgument(format!(
                "block {} is shared, free or leased and cannot be lent",
                b.0
            )));
        }
        for b in &table.blocks {
            self.leased[b.0 as usize] = true;
        }
        let table = std::mem::take(table);
        Ok(KvLease { arena: Arc::clone(&self.data), table, block_elems: self.layout.block_elems() })
    }

    /// Takes a lease back and returns its table (same blocks, same length as when lent). A lease
    /// of another cache is refused (and its blocks stay lent there).
    pub fn end_lease(&mut self, lease: KvLease) -> Result<BlockTable> {
        if !Arc::ptr_eq(&lease.arena, &self.data) {
            return Err(EngineError::InvalidArgument("a lease of another KV cache".into()));
        }
        let elems = self.layout.block_elems();
        for b in &lease.table.blocks {
            self.leased[b.0 as usize] = false;
            if cfg!(target_endian = "big") {
                // The lease wrote little-endian wire bytes; make them native f16 values.
                // SAFETY: `&mut self`; the block is no longer leased and its lease is gone.
                let dst = unsafe { self.data.slice_mut(b.0 as usize * elems, elems) };
                for x in dst {
                    *x = f16::from_bits(u16::from_le(x.to_bits()));
                }
            }
        }
        Ok(lease.table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout() -> KvLayout {
        KvLayout { n_layer: 2, kv_dim: 4, head_dim: 2, block_size: 3 }
    }

    #[test]
    fn a_cache_larger_than_the_machine_is_a_typed_error_not_an_abort() {
        // The default model's layout at a million-token context's worth of blocks and more
        // (~790 TB): refused before any allocation, where `vec!` used to abort the process.
        let big = KvLayout { n_layer: 30, kv_dim: 192, head_dim: 64, block_size: 16 };
        match KvCache::new(big, 1 << 31) {
            Err(EngineError::OutOfMemory { bytes, .. }) => assert_eq!(bytes, (big.block_elems() * 2) << 31),
            other => panic!("expected OutOfMemory, got {:?}", other.map(|c| c.total_blocks())),
        }
        // A cache that fits still reads as zeros everywhere.
        let c = KvCache::new(layout(), 4).unwrap();
        assert!(c.data.all_zero());
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let mut c = KvCache::new(layout(), 2).unwrap();
        let mut t = BlockTable::default();
        c.reserve(&mut t, 6).unwrap();
        assert_eq!(c.free_blocks(), 0);
        let mut u = BlockTable::default();
        let err = c.reserve(&mut u, 1).unwrap_err();
        assert!(matches!(err, EngineError::KvCacheFull { needed: 1, free: 0 }));
        assert!(u.blocks().is_empty());
        c.free_table(&mut t).unwrap();
        assert_eq!(c.free_blocks(), 2);
    }

    #[test]
    fn export_import_round_trip() {
        let mut a = KvCache::new(layout(), 4).unwrap();
        let mut t = BlockTable::default();
        a.reserve(&mut t, 4).unwrap();
        for pos in 0..4 {
            for layer in 0..2 {
                let k: Vec<f32> = (0..4).map(|i| (pos * 10 + layer * 100 + i) as f32).collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                a.write(&t, layer, pos, &k, &v);
            }
        }
        a.advance(&mut t, 4);
        let bytes = a.export(&t);
        let mut b = KvCache::new(layout(), 4).unwrap();
        let t2 = b.import(&bytes, 4).unwrap();
        assert_eq!(b.export(&t2), bytes);
        assert!(b.import(&bytes[1..], 4).is_err());
        assert_eq!(b.used_blocks(), 2, "a failed import leaves nothing allocated");
        // Block-wise writes into a reserved table give the same bytes.
        let mut t3 = BlockTable::default();
        b.reserve(&mut t3, 4).unwrap();
        let per = b.block_bytes();
        b.write_blocks(&t3, 1, &bytes[per..]).unwrap();
        b.write_blocks(&t3, 0, &bytes[..per]).unwrap();
        b.set_len(&mut t3, 4).unwrap();
        assert_eq!(b.export(&t3), bytes);
        assert!(b.write_blocks(&t3, 1, &bytes).is_err(), "past the table's end");
        assert!(b.write_blocks(&t3, 0, &bytes[..per - 2]).is_err(), "not a whole block");
        assert!(b.set_len(&mut t3, 7).is_err());
    }

    #[test]
    fn a_tracked_cache_records_each_block_passing_one_reference() {
        let mut c = KvCache::new(layout(), 4).unwrap();
        let mut t = BlockTable::default();
        c.reserve(&mut t, 6).unwrap();
        let mut s = c.share(&t.blocks()[..1]).unwrap();
        let mut log = Vec::new();
        c.drain_shared_changes(|b, on| log.push((b, on)));
        assert!(log.is_empty(), "untracked: nothing recorded");
        c.track_shared();
        let b = t.blocks()[0];
        c.retain(b).unwrap(); // 3
        c.free_table(&mut s).unwrap(); // 2
        c.free_table(&mut t).unwrap(); // 1: no longer shared
        c.retain(b).unwrap(); // 2: shared again
        c.drain_shared_changes(|b, on| log.push((b, on)));
        assert_eq!(log, vec![(b, false), (b, true)]);
        c.drain_shared_changes(|b, on| log.push((b, on)));
        assert_eq!(log.len(), 2, "drained once");
    }

    #[test]
    fn shared_prefix_blocks_are_retained_and_released() {
        let mut c = KvCache::new(layout(), 4).unwrap();
        let mut t = BlockTable::default();
        c.reserve(&mut t, 6).unwrap();
        let mut s = c.share(&t.blocks()[..1]).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(c.refcount(t.blocks()[0]), 2);
        c.free_table(&mut t).unwrap();
        assert_eq!(c.used_blocks(), 1, "the shared block lives on");
        c.free_table(&mut s).unwrap();
        assert_eq!(c.used_blocks(), 0);
        assert!(c.share(&[BlockId(0)]).is_err(), "a free block cannot be shared");
    }

    #[test]
    fn leased_blocks_are_written_by_another_thread_and_untouchable_meanwhile() {
        let mut c = KvCache::new(layout(), 4).unwrap();
        let mut t = BlockTable::default();
        c.reserve(&mut t, 6).unwrap();
        let mut lease = c.lease(&mut t).unwrap();
        assert!(t.blocks().is_empty(), "the table went into the lease");
        assert_eq!((lease.blocks(), c.used_blocks()), (2, 2), "lent blocks stay allocated");
        let lent = lease.table.blocks().to_vec();
        assert!(c.retain(lent[0]).is_err() && c.release(lent[0]).is_err() && c.share(&lent[..1]).is_err());
        let per = lease.block_bytes();
        let bytes: Vec<u8> = (0..2 * per).map(|i| (i % 251) as u8).collect();
        let want = bytes.clone();
        let lease = std::thread::spawn(move || {
            for i in 0..lease.blocks() {
                lease.block_mut(i).unwrap().copy_from_slice(&bytes[i * per..(i + 1) * per]);
            }
            assert!(lease.block_mut(2).is_none());
            lease
        })
        .join()
        .unwrap();
        let mut back = c.end_lease(lease).unwrap();
        c.set_len(&mut back, 6).unwrap();
        assert_eq!(c.export(&back), want, "the bytes written through the lease are the blocks");

        let mut shared = c.share(&back.blocks()[..1]).unwrap();
        assert!(c.lease(&mut back).is_err(), "a shared block cannot be lent");
        assert_eq!(back.blocks().len(), 2, "a refused lease leaves the table as it was");
        c.free_table(&mut shared).unwrap();
        c.free_table(&mut back).unwrap();
        assert_eq!(c.used_blocks(), 0);

        let mut other = KvCache::new(layout(), 4).unwrap();
        let mut u = BlockTable::default();
        other.reserve(&mut u, 1).unwrap();
        assert!(c.end_lease(other.lease(&mut u).unwrap()).is_err(), "a lease of another cache");
    }

    #[test]
    #[should_panic(expected = "is leased")]
    fn a_stale_copy_of_a_lent_table_cannot_reach_its_blocks() {
        let mut c = KvCache::new(layout(), 4).unwrap();
        let mut t = BlockTable::default();
        c.reserve(&mut t, 3).unwrap();
        let stale = t.clone();
        let _lease = c.lease(&mut t).unwrap();
        assert!(c.write_blocks(&stale, 0, &vec![0; c.block_bytes()]).is_err());
        let _ = c.k_head(stale.blocks()[0], 0, 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc,
        Retain(usize),
        Release(usize),
    }

    proptest! {
        #[test]
        fn allocator_keeps_counts_consistent(ops in proptest::collection::vec(
            prop_oneof![Just(Op::Alloc), (0usize..8).prop_map(Op::Retain), (0usize..8).prop_map(Op::Release)],
            0..200,
        )) {
            let mut c = KvCache::new(layout(), 8).unwrap();
            let mut model = [0u32; 8];
            for op in ops {
                match op {
                    Op::Alloc => match c.allocate() {
                        Ok(b) => { prop_assert_eq!(model[b.0 as usize], 0); model[b.0 as usize] = 1; }
                        Err(_) => prop_assert!(model.iter().all(|&r| r > 0)),
                    },
                    Op::Retain(i) => {
                        let r = c.retain(BlockId(i as u32));
                        prop_assert_eq!(r.is_ok(), model[i] > 0);
                        if model[i] > 0 { model[i] += 1; }
                    }
                    Op::Release(i) => {
                        let r = c.release(BlockId(i as u32));
                        prop_assert_eq!(r.is_ok(), model[i] > 0);
                        if model[i] > 0 { model[i] -= 1; }
                    }
                }
                prop_assert_eq!(c.free_blocks(), model.iter().filter(|&&r| r == 0).count());
                for (i, &r) in model.iter().enumerate() {
                    prop_assert_eq!(c.refcount(BlockId(i as u32)), r);
                }
            }
        }
    }
}
