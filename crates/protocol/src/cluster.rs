//! The messages between tokenpath processes: gateway → worker requests, worker → gateway events,
//! and the prefill → decode KV transfer. Each travels in one [`crate::frame`] frame.
//!
//! Control messages are JSON (small, debuggable with `tcpdump -A`, evolvable with new optional
//! fields) and strict (`deny_unknown_fields` on requests, like the public API); KV bytes are
//! binary ([`KvChunk`]) because they are the bulk of the traffic. A connection carries one
//! request: the gateway opens it with [`ToWorker::Generate`] and the worker answers with
//! [`FromWorker::Accepted`] or [`FromWorker::Rejected`], then events, then closes. Closing the
//! connection early is how a gateway cancels, and how a gateway learns a worker died.
//!
//! The PD flow on the wire:
//! 1. gateway → decode worker: `Generate { mode: Decode { transfer } }` (blocks are reserved).
//! 2. gateway → prefill worker: `Generate { mode: Prefill { transfer, decode_addr } }`.
//! 3. prefill worker → decode worker (a new connection to `decode_addr`): `KvBegin`, `KvChunk`s
//!    (sent as blocks fill, overlapping the rest of the prefill), `KvEnd`; the decode worker
//!    answers `KvAck`. Same host: `KvBegin` names the sender's host and a Unix-socket "door"
//!    it listens on; the decode worker passes its shared-memory ring's descriptor through the
//!    door (`SCM_RIGHTS`, with the transfer token) and answers `KvRing`; each `KvChunk` becomes a
//!    `KvRingChunk` (where in the ring, and the checksum) answered by `KvRingFree` once copied
//!    out; the bytes skip the socket.
//! 4. prefill worker → gateway: the first token's `Text`, then `Handoff` (first token id and the
//!    sampler position), later `KvSent` (the transfer's duration on the prefill worker's clock).
//! 5. gateway → decode worker: `Handoff`; the decode worker continues and streams `Text`…
//!    `Finished` to the gateway. A lost or corrupted transfer makes it recompute the prompt
//!    (the prompt ids came with step 1) and say so in its timing.

pub mod conn;
mod transfer;

pub use transfer::{KvChunk, RingOffer, SameHost, TransferId, TransferToken, KV_TRAILER};

use crate::sampling::{SamplerState, SamplingParams};
use crate::work::{TokenUsage, WorkerStats};
use crate::ProtocolError;
use serde::{Deserialize, Serialize};
use tokenpath_timeline::{FinishReason, ServerTiming, Stage};

/// What part of the request path a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerRole {
    /// Computes the prompt's KV and the first token, then hands the KV on.
    Prefill,
    /// Receives KV and runs the token-by-token loop.
    Decode,
    /// Colocated: both on one engine.
    Both,
}

impl std::str::FromStr for WorkerRole {
    type Err = ProtocolError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            "both" => Ok(Self::Both),
            other => Err(ProtocolError::invalid(
                "role",
                format!("unknown worker role {other:?}: expected prefill, decode or both"),
            )),
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        })
    }
}

/// What part of the path a worker runs for one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Mode {
    /// Prefill and decode here (colocated).
    Full,
    /// Prefill here, then push the KV to `decode_addr` and hand off.
    Prefill {
        /// The transfer's id, known to the decode worker.
        transfer: TransferId,
        /// The transfer's capability, sent in `KvBegin`.
        token: TransferToken,
        /// Where the decode worker listens.
        decode_addr: String,
    },
    /// Wait for the KV of `transfer`, then decode.
    Decode {
        /// The transfer to wait for.
        transfer: TransferId,
        /// Only a `KvBegin` with this token may deliver it.
        token: TransferToken,
    },
}

