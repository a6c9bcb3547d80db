//! The KV transfer's own wire types: which transfer (a random id) and who may deliver it (a
//! token), the same-host ring's offer and door, and the binary KV chunk. Kept apart from the
//! control messages in `cluster.rs` because these are the ones every byte of KV passes through.

use crate::ProtocolError;
use serde::{Deserialize, Serialize};

/// Identifies one KV transfer between a prefill and a decode worker (chosen by the gateway,
/// at random: an id says nothing about the ids of other requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TransferId(pub u64);

impl TransferId {
    /// A fresh random id.
    pub fn random() -> Result<Self, ProtocolError> {
        let mut b = [0u8; 8];
        crate::auth::fill_random(&mut b)?;
        Ok(Self(u64::from_le_bytes(b)))
    }
}

/// The capability to deliver one transfer's KV: 128 random bits the gateway draws per transfer
/// and gives to exactly the two workers of that request. The decode worker lends its blocks only
/// to a `KvBegin` carrying it, so knowing (or guessing) a transfer id is worth nothing.
/// Compared in constant time; `Debug` does not print it.
#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TransferToken(#[serde(with = "hex16")] pub [u8; 16]);

impl TransferToken {
    /// A fresh random token.
    pub fn random() -> Result<Self, ProtocolError> {
        let mut b = [0u8; 16];
        crate::auth::fill_random(&mut b)?;
        Ok(Self(b))
    }
}

impl PartialEq for TransferToken {
    fn eq(&self, other: &Self) -> bool {
        self.0.iter().zip(other.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl Eq for TransferToken {}

impl std::fmt::Debug for TransferToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferToken(..)")
    }
}

mod hex16 {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    pub(super) fn serialize<S: Serializer>(v: &[u8; 16], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(v))
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 16], D::Error> {
        let s = String::deserialize(d)?;
        let mut b = [0u8; 16];
        hex::decode_to_slice(s, &mut b).map_err(D::Error::custom)?;
        Ok(b)
    }
}

/// What a prefill worker able to write KV into a same-host decode worker's ring says in
/// `KvBegin`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SameHost {
    /// The sender's host: the kernel's boot id.
    pub host: String,
    /// The abstract Unix socket the sender listens on for this one transfer, through which
    /// the decode worker passes its ring's descriptor (never a path or pid to open: the
    /// receiver only ever maps a descriptor its peer handed it).
    pub door: String,
}

/// A decode worker's shared-memory ring for one same-host transfer: a sealed (it can neither
/// shrink nor grow) memfd of `len` bytes, whose descriptor went through the prefill worker's
/// door (with the transfer's token) before this offer was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RingOffer {
    /// The ring's size in bytes.
    pub len: u64,
}

/// One chunk of KV blocks: `bytes | transfer u64 | first_block u32 | n_blocks u32`. The ids
/// trail the bytes so neither side copies the bulk: the sender writes the block bytes straight
/// from its export buffer followed by [`KvChunk::trailer`], the receiver truncates the trailer
/// off the payload it read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvChunk {
    /// Which transfer.
    pub transfer: TransferId,
    /// Index of the first block in the sequence.
    pub first_block: u32,
    /// Whole blocks in `bytes`.
    pub n_blocks: u32,
    /// Block bytes.
    pub bytes: Vec<u8>,
}

/// Bytes of a KV chunk's trailer.
pub const KV_TRAILER: usize = 16;

impl KvChunk {
    /// The 16 trailer bytes of a chunk.
    pub fn trailer(transfer: TransferId, first_block: u32, n_blocks: u32) -> [u8; KV_TRAILER] {
        let mut t = [0u8; KV_TRAILER];
        t[..8].copy_from_slice(&transfer.0.to_le_bytes());
        t[8..12].copy_from_slice(&first_block.to_le_bytes());
        t[12..16].copy_from_slice(&n_blocks.to_le_bytes());
        t
    }

    /// The whole frame payload (tests and small chunks; the sender avoids this copy).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes.len() + KV_TRAILER);
        out.extend_from_slice(&self.bytes);
        out.extend_from_slice(&Self::trailer(self.transfer, self.first_block, self.n_blocks));
        out
    }

    /// Whole blocks in a chunk frame of `payload_len` bytes, for a receiver that reads the bytes
    /// straight into its blocks before the trailer: `block_bytes` is the receiver's own block
    /// size (never taken from the wire) and the bytes before the trailer must be a whole,
    /// non-zero number of blocks. The trailer, read last, must then say the same
    /// ([`KvChunk::parse_trailer`]).
    pub fn blocks_in(payload_len: usize, block_bytes: usize) -> Result<u32, ProtocolError> {
        let bytes = payload_len.checked_sub(KV_TRAILER).filter(|&b| b > 0).ok_or_else(|| {
            ProtocolError::InvalidFrame { message: format!("KV chunk of {payload_len} bytes holds no block") }
        })?;
        if block_bytes == 0 || !bytes.is_multiple_of(block_bytes) {
            return Err(ProtocolError::InvalidFrame {
                message: format!(
                    "KV chunk of {bytes} bytes is not a whole number of {block_bytes}-byte blocks"
                ),
            });
        }
        u32::try_from(bytes / block_bytes)
            .map_err(|_| ProtocolError::InvalidFrame { message: "KV chunk of too many blocks".into() })
    }

    /// `(transfer, first_block, n_blocks)` of a chunk's trailer.
    pub fn parse_trailer(t: &[u8; KV_TRAILER]) -> (TransferId, u32, u32) {
        let mut id = [0u8; 8];
        id.copy_from_slice(&t[..8]);
        (
            TransferId(u64::from_le_bytes(id)),
            u32::from_le_bytes([t[8], t[9], t[10], t[11]]),
            u32::from_le_bytes([t[12], t[13], t[14], t[15]]),
        )
    }

    /// Decodes a frame payload; `block_bytes` is the receiver's own block size in bytes (never
    /// taken from the wire) and the block count must match the byte count exactly.
    pub fn decode(mut payload: Vec<u8>, block_bytes: usize) -> Result<Self, ProtocolError> {
        let Some(split) = payload.len().checked_sub(KV_TRAILER) else {
            return Err(ProtocolError::InvalidFrame { message: "KV chunk shorter than its trailer".into() });
        };
        let mut t = [0u8; KV_TRAILER];
        t.copy_from_slice(&payload[split..]);
        let (transfer, first_block, n_blocks) = Self::parse_trailer(&t);
        payload.truncate(split);
        // An empty chunk (0 blocks, 0 bytes) moves nothing and would only be counted.
        if block_bytes == 0
            || n_blocks == 0
            || (n_blocks as usize).checked_mul(block_bytes) != Some(payload.len())
        {
            return Err(ProtocolError::InvalidFrame {
                message: format!("KV chunk says {n_blocks} blocks but carries {} bytes", payload.len()),
            });
        }
        Ok(Self { transfer, first_block, n_blocks, bytes: payload })
    }
}
