//! The prefix cache index: which KV block holds which chained block hash, and which of those
//! blocks to give back first when the pool runs dry.
//!
//! It is generic over the block id and never touches KV memory: the owner (a worker's batcher,
//! which owns the engine's cache) keeps one reference on every block the index holds and asks
//! [`PrefixCache::evict`] for a block to release when it needs room. Only LEAVES are evicted
//! (entries no other cached entry extends), least recently used first: evicting a parent would
//! strand its children, since a lookup only ever matches a prefix from the first block on. A
//! lookup touches the whole matched chain, so a hot system prompt stays while cold suffixes go.

use crate::BlockHash;
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

#[derive(Debug, Clone)]
struct Entry<B> {
    block: B,
    parent: Option<BlockHash>,
    children: u32,
    tick: u64,
}

/// Chained block hash → block, with leaf-first LRU eviction.
#[derive(Debug, Clone)]
pub struct PrefixCache<B> {
    map: HashMap<BlockHash, Entry<B>>,
    /// The leaves (entries nothing cached extends) by last use: eviction looks only here, so it
    /// never walks past the parents of long chains (security review L8: a scan of every entry,
    /// oldest first, made each eviction cost about a chain's length).
    leaves: BTreeMap<u64, BlockHash>,
    tick: u64,
}

impl<B> Default for PrefixCache<B> {
    fn default() -> Self {
        Self { map: HashMap::new(), leaves: BTreeMap::new(), tick: 0 }
    }
}

