//! Who may talk to a worker: every connection between tokenpath processes (gateway → worker,
//! prefill worker → decode worker, stats polls) starts with a mutual challenge–response over the
//! cluster secret, before either side sends anything else.
//!
//! ```text
//! server → client  Challenge { version, nonce: Ns }
//! client → server  Auth { nonce: Nc, mac: MAC(k, "client" | Ns | Nc) }
//! server → client  Welcome { mac: MAC(k, "server" | Ns | Nc) }
//! ```
//!
//! `k` is derived from the secret with BLAKE3's key derivation and `MAC` is BLAKE3's keyed
//! mode (a PRF built for exactly this; the same crate keys the prefix cache). Fresh 256-bit
//! nonces on both sides make a recorded exchange useless for a replay, the two labels stop a
//! reflection, and the client checks the server too: a prefill worker told to push KV to an
//! address that does not hold the secret learns it before sending a byte of KV, and the gateway
//! never sends a prompt to a process that merely listens on a worker's port. A connection that
//! fails gets nothing but a close.
//!
//! Why not mutual TLS: `serve --prefill/--decode` already hands a secret to its children, so a
//! shared secret needs no certificate authority, no rotation tooling and no per-host files; it
//! costs one round trip per connection and nothing per byte, which matters on the KV path (tens
//! of MB per long prompt, and the same-host ring skips the socket altogether). What it does not
//! give is confidentiality or integrity against an on-path attacker after the handshake: across
//! an untrusted network run the workers on a private network or inside WireGuard/IPsec, as
//! vLLM's and SGLang's KV transports also assume. KV transfers are additionally bound to one
//! request by a [`crate::cluster::TransferToken`] the gateway draws per transfer.

use crate::frame::{read_control_frame, write_frame, FrameKind};
use crate::ProtocolError;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};

/// The handshake's version; a peer that speaks another is refused.
pub const AUTH_VERSION: u32 = 1;
/// Shortest secret accepted (bytes): a generated one has 64 hex characters.
pub const MIN_SECRET_LEN: usize = 16;
const KDF_CONTEXT: &str = "tokenpath 2026-12-01 cluster secret v1";

/// 32 bytes on the wire as 64 hex characters.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Bytes32(pub [u8; 32]);

impl std::fmt::Debug for Bytes32 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Bytes32(..)")
    }
}

impl Bytes32 {
    /// 32 bytes from the operating system's CSPRNG.
    pub fn random() -> Result<Self, ProtocolError> {
        let mut b = [0u8; 32];
        fill_random(&mut b)?;
        Ok(Self(b))
    }
}

impl Serialize for Bytes32 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(self.0))
    }
}

impl<'de> Deserialize<'de> for Bytes32 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let mut b = [0u8; 32];
        hex::decode_to_slice(s, &mut b).map_err(serde::de::Error::custom)?;
        Ok(Self(b))
    }
}

/// Fills `b` from the OS's CSPRNG.
pub fn fill_random(b: &mut [u8]) -> Result<(), ProtocolError> {
    getrandom::fill(b).map_err(|e| ProtocolError::Connection { message: format!("no randomness: {e}") })
}

/// The handshake's messages (each one control frame).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Handshake {
    /// Server → client, first frame on every connection.
    Challenge {
        /// [`AUTH_VERSION`].
        version: u32,
        /// The server's nonce.
        nonce: Bytes32,
    },
    /// Client → server: its nonce and its proof.
    Auth {
        /// The client's nonce.
        nonce: Bytes32,
        /// `MAC(k, "client" | Ns | Nc)`.
        mac: Bytes32,
    },
    /// Server → client: the server's proof; the connection is open.
    Welcome {
        /// `MAC(k, "server" | Ns | Nc)`.
        mac: Bytes32,
    },
}

/// The key every process of one cluster shares. Kept only as the derived key; `Debug` prints
/// nothing of it.
#[derive(Clone)]
pub struct ClusterSecret {
    key: [u8; 32],
    open: bool,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.open { "ClusterSecret(open)" } else { "ClusterSecret(..)" })
    }
}

