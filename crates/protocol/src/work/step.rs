//! One engine step as the batcher saw it: the opt-in per-step log (`--step-log`), one JSON
//! object per line. It is what a step-time model is fitted to (rows, prompt and decode tokens,
//! attention work) and what the time between steps — the overhead simulators forget — is read
//! from, so the writer (the batcher) and every reader (the simulator's calibration, a profile)
//! share this one definition.

use serde::{Deserialize, Serialize};

/// One forward step of a worker.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Microseconds from the worker's start to this step's start.
    pub start_us: u64,
    /// Microseconds inside the forward call (what `busy_seconds` sums).
    pub dur_us: u64,
    /// Microseconds from the previous step's end to this step's start: planning, sampling,
    /// streaming and idle time (`None` for the first step).
    pub gap_us: Option<u64>,
    /// Sequences fed this step.
    pub rows: usize,
    /// Prompt tokens fed (prefill chunks and recomputation).
    pub prefill_tokens: usize,
    /// Decoding sequences fed one token each.
    pub decode_tokens: usize,
    /// Attention work: Σ over fed tokens of the context each attends to (query × key pairs).
    pub attn_pairs: u64,
    /// Of those, the pairs of decoding sequences (one query each); the rest are prompt tokens'.
    #[serde(default)]
    pub decode_pairs: u64,
    /// Sequences in the running batch after planning.
    pub running: usize,
    /// Requests waiting for admission after planning.
    pub waiting: usize,
    /// KV blocks free after the step.
    pub free_blocks: usize,
}

impl StepRecord {
    /// Attention pairs of feeding `n` tokens to a sequence with `fed` tokens in its cache.
    pub fn pairs(fed: usize, n: usize) -> u64 {
        let (fed, n) = (fed as u64, n as u64);
        n * fed + n * (n + 1) / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_pairs_count_every_query_against_its_causal_context() {
        // Decode at 10 tokens of context: one query against 11 keys (itself included).
        assert_eq!(StepRecord::pairs(10, 1), 11);
        // A 3-token prompt from scratch: 1 + 2 + 3.
        assert_eq!(StepRecord::pairs(0, 3), 6);
        let brute: u64 = (0..5u64).map(|i| 7 + i + 1).sum();
        assert_eq!(StepRecord::pairs(7, 5), brute);
    }

    #[test]
    fn a_record_round_trips_through_one_json_line() {
        let r = StepRecord {
            start_us: 5,
            dur_us: 9,
            gap_us: Some(2),
            rows: 3,
            prefill_tokens: 64,
            decode_tokens: 2,
            attn_pairs: 100,
            decode_pairs: 30,
            running: 3,
            waiting: 1,
            free_blocks: 40,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<StepRecord>(&line).unwrap(), r);
        // A log written before `decode_pairs` existed still reads.
        let old = line.replace(",\"decode_pairs\":30", "");
        assert_eq!(serde_json::from_str::<StepRecord>(&old).unwrap().decode_pairs, 0);
    }
}
