//! Client marks (what a load generator observes) and the per-request metrics defined on them.
//!
//! A [`ClientRecord`] keeps every stream event, token-bearing or not, with the number of generated
//! tokens it carried; the definitions below decide what counts. Keeping the raw events (rather than
//! letting each caller pick "the first chunk") is what makes the traps — a role-only first chunk,
//! a chunk carrying several tokens — come out the same everywhere.

use crate::{EngineSpan, Nanos, RequestId, ServerTiming, TraceId};
use serde::{Deserialize, Serialize};

/// One event of a response stream (an SSE `data:` line, or the whole body when not streaming).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamEvent {
    /// When the client read it, ns since the run's origin.
    pub at_ns: Nanos,
    /// Generated tokens it carried: 0 for role-only, empty, usage-only and keep-alive events.
    pub tokens: u32,
}

/// The server's `usage` object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens, cached ones included.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from a prefix cache (`prompt_tokens_details.cached_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
}

/// How a request ended, from the client's side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    /// A complete response.
    Ok {
        /// `finish_reason` as the server sent it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        finish_reason: Option<String>,
    },
    /// Anything else: HTTP error, connection error, timeout, stream cut short, error event.
    Failed {
        /// A short machine-readable kind (`http_503`, `timeout`, `connect`, `stream_error`, ...).
        kind: String,
        /// Human-readable detail.
        message: String,
    },
}

/// Where N_out (the number of generated tokens) came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NOutSource {
    /// The server's `usage.completion_tokens`: the truth.
    Usage,
    /// Re-tokenizing the generated text with the model's tokenizer (fallback).
    Retokenized,
    /// Summing the client's per-event token counts (last resort).
    Events,
}

/// Everything the client observed about one request, joined with the server's `timing` when the
/// server sent one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClientRecord {
    /// Request id within the run.
    pub id: RequestId,
    /// When the arrival process meant to send, ns since the run's origin.
    pub t_sched: Nanos,
    /// When the request was actually sent.
    pub t_send: Nanos,
    /// Whether the response was streamed. A non-streamed response has no observable TTFT or TPOT.
    pub streamed: bool,
    /// Every event in arrival order.
    pub events: Vec<StreamEvent>,
    /// When the stream closed (or the failure was observed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t_done: Option<Nanos>,
    /// The server's `usage`, when sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Generated tokens counted by re-tokenizing the output text, when a tokenizer was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retokenized_output: Option<u64>,
    /// Prompt tokens as the client counted them, when it could.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_hint: Option<u64>,
    /// How it ended.
    pub outcome: Outcome,
    /// The server's `timing` object, when sent; or the stages of the engine's span, joined by
    /// trace id (then each stage's source says so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerTiming>,
    /// The trace id sent with the request (`traceparent`), when one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<TraceId>,
    /// The spans engines exported under that trace id, every attribute kept raw.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spans: Vec<EngineSpan>,
}

impl ClientRecord {
    /// A record with no events yet, sent at `t_send`, meant for `t_sched`.
    pub fn new(id: RequestId, t_sched: Nanos, t_send: Nanos, streamed: bool) -> Self {
        Self {
            id,
            t_sched,
            t_send,
            streamed,
            events: Vec::new(),
            t_done: None,
            usage: None,
            retokenized_output: None,
            prompt_tokens_hint: None,
            outcome: Outcome::Ok { finish_reason: None },
            server: None,
            trace_id: None,
            spans: Vec::new(),
        }
    }

    /// Whether the request completed.
    pub fn is_ok(&self) -> bool {
        matches!(self.outcome, Outcome::Ok { .. })
    }