/// A generation request for a worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateMsg {
    /// The gateway's request id (logs).
    pub id: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going past EOS.
    pub ignore_eos: bool,
    /// Which part of the path.
    pub mode: Mode,
    /// The prefix-cache scope (a tenant): KV is shared only within it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_scope: Option<String>,
    /// The request's W3C trace context (sent only when the request has one, so a message
    /// without it is byte for byte what older workers take).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<tokenpath_timeline::TraceParent>,
}

/// Messages to a worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToWorker {
    /// Start a request (first message of a request connection).
    Generate(GenerateMsg),
    /// The first token and sampler position for a `Decode` request (gateway → decode worker).
    Handoff {
        /// The token the prefill worker sampled.
        first_token: u32,
        /// Where its sampler stood after sampling it.
        sampler: SamplerState,
    },
    /// Ask for a [`StatsMsg`] (first message of a stats connection; health checks use it).
    Stats,
    /// A KV transfer starts (first message of a KV connection, prefill → decode).
    KvBegin {
        /// Which transfer.
        transfer: TransferId,
        /// The transfer's capability (from the gateway, via `Mode::Prefill`).
        token: TransferToken,
        /// Tokens whose KV follows.
        n_tokens: u32,
        /// Engine KV layout fingerprint: `n_layer`, `kv_dim`, `block_size`, `head_dim`; must match
        /// exactly.
        layout: [u32; 4],
        /// Set when the sender can move the blocks through shared memory: a decode worker on
        /// the same host answers [`FromWorker::KvRing`] before any block.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        same_host: Option<SameHost>,
    },
    /// Same-host transfer: blocks `first_block..first_block + n_blocks` were written into the
    /// decode worker's ring at `offset` (the bytes never cross the socket).
    KvRingChunk {
        /// Which transfer.
        transfer: TransferId,
        /// Index of the first block in the sequence.
        first_block: u32,
        /// Whole blocks written.
        n_blocks: u32,
        /// Where in the ring they start.
        offset: u64,
        /// XXH3-64 of the block bytes, as a frame's.
        checksum: u64,
    },
    /// Every chunk was sent.
    KvEnd {
        /// Which transfer.
        transfer: TransferId,
        /// Chunks sent (the receiver checks it saw them all).
        chunks: u32,
    },
}

/// Why a worker refused a request before running it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectKind {
    /// Queue full: retry elsewhere or later.
    Overloaded,
    /// Prompt plus completion exceed the context.
    ContextOverflow,
    /// A request the worker cannot run.
    Invalid,
    /// The worker is stopping or broken.
    Unavailable,
}

/// A worker's load and capacity.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatsMsg {
    /// `prefill`, `decode` or `both`.
    pub role: String,
    /// The worker's name.
    pub worker_id: String,
    /// The model's context length.
    pub n_ctx: u64,
    /// Tokens per KV block.
    pub block_size: u64,
    /// Requests accepted and not finished.
    pub in_flight: u64,
    /// Its batcher's load and counters (flattened: the message stays one flat object).
    #[serde(flatten)]
    pub stats: WorkerStats,
    /// The worker is draining (stopping): it finishes what it runs and takes nothing new.
    #[serde(default)]
    pub draining: bool,
    /// BLAKE3 of the model file the worker serves: a gateway that knows its own file's routes
    /// only to workers that serve the same one (its tokens mean nothing to another vocabulary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<crate::auth::Bytes32>,
}

