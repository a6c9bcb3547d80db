//! The KV pool's remote tier: blocks in a Valkey/Redis server that pools on several hosts share,
//! so a prefix computed on one host is a hit on every other.
//!
//! Each value is the SSD slot's header (key, namespace, length, BLAKE3 of the payload, itself
//! checksummed), the payload, and a BLAKE3 MAC of both under a key derived from the fleet's
//! `--kv-pool-remote-key` secret. A value is served only after its MAC, its header (the key and
//! namespace asked for) and its payload's checksum all check out — so whoever can write to the
//! server without the secret (another tenant of a shared Redis, the server itself) can cause
//! misses, never plant KV. Reads use `GETRANGE` bounded to one value; the redis crate still reads
//! a reply as long as the server announces, so the server is trusted not to flood us (the
//! timeouts bound each read). Blocks expire
//! after a TTL; the server's own `maxmemory` policy bounds the tier. A server that does not
//! answer costs a bounded wait (timeouts on connect, read and write), then the tier is skipped
//! for a few seconds: the pool serves from RAM and SSD meanwhile.
//!
//! A Redis URL (`redis://[:password@]host:port/db`) names it; a password in it is never logged.

use std::time::{Duration, Instant};

use tokenpath_protocol::pool::PoolTier;

use crate::slab::{Header, HEADER_BYTES};
use crate::store::BlockStore;
use crate::{BlockHash, KvError};

/// Longest wait to connect, and for any one reply.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long a server that failed is left alone.
const BACKOFF: Duration = Duration::from_secs(5);

/// Blocks in a Valkey/Redis server.
pub struct RemoteStore {
    client: redis::Client,
    conn: Option<redis::Connection>,
    /// Where the URL points, without credentials (for logs).
    shown: String,
    prefix: String,
    namespace: BlockHash,
    payload_bytes: usize,
    ttl: Duration,
    /// The MAC key (derived from the fleet's secret).
    mac_key: [u8; 32],
    retry_at: Option<Instant>,
    stored: usize,
    failed: u64,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore").field("server", &self.shown).field("prefix", &self.prefix).finish()
    }
}

fn remote_err(shown: &str, e: impl std::fmt::Display) -> KvError {
    KvError::Remote(format!("{shown}: {e}"))
}

impl RemoteStore {
    /// Connects to the server at `url` for blocks of `payload_bytes` under `namespace`, kept for
    /// `ttl` and authenticated under `secret` (the fleet's, at least 16 bytes). Fails when the
    /// secret is short, the URL is bad or the server does not answer a PING.
    pub fn open(
        url: &str,
        secret: &str,
        namespace: BlockHash,
        payload_bytes: usize,
        ttl: Duration,
    ) -> Result<Self, KvError> {
        if secret.len() < 16 {
            return Err(KvError::Remote("needs a secret of at least 16 bytes (--kv-pool-remote-key)".into()));
        }
        let client =
            redis::Client::open(url).map_err(|e| KvError::Remote(format!("bad remote tier URL: {e}")))?;
        let info = client.get_connection_info();
        let shown = format!("{}", info.addr());
        let ns: String = namespace.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        let mut me = Self {
            client,
            conn: None,
            shown,
            prefix: format!("tokenpath:kv:{ns}:"),
            namespace,
            payload_bytes,
            ttl,
            mac_key: blake3::derive_key("tokenpath 2026-12-04 kv pool remote tier mac v1", secret.as_bytes()),
            retry_at: None,
            stored: 0,
            failed: 0,
        };
        me.connect()?;
        Ok(me)
    }

    fn connect(&mut self) -> Result<(), KvError> {
        let mut conn =
            self.client.get_connection_with_timeout(TIMEOUT).map_err(|e| remote_err(&self.shown, e))?;
        conn.set_read_timeout(Some(TIMEOUT)).map_err(|e| remote_err(&self.shown, e))?;
        conn.set_write_timeout(Some(TIMEOUT)).map_err(|e| remote_err(&self.shown, e))?;
        redis::cmd("PING").query::<String>(&mut conn).map_err(|e| remote_err(&self.shown, e))?;
        self.conn = Some(conn);
        Ok(())
    }

    /// The connection, reconnecting after the backoff; `None` while the server is left alone.
    fn conn(&mut self) -> Option<&mut redis::Connection> {
        if self.conn.is_none() {
            if self.retry_at.is_some_and(|t| Instant::now() < t) {
                return None;
            }
            if let Err(e) = self.connect() {
                tracing::warn!("KV pool remote tier unreachable, skipped for {BACKOFF:?}: {e}");
                self.retry_at = Some(Instant::now() + BACKOFF);
                return None;
            }
        }
        self.conn.as_mut()
    }

