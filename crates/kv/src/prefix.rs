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
use std::collections::BTreeMap;

/// Hash maps keyed by digests and block ids, with aHash's randomly keyed hasher (SipHash was a
/// fifth of a simulated step's cost; the keys come from clients' tokens, so the key stays random).
type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;
use std::hash::Hash;

/// Where an entry lives in [`PrefixCache::slots`]. Entries point at their parent by slot, so
/// walking a chain (pins, eviction) costs no hash lookups; a slot is reused only after its entry
/// is evicted, and an entry with children is never evicted, so a parent's slot stays its own.
type Slot = u32;

#[derive(Debug, Clone)]
struct Entry<B> {
    hash: BlockHash,
    block: B,
    parent: Option<Slot>,
    children: u32,
    tick: u64,
    /// Someone besides the index uses the block ([`PrefixCache::set_pinned`]).
    pinned: bool,
    /// Children whose subtree holds a pinned entry.
    kept_children: u32,
}

impl<B> Entry<B> {
    /// Not evictable, now or after its descendants: pinned, or above a pinned entry.
    fn kept(&self) -> bool {
        self.pinned || self.kept_children > 0
    }
}

/// Chained block hash → block, with leaf-first LRU eviction.
#[derive(Debug, Clone)]
pub struct PrefixCache<B> {
    /// Chained hash → its entry's slot.
    map: HashMap<BlockHash, Slot>,
    /// The entries (`None`: a free slot, listed in `free`).
    slots: Vec<Option<Entry<B>>>,
    free: Vec<Slot>,
    /// Which entry holds each block (a block holds one chain position at most).
    by_block: HashMap<B, Slot>,
    /// Entries that are pinned or have a pinned descendant (kept as pins change, so the
    /// evictable count costs nothing to ask for).
    kept: usize,
    /// The leaves (entries nothing cached extends) by last use: eviction looks only here, so it
    /// never walks past the parents of long chains (security review L8: a scan of every entry,
    /// oldest first, made each eviction cost about a chain's length).
    leaves: BTreeMap<u64, Slot>,
    tick: u64,
}

impl<B> Default for PrefixCache<B> {
    fn default() -> Self {
        Self {
            map: HashMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            by_block: HashMap::default(),
            kept: 0,
            leaves: BTreeMap::new(),
            tick: 0,
        }
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

    /// The block cached under `hash`, without touching anything.
    pub fn peek(&self, hash: BlockHash) -> Option<B>
    where
        B: Copy,
    {
        self.map.get(&hash).and_then(|s| self.entry(*s)).map(|e| e.block)
    }

    fn entry(&self, slot: Slot) -> Option<&Entry<B>> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    fn entry_mut(&mut self, slot: Slot) -> Option<&mut Entry<B>> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    fn touch(&mut self, slot: Slot) {
        self.tick += 1;
        let tick = self.tick;
        let Some(e) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else { return };
        if e.children == 0 {
            self.leaves.remove(&e.tick);
            self.leaves.insert(tick, slot);
        }
        e.tick = tick;
    }

    /// The blocks of the longest cached prefix of `hashes` (a chain from the first block), all
    /// marked as just used.
    pub fn lookup(&mut self, hashes: &[BlockHash]) -> Vec<B> {
        let hit: Vec<Slot> = hashes.iter().map_while(|h| self.map.get(h).copied()).collect();
        let mut blocks = Vec::with_capacity(hit.len());
        for s in hit {
            self.touch(s);
            if let Some(e) = self.entry(s) {
                blocks.push(e.block);
            }
        }
        blocks
    }

    /// How many leading blocks of `hashes` are cached, without touching anything (for routing).
    pub fn matched(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.map.contains_key(h)).count()
    }

