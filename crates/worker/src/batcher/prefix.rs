//! The batcher's prefix reuse past the arena: the host's KV pool. The arena's part (lookup,
//! verification, sharing, registering) is the shared scheduler's (`tokenpath_scheduler`); this
//! adds what only a real worker does — leasing pool blocks, copying them into the arena and
//! checking them, and storing fresh blocks in the pool.

use super::Batcher;
use crate::seq::Seq;
use crate::WorkerStats;
use std::time::Instant;
use tokenpath_engine::kv_cache::BlockId;
use tokenpath_kv::pool::{FillItem, PoolClient, ReadLease};
use tokenpath_kv::BlockHash;
use tokenpath_protocol::pool::PoolTier;
use tokenpath_scheduler::{PrefixSource, Scheduler};
use tokenpath_timeline::Mark;

/// Prefixes from the arena, then from the host's KV pool when one is configured.
pub(super) struct PoolSource<'a> {
    pub(super) pool: Option<&'a mut PoolClient>,
    pub(super) stats: &'a mut WorkerStats,
}

impl PrefixSource<Seq> for PoolSource<'_> {
    fn attach(&mut self, sched: &mut Scheduler<Seq>, seq: &mut Seq) {
        let Some(mut a) = sched.attach_arena(seq) else { return };
        let bs = sched.policy.block_size;
        let hashes = seq.prompt_hashes.clone();
        // Past the arena's blocks, the host pool's: leased, each copied into a fresh block and
        // checked against the checksum its writer computed before use, then registered in the
        // arena's index like a computed one. A block that fails its check ends the prefix (the
        // rest is computed); the lease ends on every path.
        let arena = a.arena;
        let mut have = arena;
        let (mut host, mut ssd, mut remote) = (0usize, 0usize, 0usize);
        let load_start = Instant::now();
        let lease = match self.pool.as_mut().filter(|_| have < hashes.len()) {
            Some(pool) => pool.lookup(&hashes[have..]),
            None => ReadLease::default(),
        };
        if !lease.blocks.is_empty() {
            // Room for the loads: blocks only the prefix cache holds are given up for them (a
            // full arena of cached blocks is the steady state, so free blocks alone would leave
            // nothing to load into).
            let room = sched.available();
            sched.reclaim(lease.blocks.len().min(room));
        }
        if let (false, Some(pool)) = (lease.blocks.is_empty(), self.pool.as_ref()) {
            // As many blocks as the arena has room for, reserved at once and filled straight
            // from the pool's slots on every core, each checked after its copy; the prefix
            // ends at the first that fails (the blocks after it stay reserved as room for
            // the tokens to compute).
            let n = lease.blocks.len().min(sched.cache.free_blocks());
            let cache = &mut sched.cache;
            let filled =
                cache.reserve(&mut a.table, (have + n) * bs).map_err(|e| e.to_string()).and_then(|()| {
                    let mut dsts = cache.blocks_bytes_mut(&a.table, have, n).map_err(|e| e.to_string())?;
                    Ok(pool.load_all(&lease.blocks[..n], &mut dsts))
                });
            let ok = filled.unwrap_or_else(|e| {
                tracing::warn!(request = %seq.id, "no room for a KV pool hit: {e}");
                Vec::new()
            });
            let good = ok.iter().take_while(|&&b| b).count();
            if good < ok.len() {
                self.stats.kv_pool_failed_loads += 1;
                tracing::warn!(request = %seq.id, "a KV pool block failed its check: recomputed");
            }
            for block in &lease.blocks[..good] {
                sched.insert_loaded(seq, &hashes, have, a.table.blocks()[have]);
                match block.tier {
                    PoolTier::Host => host += 1,
                    PoolTier::Ssd => ssd += 1,
                    PoolTier::Remote => remote += 1,
                }
                have += 1;
            }
        }
        if let Some(pool) = self.pool.as_mut() {
            pool.release(lease, have - arena);
        }
        if have > arena {
            seq.stamp(Mark::KvLoadStart, load_start);
            seq.stamp(Mark::KvLoadEnd, Instant::now());
            self.stats.kv_pool_load_bytes += ((have - arena) * sched.cache.block_bytes()) as u64;
        }
        let cached = sched.finish_attach(seq, a, have);
        if cached > 0 {
            // Loaded blocks are in key order, host and SSD hits interleaved; the split counts
            // blocks (a prompt's last block is never cached, so every cached block is whole).
            seq.cached_tokens_ssd = ssd * bs;
            seq.cached_tokens_host = host * bs;
            seq.cached_tokens_remote = remote * bs;
            self.stats.prompt_tokens_cached += cached as u64;
            self.stats.prompt_tokens_cached_ssd += seq.cached_tokens_ssd as u64;
            self.stats.prompt_tokens_cached_host += seq.cached_tokens_host as u64;
            self.stats.prompt_tokens_cached_remote += seq.cached_tokens_remote as u64;
        }
    }
}

impl Batcher {
    /// Registers a sequence's newly completed blocks in the prefix cache, and has the ones new
    /// to this worker stored in the host's pool (by the writer thread; it skips those the pool
    /// holds already).
    pub(crate) fn register_prefix(&mut self, seq: &mut Seq) {
        let fresh = self.sched.register(seq);
        if fresh.is_empty() {
            return;
        }
        if let Some(writer) = &self.pool_writer {
            let blocks = seq.table.blocks();
            let items =
                fresh.iter().map(|(i, h)| FillItem { key: *h, tag: u64::from(blocks[*i].0) }).collect();
            if writer.store(items) {
                // Published at once, before this step's events: whoever sees the request end
                // sees its store in flight (tests wait for it to reach 0).
                let n = writer.in_flight() as u64;
                self.stats.kv_pool_stores_pending = n;
                self.stats_tx.send_modify(|s| s.kv_pool_stores_pending = n);
            } else {
                tracing::debug!(request = %seq.id, blocks = fresh.len(), "KV pool writer busy: blocks not stored");
            }
        } else if let Some(pool) = self.pool.as_mut() {
            let keys: Vec<BlockHash> = fresh.iter().map(|(_, h)| *h).collect();
            let (cache, table) = (&self.sched.cache, &seq.table);
            pool.store(&keys, |j| cache.export_blocks(table, fresh[j].0, fresh[j].0 + 1));
        }
    }

    /// Copies the blocks the pool writer asks for (the ones the pool gave slots) out of the
    /// cache, between steps: one memcpy per block; the writer hashes and stores them. A block
    /// no longer cached under its key (evicted since) is not given, and the writer then stores
    /// none of that fill.
    pub(crate) fn fill_pool(&mut self) {
        let Some(writer) = &self.pool_writer else { return };
        while let Some(mut fill) = writer.next_fill() {
            for i in 0..fill.items().len() {
                let item = fill.items()[i];
                let Ok(id) = u32::try_from(item.tag) else { continue };
                if self.sched.cached_block(item.key) != Some(BlockId(id)) {
                    continue;
                }
                if fill.buffer(i).is_some_and(|buf| self.sched.cache.copy_block(BlockId(id), buf)) {
                    fill.written(i);
                }
            }
        }
    }
}
