//! Every wire format of tokenpath, and only here: the OpenAI request/response/SSE types with the
//! `timing` extension, worker messages, and KV transfer framing.
//!
//! One crate owns the bytes so that a format change is one diff, and so every decoder of
//! untrusted input sits in one place with its bounds, typed errors and fuzz target. It starts with
//! the timing extension's two renderings (the JSON `timing` object, defined by the `timeline`
//! crate, and the W3C `Server-Timing` header); the OpenAI types land with `tokenpath serve`.

use tokenpath_timeline::{ServerTiming, Stage};

/// Errors decoding wire formats.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// A message larger than its bound.
    #[error("{what} is {len} bytes, over the {max}-byte limit")]
    TooLarge {
        /// What was being decoded.
        what: &'static str,
        /// Its declared or actual size.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// The JSON key of the timing extension in responses and in the last SSE chunk.
pub const TIMING_FIELD: &str = "timing";

/// Renders a W3C `Server-Timing` header value (`queue;dur=12.1, prefill;dur=240.5`), stages in path
/// order, so browsers' dev tools display the server timeline of a non-streamed response.
pub fn server_timing_header(timing: &ServerTiming) -> String {
    Stage::ALL
        .iter()
        .filter_map(|s| timing.stage_ms(*s).map(|ms| format!("{};dur={ms:.1}", s.name())))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timing_header_is_in_path_order_and_skips_absent_stages() {
        let mut t = ServerTiming::default();
        t.stages_ms.insert(Stage::Prefill, 240.54);
        t.stages_ms.insert(Stage::Queue, 12.1);
        t.stages_ms.insert(Stage::Decode, 1000.0);
        assert_eq!(server_timing_header(&t), "queue;dur=12.1, prefill;dur=240.5, decode;dur=1000.0");
        assert_eq!(server_timing_header(&ServerTiming::default()), "");
    }
}
