//! The API key file (`--api-keys-file`, TOML): one `[[key]]` table per key, naming its tenant,
//! the key (`key_sha256 = "<hex>"`, or `key = "plain"` hashed at load and never kept) and the
//! tenant's optional limits per minute. See `deploy/keys.example.toml`.
//!
//! Shaped so a key can never leak through an error: the file is first parsed as TOML (syntax
//! errors report a line and TOML's message, never the offending line's text), then each entry is
//! decoded on its own, so every error names the entry by position, and any string of the entry
//! is masked out of decoder messages (serde echoes a wrongly-typed value). Unknown fields are
//! refused (`deny_unknown_fields`), so a misspelt limit is an error instead of no limit.

use crate::auth::{digest, ApiKeys, KeyEntry, Tenant};
use crate::error::GatewayError;
use crate::ratelimit::RateLimits;
use serde::Deserialize;
use std::path::Path;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    #[serde(default)]
    key: Vec<toml::Value>,
}

/// One `[[key]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    tenant: String,
    key: Option<String>,
    key_sha256: Option<String>,
    requests_per_minute: Option<u64>,
    input_tokens_per_minute: Option<u64>,
    output_tokens_per_minute: Option<u64>,
    max_concurrent_requests: Option<u64>,
}

/// A SHA-256 digest from 64 hex digits.
fn parse_hex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(s.as_bytes().chunks_exact(2)) {
        let hi = char::from(pair[0]).to_digit(16)?;
        let lo = char::from(pair[1]).to_digit(16)?;
        *o = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(out)
}

/// `msg` with every string of `entry` that could be a key (any field but `tenant`, at least the
/// 8 characters a key needs) masked out: serde echoes wrongly-typed values.
fn mask(msg: &str, entry: &toml::Value) -> String {
    let mut msg = msg.to_owned();
    if let Some(table) = entry.as_table() {
        let secrets = table.iter().filter(|(k, _)| *k != "tenant").filter_map(|(_, v)| v.as_str());
        for v in secrets.filter(|v| v.len() >= 8) {
            msg = msg.replace(v, "***");
        }
    }
    msg
}

fn decode(n: usize, value: toml::Value) -> Result<KeyEntry, String> {
    let e: Entry =
        value.clone().try_into().map_err(|e| format!("key entry #{n}: {}", mask(e.message(), &value)))?;
    let digest = match (&e.key, &e.key_sha256) {
        (Some(key), None) if key.trim().len() >= 8 => digest(key.trim()),
        (Some(_), None) => return Err(format!("key entry #{n}: the key must be at least 8 characters")),
        (None, Some(hex)) => {
            let d = parse_hex(hex)
                .ok_or_else(|| format!("key entry #{n}: key_sha256 must be 64 hexadecimal digits"))?;
            // A digest hides the key's length; at least refuse the keys everyone tries first.
            if ["", "test", "password", "changeme", "secret", "admin"].iter().any(|w| digest(w) == d) {
                return Err(format!("key entry #{n}: key_sha256 is the digest of a well-known key"));
            }
            d
        }
        _ => return Err(format!("key entry #{n}: give exactly one of `key` and `key_sha256`")),
    };
    let limits = RateLimits {
        requests_per_minute: e.requests_per_minute,
        input_tokens_per_minute: e.input_tokens_per_minute,
        output_tokens_per_minute: e.output_tokens_per_minute,
        max_concurrent_requests: e.max_concurrent_requests,
    };
    for (name, v) in [
        ("requests_per_minute", limits.requests_per_minute),
        ("input_tokens_per_minute", limits.input_tokens_per_minute),
        ("output_tokens_per_minute", limits.output_tokens_per_minute),
        ("max_concurrent_requests", limits.max_concurrent_requests),
    ] {
        if v == Some(0) {
            return Err(format!("key entry #{n}: {name} must be at least 1 (leave it out for no limit)"));
        }
    }
    Ok(KeyEntry { tenant: Tenant(e.tenant.trim().to_owned()), digest, limits })
}

fn parse(text: &str) -> Result<ApiKeys, String> {
    let file: KeyFile = toml::from_str(text).map_err(|e| {
        let line = e.span().map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        match line {
            Some(line) => format!("line {line}: {}", e.message()),
            None => e.message().to_owned(),
        }
    })?;
    let entries =
        file.key.into_iter().enumerate().map(|(i, v)| decode(i + 1, v)).collect::<Result<Vec<_>, _>>()?;
    ApiKeys::from_entries(entries, "key entry")
}

impl ApiKeys {
    /// Keys from the text of a key file (see the module docs). Errors name the entry, never a key.
    pub fn from_toml_str(text: &str) -> Result<Self, GatewayError> {
        parse(text).map_err(GatewayError::Keys)
    }

    /// Keys from a key file.
    pub fn load(path: &Path) -> Result<Self, GatewayError> {
        let file = || path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| GatewayError::KeyFile { path: file(), message: e.to_string() })?;
        parse(&text).map_err(|message| GatewayError::KeyFile { path: file(), message })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What deploy/keys.example.toml has in place of every digest.
    const EXAMPLE_PLACEHOLDER: &str = "REPLACE-with-the-sha256-of-your-key";

