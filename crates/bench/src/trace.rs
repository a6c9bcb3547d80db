//! Trace replay: a JSONL file, one request per line (`timestamp` in seconds, `prompt` text or
//! `prompt_tokens` length, `output_tokens`), whose timestamps become the send schedule. The file
//! is untrusted input: every line is checked here, once, and a bad one is refused with its line
//! number, so a run never starts on a trace it would have to guess about. Timestamps must not go
//! backwards (an unsorted trace is far more often a mistake than an intent); offsets are taken
//! from the first line's timestamp.

use crate::workload::MAX_LEN;
use crate::BenchError;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// Most lines a trace may have.
pub const MAX_TRACE_LINES: usize = 1_000_000;
/// Latest timestamp accepted, seconds (about 116 days).
pub const MAX_TIMESTAMP_S: f64 = 1e7;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEntry {
    /// Seconds on the trace's clock.
    pub timestamp: f64,
    /// The prompt text, when the trace has it.
    pub prompt: Option<String>,
    /// The prompt length in tokens, when the trace has it (text is generated when `prompt` is
    /// absent).
    pub prompt_tokens: Option<usize>,
    /// `max_tokens` to ask for.
    pub output_tokens: u32,
}

/// A whole trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// Where it came from (for messages).
    pub source: String,
    /// Its requests, in file order.
    pub entries: Vec<TraceEntry>,
}

impl Trace {
    /// Reads and checks the trace at `path`.
    pub fn load(path: &Path) -> Result<Trace, BenchError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|source| BenchError::Read { path: name.clone(), source })?;
        Trace::parse(&text, &name)
    }

    /// Checks the JSONL `text`; `source` names it in errors.
    pub fn parse(text: &str, source: &str) -> Result<Trace, BenchError> {
        let mut entries = Vec::new();
        let mut last = f64::NEG_INFINITY;
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            let bad =
                |reason: String| BenchError::BadTrace { path: source.to_owned(), line: line_no, reason };
            if line.trim().is_empty() {
                continue;
            }
            if entries.len() >= MAX_TRACE_LINES {
                return Err(bad(format!("more than {MAX_TRACE_LINES} requests")));
            }
            let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
            let obj = v.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
            let timestamp = obj
                .get("timestamp")
                .ok_or_else(|| bad("no `timestamp`".into()))?
                .as_f64()
                .ok_or_else(|| bad("`timestamp` is not a number".into()))?;
            if !(0.0..=MAX_TIMESTAMP_S).contains(&timestamp) {
                return Err(bad(format!("`timestamp` {timestamp} must be within 0..={MAX_TIMESTAMP_S} s")));
            }
            if timestamp < last {
                return Err(bad(format!("`timestamp` {timestamp} goes back (previous line: {last})")));
            }
            let count = |key: &str| -> Result<Option<usize>, BenchError> {
                match obj.get(key) {
                    None | Some(Value::Null) => Ok(None),
                    Some(v) => match v.as_u64() {
                        Some(n) if (1..=MAX_LEN as u64).contains(&n) => Ok(Some(n as usize)),
                        _ => Err(bad(format!("`{key}` must be an integer within 1..={MAX_LEN}, not {v}"))),
                    },
                }
            };
            let prompt = match obj.get("prompt") {
                None | Some(Value::Null) => None,
                Some(Value::String(p)) if !p.is_empty() => Some(p.clone()),
                Some(v) => return Err(bad(format!("`prompt` must be a non-empty string, not {v}"))),
            };
            let prompt_tokens = count("prompt_tokens")?;
            if prompt.is_none() && prompt_tokens.is_none() {
                return Err(bad("needs `prompt` (text) or `prompt_tokens` (length)".into()));
            }
            let output_tokens = count("output_tokens")?.ok_or_else(|| bad("no `output_tokens`".into()))?;
            last = timestamp;
            entries.push(TraceEntry {
                timestamp,
                prompt,
                prompt_tokens,
                output_tokens: output_tokens as u32,
            });
        }
        if entries.is_empty() {
            return Err(BenchError::BadTrace {
                path: source.to_owned(),
                line: 0,
                reason: "no requests".into(),
            });
        }
        Ok(Trace { source: source.to_owned(), entries })
    }

    /// Send offsets from the first request's timestamp: non-decreasing, the first is 0.
    pub fn offsets(&self) -> Vec<Duration> {
        let t0 = self.entries.first().map_or(0.0, |e| e.timestamp);
        self.entries.iter().map(|e| Duration::from_secs_f64((e.timestamp - t0).max(0.0))).collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_text_and_length_lines() {
        let t = Trace::parse(
            "{\"timestamp\": 10.5, \"prompt\": \"hi there\", \"output_tokens\": 4}\n\n\
             {\"timestamp\": 11, \"prompt_tokens\": 30, \"output_tokens\": 8, \"extra\": 1}\n",
            "t.jsonl",
        )
        .unwrap();
        assert_eq!(t.entries.len(), 2);
        assert_eq!(t.entries[1].prompt_tokens, Some(30));
        assert_eq!(t.offsets(), vec![Duration::ZERO, Duration::from_millis(500)]);
    }

    #[test]
    fn bad_lines_name_their_line() {
        let ok = "{\"timestamp\": 1, \"prompt_tokens\": 3, \"output_tokens\": 2}\n";
        for (bad, why) in [
            ("{\"timestamp\": 1, \"output_tokens\": 2}", "prompt"),
            ("{\"prompt_tokens\": 3, \"output_tokens\": 2}", "timestamp"),
            ("{\"timestamp\": 0.5, \"prompt_tokens\": 3, \"output_tokens\": 2}", "goes back"),
            ("{\"timestamp\": 2, \"prompt_tokens\": 0, \"output_tokens\": 2}", "prompt_tokens"),
            ("{\"timestamp\": 2, \"prompt_tokens\": 3}", "output_tokens"),
            ("{\"timestamp\": -1, \"prompt_tokens\": 3, \"output_tokens\": 2}", "timestamp"),
            ("{\"timestamp\": 2, \"prompt\": 7, \"output_tokens\": 2}", "prompt"),
            ("[1, 2]", "object"),
            ("{\"timestamp\": 2,", "JSON"),
        ] {
            let err = Trace::parse(&format!("{ok}\n{bad}\n"), "x.jsonl").unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("x.jsonl:3:") && msg.contains(why), "{bad}: {msg}");
        }
        assert!(Trace::parse("\n\n", "e").unwrap_err().to_string().contains("no requests"));
    }

    proptest! {
        #[test]
        fn never_panics_on_junk(text in "\\PC{0,200}") {
            let _ = Trace::parse(&text, "junk");
        }

        #[test]
        fn sorted_traces_round_trip(gaps in proptest::collection::vec((0u32..5000, 1usize..500, 1u32..100), 1..40)) {
            let mut t = 0.0;
            let mut text = String::new();
            for (gap, p, o) in &gaps {
                t += f64::from(*gap) / 1000.0;
                text.push_str(&format!("{{\"timestamp\": {t}, \"prompt_tokens\": {p}, \"output_tokens\": {o}}}\n"));
            }
            let trace = Trace::parse(&text, "p").unwrap();
            prop_assert_eq!(trace.entries.len(), gaps.len());
            let off = trace.offsets();
            prop_assert_eq!(off[0], Duration::ZERO);
            prop_assert!(off.windows(2).all(|w| w[0] <= w[1]));
        }
    }
}