    /// Records that `block` holds the chain ending in `hash`, extending `parent` (`None` for a
    /// sequence's first block). Returns `true` when the entry is new — the caller then keeps
    /// one reference on `block` for the index. An already cached hash, or a parent that is no
    /// longer cached (the entry could never be matched), returns `false`. Pins
    /// ([`PrefixCache::set_pinned`]) follow a block's first entry: an owner that pins gives
    /// each block one chain position (the router's index of `()` blocks pins nothing).
    pub fn insert(&mut self, parent: Option<BlockHash>, hash: BlockHash, block: B) -> bool {
        if let Some(&s) = self.map.get(&hash) {
            self.touch(s);
            return false;
        }
        let parent = match parent {
            Some(p) => {
                let Some(&ps) = self.map.get(&p) else { return false };
                let Some(pe) = self.slots.get_mut(ps as usize).and_then(Option::as_mut) else {
                    return false;
                };
                if pe.children == 0 {
                    self.leaves.remove(&pe.tick);
                }
                pe.children += 1;
                Some(ps)
            }
            None => None,
        };
        self.tick += 1;
        let e = Entry { hash, block, parent, children: 0, tick: self.tick, pinned: false, kept_children: 0 };
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(e);
                s
            }
            None => {
                self.slots.push(Some(e));
                (self.slots.len() - 1) as Slot
            }
        };
        self.map.insert(hash, slot);
        self.by_block.entry(block).or_insert(slot);
        self.leaves.insert(self.tick, slot);
        true
    }

    /// Removes the least recently used leaf whose block `can_free` allows (typically: nobody
    /// but the index references it) and returns its block, which the caller releases.
    pub fn evict(&mut self, mut can_free: impl FnMut(B) -> bool) -> Option<B> {
        let (tick, slot) = self
            .leaves
            .iter()
            .map(|(t, s)| (*t, *s))
            .find(|(_, s)| self.entry(*s).is_some_and(|e| can_free(e.block)))?;
        self.leaves.remove(&tick);
        let e = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        self.map.remove(&e.hash);
        if self.by_block.get(&e.block) == Some(&slot) {
            self.by_block.remove(&e.block);
        }
        if e.kept() {
            // Only when the caller's `can_free` and its pins disagree; the books stay right.
            self.kept -= 1;
            self.propagate(e.parent, false);
        }
        if let Some(p) = e.parent {
            if let Some(pe) = self.entry_mut(p) {
                pe.children = pe.children.saturating_sub(1);
                if pe.children == 0 {
                    let t = pe.tick;
                    self.leaves.insert(t, p);
                }
            }
        }
        Some(e.block)
    }

    /// The leaf index holds exactly the entries without children, each at its own tick, and
    /// the hash map and the slots agree.
    #[cfg(test)]
    fn check_leaves(&self) {
        let live: Vec<(Slot, &Entry<B>)> =
            self.slots.iter().enumerate().filter_map(|(i, e)| Some((i as Slot, e.as_ref()?))).collect();
        assert_eq!(live.len(), self.map.len());
        assert_eq!(live.len() + self.free.len(), self.slots.len());
        for (s, e) in &live {
            assert_eq!(self.map.get(&e.hash), Some(s));
        }
        let leaves: Vec<(u64, Slot)> =
            live.iter().filter(|(_, e)| e.children == 0).map(|(s, e)| (e.tick, *s)).collect();
        assert_eq!(leaves.len(), self.leaves.len());
        for (t, s) in leaves {
            assert_eq!(self.leaves.get(&t), Some(&s));
        }
    }

    /// Tells the index whether someone besides it uses `block` (the owner calls it as a
    /// block's reference count passes 1; a block the index does not hold is ignored). Pinned
    /// entries and their ancestors are what [`PrefixCache::evictable_now`] leaves out.
    pub fn set_pinned(&mut self, block: B, pinned: bool) {
        let Some(&slot) = self.by_block.get(&block) else { return };
        let Some(e) = self.entry_mut(slot) else { return };
        if e.pinned == pinned {
            return;
        }
        let was = e.kept();
        e.pinned = pinned;
        let now = e.kept();
        let parent = e.parent;
        if was != now {
            if now {
                self.kept += 1;
            } else {
                self.kept -= 1;
            }
            self.propagate(parent, now);
        }
    }

    /// A child of `parent` became kept (`true`) or stopped being kept: up the chain until an
    /// ancestor's own state does not change (amortised O(1) per pin for chains pinned and
    /// unpinned in order).
    fn propagate(&mut self, mut parent: Option<Slot>, became: bool) {
        while let Some(s) = parent {
            let Some(p) = self.slots.get_mut(s as usize).and_then(Option::as_mut) else { return };
            let was = p.kept();
            if became {
                p.kept_children += 1;
            } else {
                p.kept_children = p.kept_children.saturating_sub(1);
            }
            let now = p.kept();
            if was == now {
                return;
            }
            if now {
                self.kept += 1;
            } else {
                self.kept -= 1;
            }
            parent = p.parent;
        }
    }

    /// How many blocks repeated [`PrefixCache::evict`] could free given the pins
    /// ([`PrefixCache::set_pinned`]): every entry but the pinned ones and their ancestors. O(1):
    /// the scheduler asks before every step, with thousands of cached blocks.
    pub fn evictable_now(&self) -> usize {
        self.map.len() - self.kept
    }

    /// How many blocks [`PrefixCache::evict`] could free right now, evicting repeatedly (a
    /// chain of unreferenced blocks counts whole: its leaf goes first, then its parent): the
    /// O(index) reference [`PrefixCache::evictable_now`] is tested against.
    #[cfg(test)]
    fn evictable(&self, mut can_free: impl FnMut(B) -> bool) -> usize {
        // An entry is reclaimable when its block is free-able and all its children are too.
        let mut pending: HashMap<Slot, u32> = HashMap::default();
        let mut stack: Vec<Slot> = Vec::new();
        let mut free_able: HashMap<Slot, bool> = HashMap::default();
        for (i, e) in self.slots.iter().enumerate() {
            let Some(e) = e else { continue };
            let s = i as Slot;
            free_able.insert(s, can_free(e.block));
            pending.insert(s, e.children);
            if e.children == 0 {
                stack.push(s);
            }
        }
        let mut count = 0;
        while let Some(s) = stack.pop() {
            if !free_able.get(&s).copied().unwrap_or(false) {
                continue;
            }
            count += 1;
            if let Some(p) = self.entry(s).and_then(|e| e.parent) {
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

    /// Regression: pins once made `insert` refuse a block indexed under another hash, and the
    /// router's index, whose blocks are all `()`, kept one entry only.
    #[test]
    fn an_index_of_unit_blocks_keeps_every_chain() {
        let mut c: PrefixCache<()> = PrefixCache::new();
        let h = chain(&[1, 2, 3, 4, 5, 6]);
        let mut parent = None;
        for x in &h {
            assert!(c.insert(parent, *x, ()));
            parent = Some(*x);
        }
        assert_eq!(c.matched(&h), 3);
    }

    #[test]
    fn pins_keep_a_block_and_its_ancestors() {
        let mut c = PrefixCache::new();
        let h = chain(&[1, 2, 3, 4]);
        assert!(c.insert(None, h[0], 7u32));
        assert!(c.insert(Some(h[0]), h[1], 8));
        c.set_pinned(8, true);
        assert_eq!(c.evictable_now(), 0, "a pinned leaf keeps its parent");
        c.set_pinned(8, false);
        c.set_pinned(7, true);
        assert_eq!(c.evictable_now(), 1, "a pinned parent keeps only itself");
        c.set_pinned(7, false);
        c.set_pinned(99, true);
        assert_eq!(c.evictable_now(), 2, "a block the index does not hold changes nothing");
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
            // Pins kept as they change give the count the predicate gives, pinning and
            // unpinning in any order.
            for b in &pinned {
                c.set_pinned(*b, true);
            }
            let (unpin, pinned) = pinned.split_at(pinned.len() / 2);
            for b in unpin {
                if !pinned.contains(b) {
                    c.set_pinned(*b, false);
                }
            }
            let can = |b: u32| !pinned.contains(&b);
            let expect = c.evictable(can);
            prop_assert_eq!(c.evictable_now(), expect);
            let mut got = Vec::new();
            while let Some(b) = c.evict(can) {
                prop_assert!(!got.contains(&b));
                got.push(b);
                c.check_leaves();
                prop_assert_eq!(c.evictable_now(), c.evictable(can));
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