    fn token_events(&self) -> impl Iterator<Item = &StreamEvent> + '_ {
        self.events.iter().filter(|e| e.tokens > 0)
    }

    /// `t_first`: the first event carrying at least one generated token (streaming only).
    pub fn t_first(&self) -> Option<Nanos> {
        if !self.streamed {
            return None;
        }
        self.token_events().next().map(|e| e.at_ns)
    }

    /// `t_last`: the last token-bearing event (for a non-streamed response, the body).
    pub fn t_last(&self) -> Option<Nanos> {
        self.token_events().last().map(|e| e.at_ns)
    }

    /// When the request ended from the client's view: `t_done`, else `t_last`.
    pub fn t_end(&self) -> Option<Nanos> {
        self.t_done.or_else(|| self.t_last())
    }

    /// N_out and where it came from: `usage` first, then re-tokenization, then event counts.
    pub fn n_out(&self) -> Option<(u64, NOutSource)> {
        if let Some(u) = self.usage {
            return Some((u.completion_tokens, NOutSource::Usage));
        }
        if let Some(n) = self.retokenized_output {
            return Some((n, NOutSource::Retokenized));
        }
        let n: u64 = self.events.iter().map(|e| u64::from(e.tokens)).sum();
        (n > 0 || !self.events.is_empty()).then_some((n, NOutSource::Events))
    }

    /// Re-tokenized count minus `usage.completion_tokens`, when both are known.
    pub fn usage_disagreement(&self) -> Option<i64> {
        let u = self.usage?.completion_tokens;
        let r = self.retokenized_output?;
        Some(r as i64 - u as i64)
    }

    /// Input tokens: `usage.prompt_tokens`, else the client's own count.
    pub fn input_tokens(&self) -> Option<u64> {
        self.usage.map(|u| u.prompt_tokens).or(self.prompt_tokens_hint)
    }

    /// Cached input tokens: from `usage`, else from the server's `timing`, else 0.
    pub fn cached_tokens(&self) -> u64 {
        self.usage
            .and_then(|u| u.cached_tokens)
            .or_else(|| self.server.as_ref().map(|s| s.cached_tokens))
            .unwrap_or(0)
    }

    /// TTFT observed by the client = `t_first − t_send`, ns.
    pub fn ttft_ns(&self) -> Option<Nanos> {
        Some(self.t_first()?.saturating_sub(self.t_send))
    }

    /// TTFT from the schedule = `t_first − t_sched`, ns: includes the client's own lateness, so it
    /// does not hide the requests a late client failed to send (coordinated omission).
    pub fn ttft_from_sched_ns(&self) -> Option<Nanos> {
        Some(self.t_first()?.saturating_sub(self.t_sched))
    }

    /// Client schedule lag = `t_send − t_sched`, ns.
    pub fn schedule_lag_ns(&self) -> Nanos {
        self.t_send.saturating_sub(self.t_sched)
    }

    /// TPOT = `(t_last − t_first) / (N_out − 1)`, ns; undefined for N_out ≤ 1 and when not
    /// streamed.
    pub fn tpot_ns(&self) -> Option<f64> {
        let (n, _) = self.n_out()?;
        if n <= 1 {
            return None;
        }
        let span = self.t_last()?.checked_sub(self.t_first()?)?;
        Some(span as f64 / (n - 1) as f64)
    }

    /// Chunk gaps: the time between consecutive token-bearing events, ns — what a user sees stall.
    pub fn chunk_gaps_ns(&self) -> Vec<Nanos> {
        if !self.streamed {
            return Vec::new();
        }
        let times: Vec<Nanos> = self.token_events().map(|e| e.at_ns).collect();
        times.windows(2).map(|w| w[1].saturating_sub(w[0])).collect()
    }

    /// Per-token ITL, ns: each chunk gap divided by the tokens of the event that ends it, counted
    /// once per token of that event (so the distribution is over tokens, not events).
    pub fn per_token_itl_ns(&self) -> Vec<f64> {
        if !self.streamed {
            return Vec::new();
        }
        let evs: Vec<&StreamEvent> = self.token_events().collect();
        let mut out = Vec::new();
        for w in evs.windows(2) {
            let gap = w[1].at_ns.saturating_sub(w[0].at_ns) as f64;
            let k = w[1].tokens;
            out.extend(std::iter::repeat_n(gap / f64::from(k), k as usize));
        }
        out
    }

    /// The largest chunk gap, ns.
    pub fn max_chunk_gap_ns(&self) -> Option<Nanos> {
        self.chunk_gaps_ns().into_iter().max()
    }

    /// E2E = `t_last − t_send`, ns (`t_done` is kept separately).
    pub fn e2e_ns(&self) -> Option<Nanos> {
        Some(self.t_last()?.saturating_sub(self.t_send))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn rec(events: &[(u64, u32)]) -> ClientRecord {
        let mut r = ClientRecord::new(RequestId(1), 0, 10 * MS, true);
        r.events = events.iter().map(|&(t, k)| StreamEvent { at_ns: t * MS, tokens: k }).collect();
        r.t_done = r.events.last().map(|e| e.at_ns + MS);
        r
    }

    #[test]
    fn role_only_first_chunk_is_not_the_first_token() {
        // role-only at 20 ms, first token at 110 ms, then 130, 150; usage event at 151.
        let mut r = rec(&[(20, 0), (110, 1), (130, 1), (150, 1), (151, 0)]);
        r.usage = Some(Usage { prompt_tokens: 8, completion_tokens: 3, cached_tokens: None });
        assert_eq!(r.ttft_ns(), Some(100 * MS));
        assert_eq!(r.ttft_from_sched_ns(), Some(110 * MS));
        assert_eq!(r.tpot_ns(), Some(20.0 * MS as f64));
        assert_eq!(r.e2e_ns(), Some(140 * MS));
        assert_eq!(r.t_done, Some(152 * MS));
        assert_eq!(r.chunk_gaps_ns(), vec![20 * MS, 20 * MS]);
    }

    #[test]
    fn chunk_with_several_tokens_splits_per_token_itl_but_not_chunk_gap() {
        // tokens: 1 at 100, 3 at 160, 1 at 170 → N_out = 5.
        let mut r = rec(&[(100, 1), (160, 3), (170, 1)]);
        r.usage = Some(Usage { prompt_tokens: 4, completion_tokens: 5, cached_tokens: None });
        assert_eq!(r.chunk_gaps_ns(), vec![60 * MS, 10 * MS]);
        let per_token: Vec<f64> = r.per_token_itl_ns().iter().map(|v| v / MS as f64).collect();
        assert_eq!(per_token, vec![20.0, 20.0, 20.0, 10.0]);
        // TPOT = (170 − 100) / (5 − 1) = 17.5 ms.
        assert_eq!(r.tpot_ns(), Some(17.5 * MS as f64));
    }

    #[test]
    fn exactly_one_output_token_has_no_tpot() {
        let mut r = rec(&[(5, 0), (50, 1)]);
        r.usage = Some(Usage { prompt_tokens: 4, completion_tokens: 1, cached_tokens: None });
        assert_eq!(r.tpot_ns(), None);
        assert_eq!(r.ttft_ns(), Some(40 * MS));
        assert!(r.chunk_gaps_ns().is_empty());
    }

    #[test]
    fn usage_missing_falls_back_to_retokenized_then_events() {
        let mut r = rec(&[(100, 1), (120, 2), (140, 1)]);
        assert_eq!(r.n_out(), Some((4, NOutSource::Events)));
        assert_eq!(r.tpot_ns(), Some(40.0 * MS as f64 / 3.0));
        r.retokenized_output = Some(5);
        assert_eq!(r.n_out(), Some((5, NOutSource::Retokenized)));
        assert_eq!(r.usage_disagreement(), None);
        r.usage = Some(Usage { prompt_tokens: 3, completion_tokens: 4, cached_tokens: Some(2) });
        assert_eq!(r.n_out(), Some((4, NOutSource::Usage)));
        assert_eq!(r.usage_disagreement(), Some(1));
        assert_eq!(r.cached_tokens(), 2);
    }

    #[test]
    fn non_streamed_response_has_e2e_but_no_ttft_tpot_or_itl() {
        let mut r = ClientRecord::new(RequestId(2), 0, 0, false);
        r.events.push(StreamEvent { at_ns: 300 * MS, tokens: 12 });
        r.usage = Some(Usage { prompt_tokens: 4, completion_tokens: 12, cached_tokens: None });
        assert_eq!(r.ttft_ns(), None);
        assert_eq!(r.tpot_ns(), None);
        assert!(r.chunk_gaps_ns().is_empty());
        assert_eq!(r.e2e_ns(), Some(300 * MS));
    }

    #[test]
    fn record_round_trips_through_json() {
        let mut r = rec(&[(100, 1), (120, 1)]);
        r.outcome = Outcome::Failed { kind: "stream_error".into(), message: "cut".into() };
        let back: ClientRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert!(!back.is_ok());
    }
}