/// Messages from a worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromWorker {
    /// The request was queued.
    Accepted,
    /// The request was refused before running.
    Rejected {
        /// Why.
        kind: RejectKind,
        /// For logs and the client.
        message: String,
    },
    /// Text for the client and how many tokens it covers.
    Text {
        /// The text.
        delta: String,
        /// Tokens.
        tokens: u32,
    },
    /// Prefill role: the first token is done and the KV is on its way.
    Handoff {
        /// The sampled token.
        first_token: u32,
        /// The sampler's position after it.
        sampler: SamplerState,
        /// Stages this worker measured (queue, prefill).
        timing: ServerTiming,
        /// Token counts so far (cached prompt tokens included).
        usage: TokenUsage,
        /// The stages whose span (OTLP) this worker exported itself, which the gateway leaves
        /// out of its own export.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        spans: Vec<Stage>,
    },
    /// Prefill role: the KV transfer finished (or failed), measured on this worker's clock from
    /// the first byte out to the decode worker's acknowledgement.
    KvSent {
        /// Whether the decode worker acknowledged every byte.
        ok: bool,
        /// Transfer duration after prefill end (ms).
        ms: f64,
        /// Bytes sent.
        bytes: u64,
        /// The blocks went through a same-host shared-memory ring rather than the socket.
        #[serde(default)]
        ring: bool,
        /// The stages whose span (OTLP) this worker exported itself, which the gateway leaves
        /// out of its own export.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        spans: Vec<Stage>,
    },
    /// The request finished.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: TokenUsage,
        /// Stages this worker measured.
        timing: ServerTiming,
        /// The stages whose span (OTLP) this worker exported itself, which the gateway leaves
        /// out of its own export.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        spans: Vec<Stage>,
    },
    /// The request failed after it was accepted.
    Failed {
        /// What went wrong.
        message: String,
    },
    /// Answer to [`ToWorker::Stats`].
    Stats(StatsMsg),
    /// Sent on a request connection when nothing else was for a while: the worker is alive and
    /// the request still waits (the gateway gives up on a silent connection, see
    /// `tokenpath_worker::net::PEER_IDLE`).
    KeepAlive,
    /// Decode worker → prefill worker, answering a `KvBegin` that named a host: the shared
    /// ring to write blocks into, or none (the blocks come as `KvChunk` frames).
    KvRing {
        /// The ring, when offered.
        offer: Option<RingOffer>,
    },
    /// Decode worker → prefill worker: this many ring chunks (counted from the first) have been
    /// copied out, so their space may be written again.
    KvRingFree {
        /// Chunks consumed so far.
        chunks: u32,
    },
    /// Decode worker → prefill worker: the transfer arrived intact (or not).
    KvAck {
        /// Whether every chunk arrived and verified.
        ok: bool,
        /// What went wrong when not.
        message: Option<String>,
        /// Time between the blocks landing in the decode worker's cache and this message being
        /// written (decode clock), which the prefill worker takes off its transfer time: the
        /// transfer ends when the KV is in place, not when the acknowledgement got a core.
        #[serde(default)]
        held_ms: f64,
    },
}

/// Longest text from a peer's `Rejected` or `Failed` message that reaches a client.
pub const PEER_MESSAGE_MAX: usize = 512;

/// A peer's error text as a client may see it: at most [`PEER_MESSAGE_MAX`] bytes (cut at a
/// character boundary) and no control characters (a message cannot forge log lines or SSE
/// framing, security review L6).
pub fn peer_message(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(PEER_MESSAGE_MAX));
    for c in s.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > PEER_MESSAGE_MAX {
            out.push('…');
            break;
        }
        out.push(c);
    }
    out
}

/// Encodes a control message.
pub fn encode_control<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    serde_json::to_vec(msg).map_err(|e| ProtocolError::InvalidFrame { message: format!("encoding: {e}") })
}

