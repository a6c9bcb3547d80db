//! The KV pool's wire: what a worker asks its host's pool owner, and the answers.
//!
//! The pool owner holds the index of a host-RAM tier (one sealed memfd of fixed slots, mapped
//! read-only by every client; its descriptor passed once with [`PoolReply::Welcome`]) and of the
//! SSD tier behind it. A load's bytes never cross this connection: it carries keys, slot numbers,
//! leases and checks, and a client copies a leased slot straight into its own KV blocks. A
//! store's do — only the owner writes the RAM tier, so a client cannot change a block another
//! reads — as KV-chunk frames after a [`PoolRequest::Write`]. Control frames of [`crate::frame`] carry one
//! JSON message each; every list is bounded here ([`MAX_POOL_KEYS`]) so a decoder never holds
//! more than a frame's worth for a peer.

use serde::{Deserialize, Serialize};

use crate::ProtocolError;

/// The pool protocol's version; a client of another version is refused at `Hello`.
pub const POOL_VERSION: u32 = 2;
/// Longest pool id (a boot id and a socket path).
pub const MAX_POOL_ID: usize = 512;
/// The most keys one lookup or reservation names (64 Ki tokens of 16-token blocks): a prompt
/// longer than that looks up its first blocks only.
pub const MAX_POOL_KEYS: usize = 4096;
/// Most blocks one [`PoolRequest::Write`] carries.
pub const MAX_POOL_WRITE: usize = 64;

/// A block's key on the wire: the 32 bytes of its chained BLAKE3 hash, as 64 hex digits
/// (`tokenpath_kv::BlockHash` is converted to and from it at the edge).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireKey(pub [u8; 32]);

impl Serialize for WireKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(self.0))
    }
}

impl<'de> Deserialize<'de> for WireKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(s.as_bytes(), &mut out).map_err(serde::de::Error::custom)?;
        Ok(Self(out))
    }
}

/// Which tier a leased block came from (it is in host RAM by the time it is leased).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolTier {
    /// It was in host RAM.
    Host,
    /// It was read up from the SSD tier for this lookup.
    Ssd,
    /// It was read up from the remote tier (a Valkey/Redis server shared by hosts).
    Remote,
}

/// A worker's request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum PoolRequest {
    /// The first message: the client's protocol version, the namespace its keys are chained
    /// from and its block size, which must be the pool's.
    Hello {
        /// [`POOL_VERSION`].
        version: u32,
        /// The namespace root (model file, KV layout, numerics).
        namespace: WireKey,
        /// Bytes of one KV block.
        block_bytes: u64,
    },
    /// Leases the longest run of held blocks from the first key on.
    Lookup {
        /// The chained keys of a prompt's full blocks, in order.
        keys: Vec<WireKey>,
    },
    /// Ends a read lease (its slots may be evicted again).
    Release {
        /// The lease.
        lease: u64,
        /// Its blocks the client copied and whose check passed, from the first: only these
        /// count as hits (a block that failed its check is never one).
        used: u32,
    },
    /// Asks for slots to write the blocks the pool does not hold yet.
    Reserve {
        /// The blocks' keys.
        keys: Vec<WireKey>,
    },
    /// The reserved slots are written: the pool checks each slot's bytes against the BLAKE3
    /// its writer computed and indexes those that match.
    Commit {
        /// The write lease.
        lease: u64,
        /// Per slot given (in key order), the BLAKE3 of what was written.
        checksums: Vec<WireKey>,
    },
    /// Writes blocks of a write lease: `count` KV-chunk frames follow this message, each one
    /// block's bytes, for the lease's slots `first..first + count` (clients map the RAM tier
    /// read-only; the owner writes it).
    Write {
        /// The write lease.
        lease: u64,
        /// Index of the first block among the slots the lease gave.
        first: u32,
        /// Blocks that follow, at most [`MAX_POOL_WRITE`].
        count: u32,
    },
    /// Gives a write lease's slots back unwritten.
    Abandon {
        /// The write lease.
        lease: u64,
    },
    /// The pool's counters.
    Stats,
}

/// One leased block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeasedBlock {
    /// Its slot in the shared RAM tier.
    pub slot: u32,
    /// XXH3-64 of the bytes the pool wrote into the slot: the client checks what it copied
    /// against it before use.
    pub check: u64,
    /// Where the pool found it.
    pub tier: PoolTier,
}

/// The pool's counters, as [`PoolRequest::Stats`] returns them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolStats {
    /// The pool's identity: this boot of its host and its socket. Workers that report the same
    /// id share one RAM tier, so a router counts a prefix one of them stored as cheap for all.
    #[serde(default)]
    pub id: String,
    /// Slots of the RAM tier, and how many hold a block.
    pub ram_slots: u32,
    /// RAM slots holding a block.
    pub ram_blocks: u32,
    /// Slots of the SSD tier (0: none, or degraded).
    pub ssd_slots: u32,
    /// SSD slots holding a block.
    pub ssd_blocks: u32,
    /// The SSD tier failed and the pool runs on RAM only.
    pub ssd_degraded: bool,
    /// Blocks leased from RAM that their reader copied and checked (reported at release).
    pub hits_ram: u64,
    /// Blocks read up from the SSD tier that their reader copied and checked.
    pub hits_ssd: u64,
    /// Blocks read up from the remote tier.
    #[serde(default)]
    pub hits_remote: u64,
    /// A remote tier is configured.
    #[serde(default)]
    pub remote: bool,
    /// Blocks written to the remote tier.
    #[serde(default)]
    pub written_remote: u64,
    /// Lookups' first keys not held.
    pub misses: u64,
    /// Blocks stored (committed and verified).
    pub stored: u64,
    /// Committed slots whose bytes were not a block (left unindexed), and SSD reads that failed
    /// verification.
    pub failed: u64,
    /// Blocks pushed out of RAM (written down to SSD first when it has room).
    pub evictions_ram: u64,
    /// Blocks written down to the SSD tier.
    pub written_ssd: u64,
    /// The second-sighting filter is on: a block is written down only once seen twice.
    #[serde(default)]
    pub second_sighting: bool,
    /// Blocks that left RAM without being written down, seen only once (the filter's savings).
    #[serde(default)]
    pub filtered: u64,
    /// Leases open now (read and write), and RAM slots they pin.
    pub leases: u32,
    /// RAM slots pinned by leases.
    pub pinned: u32,
    /// Leases ended by their deadline or by their client's going away.
    pub leases_expired: u64,
    /// Age of the oldest open lease, milliseconds.
    pub oldest_lease_ms: u64,
}

