//! KV cache handling, the stage between prefill and decode: deciding what can be reused (prefix
//! hashing), what must be filled, and what must move to another process.
//!
//! It is its own crate, apart from the engine, because the same block identities are used by the
//! gateway's cache-aware router (which never loads a model) and by the transfer transport (which
//! never runs one). [`PrefixCache`] is the reuse index every worker keeps; the bytes of a block
//! move between processes in the worker crate, framed by the protocol crate. [`Slab`] is the KV
//! pool's SSD tier: blocks in a file of fixed slots that outlives the process, each verified
//! against its key, namespace and checksum before it is served.

pub mod pool;
mod prefix;
pub mod remote;
pub mod shm;
pub mod slab;
pub mod store;

pub use prefix::PrefixCache;
pub use slab::{Slab, SlabGeometry};

use std::fmt;

/// Errors of the KV handling layer.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A block size of zero tokens was asked for.
    #[error("block size must be at least one token")]
    ZeroBlockSize,
    /// A pool file could not be read or written.
    #[error("KV pool file {}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A slab file of another shape, or a block that does not fit its slots.
    #[error("KV pool slab: {0}")]
    SlabGeometry(String),
    /// The remote tier's server refused or could not be reached.
    #[error("KV pool remote tier {0}")]
    Remote(String),
}

/// Identity of one full KV block: BLAKE3 chained over a namespace and every token from the
/// start of the sequence to the end of this block, so equal hashes mean an equal prefix *in the
/// same namespace* (model, KV layout, numerics, and — when the cache is scoped — tenant). The
/// hash is collision-resistant: nobody can craft a prompt whose blocks collide with another's
/// (the FNV-1a it replaces could be steered), so a hit can neither be planted nor probed for.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

impl BlockHash {
    /// The root a namespace's chains start from: everything that makes KV valid or private,
    /// each part length-prefixed (so no two different lists of parts give the same bytes).
    pub fn namespace(parts: &[&[u8]]) -> Self {
        let mut h = blake3::Hasher::new_derive_key("tokenpath 2026-12-01 prefix namespace v1");
        for p in parts {
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        Self(*h.finalize().as_bytes())
    }

    /// The same namespace narrowed to `scope` (a tenant): chains under it never meet the
    /// parent's or another scope's.
    pub fn scoped(self, scope: Option<&str>) -> Self {
        match scope {
            None => self,
            Some(s) => Self::namespace(&[&self.0, b"scope", s.as_bytes()]),
        }
    }
}

/// Chained hashes of the full blocks of `tokens` under `root` (a trailing partial block has no
/// hash: it cannot be shared until it is full).
pub fn block_hashes(root: BlockHash, tokens: &[u32], block_size: usize) -> Result<Vec<BlockHash>, KvError> {
    if block_size == 0 {
        return Err(KvError::ZeroBlockSize);
    }
    let mut prev = root;
    Ok(tokens
        .chunks_exact(block_size)
        .map(|block| {
            prev = chain_hash(prev, block);
            prev
        })
        .collect())
}

/// The hash of one block given the hash before it (the namespace root for the first block):
/// the incremental form of [`block_hashes`], for a sequence whose blocks fill one at a time.
pub fn chain_hash(prev: BlockHash, block: &[u32]) -> BlockHash {
    // The same bytes as hashing the previous hash and each token's little-endian bytes in turn
    // (BLAKE3 does not depend on how its input is split), gathered first: one `update` instead
    // of one per token, which was most of the cost of keying a block.
    const ON_STACK: usize = 64;
    let mut buf = [0u8; 32 + 4 * ON_STACK];
    let mut h = blake3::Hasher::new();
    h.update(&prev.0);
    for part in block.chunks(ON_STACK) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(part) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..4 * part.len()]);
    }
    BlockHash(*h.finalize().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys are on disk (the KV pool's SSD tier) and shared between processes: gathering
    /// the bytes before hashing must not change a single one.
    #[test]
    fn a_block_key_is_the_hash_of_the_previous_key_and_the_tokens_bytes() {
        for n in [1usize, 16, 63, 64, 65, 200] {
            let block: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
            let prev = BlockHash::namespace(&[b"x"]);
            let mut bytes = prev.0.to_vec();
            for t in &block {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            assert_eq!(chain_hash(prev, &block).0, *blake3::hash(&bytes).as_bytes(), "{n} tokens");
        }
    }

    #[test]
    fn equal_prefixes_share_hashes_and_diverge_after() {
        let root = BlockHash::namespace(&[b"model"]);
        let a = block_hashes(root, &[1, 2, 3, 4, 5, 6, 7], 2).unwrap();
        let b = block_hashes(root, &[1, 2, 3, 4, 9, 6], 2).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(b.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn same_block_at_another_position_hashes_differently() {
        let h = block_hashes(BlockHash::namespace(&[]), &[7, 7, 7, 7], 2).unwrap();
        assert_ne!(h[0], h[1]);
    }

    #[test]
    fn namespaces_and_scopes_never_share_a_chain() {
        let model = BlockHash::namespace(&[b"model-a", b"f16"]);
        let other = BlockHash::namespace(&[b"model-b", b"f16"]);
        let t = [1, 2, 3, 4];
        let base = block_hashes(model, &t, 2).unwrap();
        assert_ne!(base, block_hashes(other, &t, 2).unwrap());
        let alice = block_hashes(model.scoped(Some("alice")), &t, 2).unwrap();
        let bob = block_hashes(model.scoped(Some("bob")), &t, 2).unwrap();
        assert!(alice.iter().chain(&bob).all(|h| !base.contains(h)));
        assert!(alice.iter().all(|h| !bob.contains(h)));
        assert_eq!(model.scoped(None), model);
        // Length-prefixed parts: ("ab", "c") is not ("a", "bc").
        assert_ne!(BlockHash::namespace(&[b"ab", b"c"]), BlockHash::namespace(&[b"a", b"bc"]));
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert!(matches!(block_hashes(BlockHash::namespace(&[]), &[1], 0), Err(KvError::ZeroBlockSize)));
    }
}