impl ClusterSecret {
    /// A secret from its text form (at least [`MIN_SECRET_LEN`] bytes).
    pub fn new(secret: &str) -> Result<Self, ProtocolError> {
        let secret = secret.trim();
        if secret.len() < MIN_SECRET_LEN {
            return Err(ProtocolError::Unauthenticated {
                message: format!("a cluster secret needs at least {MIN_SECRET_LEN} characters"),
            });
        }
        Ok(Self { key: blake3::derive_key(KDF_CONTEXT, secret.as_bytes()), open: false })
    }

    /// A fresh random secret in text form (what `serve --prefill/--decode` hands its children).
    pub fn generate() -> Result<String, ProtocolError> {
        Ok(hex::encode(Bytes32::random()?.0))
    }

    /// No secret configured: the handshake runs with a key every tokenpath process knows, so it
    /// keeps the protocol uniform but authenticates nobody. Only for workers bound to loopback
    /// (the CLI refuses anything else) and for tests.
    pub fn open() -> Self {
        Self { key: blake3::derive_key(KDF_CONTEXT, b""), open: true }
    }

    /// Whether this is [`ClusterSecret::open`].
    pub fn is_open(&self) -> bool {
        self.open
    }

    fn mac(&self, label: &[u8], server: &Bytes32, client: &Bytes32) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(label);
        h.update(&server.0);
        h.update(&client.0);
        h.finalize()
    }

    /// A keyed digest of `parts` under this secret (for values the cluster signs).
    pub fn digest(&self, label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(label);
        for p in parts {
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        *h.finalize().as_bytes()
    }
}

fn refused(message: impl Into<String>) -> ProtocolError {
    ProtocolError::Unauthenticated { message: message.into() }
}

async fn read<R: AsyncRead + Unpin>(rd: &mut R) -> Result<Handshake, ProtocolError> {
    let payload = read_control_frame(rd).await?.ok_or_else(|| refused("the peer closed the handshake"))?;
    serde_json::from_slice(&payload).map_err(|_| refused("not a handshake message"))
}

async fn write<W: AsyncWrite + Unpin>(wr: &mut W, msg: &Handshake) -> Result<(), ProtocolError> {
    let bytes = serde_json::to_vec(msg).map_err(|e| refused(format!("encoding: {e}")))?;
    write_frame(wr, FrameKind::Control, &bytes).await
}

/// The server's side: challenge, check the client's proof, prove itself. On `Err` the caller
/// closes the connection without a word. Bound it with the caller's first-message timeout.
pub async fn accept<R, W>(rd: &mut R, wr: &mut W, secret: &ClusterSecret) -> Result<(), ProtocolError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let ns = Bytes32::random()?;
    write(wr, &Handshake::Challenge { version: AUTH_VERSION, nonce: ns }).await?;
    let Handshake::Auth { nonce: nc, mac } = read(rd).await? else {
        return Err(refused("expected the client's proof"));
    };
    // blake3::Hash compares in constant time.
    if secret.mac(b"client", &ns, &nc) != blake3::Hash::from_bytes(mac.0) {
        return Err(refused("the client does not hold the cluster secret"));
    }
    let proof = Bytes32(*secret.mac(b"server", &ns, &nc).as_bytes());
    write(wr, &Handshake::Welcome { mac: proof }).await
}

