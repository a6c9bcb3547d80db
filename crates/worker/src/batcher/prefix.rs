//! The batcher's prefix reuse: attaching the longest cached prefix to a fresh sequence (each
//! hit checked against the very tokens it was computed from), registering a sequence's full
//! blocks, and evicting what nobody uses when room is needed. Apart from `batcher.rs` because it
//! is the one part that talks to the prefix index (`tokenpath_kv::PrefixCache`).

use super::Batcher;
use crate::seq::Seq;
use std::time::Instant;
use tokenpath_kv::pool::ReadLease;
use tokenpath_kv::{block_hashes, chain_hash, BlockHash};
use tokenpath_protocol::pool::PoolTier;
use tokenpath_timeline::Mark;

impl Batcher {
    /// Blocks held only by the prefix cache (reclaimable at any time).
    fn cached_only(&self) -> usize {
        let cache = &self.cache;
        self.prefix.as_ref().map_or(0, |p| p.evictable(|b| cache.refcount(b) == 1))
    }

    /// Free blocks plus blocks only the prefix cache holds.
    pub(crate) fn available(&self) -> usize {
        self.cache.free_blocks() + self.cached_only()
    }

    /// Evicts prefix-cache blocks nobody uses until `need` blocks are free (or none are left).
    pub(crate) fn reclaim(&mut self, need: usize) {
        let Some(prefix) = self.prefix.as_mut() else { return };
        while self.cache.free_blocks() < need {
            let cache = &self.cache;
            let Some(b) = prefix.evict(|b| cache.refcount(b) == 1) else { break };
            self.prefix_tokens.remove(&b);
            if let Err(e) = self.cache.release(b) {
                tracing::error!("releasing an evicted prefix block failed: {e}");
            }
        }
    }

    /// Attaches the longest cached prefix of a fresh sequence's tokens (at least one token is
    /// always left to compute: the last one's logits are needed).
    pub(super) fn attach_prefix(&mut self, seq: &mut Seq) {
        let Some(prefix) = self.prefix.as_mut() else { return };
        if !seq.table.is_empty() || !seq.table.blocks().is_empty() || seq.fed != 0 {
            return;
        }
        let bs = self.cfg.block_size;
        let usable = (seq.tokens.len() - 1) / bs;
        let Ok(hashes) = block_hashes(seq.root, &seq.tokens[..usable * bs], bs) else { return };
        let mut blocks = prefix.lookup(&hashes);
        // Served only for the tokens it holds (a collision is infeasible; a bug must not become
        // another sequence's attention state).
        let verified = blocks
            .iter()
            .enumerate()
            .take_while(|(i, b)| {
                self.prefix_tokens.get(b).is_some_and(|t| **t == seq.tokens[i * bs..(i + 1) * bs])
            })
            .count();
        if verified < blocks.len() {
            tracing::error!(request = %seq.id, verified, hits = blocks.len(), "prefix cache hit with other tokens");
            blocks.truncate(verified);
        }
        let mut table = if blocks.is_empty() {
            std::mem::take(&mut seq.table)
        } else {
            match self.cache.share(&blocks) {
                Ok(table) => table,
                Err(e) => {
                    tracing::error!(request = %seq.id, "sharing cached prefix blocks failed: {e}");
                    return;
                }
            }
        };
        // Past the arena's blocks, the host pool's: leased, each copied into a fresh block and
        // checked against the checksum its writer computed before use, then registered in the
        // arena's index like a computed one. A block that fails its check ends the prefix (the
        // rest is computed); the lease ends on every path.
        let arena = blocks.len();
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
            self.reclaim(lease.blocks.len().min(self.available()));
        }
        if let (false, Some(pool)) = (lease.blocks.is_empty(), self.pool.as_ref()) {
            // As many blocks as the arena has room for, reserved at once and filled straight
            // from the pool's slots on every core, each checked after its copy; the prefix
            // ends at the first that fails (the blocks after it stay reserved as room for
            // the tokens to compute).
            let n = lease.blocks.len().min(self.cache.free_blocks());
            let filled =
                self.cache.reserve(&mut table, (have + n) * bs).map_err(|e| e.to_string()).and_then(|()| {
                    let mut dsts = self.cache.blocks_bytes_mut(&table, have, n).map_err(|e| e.to_string())?;
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
                let b = table.blocks()[have];
                let parent = have.checked_sub(1).map(|i| hashes[i]);
                if let Some(prefix) = self.prefix.as_mut() {
                    if prefix.insert(parent, hashes[have], b) {
                        self.prefix_tokens.insert(b, seq.tokens[have * bs..(have + 1) * bs].into());
                        if let Err(e) = self.cache.retain(b) {
                            tracing::error!("retaining a prefix block failed: {e}");
                        }
                    }
                }
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
            self.stats.kv_pool_load_bytes += ((have - arena) * self.cache.block_bytes()) as u64;
        }
        if have == 0 {
            seq.table = table;
            return;
        }
        if let Err(e) = self.cache.set_len(&mut table, have * bs) {
            tracing::error!(request = %seq.id, "a cached prefix does not fit its blocks: {e}");
        }
        seq.table = table;
        seq.fed = have * bs;
        if seq.hashes.len() < have {
            seq.hashes = hashes[..have].to_vec();
        }
        if seq.cached_tokens == 0 && !seq.prefill_started {
            seq.cached_tokens = seq.fed.min(seq.prompt_len);
            // Loaded blocks are in key order, host and SSD hits interleaved; the split counts
            // blocks (a prompt's last block is never cached, so every cached block is whole).
            seq.cached_tokens_ssd = ssd * bs;
            seq.cached_tokens_host = host * bs;
            seq.cached_tokens_remote = remote * bs;
            self.stats.prompt_tokens_cached += seq.cached_tokens as u64;
            self.stats.prompt_tokens_cached_ssd += seq.cached_tokens_ssd as u64;
            self.stats.prompt_tokens_cached_host += seq.cached_tokens_host as u64;
            self.stats.prompt_tokens_cached_remote += seq.cached_tokens_remote as u64;
        }
    }

    /// Registers a sequence's newly completed blocks in the prefix cache, and stores the ones
    /// new to this worker in the host's pool (it skips those it holds already).
    pub(crate) fn register_prefix(&mut self, seq: &mut Seq) {
        let Some(prefix) = self.prefix.as_mut() else { return };
        let bs = self.cfg.block_size;
        let full = (seq.fed / bs).min(seq.table.blocks().len());
        let mut fresh: Vec<(usize, BlockHash)> = Vec::new();
        while seq.hashes.len() < full {
            let i = seq.hashes.len();
            let parent = seq.hashes.last().copied();
            let block = &seq.tokens[i * bs..(i + 1) * bs];
            let h = chain_hash(parent.unwrap_or(seq.root), block);
            let b = seq.table.blocks()[i];
            if prefix.insert(parent, h, b) {
                self.prefix_tokens.insert(b, block.into());
                if let Err(e) = self.cache.retain(b) {
                    tracing::error!("retaining a prefix block failed: {e}");
                }
                fresh.push((i, h));
            }
            seq.hashes.push(h);
        }
        if let Some(pool) = self.pool.as_mut().filter(|_| !fresh.is_empty()) {
            let keys: Vec<BlockHash> = fresh.iter().map(|(_, h)| *h).collect();
            let (cache, table) = (&self.cache, &seq.table);
            pool.store(&keys, |j| cache.export_blocks(table, fresh[j].0, fresh[j].0 + 1));
        }
    }
}
