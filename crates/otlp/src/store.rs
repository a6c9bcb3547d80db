//! The spans received so far, in one owning task: a handle, a command enum, a channel.
//!
//! Only traces someone announced ([`SpanStore::expect`]) are kept, each with at most
//! [`StoreLimits::spans_per_trace`] spans and at most [`StoreLimits::traces`] traces in all, so
//! what an exporter sends cannot grow the store past what its user asked for; the rest is
//! counted. [`SpanStore::collect`] waits until every expected trace has a span or a deadline
//! passes, whichever is first, and hands back what arrived.

use std::collections::HashMap;
use std::time::Duration;

use tokenpath_timeline::{EngineSpan, TraceId};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::OtlpError;

/// The store's bounds.
#[derive(Clone, Copy, Debug)]
pub struct StoreLimits {
    /// Most traces expected at once (one per request of a run).
    pub traces: usize,
    /// Most spans kept for one trace.
    pub spans_per_trace: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self { traces: 1 << 20, spans_per_trace: 64 }
    }
}

/// What [`SpanStore::collect`] hands back.
#[derive(Debug, Default)]
pub struct Collected {
    /// The spans of each expected trace that got any.
    pub spans: HashMap<TraceId, Vec<EngineSpan>>,
    /// Expected traces that got no span before the deadline.
    pub missing: usize,
    /// Spans received for traces nobody expected (an engine's start-up spans, other clients).
    pub unexpected: u64,
    /// Spans dropped because their trace had its fill.
    pub over_limit: u64,
}

enum Cmd {
    Expect(TraceId),
    Add(Vec<EngineSpan>),
    Collect { within: Duration, settle: Duration, reply: oneshot::Sender<Collected> },
    Take { trace: TraceId, within: Duration, settle: Duration, reply: oneshot::Sender<Vec<EngineSpan>> },
}

/// One trace's waiter: answered at `until`, which moves up to `settle` after its first span.
struct Taker {
    until: Instant,
    settle: Duration,
    reply: oneshot::Sender<Vec<EngineSpan>>,
}

/// A handle to the store's task; cheap to clone.
#[derive(Clone, Debug)]
pub struct SpanStore {
    tx: mpsc::UnboundedSender<Cmd>,
}

impl SpanStore {
    /// Starts the task (on the current runtime).
    pub fn start(limits: StoreLimits) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, limits));
        Self { tx }
    }

    /// Announces a trace whose spans are to be kept (before its request is sent). Past
    /// [`StoreLimits::traces`] the trace is not kept, and counts as missing.
    pub fn expect(&self, trace: TraceId) -> Result<(), OtlpError> {
        self.tx.send(Cmd::Expect(trace)).map_err(|_| OtlpError::Stopped)
    }

    /// Hands received spans to the store.
    pub(crate) fn add(&self, spans: Vec<EngineSpan>) -> Result<(), OtlpError> {
        self.tx.send(Cmd::Add(spans)).map_err(|_| OtlpError::Stopped)
    }

    /// Waits at most `within` for the spans of one expected trace and forgets it. The answer
    /// comes `settle` after its first span (an engine that exports several spans per request,
    /// SGLang, sends them in batches), or at `within` with whatever arrived (maybe nothing).
    /// A trace that was never expected gets nothing, at once.
    pub async fn take(
        &self,
        trace: TraceId,
        within: Duration,
        settle: Duration,
    ) -> Result<Vec<EngineSpan>, OtlpError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Take { trace, within, settle, reply }).map_err(|_| OtlpError::Stopped)?;
        rx.await.map_err(|_| OtlpError::Stopped)
    }

    /// Waits at most `within` for every expected trace to have a span and then for `settle`
    /// without a new span (a trace's spans come from several processes, each in its own export
    /// batch), then returns what arrived and forgets it (the next collect starts empty).
    pub async fn collect(&self, within: Duration, settle: Duration) -> Result<Collected, OtlpError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Collect { within, settle, reply }).map_err(|_| OtlpError::Stopped)?;
        rx.await.map_err(|_| OtlpError::Stopped)
    }
}