/// The client's side: answer the challenge, check the server's proof. Nothing may be sent on
/// the connection before this returns `Ok`.
pub async fn connect<R, W>(rd: &mut R, wr: &mut W, secret: &ClusterSecret) -> Result<(), ProtocolError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Handshake::Challenge { version, nonce: ns } = read(rd).await? else {
        return Err(refused("expected a challenge"));
    };
    if version != AUTH_VERSION {
        return Err(refused(format!("handshake version {version}, this side speaks {AUTH_VERSION}")));
    }
    let nc = Bytes32::random()?;
    let proof = Bytes32(*secret.mac(b"client", &ns, &nc).as_bytes());
    write(wr, &Handshake::Auth { nonce: nc, mac: proof }).await?;
    let Handshake::Welcome { mac } = read(rd).await? else {
        return Err(refused("the server did not accept the proof"));
    };
    if secret.mac(b"server", &ns, &nc) != blake3::Hash::from_bytes(mac.0) {
        return Err(refused("the server does not hold the cluster secret"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(
        server: ClusterSecret,
        client: ClusterSecret,
    ) -> (Result<(), ProtocolError>, Result<(), ProtocolError>) {
        let (a, b) = tokio::io::duplex(4096);
        let (mut ar, mut aw) = tokio::io::split(a);
        let (mut br, mut bw) = tokio::io::split(b);
        let s = async move { accept(&mut ar, &mut aw, &server).await };
        let c = async move { connect(&mut br, &mut bw, &client).await };
        tokio::join!(s, c)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime")
    }

    #[test]
    fn same_secret_passes_and_any_other_fails_on_both_sides() {
        let rt = rt();
        let a = ClusterSecret::new("correct horse battery staple").unwrap();
        let b = ClusterSecret::new("correct horse battery stapl3").unwrap();
        let (s, c) = rt.block_on(pair(a.clone(), a.clone()));
        assert!(s.is_ok() && c.is_ok(), "{s:?} {c:?}");
        let (s, c) = rt.block_on(pair(a.clone(), b.clone()));
        assert!(matches!(s, Err(ProtocolError::Unauthenticated { .. })), "{s:?}");
        assert!(c.is_err());
        let (s, c) = rt.block_on(pair(ClusterSecret::open(), a.clone()));
        assert!(s.is_err() && c.is_err());
        let (s, c) = rt.block_on(pair(ClusterSecret::open(), ClusterSecret::open()));
        assert!(s.is_ok() && c.is_ok());
    }

    #[test]
    fn a_server_that_only_echoes_or_replays_cannot_pass_the_client() {
        let rt = rt();
        let secret = ClusterSecret::new("0123456789abcdef-secret").unwrap();
        // A rogue server that knows a recorded Welcome from an earlier exchange: the client's
        // fresh nonce makes it useless.
        let recorded = Bytes32(*secret.mac(b"server", &Bytes32([1; 32]), &Bytes32([2; 32])).as_bytes());
        let (a, b) = tokio::io::duplex(4096);
        let (mut ar, mut aw) = tokio::io::split(a);
        let (mut br, mut bw) = tokio::io::split(b);
        let rogue = async move {
            write(&mut aw, &Handshake::Challenge { version: AUTH_VERSION, nonce: Bytes32([1; 32]) }).await?;
            let Handshake::Auth { mac, .. } = read(&mut ar).await? else { return Err(refused("x")) };
            // Reflecting the client's own proof does not work either (different label).
            let _ = mac;
            write(&mut aw, &Handshake::Welcome { mac: recorded }).await
        };
        let c = async move { connect(&mut br, &mut bw, &secret).await };
        let (_, c) = rt.block_on(async { tokio::join!(rogue, c) });
        assert!(matches!(c, Err(ProtocolError::Unauthenticated { .. })), "{c:?}");
    }

    #[test]
    fn short_secrets_are_refused_and_debug_shows_nothing() {
        assert!(ClusterSecret::new("short").is_err());
        let s = ClusterSecret::new("a-long-enough-secret").unwrap();
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
        let g = ClusterSecret::generate().unwrap();
        assert_eq!(g.len(), 64);
        assert_ne!(g, ClusterSecret::generate().unwrap());
    }

    #[test]
    fn a_kv_frame_in_the_handshake_is_refused_before_its_payload() {
        let rt = rt();
        // A header announcing a 16 MiB KV chunk, and no payload: refused from the header alone.
        let header =
            crate::frame::FrameHeader { kind: FrameKind::KvChunk, len: 16 << 20, checksum: 0 }.encode();
        let mut r: &[u8] = &header;
        let e = rt.block_on(read_control_frame(&mut r));
        assert!(matches!(e, Err(ProtocolError::InvalidFrame { .. })), "{e:?}");
    }
}
