//! The routing decision both of the gateway's multi-target backends make — tokenpath workers
//! ([`crate::cluster`]) and HTTP upstreams ([`crate::upstream`]) — written once: the gateway's
//! own prefix index over token ids (which prompt prefixes it sent where), and the cache-aware
//! choice with a balance bound.
//!
//! The target with the longest remembered prefix of the prompt wins, unless it already carries
//! [`BALANCE_THRESHOLD`] more requests than the least-loaded one: a cache-aware router without
//! that bound sends every request sharing a hot system prompt to one target and melts it.

use std::collections::HashMap;
use tokenpath_kv::{block_hashes, BlockHash, PrefixCache};

/// How many more in-flight requests the prefix-preferred target may carry than the least-loaded
/// one before the router ignores the prefix.
pub const BALANCE_THRESHOLD: usize = 4;
/// Block size the router hashes prompts with (tokenpath workers use the same, so prefix
/// affinity matches their caches).
const ROUTER_BLOCK: usize = 16;
/// Most prefix entries remembered per target.
const MAX_PREFIX_ENTRIES: usize = 65_536;

/// Which prompt prefixes were sent to which target (by key: an address or a URL).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    per_target: HashMap<String, PrefixCache<()>>,
}

impl PrefixIndex {
    /// The prompt's chained block hashes, scoped (a tenant's prompts never steer another
    /// tenant's routing).
    pub fn hashes(prompt: &[u32], scope: Option<&str>) -> Vec<BlockHash> {
        let root = BlockHash::namespace(&[b"router"]).scoped(scope);
        block_hashes(root, prompt, ROUTER_BLOCK).unwrap_or_default()
    }

    /// How many leading blocks of `hashes` were sent to `key`.
    pub fn matched(&self, key: &str, hashes: &[BlockHash]) -> usize {
        self.per_target.get(key).map_or(0, |p| p.matched(hashes))
    }

    /// `hashes` went to `key` (oldest entries forgotten past the bound).
    pub fn remember(&mut self, key: &str, hashes: &[BlockHash]) {
        let p = self.per_target.entry(key.to_owned()).or_default();
        let mut parent = None;
        for h in hashes {
            p.insert(parent, *h, ());
            parent = Some(*h);
        }
        while p.len() > MAX_PREFIX_ENTRIES {
            if p.evict(|()| true).is_none() {
                break;
            }
        }
    }

    /// `key` lost its cache (it died, or left).
    pub fn forget(&mut self, key: &str) {
        self.per_target.remove(key);
    }
}

/// One routing candidate: its key, its load (in-flight requests) and how many prompt blocks it
/// is remembered to hold.
#[derive(Clone, Copy, Debug)]
pub struct Candidate<'a> {
    pub key: &'a str,
    pub load: u64,
    pub matched: usize,
}

/// The cache-aware pick within the balance bound (ties: the less loaded, then the first).
pub fn cache_aware<'a>(candidates: &[Candidate<'a>]) -> Option<&'a str> {
    let least = candidates.iter().map(|c| c.load).min()?;
    let bound = least.saturating_add(BALANCE_THRESHOLD as u64);
    candidates
        .iter()
        .filter(|c| c.load <= bound)
        .fold(None::<&Candidate<'a>>, |best, c| match best {
            Some(b) if (b.matched, std::cmp::Reverse(b.load)) >= (c.matched, std::cmp::Reverse(c.load)) => {
                Some(b)
            }
            _ => Some(c),
        })
        .map(|c| c.key)
}

/// One decode-worker candidate for a PD request: its load (requests in flight plus running
/// sequences) and its free KV room (`None`: not reported yet).
#[derive(Clone, Copy, Debug)]
pub struct DecodeCandidate<'a> {
    pub key: &'a str,
    pub load: u64,
    /// Free blocks and tokens per block.
    pub room: Option<(u64, u64)>,
}

