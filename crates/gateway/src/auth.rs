//! API keys: each key names a tenant; keys are kept only as SHA-256 digests and a presented key
//! is compared against every digest in constant time, so neither memory dumps nor response
//! timing reveal a key.
//!
//! Keys come from a spec string (`tenant:key,tenant2:key2`, e.g. the `TOKENPATH_API_KEYS`
//! environment variable; no limits) or from a TOML key file ([`crate::keyfile`], with per-tenant
//! rate limits). No keys configured means the API is open; the binary then refuses to bind
//! anything but loopback unless told otherwise. A tenant may hold several keys (rotation); its
//! limits, and so its rate-limit buckets, are the tenant's, not a key's.

use crate::ratelimit::RateLimits;
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

/// The configured keys, as digests, and each tenant's limits.
#[derive(Clone, Default)]
pub struct ApiKeys {
    /// Index into `tenants`, and the key's digest.
    keys: Vec<(usize, [u8; 32])>,
    /// Each tenant once.
    tenants: Vec<(Tenant, RateLimits)>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print digests: only who has a key.
        f.debug_list()
            .entries(self.keys.iter().filter_map(|(t, _)| self.tenants.get(*t)).map(|(t, _)| &t.0))
            .finish()
    }
}

/// One configured key: whose it is, its digest, and the tenant's limits.
#[derive(Clone, Debug)]
pub(crate) struct KeyEntry {
    pub(crate) tenant: Tenant,
    pub(crate) digest: [u8; 32],
    pub(crate) limits: RateLimits,
}

pub(crate) fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Tenant names become metric labels and log fields: short, plain ASCII.
fn valid_tenant(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
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
            keys.push(KeyEntry {
                tenant: Tenant(tenant.to_owned()),
                digest: digest(key),
                limits: RateLimits::default(),
            });
        }
        Self::from_entries(keys, "API key")
    }

    /// Keys from entries; `what` names an entry in errors (`API key`, `key entry`), by position
    /// from 1. Refuses invalid tenant names, a key given twice, and one tenant with two sets of
    /// limits.
    pub(crate) fn from_entries(entries: Vec<KeyEntry>, what: &str) -> Result<Self, String> {
        let mut out = Self::default();
        for (i, e) in entries.into_iter().enumerate() {
            let n = i + 1;
            if !valid_tenant(&e.tenant.0) {
                return Err(format!(
                    "{what} #{n}: the tenant name must be 1-64 characters of A-Z a-z 0-9 - _ ."
                ));
            }
            if let Some(j) = out.keys.iter().position(|(_, d)| ct_eq(d, &e.digest)) {
                return Err(format!("{what} #{n}: the same key as {what} #{}", j + 1));
            }
            let t = match out.tenants.iter().position(|(t, _)| *t == e.tenant) {
                Some(t) if out.tenants[t].1 != e.limits => {
                    return Err(format!(
                        "{what} #{n}: tenant {} already has different limits; give every key of a tenant \
                         the same limits",
                        e.tenant
                    ));
                }
                Some(t) => t,
                None => {
                    out.tenants.push((e.tenant, e.limits));
                    out.tenants.len() - 1
                }
            };
            out.keys.push((t, e.digest));
        }
        Ok(out)
    }

    /// Each tenant once, with its limits.
    pub fn tenants(&self) -> impl Iterator<Item = (&Tenant, &RateLimits)> {
        self.tenants.iter().map(|(t, l)| (t, l))
    }

    /// Whether no key is configured (the API is open).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether `admin` is also one of these keys (a configuration error: the credentials must
    /// never be interchangeable).
    pub(crate) fn holds(&self, admin: &AdminKey) -> bool {
        self.keys.iter().any(|(_, d)| ct_eq(d, &admin.0))
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
        let presented = bearer(authorization).ok_or(AuthFailure::Missing)?;
        let d = digest(presented);
        // Compare against every key so the time does not tell which tenant (or none) matched.
        let mut found = None;
        for (tenant, k) in &self.keys {
            if ct_eq(&d, k) && found.is_none() {
                found = Some(*tenant);
            }
        }
        found.and_then(|t| self.tenants.get(t)).map(|(t, _)| Some(t.clone())).ok_or(AuthFailure::Wrong)
    }
}

/// The operator's credential (`--admin-key`): guards `/admin/*` and `/metrics`. A separate
/// secret from every tenant key (a tenant key never opens an admin route, and the admin key is
/// not a tenant key), kept as a digest and compared in constant time like them.
#[derive(Clone)]
pub struct AdminKey([u8; 32]);

impl fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminKey(..)")
    }
}

impl AdminKey {
    /// The key in clear (at least 16 characters; it is never stored as given).
    pub fn new(key: &str) -> Result<Self, String> {
        let key = key.trim();
        if key.len() < 16 {
            return Err("the admin key must be at least 16 characters".into());
        }
        Ok(Self(digest(key)))
    }

    /// Whether `authorization` carries this key.
    pub(crate) fn check(&self, authorization: Option<&[u8]>) -> Result<(), AuthFailure> {
        let presented = bearer(authorization).ok_or(AuthFailure::Missing)?;
        if ct_eq(&digest(presented), &self.0) {
            Ok(())
        } else {
            Err(AuthFailure::Wrong)
        }
    }
}

/// The key of an `Authorization: Bearer KEY` header.
fn bearer(authorization: Option<&[u8]>) -> Option<&str> {
    authorization
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .filter(|k| !k.is_empty())
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
        for bad in
            ["alice", ":sk-12345678", "alice:short", "al ice:sk-12345678", "a:sk-12345678,b:sk-12345678"]
        {
            let err = ApiKeys::parse(bad).unwrap_err();
            assert!(err.contains("#1") && !err.contains("sk-"), "{err}");
        }
    }
}
