//! Prefix reuse: attaching the longest cached prefix to a fresh sequence (each hit checked
//! against the very tokens it was computed from), registering a sequence's full blocks, and
//! evicting what nobody uses when room is needed. Apart from `lib.rs` because it is the one part
//! that talks to the prefix index (`tokenpath_kv::PrefixCache`).

use crate::{Scheduler, SeqCore, Sequence};
use tokenpath_engine::kv_cache::{BlockId, BlockTable};
use tokenpath_kv::{block_hashes, chain_hash, BlockHash, PrefixCache};

/// A fresh sequence's prefix as far as the arena holds it: the table sharing the arena's blocks,
/// and how many those are (the chain of its cacheable prompt blocks is in the sequence's
/// `prompt_hashes`). A [`crate::PrefixSource`] may extend it (loading more blocks into `table`)
/// before [`Scheduler::finish_attach`].
#[derive(Debug)]
pub struct Attached {
    /// The table: the arena's shared blocks first.
    pub table: BlockTable,
    /// Blocks that came from the arena.
    pub arena: usize,
}

/// The token ids of every block the prefix cache holds, checked on every hit: one row per
/// arena block in a flat table (a map from block to a boxed copy cost an allocation and two
/// hash-map operations per cached block — a fifth of a long simulation).
#[derive(Debug)]
pub(crate) struct BlockTokens {
    block_size: usize,
    tokens: Vec<u32>,
    held: Vec<bool>,
}

impl BlockTokens {
    pub(crate) fn new(block_size: usize) -> Self {
        Self { block_size, tokens: Vec::new(), held: Vec::new() }
    }

    fn set(&mut self, b: BlockId, tokens: &[u32]) {
        let (i, bs) = (b.0 as usize, self.block_size);
        if self.held.len() <= i {
            self.held.resize(i + 1, false);
            self.tokens.resize((i + 1) * bs, 0);
        }
        let n = tokens.len().min(bs);
        self.tokens[i * bs..i * bs + n].copy_from_slice(&tokens[..n]);
        self.held[i] = n == bs;
    }

    fn get(&self, b: BlockId) -> Option<&[u32]> {
        let (i, bs) = (b.0 as usize, self.block_size);
        self.held.get(i).copied().unwrap_or(false).then(|| &self.tokens[i * bs..(i + 1) * bs])
    }

    fn clear(&mut self, b: BlockId) {
        if let Some(h) = self.held.get_mut(b.0 as usize) {
            *h = false;
        }
    }
}

impl<S: Sequence> Scheduler<S> {
    /// Tells the prefix index which of its blocks sequences started or stopped using since the
    /// last call (the allocator records each block passing one reference).
    fn sync_pins(&mut self) {
        let Some(prefix) = self.prefix.as_mut() else { return };
        self.cache.drain_shared_changes(|b, shared| prefix.set_pinned(b, shared));
    }

    /// Free blocks plus blocks only the prefix cache holds (reclaimable at any time).
    pub fn available(&mut self) -> usize {
        self.sync_pins();
        self.cache.free_blocks() + self.prefix.as_ref().map_or(0, PrefixCache::evictable_now)
    }

    /// Evicts prefix-cache blocks nobody uses until `need` blocks are free (or none are left).
    pub fn reclaim(&mut self, need: usize) {
        self.sync_pins();
        let Some(prefix) = self.prefix.as_mut() else { return };
        while self.cache.free_blocks() < need {
            let cache = &self.cache;
            let Some(b) = prefix.evict(|b| cache.refcount(b) == 1) else { break };
            self.prefix_tokens.clear(b);
            if let Err(e) = self.cache.release(b) {
                tracing::error!("releasing an evicted prefix block failed: {e}");
            }
        }
    }

    /// Reserves blocks for a decode-mode sequence's whole prompt (its KV arrives from a prefill
    /// worker), giving up blocks only the prefix cache holds first. All or nothing.
    pub fn reserve_prompt(&mut self, seq: &mut SeqCore) -> Result<(), tokenpath_engine::error::EngineError> {
        self.reclaim(seq.prompt_len.div_ceil(self.policy.block_size));
        self.cache.reserve(&mut seq.table, seq.prompt_len)
    }

