//! The batcher's prefix reuse: attaching the longest cached prefix to a fresh sequence (each
//! hit checked against the very tokens it was computed from), registering a sequence's full
//! blocks, and evicting what nobody uses when room is needed. Apart from `batcher.rs` because it
//! is the one part that talks to the prefix index (`tokenpath_kv::PrefixCache`).

use super::Batcher;
use crate::seq::Seq;
use crate::{KvPoolConfig, WorkerError};
use tokenpath_kv::slab::{Slab, SlabGeometry};
use tokenpath_kv::{block_hashes, chain_hash, BlockHash};

/// Opens worker `id`'s SSD tier under `cfg.dir` for blocks of `block_bytes` under `root`.
pub(super) fn open_pool(
    cfg: &KvPoolConfig,
    id: &str,
    block_bytes: usize,
    root: BlockHash,
) -> Result<Slab, WorkerError> {
    let fail = |e: String| WorkerError::Config(format!("KV pool {}: {e}", cfg.dir.display()));
    std::fs::create_dir_all(&cfg.dir).map_err(|e| fail(e.to_string()))?;
    let payload_bytes = u32::try_from(block_bytes).map_err(|_| fail("a KV block over 4 GiB".into()))?;
    let slot = SlabGeometry { slots: 1, payload_bytes }.slot_bytes();
    let slots =
        u32::try_from(cfg.ssd_bytes.saturating_sub(tokenpath_kv::slab::PAGE) / slot).unwrap_or(u32::MAX);
    if slots == 0 {
        return Err(fail(format!("{} bytes hold no {slot}-byte slot", cfg.ssd_bytes)));
    }
    let geometry = SlabGeometry { slots, payload_bytes };
    let path = cfg.dir.join(format!("{id}.slab"));
    let (slab, report) = Slab::open(&path, geometry, root).map_err(|e| fail(e.to_string()))?;
    tracing::info!(
        path = %path.display(), blocks = report.blocks, torn = report.torn, foreign = report.foreign,
        "KV pool SSD tier opened"
    );
    Ok(slab)
}

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
        // Past the arena's blocks, the SSD tier's: each verified by the slab before use, read
        // into a fresh block and registered in the arena's index like a computed one. A block
        // the tier lacks or fails to verify ends the prefix (the rest is computed).
        let arena = blocks.len();
        let mut have = arena;
        if let Some(pool) = self.pool.as_mut() {
            while have < hashes.len() && pool.contains(&hashes[have]) && self.cache.free_blocks() > 0 {
                let bytes = match pool.get(&hashes[have]) {
                    Ok(Some(b)) => b,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(request = %seq.id, "KV pool read failed: {e}");
                        break;
                    }
                };
                if let Err(e) = self.cache.reserve(&mut table, (have + 1) * bs) {
                    tracing::warn!(request = %seq.id, "no block for a KV pool hit: {e}");
                    break;
                }
                if let Err(e) = self.cache.write_blocks(&table, have, &bytes) {
                    // The reserved block stays in the table as room for tokens to compute.
                    tracing::error!(request = %seq.id, "loading a KV pool block failed: {e}");
                    break;
                }
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
                have += 1;
            }
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
            seq.cached_tokens_ssd = seq.cached_tokens.saturating_sub(arena * bs);
            self.stats.prompt_tokens_cached += seq.cached_tokens as u64;
            self.stats.prompt_tokens_cached_ssd += seq.cached_tokens_ssd as u64;
        }
    }

    /// Registers a sequence's newly completed blocks in the prefix cache.
    pub(crate) fn register_prefix(&mut self, seq: &mut Seq) {
        let Some(prefix) = self.prefix.as_mut() else { return };
        let bs = self.cfg.block_size;
        let full = (seq.fed / bs).min(seq.table.blocks().len());
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
            }
            // Written through to the SSD tier (once per key): it survives this process.
            if let Some(pool) = self.pool.as_mut() {
                if !pool.contains(&h) {
                    let bytes = self.cache.export_blocks(&seq.table, i, i + 1);
                    if let Err(e) = pool.put(h, &bytes) {
                        tracing::warn!("KV pool write failed: {e}");
                    }
                }
            }
            seq.hashes.push(h);
        }
    }
}
