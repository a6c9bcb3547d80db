//! Helpers shared by the KV crate's integration tests.

pub mod replay;
