//! A worker is one engine instance behind a batcher, in role `prefill`, `decode` or `both`.
//!
//! It is separate from the engine so the engine stays a pure model runner (no queues, no
//! sockets) and separate from the gateway so a worker can run in its own process, pinned to its
//! own cores. Continuous batching and chunked prefill live here, not in the engine. This crate
//! starts with the role vocabulary; the batcher lands with `tokenpath serve`.

use std::{fmt, str::FromStr};

/// Errors of the worker layer.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A role name that is not `prefill`, `decode` or `both`.
    #[error("unknown worker role {0:?}: expected prefill, decode or both")]
    UnknownRole(String),
}

/// What part of the request path a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes the prompt's KV and the first token, then hands the KV on.
    Prefill,
    /// Receives KV and runs the token-by-token loop.
    Decode,
    /// Colocated: both on one engine.
    Both,
}

impl FromStr for Role {
    type Err = WorkerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            "both" => Ok(Self::Both),
            other => Err(WorkerError::UnknownRole(other.to_owned())),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_and_reject_unknown() {
        for r in [Role::Prefill, Role::Decode, Role::Both] {
            assert_eq!(r.to_string().parse::<Role>().unwrap(), r);
        }
        let err = "mixed".parse::<Role>().unwrap_err();
        assert!(err.to_string().contains("mixed"));
    }
}