    fn hex_of(d: &[u8; 32]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    const GOOD: &str = r#"
        [[key]]
        tenant = "team-a"
        key = "sk-team-a-secret"
        requests_per_minute = 60
        input_tokens_per_minute = 100000
        output_tokens_per_minute = 20000

        [[key]]   # a second key of the same tenant (rotation)
        tenant = "team-a"
        key_sha256 = "1DEAD7596CF26003326D5995B0AAFA26E095174706234F32F3A83862D33DEB79"
        requests_per_minute = 60
        input_tokens_per_minute = 100000
        output_tokens_per_minute = 20000

        [[key]]
        tenant = "team-b"
        key = "sk-team-b-secret"
    "#;

    #[test]
    fn a_good_file_loads() {
        let keys = ApiKeys::from_toml_str(GOOD).unwrap();
        assert_eq!(keys.len(), 3);
        let tenants: Vec<_> = keys.tenants().map(|(t, l)| (t.0.clone(), *l)).collect();
        assert_eq!(tenants.len(), 2);
        assert_eq!(tenants[0].1.requests_per_minute, Some(60));
        assert!(tenants[1].1.is_unlimited());
        // sha256("sk-team-a-rotated") in upper case hex.
        assert_eq!(keys.check(Some(b"Bearer sk-team-a-rotated")), Ok(Some(Tenant("team-a".into()))));
        assert_eq!(keys.check(Some(b"Bearer sk-team-b-secret")), Ok(Some(Tenant("team-b".into()))));
        assert!(ApiKeys::from_toml_str("").unwrap().is_empty());
        // The example holds placeholders, never a usable key: loading it as is fails, and with
        // the placeholders filled in it loads.
        let example = include_str!("../../../deploy/keys.example.toml");
        let err = ApiKeys::from_toml_str(example).unwrap_err().to_string();
        assert!(err.contains("64 hexadecimal"), "{err}");
        let filled = example.replace(EXAMPLE_PLACEHOLDER, &"ab".repeat(32));
        let filled = filled.replacen(&"ab".repeat(32), &"cd".repeat(32), 1);
        let filled = filled.replacen(&"ab".repeat(32), &"ef".repeat(32), 1);
        assert_eq!(ApiKeys::from_toml_str(&filled).unwrap().tenants().count(), 3);
        // The digest of a trivially weak key is refused even though a digest hides its length.
        let weak = format!("[[key]]\ntenant = \"a\"\nkey_sha256 = \"{}\"\n", hex_of(&digest("test")));
        assert!(ApiKeys::from_toml_str(&weak).unwrap_err().to_string().contains("well-known"));
    }

    #[test]
    fn bad_files_name_the_entry_never_the_key() {
        let entry =
            |body: &str| format!("[[key]]\ntenant = \"ok\"\nkey = \"sk-first-key\"\n\n[[key]]\n{body}\n");
        let cases = [
            (
                entry("tenant = \"a\"\nkey = \"sk-secret-1\"\nrequests_per_minute = \"sk-secret-1\""),
                "key entry #2: invalid type: string \"***\", expected u64",
            ),
            (entry("tenant = \"b\"\nkey = \"sk-secret-1\"\nrequest_per_minute = 5"), "unknown field"),
            (entry("tenant = \"b\"\nkey = \"sk-secret-1\"\noutput_tokens_per_minute = 0"), "at least 1"),
            (entry("tenant = \"b\"\nkey = \"sk-secret-1\"\nkey_sha256 = \"00\""), "exactly one"),
            (entry("tenant = \"b\"\nkey_sha256 = \"sk-secret-1\""), "64 hexadecimal"),
            (entry("tenant = \"b\"\nkey = \"short\""), "at least 8"),
            (entry("tenant = \"b c\"\nkey = \"sk-secret-1\""), "tenant name"),
            (entry("tenant = \"b\"\nkey = \"sk-first-key\""), "same key as key entry #1"),
            (entry("tenant = \"ok\"\nkey = \"sk-secret-1\"\nrequests_per_minute = 3"), "different limits"),
            (entry("key = \"sk-secret-1\""), "missing field `tenant`"),
            ("[[keys]]\ntenant = \"a\"".to_owned(), "unknown field `keys`"),
            ("[[key]]\ntenant = \"a\"\nkey = \"sk-secret-1".to_owned(), "line 3"),
        ];
        for (text, want) in cases {
            let err = ApiKeys::from_toml_str(&text).unwrap_err().to_string();
            assert!(err.contains(want), "{want:?} not in {err:?}");
            assert!(!err.contains("sk-secret") && !err.contains("sk-first"), "key leaked: {err}");
        }
    }

    #[test]
    fn load_names_the_file() {
        let dir = std::env::temp_dir().join(format!("tokenpath-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys.toml");
        std::fs::write(&path, GOOD).unwrap();
        assert_eq!(ApiKeys::load(&path).unwrap().len(), 3);
        std::fs::write(&path, "[[key]]\ntenant = 3").unwrap();
        let err = ApiKeys::load(&path).unwrap_err().to_string();
        assert!(err.contains("keys.toml") && err.contains("key entry #1"), "{err}");
        let err = ApiKeys::load(&dir.join("missing.toml")).unwrap_err().to_string();
        assert!(err.contains("missing.toml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
