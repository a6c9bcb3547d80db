//! The second-sighting filter's memory: keys seen once, bounded, the oldest forgotten first.

use std::collections::VecDeque;

use crate::BlockHash;

/// A bounded set of keys, forgetting the oldest first.
#[derive(Debug)]
pub(super) struct SeenOnce {
    keys: std::collections::HashSet<BlockHash>,
    order: VecDeque<BlockHash>,
    cap: usize,
}

impl SeenOnce {
    pub(super) fn new(cap: usize) -> Self {
        Self { keys: Default::default(), order: VecDeque::new(), cap: cap.max(1) }
    }

    /// Remembers `key`; whether it was seen before (then it is forgotten: it is sighted now).
    pub(super) fn sight(&mut self, key: BlockHash) -> bool {
        if self.keys.remove(&key) {
            return true;
        }
        self.keys.insert(key);
        self.order.push_back(key);
        // `order` may hold keys already taken out by a second sighting; they are skipped here.
        while self.keys.len() > self.cap || self.order.len() > 2 * self.cap {
            let Some(old) = self.order.pop_front() else { break };
            self.keys.remove(&old);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> BlockHash {
        crate::chain_hash(BlockHash::namespace(&[b"seen-tests"]), &[i])
    }

    #[test]
    fn the_seen_once_set_stays_bounded() {
        let mut s = SeenOnce::new(3);
        for i in 0..100 {
            assert!(!s.sight(key(i)));
            assert!(s.keys.len() <= 3 && s.order.len() <= 6);
        }
        assert!(s.sight(key(99)), "the newest is remembered");
        assert!(!s.sight(key(0)), "the oldest was forgotten");
    }
}