struct State {
    limits: StoreLimits,
    /// Expected traces → their spans so far.
    traces: HashMap<TraceId, Vec<EngineSpan>>,
    /// Expected traces with no span yet.
    waiting: usize,
    /// Announced past the bound.
    refused: usize,
    unexpected: u64,
    over_limit: u64,
    takers: HashMap<TraceId, Taker>,
    /// The takers' deadlines in order: the next one is the first (no scan per command).
    deadlines: std::collections::BTreeSet<(Instant, TraceId)>,
    /// When the last span of an expected trace came.
    last_span: Option<Instant>,
}

impl State {
    /// Forgets `trace` and hands over its spans.
    fn remove(&mut self, trace: &TraceId) -> Vec<EngineSpan> {
        let spans = self.traces.remove(trace).unwrap_or_default();
        if spans.is_empty() {
            self.waiting = self.waiting.saturating_sub(1);
        }
        spans
    }

    /// Answers every taker whose time has come.
    fn answer_due(&mut self, now: Instant) {
        while let Some(&(until, trace)) = self.deadlines.first() {
            if until > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(taker) = self.takers.remove(&trace) {
                let _ = taker.reply.send(self.remove(&trace));
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    fn add(&mut self, span: EngineSpan) {
        let Some(spans) = self.traces.get_mut(&span.trace_id) else {
            self.unexpected += 1;
            return;
        };
        if spans.len() >= self.limits.spans_per_trace {
            self.over_limit += 1;
            return;
        }
        if spans.is_empty() {
            self.waiting = self.waiting.saturating_sub(1);
            if let Some(t) = self.takers.get_mut(&span.trace_id) {
                let sooner = Instant::now() + t.settle;
                if sooner < t.until {
                    self.deadlines.remove(&(t.until, span.trace_id));
                    t.until = sooner;
                    self.deadlines.insert((sooner, span.trace_id));
                }
            }
        }
        spans.push(span);
        self.last_span = Some(Instant::now());
    }

    fn take(&mut self) -> Collected {
        // Traces someone is taking one by one are theirs, not the collector's.
        let taken: Vec<(TraceId, Vec<EngineSpan>)> =
            self.takers.keys().filter_map(|k| Some((*k, self.traces.remove(k)?))).collect();
        let missing =
            self.waiting.saturating_sub(taken.iter().filter(|(_, s)| s.is_empty()).count()) + self.refused;
        let spans = std::mem::take(&mut self.traces).into_iter().filter(|(_, s)| !s.is_empty()).collect();
        self.waiting = 0;
        for (k, s) in taken {
            self.waiting += usize::from(s.is_empty());
            self.traces.insert(k, s);
        }
        let out = Collected { spans, missing, unexpected: self.unexpected, over_limit: self.over_limit };
        (self.refused, self.unexpected, self.over_limit) = (0, 0, 0);
        out
    }
}

async fn run(mut rx: mpsc::UnboundedReceiver<Cmd>, limits: StoreLimits) {
    let mut st = State {
        limits,
        traces: HashMap::new(),
        waiting: 0,
        refused: 0,
        unexpected: 0,
        over_limit: 0,
        takers: HashMap::new(),
        deadlines: std::collections::BTreeSet::new(),
        last_span: None,
    };
    let mut pending: Option<Pending> = None;
    loop {
        let deadline = match (pending.as_ref().map(|p| p.due(&st)), st.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let cmd = tokio::select! {
            c = rx.recv() => match c {
                Some(c) => Some(c),
                None => return,
            },
            () = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => None,
        };
        match cmd {
            Some(Cmd::Expect(t)) => {
                if st.traces.contains_key(&t) {
                    // Announced twice (an agent sends one trace id on every call): one entry,
                    // its spans kept.
                } else if st.traces.len() >= st.limits.traces {
                    st.refused += 1;
                } else {
                    st.traces.insert(t, Vec::new());
                    st.waiting += 1;
                }
            }
            Some(Cmd::Add(spans)) => spans.into_iter().for_each(|s| st.add(s)),
            Some(Cmd::Collect { within, settle, reply }) => {
                // One collector at a time: an earlier one gets what is there now.
                if let Some(earlier) = pending.take() {
                    let _ = earlier.reply.send(st.take());
                }
                let now = Instant::now();
                pending = Some(Pending { until: now + within, settle, asked: now, reply });
            }
            Some(Cmd::Take { trace, within, settle, reply }) => match st.traces.get(&trace) {
                // Not expected, or someone takes it already (the same trace id on two
                // requests): nothing, at once — the spans go to the first taker only.
                Some(_) if st.takers.contains_key(&trace) => {
                    let _ = reply.send(Vec::new());
                }
                None => {
                    let _ = reply.send(Vec::new());
                }
                Some(spans) => {
                    let now = Instant::now();
                    let until = if spans.is_empty() { now + within } else { now + settle.min(within) };
                    st.deadlines.insert((until, trace));
                    st.takers.insert(trace, Taker { until, settle, reply });
                }
            },
            None => {} // the deadline: answered below
        }
        st.answer_due(Instant::now());
        if pending.as_ref().is_some_and(|p| Instant::now() >= p.due(&st)) {
            if let Some(p) = pending.take() {
                let _ = p.reply.send(st.take());
            }
        }
    }
}

/// A collector waiting.
struct Pending {
    /// Answered by then whatever came.
    until: Instant,
    /// Once every trace has a span, answered after this long without a new one.
    settle: Duration,
    /// When it asked (the quiet period counts from here when no span came at all).
    asked: Instant,
    reply: oneshot::Sender<Collected>,
}

impl Pending {
    /// When it is to be answered, given what the store holds now.
    fn due(&self, st: &State) -> Instant {
        if st.waiting > 0 {
            return self.until;
        }
        (st.last_span.unwrap_or(self.asked) + self.settle).min(self.until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_timeline::SpanId;

    fn span(t: u8, s: u8) -> EngineSpan {
        EngineSpan {
            trace_id: TraceId([t; 16]),
            span_id: SpanId([s; 8]),
            parent: None,
            name: "llm_request".into(),
            service: None,
            start_unix_ns: 0,
            end_unix_ns: 1,
            attributes: Default::default(),
        }
    }

    #[tokio::test]
    async fn collect_returns_as_soon_as_every_expected_trace_has_a_span() {
        let store = SpanStore::start(StoreLimits { traces: 10, spans_per_trace: 2 });
        store.expect(TraceId([1; 16])).unwrap();
        store.expect(TraceId([2; 16])).unwrap();
        store.add(vec![span(1, 1), span(1, 2), span(1, 3), span(5, 1)]).unwrap();
        let s2 = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            s2.add(vec![span(2, 1)]).unwrap();
        });
        // A deadline far beyond the test's patience: only the arrival can end the wait.
        let got = tokio::time::timeout(
            Duration::from_secs(30),
            store.collect(Duration::from_secs(3600), Duration::ZERO),
        )
        .await
        .expect("collect waited for the deadline although every trace had a span")
        .unwrap();
        assert_eq!(got.spans.len(), 2);
        assert_eq!(got.spans[&TraceId([1; 16])].len(), 2);
        assert_eq!((got.missing, got.unexpected, got.over_limit), (0, 1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn take_answers_a_settle_after_the_first_span_or_at_its_deadline() {
        let store = SpanStore::start(StoreLimits::default());
        store.expect(TraceId([1; 16])).unwrap();
        store.expect(TraceId([2; 16])).unwrap();
        let (s1, s2) = (store.clone(), store.clone());
        let one = tokio::spawn(async move {
            s1.take(TraceId([1; 16]), Duration::from_secs(60), Duration::from_secs(1)).await.unwrap()
        });
        let two = tokio::spawn(async move {
            s2.take(TraceId([2; 16]), Duration::from_secs(5), Duration::from_secs(1)).await.unwrap()
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let t0 = Instant::now();
        store.add(vec![span(1, 1)]).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        store.add(vec![span(1, 2)]).unwrap();
        let got = one.await.unwrap();
        assert_eq!(got.len(), 2, "the second span came within the settle");
        assert!(Instant::now() - t0 < Duration::from_secs(2), "answered after the settle, not at 60 s");
        assert!(two.await.unwrap().is_empty(), "nothing came: answered empty at its deadline");
        // Both traces are forgotten; an unknown trace is answered at once.
        let c = store.collect(Duration::ZERO, Duration::ZERO).await.unwrap();
        assert_eq!((c.spans.len(), c.missing), (0, 0));
        assert!(store
            .take(TraceId([9; 16]), Duration::from_secs(60), Duration::ZERO)
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn one_trace_id_on_two_requests_keeps_its_spans_and_answers_both_takers() {
        let store = SpanStore::start(StoreLimits::default());
        let t = TraceId([4; 16]);
        store.expect(t).unwrap();
        store.add(vec![span(4, 1)]).unwrap();
        store.expect(t).unwrap(); // the second request with the same id
        store.add(vec![span(4, 2)]).unwrap();
        let (a, b) = (store.clone(), store.clone());
        let first =
            tokio::spawn(async move { a.take(t, Duration::from_secs(60), Duration::from_secs(1)).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let second = b.take(t, Duration::from_secs(60), Duration::from_secs(1)).await.unwrap();
        assert!(second.is_empty(), "the spans go to the first taker only");
        assert_eq!(first.await.unwrap().unwrap().len(), 2, "nothing was dropped by the second announce");
        // The store is alive and consistent afterwards.
        store.expect(TraceId([5; 16])).unwrap();
        let c = store.collect(Duration::ZERO, Duration::ZERO).await.unwrap();
        assert_eq!(c.missing, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn collect_gives_up_at_its_deadline_and_counts_the_missing() {
        let store = SpanStore::start(StoreLimits { traces: 2, spans_per_trace: 4 });
        for t in 1..=3 {
            store.expect(TraceId([t; 16])).unwrap();
        }
        store.add(vec![span(1, 1)]).unwrap();
        let got = store.collect(Duration::from_secs(5), Duration::ZERO).await.unwrap();
        assert_eq!(got.spans.len(), 1);
        assert_eq!(got.missing, 2, "one never arrived, one was past the bound");
        // Forgotten: a span for an old trace is now unexpected.
        store.add(vec![span(1, 2)]).unwrap();
        let again = store.collect(Duration::ZERO, Duration::ZERO).await.unwrap();
        assert!(again.spans.is_empty());
        assert_eq!(again.unexpected, 1);
    }

    /// Regression (issue 18): a trace's spans come from three processes, each in its own export
    /// batch; collect answered at the first, and the later ones were lost.
    #[tokio::test]
    async fn collect_waits_for_a_quiet_period_after_every_trace_has_a_span() {
        let store = SpanStore::start(StoreLimits { traces: 10, spans_per_trace: 8 });
        store.expect(TraceId([1; 16])).unwrap();
        store.add(vec![span(1, 1)]).unwrap();
        let s2 = store.clone();
        tokio::spawn(async move {
            for s in 2..=3 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                s2.add(vec![span(1, s)]).unwrap();
            }
        });
        let got = store.collect(Duration::from_secs(3600), Duration::from_secs(1)).await.unwrap();
        assert_eq!(got.spans[&TraceId([1; 16])].len(), 3, "the later batches were not waited for");
    }
}