impl<B: Copy + Eq + Hash> PrefixCache<B> {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries (= blocks the index holds a reference on).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.map.contains_key(&hash)
    }

    fn touch(&mut self, hash: BlockHash) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.map.get_mut(&hash) {
            if e.children == 0 {
                self.leaves.remove(&e.tick);
                self.leaves.insert(tick, hash);
            }
            e.tick = tick;
        }
    }

    /// The blocks of the longest cached prefix of `hashes` (a chain from the first block), all
    /// marked as just used.
    pub fn lookup(&mut self, hashes: &[BlockHash]) -> Vec<B> {
        let hit: Vec<(BlockHash, B)> =
            hashes.iter().map_while(|h| self.map.get(h).map(|e| (*h, e.block))).collect();
        for (h, _) in &hit {
            self.touch(*h);
        }
        hit.into_iter().map(|(_, b)| b).collect()
    }

    /// How many leading blocks of `hashes` are cached, without touching anything (for routing).
    pub fn matched(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.map.contains_key(h)).count()
    }

    /// Records that `block` holds the chain ending in `hash`, extending `parent` (`None` for a
    /// sequence's first block). Returns `true` when the entry is new — the caller then keeps
    /// one reference on `block` for the index. An already cached hash, or a parent that is no
    /// longer cached (the entry could never be matched), returns `false`.
    pub fn insert(&mut self, parent: Option<BlockHash>, hash: BlockHash, block: B) -> bool {
        if self.map.contains_key(&hash) {
            self.touch(hash);
            return false;
        }
        if let Some(p) = parent {
            match self.map.get_mut(&p) {
                Some(pe) => {
                    if pe.children == 0 {
                        self.leaves.remove(&pe.tick);
                    }
                    pe.children += 1;
                }
                None => return false,
            }
        }
        self.tick += 1;
        self.map.insert(hash, Entry { block, parent, children: 0, tick: self.tick });
        self.leaves.insert(self.tick, hash);
        true
    }

    /// Removes the least recently used leaf whose block `can_free` allows (typically: nobody
    /// but the index references it) and returns its block, which the caller releases.
    pub fn evict(&mut self, mut can_free: impl FnMut(B) -> bool) -> Option<B> {
        let (tick, hash) = self
            .leaves
            .iter()
            .map(|(t, h)| (*t, *h))
            .find(|(_, h)| self.map.get(h).is_some_and(|e| can_free(e.block)))?;
        self.leaves.remove(&tick);
        let e = self.map.remove(&hash)?;
        if let Some(p) = e.parent {
            if let Some(pe) = self.map.get_mut(&p) {
                pe.children = pe.children.saturating_sub(1);
                if pe.children == 0 {
                    self.leaves.insert(pe.tick, p);
                }
            }
        }
        Some(e.block)
    }

    /// The leaf index holds exactly the entries without children, each at its own tick.
    #[cfg(test)]
    fn check_leaves(&self) {
        let leaves: Vec<(u64, BlockHash)> =
            self.map.iter().filter(|(_, e)| e.children == 0).map(|(h, e)| (e.tick, *h)).collect();
        assert_eq!(leaves.len(), self.leaves.len());
        for (t, h) in leaves {
            assert_eq!(self.leaves.get(&t), Some(&h));
        }
    }

    /// How many blocks [`PrefixCache::evict`] could free right now, evicting repeatedly (a
    /// chain of unreferenced blocks counts whole: its leaf goes first, then its parent).
    pub fn evictable(&self, mut can_free: impl FnMut(B) -> bool) -> usize {
        // An entry is reclaimable when its block is free-able and all its children are too.
        let mut pending: HashMap<BlockHash, u32> = HashMap::new();
        let mut stack: Vec<BlockHash> = Vec::new();
        let mut free_able: HashMap<BlockHash, bool> = HashMap::new();
        for (h, e) in &self.map {
            free_able.insert(*h, can_free(e.block));
            pending.insert(*h, e.children);
            if e.children == 0 {
                stack.push(*h);
            }
        }
        let mut count = 0;
        while let Some(h) = stack.pop() {
            if !free_able.get(&h).copied().unwrap_or(false) {
                continue;
            }
            count += 1;
            if let Some(p) = self.map.get(&h).and_then(|e| e.parent) {
                if let Some(n) = pending.get_mut(&p) {
                    *n -= 1;
                    if *n == 0 {
                        stack.push(p);
                    }
                }
            }
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hashes;
    use proptest::prelude::*;

    fn chain(tokens: &[u32]) -> Vec<BlockHash> {
        block_hashes(crate::BlockHash::namespace(&[]), tokens, 2).unwrap()
    }

    fn insert_chain(c: &mut PrefixCache<u32>, hashes: &[BlockHash], first_block: u32) {
        let mut parent = None;
        for (i, h) in hashes.iter().enumerate() {
            c.insert(parent, *h, first_block + i as u32);
            parent = Some(*h);
        }
    }

    #[test]
    fn lookup_finds_the_longest_cached_prefix() {
        let mut c = PrefixCache::new();
        let a = chain(&[1, 2, 3, 4, 5, 6]);
        insert_chain(&mut c, &a, 10);
        assert_eq!(c.lookup(&a), vec![10, 11, 12]);
        let b = chain(&[1, 2, 3, 4, 9, 9]);
        assert_eq!(c.lookup(&b), vec![10, 11]);
        assert_eq!(c.matched(&b), 2);
        assert!(c.lookup(&chain(&[7, 7])).is_empty());
    }

    #[test]
    fn leaves_go_first_and_parents_follow() {
        let mut c = PrefixCache::new();
        let a = chain(&[1, 2, 3, 4, 5, 6]);
        insert_chain(&mut c, &a, 0);
        assert_eq!(c.evictable(|_| true), 3);
        assert_eq!(c.evict(|_| true), Some(2));
        assert_eq!(c.evict(|_| true), Some(1));
        assert_eq!(c.evict(|_| true), Some(0));
        assert_eq!(c.evict(|_| true), None);
    }

    #[test]
    fn referenced_blocks_and_their_ancestors_stay() {
        let mut c = PrefixCache::new();
        insert_chain(&mut c, &chain(&[1, 2, 3, 4]), 0);
        assert_eq!(c.evictable(|b| b != 1), 0, "the leaf is in use, so its parent is too");
        assert_eq!(c.evict(|b| b != 1), None);
    }

    #[test]
    fn orphan_inserts_are_refused() {
        let mut c: PrefixCache<u32> = PrefixCache::new();
        let a = chain(&[1, 2, 3, 4]);
        assert!(!c.insert(Some(a[0]), a[1], 5));
        assert!(c.insert(None, a[0], 4));
        assert!(!c.insert(None, a[0], 9), "a cached hash keeps its block");
    }

    proptest! {
        /// Every block the index was given comes back exactly once through evictions, and the
        /// evictable count always matches what repeated eviction actually frees.
        #[test]
        fn evictions_return_each_block_once(seqs in proptest::collection::vec(
            proptest::collection::vec(0u32..3, 0..12), 1..12), pinned in proptest::collection::vec(0u32..64, 0..8)) {
            let mut c = PrefixCache::new();
            let mut next = 0u32;
            let mut held = Vec::new();
            for s in &seqs {
                let mut parent = None;
                for h in chain(s) {
                    if c.insert(parent, h, next) {
                        held.push(next);
                    }
                    next += 1;
                    parent = Some(h);
                }
                // Touch an earlier chain's prefix: reorders the LRU (leaves and inner entries).
                let first = chain(&seqs[0]);
                let _ = c.lookup(&first[..first.len().min(1)]);
                c.check_leaves();
            }
            let can = |b: u32| !pinned.contains(&b);
            let expect = c.evictable(can);
            let mut got = Vec::new();
            while let Some(b) = c.evict(can) {
                prop_assert!(!got.contains(&b));
                got.push(b);
                c.check_leaves();
            }
            prop_assert_eq!(got.len(), expect);
            got.sort_unstable();
            for b in &got {
                prop_assert!(held.contains(b));
            }
            prop_assert_eq!(c.len() + got.len(), held.len());
        }
    }
}