/// The pool's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum PoolReply {
    /// Hello accepted; the RAM tier's descriptor rides on this frame (`SCM_RIGHTS`).
    Welcome {
        /// Slots in the RAM tier.
        slots: u32,
        /// Bytes from one slot to the next (the block size, page-rounded).
        slot_bytes: u64,
        /// Bytes of the memfd.
        map_bytes: u64,
        /// How long a lease lives, milliseconds.
        lease_ms: u64,
    },
    /// A read lease (lease 0 and no blocks: nothing held).
    Lease {
        /// The lease, for `Release`.
        lease: u64,
        /// The blocks, in key order.
        blocks: Vec<LeasedBlock>,
    },
    /// A write lease: per key, the slot to write, or none (held already, or no room).
    Reserved {
        /// The lease, for `Commit` / `Abandon` (0 when no slot was given).
        lease: u64,
        /// Per key in order.
        slots: Vec<Option<u32>>,
    },
    /// Commit done.
    Committed {
        /// Blocks indexed.
        stored: u32,
        /// Slots whose bytes did not check out (not indexed).
        failed: u32,
    },
    /// Release or Abandon done.
    Done,
    /// The counters.
    Stats(PoolStats),
    /// A refusal.
    Error {
        /// Why.
        message: String,
    },
}

fn bounded(keys: &[WireKey]) -> Result<(), ProtocolError> {
    if keys.len() > MAX_POOL_KEYS {
        return Err(ProtocolError::TooLarge {
            what: "a KV pool key list",
            len: keys.len() as u64,
            max: MAX_POOL_KEYS as u64,
        });
    }
    Ok(())
}

fn invalid(e: serde_json::Error) -> ProtocolError {
    ProtocolError::InvalidFrame { message: format!("KV pool message: {e}") }
}

impl PoolRequest {
    /// Decodes a request from a control frame's payload, with its bounds.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = serde_json::from_slice(bytes).map_err(invalid)?;
        match &req {
            Self::Lookup { keys } | Self::Reserve { keys } | Self::Commit { checksums: keys, .. } => {
                bounded(keys)?
            }
            Self::Write { count, .. } if *count as usize > MAX_POOL_WRITE => {
                return Err(ProtocolError::TooLarge {
                    what: "a KV pool write",
                    len: u64::from(*count),
                    max: MAX_POOL_WRITE as u64,
                })
            }
            _ => {}
        }
        Ok(req)
    }

    /// Encodes it.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

impl PoolReply {
    /// Decodes a reply from a control frame's payload, with its bounds.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let reply: Self = serde_json::from_slice(bytes).map_err(invalid)?;
        let n = match &reply {
            Self::Lease { blocks, .. } => blocks.len(),
            Self::Reserved { slots, .. } => slots.len(),
            _ => 0,
        };
        if n > MAX_POOL_KEYS {
            return Err(ProtocolError::TooLarge {
                what: "a KV pool reply",
                len: n as u64,
                max: MAX_POOL_KEYS as u64,
            });
        }
        Ok(reply)
    }

    /// Encodes it.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_round_trip_and_bounds_hold() {
        let key = WireKey([7; 32]);
        for req in [
            PoolRequest::Hello { version: POOL_VERSION, namespace: key, block_bytes: 368_640 },
            PoolRequest::Lookup { keys: vec![key; 3] },
            PoolRequest::Release { lease: 9, used: 3 },
            PoolRequest::Reserve { keys: vec![key] },
            PoolRequest::Commit { lease: 2, checksums: vec![key] },
            PoolRequest::Abandon { lease: 2 },
            PoolRequest::Stats,
        ] {
            assert_eq!(PoolRequest::decode(&req.encode()).expect("decodes"), req);
        }
        let reply = PoolReply::Lease {
            lease: 3,
            blocks: vec![LeasedBlock { slot: 1, check: 7, tier: PoolTier::Ssd }],
        };
        assert_eq!(PoolReply::decode(&reply.encode()).expect("decodes"), reply);
        let many = PoolRequest::Lookup { keys: vec![key; MAX_POOL_KEYS + 1] };
        assert!(matches!(PoolRequest::decode(&many.encode()), Err(ProtocolError::TooLarge { .. })));
        assert!(PoolRequest::decode(br#"{"op":"lookup","keys":["zz"]}"#).is_err(), "not hex");
        assert!(PoolRequest::decode(br#"{"op":"release","lease":1,"extra":1}"#).is_err(), "unknown field");
    }

    proptest! {
        /// The pool's decoders of untrusted bytes never panic (fuzz target: `fuzz/pool_message`).
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = PoolRequest::decode(&bytes);
            let _ = PoolReply::decode(&bytes);
        }
    }
}
