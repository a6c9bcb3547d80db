//! The batcher's prefix reuse: attaching the longest cached prefix to a fresh sequence (each
//! hit checked against the very tokens it was computed from), registering a sequence's full
//! blocks, and evicting what nobody uses when room is needed. Apart from `batcher.rs` because it
//! is the one part that talks to the prefix index (`tokenpath_kv::PrefixCache`).

use super::Batcher;
use crate::seq::Seq;
use tokenpath_kv::{block_hashes, chain_hash};

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
        if blocks.is_empty() {
            return;
        }
        match self.cache.share(&blocks) {
            Ok(table) => {
                seq.table = table;
                seq.fed = blocks.len() * bs;
                if seq.hashes.len() < blocks.len() {
                    seq.hashes = hashes[..blocks.len()].to_vec();
                }
                if seq.cached_tokens == 0 && !seq.prefill_started {
                    seq.cached_tokens = seq.fed.min(seq.prompt_len);
                    self.stats.prompt_tokens_cached += seq.cached_tokens as u64;
                }
            }
            Err(e) => tracing::error!(request = %seq.id, "sharing cached prefix blocks failed: {e}"),
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
            seq.hashes.push(h);
        }
    }
}
