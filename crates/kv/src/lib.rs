//! KV cache handling, the stage between prefill and decode: deciding what can be reused (prefix
//! hashing), what must be filled, and what must move to another process.
//!
//! It is its own crate, apart from the engine, because the same block identities are used by the
//! gateway's cache-aware router (which never loads a model) and by the transfer transport (which
//! never runs one). [`PrefixCache`] is the reuse index every worker keeps; the bytes of a block
//! move between processes in the worker crate, framed by the protocol crate.

mod prefix;

pub use prefix::PrefixCache;

use std::fmt;

/// Errors of the KV handling layer.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A block size of zero tokens was asked for.
    #[error("block size must be at least one token")]
    ZeroBlockSize,
}

/// Identity of one full KV block: a hash chained over every token from the start of the sequence
/// to the end of this block, so equal hashes mean an equal prefix, not just an equal block.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:016x})", self.0)
    }
}

/// Chained hashes of the full blocks of `tokens` (a trailing partial block has no hash: it cannot
/// be shared until it is full). FNV-1a over the previous hash and the block's tokens; stable across
/// processes and builds, which `std`'s randomly keyed hasher is not.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Result<Vec<BlockHash>, KvError> {
    if block_size == 0 {
        return Err(KvError::ZeroBlockSize);
    }
    let mut prev = None;
    Ok(tokens
        .chunks_exact(block_size)
        .map(|block| {
            let h = chain_hash(prev, block);
            prev = Some(h);
            h
        })
        .collect())
}

/// The hash of one block given the hash of the block before it (`None` for the first block):
/// the incremental form of [`block_hashes`], for a sequence whose blocks fill one at a time.
pub fn chain_hash(prev: Option<BlockHash>, block: &[u32]) -> BlockHash {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;
    let prev = prev.map_or(OFFSET, |p| p.0);
    let mut h = OFFSET;
    for b in prev.to_le_bytes().into_iter().chain(block.iter().flat_map(|t| t.to_le_bytes())) {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    }
    BlockHash(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_hashes_and_diverge_after() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7], 2).unwrap();
        let b = block_hashes(&[1, 2, 3, 4, 9, 6], 2).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(b.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn same_block_at_another_position_hashes_differently() {
        let h = block_hashes(&[7, 7, 7, 7], 2).unwrap();
        assert_ne!(h[0], h[1]);
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert!(matches!(block_hashes(&[1], 0), Err(KvError::ZeroBlockSize)));
    }
}