    /// The arena's part of attaching a prefix to a fresh sequence (nothing in its table, nothing
    /// fed): `None` when there is no prefix cache or the sequence is not fresh.
    pub fn attach_arena(&mut self, seq: &mut SeqCore) -> Option<Attached> {
        let prefix = self.prefix.as_mut()?;
        if !seq.table.is_empty() || !seq.table.blocks().is_empty() || seq.fed != 0 {
            return None;
        }
        let bs = self.policy.block_size;
        // Every whole block but the one holding the last token (its logits are needed); a
        // preempted sequence's generated tokens count too.
        let usable = (seq.tokens.len().max(1) - 1) / bs;
        if seq.prompt_hashes.len() != usable {
            seq.prompt_hashes = block_hashes(seq.root, &seq.tokens[..usable * bs], bs).ok()?;
        }
        let mut blocks = prefix.lookup(&seq.prompt_hashes);
        // Served only for the tokens it holds (a collision is infeasible; a bug must not become
        // another sequence's attention state).
        let verified = blocks
            .iter()
            .enumerate()
            .take_while(|(i, b)| {
                self.prefix_tokens.get(**b).is_some_and(|t| *t == seq.tokens[i * bs..(i + 1) * bs])
            })
            .count();
        if verified < blocks.len() {
            tracing::error!(verified, hits = blocks.len(), "prefix cache hit with other tokens");
            blocks.truncate(verified);
        }
        let table = if blocks.is_empty() {
            std::mem::take(&mut seq.table)
        } else {
            match self.cache.share(&blocks) {
                Ok(table) => table,
                Err(e) => {
                    tracing::error!("sharing cached prefix blocks failed: {e}");
                    return None;
                }
            }
        };
        Some(Attached { table, arena: blocks.len() })
    }

    /// Registers block `i` of `seq`'s prompt, loaded from elsewhere into `block`, in the prefix
    /// index like a computed one.
    pub fn insert_loaded(&mut self, seq: &SeqCore, hashes: &[BlockHash], i: usize, block: BlockId) {
        let bs = self.policy.block_size;
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        if let Some(prefix) = self.prefix.as_mut() {
            if prefix.insert(parent, hashes[i], block) {
                self.prefix_tokens.set(block, &seq.tokens[i * bs..(i + 1) * bs]);
                if let Err(e) = self.cache.retain(block) {
                    tracing::error!("retaining a prefix block failed: {e}");
                }
            }
        }
    }

    /// Ends an attach with its first `have` blocks holding valid KV: the sequence starts from
    /// there. Returns the prompt tokens it counts as cached when this was its first admission
    /// (0 otherwise: a preempted sequence's re-attach is no new hit).
    pub fn finish_attach(&mut self, seq: &mut SeqCore, a: Attached, have: usize) -> usize {
        let Attached { mut table, .. } = a;
        if have == 0 {
            seq.table = table;
            return 0;
        }
        let bs = self.policy.block_size;
        if let Err(e) = self.cache.set_len(&mut table, have * bs) {
            tracing::error!("a cached prefix does not fit its blocks: {e}");
        }
        seq.table = table;
        seq.fed = have * bs;
        if seq.hashes.len() < have {
            seq.hashes = seq.prompt_hashes[..have].to_vec();
        }
        if seq.cached_tokens == 0 && !seq.prefill_started {
            seq.cached_tokens = seq.fed.min(seq.prompt_len);
            self.counters.prompt_tokens_cached += seq.cached_tokens as u64;
            return seq.cached_tokens;
        }
        0
    }

    /// Registers a sequence's newly completed blocks in the prefix cache; returns the ones new
    /// to it (block index in the sequence, hash), which a pool may want to store.
    pub fn register(&mut self, seq: &mut SeqCore) -> Vec<(usize, BlockHash)> {
        let Some(prefix) = self.prefix.as_mut() else { return Vec::new() };
        let bs = self.policy.block_size;
        let full = (seq.fed / bs).min(seq.table.blocks().len());
        let mut fresh = Vec::new();
        while seq.hashes.len() < full {
            let i = seq.hashes.len();
            let parent = seq.hashes.last().copied();
            let block = &seq.tokens[i * bs..(i + 1) * bs];
            // The attach already chained the prompt's blocks (the same hashes: same root, same
            // tokens); only blocks past them are hashed here.
            let h = match seq.prompt_hashes.get(i) {
                Some(h) => *h,
                None => chain_hash(parent.unwrap_or(seq.root), block),
            };
            let b = seq.table.blocks()[i];
            if prefix.insert(parent, h, b) {
                self.prefix_tokens.set(b, block);
                if let Err(e) = self.cache.retain(b) {
                    tracing::error!("retaining a prefix block failed: {e}");
                }
                fresh.push((i, h));
            }
            seq.hashes.push(h);
        }
        fresh
    }
}
