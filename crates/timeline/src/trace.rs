//! W3C trace context: the ids that join a client's record to the spans an engine exports.
//!
//! A load generator (or the gateway) sends `traceparent: 00-<trace id>-<parent span id>-<flags>`
//! with a request; an engine that continues the context (vLLM does) exports its span under the
//! same trace id, and the receiver joins the two by it. The ids are plain bytes here: whoever
//! makes them brings the randomness (this crate has no I/O).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

use crate::TimelineError;

/// A 16-byte trace id; all zero is invalid (W3C).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TraceId(pub [u8; 16]);

/// An 8-byte span id; all zero is invalid (W3C).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpanId(pub [u8; 8]);

/// A parsed `traceparent` header (version 00; later versions parse by their first four fields,
/// as the spec asks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace every span of the request belongs to.
    pub trace_id: TraceId,
    /// The caller's span: the parent of the receiver's first span.
    pub parent: SpanId,
    /// The sampled flag (bit 0 of the flags).
    pub sampled: bool,
}

fn hex_into(s: &str, out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(())
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
}

macro_rules! hex_id {
    ($t:ident, $n:expr, $what:expr) => {
        impl $t {
            /// From raw bytes (OTLP carries them so); `None` when all zero or not `$n` long.
            pub fn from_slice(b: &[u8]) -> Option<Self> {
                let arr: [u8; $n] = b.try_into().ok()?;
                (arr != [0; $n]).then_some(Self(arr))
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_hex(f, &self.0)
            }
        }
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({self})", stringify!($t))
            }
        }
        impl FromStr for $t {
            type Err = TimelineError;
            /// Lowercase hex, as `traceparent` and OTLP/JSON write it.
            fn from_str(s: &str) -> Result<Self, TimelineError> {
                let mut out = [0u8; $n];
                hex_into(s, &mut out)
                    .and_then(|()| Self::from_slice(&out))
                    .ok_or_else(|| TimelineError::BadTraceContext(format!("{} {s:?}", $what)))
            }
        }
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = std::borrow::Cow::<str>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

hex_id!(TraceId, 16, "trace id");
hex_id!(SpanId, 8, "span id");

impl Serialize for TraceParent {
    /// As the `traceparent` header writes it.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TraceParent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<str>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl TraceParent {
    /// The context a request starts with, sampled.
    pub fn new(trace_id: TraceId, parent: SpanId) -> Self {
        Self { trace_id, parent, sampled: true }
    }
}

impl fmt::Display for TraceParent {
    /// The `traceparent` header value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{:02x}", self.trace_id, self.parent, u8::from(self.sampled))
    }
}

impl FromStr for TraceParent {
    type Err = TimelineError;
    fn from_str(s: &str) -> Result<Self, TimelineError> {
        let bad = || TimelineError::BadTraceContext(format!("traceparent {s:?}"));
        let mut parts = s.trim().split('-');
        let (Some(version), Some(trace), Some(parent), Some(flags)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let mut v = [0u8; 1];
        let mut fl = [0u8; 1];
        hex_into(version, &mut v).ok_or_else(bad)?;
        hex_into(flags, &mut fl).ok_or_else(bad)?;
        // Version ff is forbidden; version 00 has exactly four fields.
        if v[0] == 0xff || (v[0] == 0 && parts.next().is_some()) {
            return Err(bad());
        }
        Ok(Self { trace_id: trace.parse()?, parent: parent.parse()?, sampled: fl[0] & 1 == 1 })
    }
}

/// One span an engine exported, as the receiver kept it: enough to place it in the request's
/// tree and to read its stages (`engines::spans_timing`); attributes whose meaning we do not map
/// are kept, raw, for the JSON output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineSpan {
    /// The trace it belongs to.
    pub trace_id: TraceId,
    /// Its own id.
    pub span_id: SpanId,
    /// Its parent (the caller's span for an engine's root span), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<SpanId>,
    /// The span name (`llm_request` for vLLM's).
    pub name: String,
    /// The exporting resource's `service.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Start and end, ns since the Unix epoch on the exporter's clock (never compared with ours).
    pub start_unix_ns: u64,
    /// See `start_unix_ns`.
    pub end_unix_ns: u64,
    /// Every attribute, as JSON (OTLP's AnyValue: strings, numbers, booleans, arrays, maps).
    #[serde(default)]
    pub attributes: serde_json::Map<String, serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_w3c_example_parses_and_prints_back() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp: TraceParent = s.parse().unwrap();
        assert_eq!(tp.to_string(), s);
        assert!(tp.sampled);
        assert_eq!(tp.trace_id.0[0], 0x4b);
    }

    #[test]
    fn malformed_contexts_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert!(bad.parse::<TraceParent>().is_err(), "{bad:?}");
        }
        // A later version may append fields.
        assert!("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz".parse::<TraceParent>().is_ok());
    }

    proptest! {
        #[test]
        fn any_nonzero_ids_round_trip(t in any::<[u8; 16]>(), p in any::<[u8; 8]>(), sampled: bool) {
            prop_assume!(t != [0; 16] && p != [0; 8]);
            let tp = TraceParent { trace_id: TraceId(t), parent: SpanId(p), sampled };
            prop_assert_eq!(tp.to_string().parse::<TraceParent>().unwrap(), tp);
            let json = serde_json::to_string(&tp.trace_id).unwrap();
            prop_assert_eq!(serde_json::from_str::<TraceId>(&json).unwrap(), tp.trace_id);
            let json = serde_json::to_string(&tp).unwrap();
            prop_assert_eq!(serde_json::from_str::<TraceParent>(&json).unwrap(), tp);
        }

        #[test]
        fn any_string_parses_or_errs_without_panicking(s in ".{0,80}") {
            let _ = s.parse::<TraceParent>();
        }
    }
}
