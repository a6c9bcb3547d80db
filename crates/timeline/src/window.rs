//! Throughput over a declared steady-state window. A request belongs to the window when it
//! *ended* inside it (`t_done`, else `t_last`); warm-up and drain are excluded by choosing the
//! window. Input, cached-input, output and total tokens are kept apart — there is no unnamed
//! "tokens/s" — and the offered rate (from `t_sched`) is shown next to the achieved send rate (from
//! `t_send`), so a client that fell behind its schedule cannot hide.

use crate::{ClientRecord, Nanos, TimelineError};
use serde::{Deserialize, Serialize};

/// A half-open interval `[start_ns, end_ns)` on the client's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Start, ns since the run's origin.
    pub start_ns: Nanos,
    /// End (exclusive).
    pub end_ns: Nanos,
}

impl Window {
    /// A window; its end must be after its start.
    pub fn new(start_ns: Nanos, end_ns: Nanos) -> Result<Self, TimelineError> {
        if end_ns <= start_ns {
            return Err(TimelineError::EmptyWindow { start_ns, end_ns });
        }
        Ok(Self { start_ns, end_ns })
    }

    /// Length in seconds.
    pub fn seconds(&self) -> f64 {
        (self.end_ns - self.start_ns) as f64 / 1e9
    }

    /// Whether `t` falls inside.
    pub fn contains(&self, t: Nanos) -> bool {
        (self.start_ns..self.end_ns).contains(&t)
    }

    /// The records that ended inside the window.
    pub fn ended_in<'a>(&self, records: &'a [ClientRecord]) -> impl Iterator<Item = &'a ClientRecord> + 'a {
        let w = *self;
        records.iter().filter(move |r| r.t_end().is_some_and(|t| w.contains(t)))
    }
}

/// Rates over one window.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    /// Window length, s.
    pub window_s: f64,
    /// Requests that completed in the window.
    pub completed: u64,
    /// Requests that failed in the window.
    pub failed: u64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Prompt tokens (cached included) of completed requests, per second.
    pub input_tokens_per_s: f64,
    /// The cached part of the input, per second.
    pub cached_input_tokens_per_s: f64,
    /// Generated tokens of completed requests, per second.
    pub output_tokens_per_s: f64,
    /// Input + output, per second.
    pub total_tokens_per_s: f64,
    /// Requests the arrival process scheduled in the window, per second.
    pub offered_rps: f64,
    /// Requests actually sent in the window, per second.
    pub achieved_send_rps: f64,
}

/// Throughput of `records` over `window`.
pub fn throughput(records: &[ClientRecord], window: Window) -> Throughput {
    let secs = window.seconds();
    let (mut completed, mut failed, mut input, mut cached, mut output) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for r in window.ended_in(records) {
        if !r.is_ok() {
            failed += 1;
            continue;
        }
        completed += 1;
        input += r.input_tokens().unwrap_or(0);
        cached += r.cached_tokens();
        output += r.n_out().map_or(0, |(n, _)| n);
    }
    let rate = |n: u64| n as f64 / secs;
    let offered = records.iter().filter(|r| window.contains(r.t_sched)).count() as u64;
    let sent = records.iter().filter(|r| window.contains(r.t_send)).count() as u64;
    Throughput {
        window_s: secs,
        completed,
        failed,
        requests_per_s: rate(completed),
        input_tokens_per_s: rate(input),
        cached_input_tokens_per_s: rate(cached),
        output_tokens_per_s: rate(output),
        total_tokens_per_s: rate(input + output),
        offered_rps: rate(offered),
        achieved_send_rps: rate(sent),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{Outcome, RequestId, StreamEvent, Usage};

    pub(crate) const S: Nanos = 1_000_000_000;

    /// A streamed request: scheduled at `sched_s`, sent `lag` later, `n` tokens 100 ms apart from
    /// `first_s`, all times in seconds.
    pub(crate) fn req(id: u64, sched_s: f64, first_s: f64, n: u32, prompt: u64) -> ClientRecord {
        let ns = |s: f64| (s * S as f64) as Nanos;
        let mut r = ClientRecord::new(RequestId(id), ns(sched_s), ns(sched_s), true);
        r.events.push(StreamEvent { at_ns: ns(sched_s) + 1, tokens: 0 });
        for i in 0..n {
            r.events.push(StreamEvent { at_ns: ns(first_s + 0.1 * f64::from(i)), tokens: 1 });
        }
        r.t_done = r.events.last().map(|e| e.at_ns + 1000);
        r.usage = Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: u64::from(n),
            cached_tokens: Some(prompt / 2),
        });
        r
    }

    #[test]
    fn hand_computed_window() {
        let mut failed = req(4, 3.0, 3.5, 2, 100);
        failed.outcome = Outcome::Failed { kind: "http_503".into(), message: String::new() };
        let records = vec![
            req(1, 0.0, 0.5, 5, 10),   // ends at 0.9 s: warm-up, outside
            req(2, 1.0, 1.5, 10, 20),  // ends ~2.4 s: inside
            req(3, 2.0, 2.2, 4, 40),   // ends ~2.5 s: inside
            failed,                    // ends ~3.6 s: inside, failed
            req(5, 4.5, 5.0, 3, 1000), // ends ~5.2 s: drain, outside
        ];
        let t = throughput(&records, Window::new(S, 5 * S).unwrap());
        assert_eq!((t.completed, t.failed), (2, 1));
        assert_eq!(t.window_s, 4.0);
        assert_eq!(t.requests_per_s, 0.5);
        assert_eq!(t.input_tokens_per_s, 60.0 / 4.0);
        assert_eq!(t.cached_input_tokens_per_s, 30.0 / 4.0);
        assert_eq!(t.output_tokens_per_s, 14.0 / 4.0);
        assert_eq!(t.total_tokens_per_s, 74.0 / 4.0);
        assert_eq!(t.offered_rps, 1.0); // scheduled at 1, 2, 3 and 4.5 s
        assert_eq!(t.achieved_send_rps, 1.0);
    }

    #[test]
    fn empty_window_is_an_error_and_window_without_requests_is_zero() {
        assert!(matches!(Window::new(5, 5), Err(TimelineError::EmptyWindow { .. })));
        let t = throughput(&[req(1, 0.0, 0.1, 1, 1)], Window::new(10 * S, 11 * S).unwrap());
        assert_eq!((t.completed, t.requests_per_s, t.output_tokens_per_s), (0, 0.0, 0.0));
    }
}