/// The decode worker for a prompt of `prompt_len` tokens: among those with room for its whole
/// KV, the least loaded, then the one with the most free blocks, then the first. The gateway's
/// PD routing and the simulator's both decide with it.
pub fn decode_pick<'a>(candidates: &[DecodeCandidate<'a>], prompt_len: usize) -> Option<&'a str> {
    candidates
        .iter()
        .filter(|c| c.room.is_none_or(|(free, bs)| free.saturating_mul(bs.max(1)) > prompt_len as u64))
        .min_by_key(|c| (c.load, std::cmp::Reverse(c.room.map_or(0, |(free, _)| free))))
        .map(|c| c.key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(key: &str, load: u64, matched: usize) -> Candidate<'_> {
        Candidate { key, load, matched }
    }

    #[test]
    fn the_longest_prefix_wins_within_the_balance_bound() {
        assert_eq!(cache_aware(&[c("a", 0, 0), c("b", 3, 5)]), Some("b"));
        assert_eq!(cache_aware(&[c("a", 0, 0), c("b", 5, 5)]), Some("a"), "over the bound");
        assert_eq!(cache_aware(&[c("a", 2, 1), c("b", 1, 1)]), Some("b"), "tie: less loaded");
        assert_eq!(cache_aware(&[c("a", 1, 1), c("b", 1, 1)]), Some("a"), "tie: first");
        assert_eq!(cache_aware(&[]), None);
    }

    #[test]
    fn the_decode_pick_needs_room_then_takes_the_least_loaded() {
        let d = |key, load, room| DecodeCandidate { key, load, room };
        let room = |free| Some((free, 16));
        assert_eq!(decode_pick(&[d("a", 0, room(4)), d("b", 3, room(100))], 100), Some("b"), "a lacks room");
        assert_eq!(decode_pick(&[d("a", 2, room(100)), d("b", 1, room(10))], 100), Some("b"));
        assert_eq!(
            decode_pick(&[d("a", 1, room(10)), d("b", 1, room(50))], 100),
            Some("b"),
            "tie: more room"
        );
        assert_eq!(
            decode_pick(&[d("a", 1, None), d("b", 1, None)], 1 << 20),
            Some("a"),
            "unknown room: tried"
        );
        assert_eq!(decode_pick(&[d("a", 0, room(1))], 16), None, "exactly full is no room");
    }

    #[test]
    fn the_index_remembers_prefixes_per_target_and_scope() {
        let mut ix = PrefixIndex::default();
        let prompt: Vec<u32> = (0..64).collect();
        let h = PrefixIndex::hashes(&prompt, Some("t1"));
        ix.remember("a", &h[..2]);
        assert_eq!(ix.matched("a", &h), 2);
        assert_eq!(ix.matched("b", &h), 0);
        assert_eq!(ix.matched("a", &PrefixIndex::hashes(&prompt, Some("t2"))), 0, "another tenant");
        ix.forget("a");
        assert_eq!(ix.matched("a", &h), 0);
    }

    proptest! {
        /// Whatever the loads and matches, the pick is a candidate within the bound of the least.
        #[test]
        fn the_pick_never_exceeds_the_bound(v in proptest::collection::vec((0u64..20, 0usize..8), 1..12)) {
            let keys: Vec<String> = (0..v.len()).map(|i| i.to_string()).collect();
            let cands: Vec<Candidate<'_>> =
                v.iter().zip(&keys).map(|(&(load, matched), k)| Candidate { key: k, load, matched }).collect();
            let pick = cache_aware(&cands).unwrap();
            let least = cands.iter().map(|c| c.load).min().unwrap();
            let chosen = cands.iter().find(|c| c.key == pick).unwrap();
            prop_assert!(chosen.load <= least + BALANCE_THRESHOLD as u64);
            let best = cands.iter().filter(|c| c.load <= least + BALANCE_THRESHOLD as u64).map(|c| c.matched).max().unwrap();
            prop_assert_eq!(chosen.matched, best);
        }
    }
}
