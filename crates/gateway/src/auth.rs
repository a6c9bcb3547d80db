//! API keys: each key names a tenant; keys are kept only as SHA-256 digests and a presented key
//! is compared against every digest in constant time, so neither memory dumps nor response
//! timing reveal a key.
//!
//! Keys come from a spec string (`tenant:key,tenant2:key2`, e.g. the `TOKENPATH_API_KEYS`
//! environment variable). No keys configured means the API is open; the binary then refuses to
//! bind anything but loopback unless told otherwise. Rate limits per key build on the tenant
//! returned here (next step of issue 4).

use sha2::{Digest, Sha256};
use std::fmt;

/// The tenant a key belongs to (appears in logs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(pub String);

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a presented credential was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AuthFailure {
    /// No `Authorization: Bearer …` header.
    Missing,
    /// A key that matches no tenant.
    Wrong,
}

/// The configured keys, as digests.
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Vec<(Tenant, [u8; 32])>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print digests: only who has a key.
        f.debug_list().entries(self.keys.iter().map(|(t, _)| &t.0)).finish()
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Equality of two digests whose running time does not depend on where they differ.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl ApiKeys {
    /// Parses `tenant:key` pairs separated by commas (whitespace around items is ignored).
    /// Errors name the offending item's position, never the key.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut keys = Vec::new();
        for (i, item) in spec.split(',').map(str::trim).enumerate().filter(|(_, s)| !s.is_empty()) {
            let Some((tenant, key)) = item.split_once(':') else {
                return Err(format!("API key #{}: expected tenant:key", i + 1));
            };
            let (tenant, key) = (tenant.trim(), key.trim());
            if tenant.is_empty() || key.len() < 8 {
                return Err(format!(
                    "API key #{}: the tenant must be named and the key ≥ 8 characters",
                    i + 1
                ));
            }
            keys.push((Tenant(tenant.to_owned()), digest(key)));
        }
        Ok(Self { keys })
    }

    /// Whether no key is configured (the API is open).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Checks an `Authorization` header value. `Ok(None)` when the API is open.
    pub(crate) fn check(&self, authorization: Option<&[u8]>) -> Result<Option<Tenant>, AuthFailure> {
        if self.keys.is_empty() {
            return Ok(None);
        }
        let presented = authorization
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(AuthFailure::Missing)?;
        let d = digest(presented);
        // Compare against every key so the time does not tell which tenant (or none) matched.
        let mut found = None;
        for (tenant, k) in &self.keys {
            if ct_eq(&d, k) && found.is_none() {
                found = Some(tenant.clone());
            }
        }
        found.map(Some).ok_or(AuthFailure::Wrong)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_and_check() {
        let keys = ApiKeys::parse(" alice:sk-alice-123 , bob:sk-bob-4567").unwrap();
        assert_eq!(keys.len(), 2);
        assert!(!format!("{keys:?}").contains("sk-"), "no key material in Debug");
        assert_eq!(keys.check(Some(b"Bearer sk-bob-4567")), Ok(Some(Tenant("bob".into()))));
        assert_eq!(keys.check(Some(b"Bearer sk-bob-4568")), Err(AuthFailure::Wrong));
        assert_eq!(keys.check(Some(b"sk-bob-4567")), Err(AuthFailure::Missing));
        assert_eq!(keys.check(None), Err(AuthFailure::Missing));
        assert_eq!(ApiKeys::default().check(None), Ok(None));
        for bad in ["alice", ":sk-12345678", "alice:short"] {
            let err = ApiKeys::parse(bad).unwrap_err();
            assert!(err.contains("#1") && !err.contains("sk-"), "{err}");
        }
    }
}