    fn lost(&mut self, e: &redis::RedisError) {
        tracing::warn!(server = %self.shown, "KV pool remote tier failed, skipped for {BACKOFF:?}: {e}");
        self.conn = None;
        self.retry_at = Some(Instant::now() + BACKOFF);
    }

    fn redis_key(&self, key: &BlockHash) -> String {
        let hex: String = key.0.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}{hex}", self.prefix)
    }

    /// The value stored for `key`: the header, then the payload.
    fn value(&self, key: BlockHash, payload: &[u8]) -> Vec<u8> {
        let header = Header {
            seq: 0,
            key,
            namespace: self.namespace,
            payload_len: payload.len() as u32,
            checksum: *blake3::hash(payload).as_bytes(),
        };
        let mut v = header.encode();
        v.extend_from_slice(payload);
        let mac = blake3::keyed_hash(&self.mac_key, &v);
        v.extend_from_slice(mac.as_bytes());
        v
    }

    /// The payload's BLAKE3 when `value` is `key`'s block of this namespace, intact.
    fn check(&self, key: &BlockHash, value: &[u8]) -> Option<[u8; 32]> {
        let (signed, mac) = value.split_at_checked(value.len().checked_sub(32)?)?;
        // Constant-time comparison (blake3's `Hash` equality).
        if blake3::keyed_hash(&self.mac_key, signed) != blake3::Hash::from_bytes(mac.try_into().ok()?) {
            return None;
        }
        let h = Header::decode(signed)?;
        let payload = signed.get(HEADER_BYTES..)?;
        (h.key == *key
            && h.namespace == self.namespace
            && h.payload_len as usize == self.payload_bytes
            && payload.len() == self.payload_bytes
            && h.checksum == *blake3::hash(payload).as_bytes())
        .then_some(h.checksum)
    }
}

impl BlockStore for RemoteStore {
    fn tier(&self) -> PoolTier {
        PoolTier::Remote
    }

    fn may_hold(&self, _key: &BlockHash) -> bool {
        // Only a round trip can tell; `get` asks.
        self.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    fn holds(&self, _key: &BlockHash) -> bool {
        false
    }

    fn get_into(&mut self, key: &BlockHash, dst: &mut [u8]) -> Result<Option<[u8; 32]>, KvError> {
        let k = self.redis_key(key);
        let last = (HEADER_BYTES + self.payload_bytes + 32) as isize; // one byte past a value: caught
        let Some(conn) = self.conn() else { return Ok(None) };
        let got: Result<Vec<u8>, _> = redis::cmd("GETRANGE").arg(&k).arg(0).arg(last).query(conn);
        let value = match got {
            Ok(v) => v,
            Err(e) => {
                self.lost(&e);
                return Ok(None);
            }
        };
        if value.is_empty() {
            return Ok(None);
        }
        match self.check(key, &value) {
            Some(sum) if dst.len() == self.payload_bytes => {
                dst.copy_from_slice(&value[HEADER_BYTES..HEADER_BYTES + self.payload_bytes]);
                Ok(Some(sum))
            }
            Some(_) => Ok(None),
            None => {
                self.failed += 1;
                // Left on the server (its TTL ends it): a pool of another fleet secret must not
                // delete the values of the pools it cannot read.
                tracing::warn!(server = %self.shown, "a remote KV block failed its check: recomputed");
                Ok(None)
            }
        }
    }

    fn put(&mut self, key: BlockHash, payload: &[u8]) -> Result<(), KvError> {
        let value = self.value(key, payload);
        let (k, ttl) = (self.redis_key(&key), self.ttl.as_secs().max(1));
        let Some(conn) = self.conn() else { return Ok(()) };
        match redis::cmd("SET").arg(&k).arg(value).arg("EX").arg(ttl).query::<()>(conn) {
            Ok(()) => self.stored += 1,
            Err(e) => self.lost(&e),
        }
        Ok(())
    }

    fn blocks(&self) -> usize {
        self.stored
    }

    fn capacity(&self) -> usize {
        0
    }

    fn failed_loads(&self) -> u64 {
        self.failed
    }

    fn sync(&self) -> Result<(), KvError> {
        Ok(())
    }
}