/// Decodes a control message.
pub fn decode_control<T: for<'de> Deserialize<'de>>(payload: &[u8]) -> Result<T, ProtocolError> {
    serde_json::from_slice(payload)
        .map_err(|e| ProtocolError::InvalidFrame { message: format!("bad control message: {e}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_and_reject_unknown() {
        for r in [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Both] {
            assert_eq!(r.to_string().parse::<WorkerRole>().unwrap(), r);
        }
        let err = "mixed".parse::<WorkerRole>().unwrap_err();
        assert!(err.to_string().contains("mixed"));
    }
    use proptest::prelude::*;

    #[test]
    fn control_messages_round_trip() {
        let msg = ToWorker::Generate(GenerateMsg {
            id: 7,
            prompt: vec![1, 2, 3],
            sampling: SamplingParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                seed: Some(3),
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
            },
            max_tokens: Some(4),
            stop: vec!["\n".into()],
            ignore_eos: false,
            mode: Mode::Prefill {
                transfer: TransferId(9),
                token: TransferToken([7; 16]),
                decode_addr: "127.0.0.1:1".into(),
            },
            cache_scope: Some("alice".into()),
            trace: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap()),
        });
        let back: ToWorker = decode_control(&encode_control(&msg).unwrap()).unwrap();
        assert_eq!(back, msg);
        let wire = String::from_utf8(encode_control(&msg).unwrap()).unwrap();
        assert!(
            wire.contains(r#""trace":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01""#),
            "{wire}"
        );
        let h = FromWorker::Handoff {
            first_token: 5,
            sampler: SamplerState { seed: u64::MAX, word_pos: u128::MAX },
            timing: ServerTiming::default(),
            usage: TokenUsage::default(),
            spans: vec![Stage::Queue, Stage::Prefill],
        };
        let back: FromWorker = decode_control(&encode_control(&h).unwrap()).unwrap();
        assert_eq!(back, h);
        assert!(
            decode_control::<ToWorker>(br#"{"type":"kv_end","transfer":1,"chunks":2,"extra":1}"#).is_err()
        );
        assert!(decode_control::<ToWorker>(br#"{"type":"nope"}"#).is_err());
        // Same-host messages; a `KvBegin` without `same_host` is the TCP-only one, byte for byte.
        let token = TransferToken([0xab; 16]);
        let begin = ToWorker::KvBegin {
            transfer: TransferId(1),
            token,
            n_tokens: 2,
            layout: [1, 2, 3, 4],
            same_host: None,
        };
        assert!(!String::from_utf8(encode_control(&begin).unwrap()).unwrap().contains("host"));
        let tcp: ToWorker = decode_control(
            br#"{"type":"kv_begin","transfer":1,"token":"abababababababababababababababab","n_tokens":2,"layout":[1,2,3,4]}"#,
        )
        .unwrap();
        assert_eq!(tcp, begin);
        // A peer from before the layout named its head width: refused, not guessed.
        assert!(decode_control::<ToWorker>(
            br#"{"type":"kv_begin","transfer":1,"token":"abababababababababababababababab","n_tokens":2,"layout":[1,2,3]}"#
        )
        .is_err());
        // No token, or a token of the wrong length: not a KvBegin at all.
        assert!(decode_control::<ToWorker>(
            br#"{"type":"kv_begin","transfer":1,"n_tokens":2,"layout":[1,2,3,4]}"#
        )
        .is_err());
        assert!(decode_control::<ToWorker>(
            br#"{"type":"kv_begin","transfer":1,"token":"abab","n_tokens":2,"layout":[1,2,3,4]}"#
        )
        .is_err());
        assert_ne!(TransferToken::random().unwrap(), TransferToken::random().unwrap());
        assert_eq!(format!("{token:?}"), "TransferToken(..)");
        for m in [
            ToWorker::KvBegin {
                transfer: TransferId(1),
                token,
                n_tokens: 2,
                layout: [1, 2, 3, 4],
                same_host: Some(SameHost { host: "b".into(), door: "tokenpath-kv-0".into() }),
            },
            ToWorker::KvRingChunk {
                transfer: TransferId(u64::MAX),
                first_block: 3,
                n_blocks: 2,
                offset: u64::MAX,
                checksum: u64::MAX,
            },
        ] {
            assert_eq!(decode_control::<ToWorker>(&encode_control(&m).unwrap()).unwrap(), m);
        }
        for m in [
            FromWorker::KvRing { offer: Some(RingOffer { len: 8 << 20 }) },
            FromWorker::KvRing { offer: None },
            FromWorker::KvRingFree { chunks: 9 },
            FromWorker::KvSent { ok: true, ms: 1.5, bytes: 10, ring: true, spans: vec![Stage::KvTransfer] },
        ] {
            assert_eq!(decode_control::<FromWorker>(&encode_control(&m).unwrap()).unwrap(), m);
        }
        let old_sent: FromWorker =
            decode_control(br#"{"type":"kv_sent","ok":true,"ms":1.0,"bytes":1}"#).unwrap();
        assert_eq!(old_sent, FromWorker::KvSent { ok: true, ms: 1.0, bytes: 1, ring: false, spans: vec![] });
        let quiet = FromWorker::KvSent { ok: true, ms: 1.0, bytes: 1, ring: false, spans: vec![] };
        assert!(!String::from_utf8(encode_control(&quiet).unwrap()).unwrap().contains("spans"));
    }

    /// Regression (security review, minor): `1e39` in a worker's sampling numbers became
    /// infinity; it is refused like the HTTP API refuses it.
    #[test]
    fn sampling_numbers_past_the_f32_range_are_refused() {
        let ok = serde_json::json!({"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": null,
            "presence_penalty": 0.0, "frequency_penalty": 0.0});
        assert!(serde_json::from_value::<SamplingParams>(ok.clone()).is_ok());
        for field in ["temperature", "top_p", "presence_penalty", "frequency_penalty"] {
            let mut bad = ok.clone();
            bad[field] = serde_json::json!(1e39);
            let e = serde_json::from_value::<SamplingParams>(bad).unwrap_err();
            assert!(e.to_string().contains("finite"), "{field}: {e}");
        }
    }

    #[test]
    fn peer_messages_are_cut_and_cleaned() {
        assert_eq!(peer_message("no KV room"), "no KV room");
        assert_eq!(peer_message("a\nb\r\u{1b}[31m"), "a b  [31m");
        let long = "é".repeat(PEER_MESSAGE_MAX);
        let cut = peer_message(&long);
        assert!(cut.len() <= PEER_MESSAGE_MAX + '…'.len_utf8() && cut.ends_with('…'), "{}", cut.len());
    }

    #[test]
    fn kv_chunks_check_their_size_against_the_receivers_block() {
        let c = KvChunk { transfer: TransferId(1), first_block: 2, n_blocks: 2, bytes: (0..8).collect() };
        assert_eq!(KvChunk::decode(c.encode(), 4).unwrap(), c);
        assert!(KvChunk::decode(c.encode(), 3).is_err());
        assert!(KvChunk::decode(c.encode(), 0).is_err());
        assert!(KvChunk::decode(vec![0; 5], 4).is_err());
        // Regression (security review, minor): an empty chunk was accepted and counted.
        let empty = KvChunk { transfer: TransferId(1), first_block: 0, n_blocks: 0, bytes: Vec::new() };
        assert!(KvChunk::decode(empty.encode(), 4).is_err());
        assert_eq!(KvChunk::blocks_in(c.encode().len(), 4).unwrap(), 2);
        let mut t = [0u8; KV_TRAILER];
        t.copy_from_slice(&c.encode()[8..]);
        assert_eq!(KvChunk::parse_trailer(&t), (TransferId(1), 2, 2));
        for (len, bb) in [(KV_TRAILER, 4), (KV_TRAILER + 6, 4), (KV_TRAILER + 8, 0), (3, 4), (usize::MAX, 1)]
        {
            assert!(KvChunk::blocks_in(len, bb).is_err(), "{len} / {bb}");
        }
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), bb in 0usize..64) {
            let _ = decode_control::<ToWorker>(&bytes);
            let _ = decode_control::<FromWorker>(&bytes);
            let _ = KvChunk::blocks_in(bytes.len(), bb);
            let _ = KvChunk::decode(bytes, bb);
        }
    }
}
