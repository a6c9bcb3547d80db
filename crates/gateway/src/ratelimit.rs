//! Per-tenant rate limits — requests, input tokens and output tokens per minute — as token
//! buckets that each hold one minute's worth and refill continuously.
//!
//! Requests and input tokens are charged at admission, after tokenization, so the count is exact;
//! a request that does not fit is refused (429) with the wait its bucket needs. Output tokens
//! cannot be known in advance, so they are charged as the worker generates them
//! ([`OutputMeter`]): a tenant may go into debt, and its next request waits until the output
//! bucket holds a token again. Buckets belong to tenants, not keys, so rotating a key keeps the
//! budget; tenants come only from the key configuration, so the state is fixed at start.
//!
//! Shape: each bucket is a single `AtomicU64` holding GCRA's "theoretical arrival time" (the
//! instant the bucket would be full again), updated by compare-and-swap. This is the one
//! exception to "shared mutable state lives in an owning task" that the project allows: the
//! state fits in one word and never leaves [`Bucket`], and it sits on the hot path (every
//! admission, every streamed event), where a channel round trip to an owning task would cost more
//! than the work and put a queue in front of every tenant. Across a tenant's buckets admission is
//! take-then-refund, so a refusal never leaves a charge behind and the limits are never exceeded
//! (rounding always favours the limit). Time comes from a [`Clock`], injected in tests.

use crate::auth::Tenant;
use crate::error::Reject;
use crate::metrics::ANONYMOUS_TENANT;
use crate::AppState;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokenpath_timeline::RequestId;

/// One minute in nanoseconds: the buckets' capacity is one minute's worth of refill.
const MINUTE_NS: u64 = 60_000_000_000;
const SECOND_NS: u64 = 1_000_000_000;

/// A tenant's limits; `None` means unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateLimits {
    /// Requests admitted per minute.
    pub requests_per_minute: Option<u64>,
    /// Prompt tokens admitted per minute.
    pub input_tokens_per_minute: Option<u64>,
    /// Tokens generated per minute.
    pub output_tokens_per_minute: Option<u64>,
}

impl RateLimits {
    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.input_tokens_per_minute.is_none()
            && self.output_tokens_per_minute.is_none()
    }
}

/// A monotonic clock in nanoseconds, injectable so tests never sleep.
pub(crate) trait Clock: Send + Sync + fmt::Debug {
    /// Nanoseconds since an arbitrary, fixed origin.
    fn now_ns(&self) -> u64;
}

/// The process clock: nanoseconds since the limiter was built.
#[derive(Debug)]
pub(crate) struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    pub(crate) fn new() -> Self {
        Self { origin: Instant::now() }
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Which limit refused a request (also the `limit` label of the rejection metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Limit {
    Requests,
    InputTokens,
    OutputTokens,
}

impl Limit {
    /// The metrics label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::InputTokens => "input_tokens",
            Limit::OutputTokens => "output_tokens",
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::InputTokens => "input tokens",
            Limit::OutputTokens => "output tokens",
        }
    }
}

/// A refusal: which limit, its size, and when to retry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RateLimited {
    pub(crate) limit: Limit,
    pub(crate) per_minute: u64,
    /// Whole seconds until the request would fit, at least 1 (for `Retry-After`).
    pub(crate) retry_after_s: u64,
    /// The request alone is larger than a minute's budget: it can never fit.
    pub(crate) too_large: Option<u64>,
}

impl RateLimited {
    fn new(limit: Limit, per_minute: u64, wait_ns: u64) -> Self {
        RateLimited { limit, per_minute, retry_after_s: wait_ns.div_ceil(SECOND_NS).max(1), too_large: None }
    }

    /// The message of the OpenAI error body (never names the key).
    pub(crate) fn message(&self) -> String {
        let (unit, limit) = (self.limit.unit(), self.per_minute);
        match self.too_large {
            Some(n) => format!(
                "Request too large: it has {n} {unit}, more than your limit of {limit} {unit} per minute. \
                 Please reduce it."
            ),
            None => format!(
                "Rate limit reached for {unit} per minute (limit {limit}). Please try again in {}s.",
                self.retry_after_s
            ),
        }
    }
}

/// One token bucket (GCRA): a single word of state, see the module docs.
#[derive(Debug)]
struct Bucket {
    /// Units per minute: the refill rate, and (one minute's worth) the capacity.
    per_minute: u64,
    /// The theoretical arrival time, in ns on the limiter's clock: the bucket is full when
    /// `tat <= now` and holds `(now + 1 min − tat) × per_minute / 1 min` units (negative: debt).
    tat: AtomicU64,
}

impl Bucket {
    fn new(per_minute: u64) -> Self {
        Bucket { per_minute: per_minute.max(1), tat: AtomicU64::new(0) }
    }

    /// Nanoseconds of refill that `n` units cost, rounded up so rounding never over-admits.
    fn cost_ns(&self, n: u64) -> u64 {
        let c = (u128::from(n) * u128::from(MINUTE_NS)).div_ceil(u128::from(self.per_minute));
        u64::try_from(c).unwrap_or(u64::MAX)
    }

    /// Where `tat` moves when `cost` is charged at `now`, and how far past a full minute's
    /// allowance that is (0: it fits).
    fn after(tat: u64, now: u64, cost: u64) -> (u64, u64) {
        let new = tat.max(now).saturating_add(cost);
        (new, new.saturating_sub(now.saturating_add(MINUTE_NS)))
    }

    /// Takes `n` units if the bucket holds them: `Ok(cost charged)`, or `Err(ns to wait)`.
    fn try_take(&self, n: u64, now: u64) -> Result<u64, u64> {
        let cost = self.cost_ns(n);
        let mut tat = self.tat.load(Ordering::Acquire);
        loop {
            let (new, over) = Self::after(tat, now, cost);
            if over > 0 {
                return Err(over);
            }
            match self.tat.compare_exchange_weak(tat, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(cost),
                Err(current) => tat = current,
            }
        }
    }

    /// Nanoseconds until the bucket holds `n` units, taking nothing (0: it does now).
    fn wait_for(&self, n: u64, now: u64) -> u64 {
        Self::after(self.tat.load(Ordering::Acquire), now, self.cost_ns(n)).1
    }

    /// Takes `n` units whatever the level: tokens already generated. May go into debt.
    fn charge(&self, n: u64, now: u64) {
        let cost = self.cost_ns(n);
        // `fetch_update` with a closure that always returns `Some` cannot fail.
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| Some(tat.max(now).saturating_add(cost)));
    }

    /// Gives back what [`Bucket::try_take`] charged (a later bucket refused the request).
    fn refund(&self, cost: u64) {
        let _ =
            self.tat.fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| Some(tat.saturating_sub(cost)));
    }
}

/// The buckets of one tenant (only the limits it has).
#[derive(Debug)]
struct TenantBuckets {
    clock: Arc<dyn Clock>,
    requests: Option<Bucket>,
    input: Option<Bucket>,
    output: Option<Bucket>,
}

/// Every limited tenant's buckets. The map is fixed at start (tenants come from configuration);
/// only the buckets' atomics change.
#[derive(Debug)]
pub(crate) struct RateLimiter {
    tenants: HashMap<String, Arc<TenantBuckets>>,
}

impl RateLimiter {
    /// Buckets for every tenant with at least one limit, on `clock`.
    pub(crate) fn new<'a>(
        tenants: impl IntoIterator<Item = (&'a Tenant, &'a RateLimits)>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let tenants = tenants
            .into_iter()
            .filter(|(_, l)| !l.is_unlimited())
            .map(|(t, l)| {
                let buckets = TenantBuckets {
                    clock: Arc::clone(&clock),
                    requests: l.requests_per_minute.map(Bucket::new),
                    input: l.input_tokens_per_minute.map(Bucket::new),
                    output: l.output_tokens_per_minute.map(Bucket::new),
                };
                (t.0.clone(), Arc::new(buckets))
            })
            .collect();
        RateLimiter { tenants }
    }

    /// Admits one request of `tenant` with `input_tokens` prompt tokens: charges the request and
    /// its input tokens, and returns the meter its output tokens are charged through. Refused
    /// when the tenant's output bucket is in debt (holds less than one token) or the request or
    /// its prompt does not fit; a refusal charges nothing.
    pub(crate) fn admit(
        &self,
        tenant: Option<&Tenant>,
        input_tokens: u64,
    ) -> Result<OutputMeter, RateLimited> {
        let Some(b) = tenant.and_then(|t| self.tenants.get(&t.0)) else {
            return Ok(OutputMeter::unlimited());
        };
        let now = b.clock.now_ns();
        if let Some(out) = &b.output {
            let wait = out.wait_for(1, now);
            if wait > 0 {
                return Err(RateLimited::new(Limit::OutputTokens, out.per_minute, wait));
            }
        }
        if let Some(input) = &b.input {
            if input_tokens > input.per_minute {
                return Err(RateLimited {
                    too_large: Some(input_tokens),
                    ..RateLimited::new(Limit::InputTokens, input.per_minute, MINUTE_NS)
                });
            }
        }
        let mut request_cost = None;
        if let Some(req) = &b.requests {
            match req.try_take(1, now) {
                Ok(cost) => request_cost = Some(cost),
                Err(wait) => return Err(RateLimited::new(Limit::Requests, req.per_minute, wait)),
            }
        }
        if let Some(input) = &b.input {
            if let Err(wait) = input.try_take(input_tokens, now) {
                if let (Some(req), Some(cost)) = (&b.requests, request_cost) {
                    req.refund(cost);
                }
                return Err(RateLimited::new(Limit::InputTokens, input.per_minute, wait));
            }
        }
        Ok(OutputMeter { buckets: Some(Arc::clone(b)), charged: 0 })
    }
}

/// Charges one request's output tokens to its tenant as they are generated.
#[derive(Debug)]
pub(crate) struct OutputMeter {
    buckets: Option<Arc<TenantBuckets>>,
    charged: u64,
}

impl OutputMeter {
    /// A meter that charges nobody (no keys, or a tenant without an output limit).
    pub(crate) fn unlimited() -> Self {
        OutputMeter { buckets: None, charged: 0 }
    }

    /// `tokens` more tokens were generated.
    pub(crate) fn charge(&mut self, tokens: u32) {
        self.charged += u64::from(tokens);
        if let Some(b) = &self.buckets {
            if let Some(out) = &b.output {
                out.charge(u64::from(tokens), b.clock.now_ns());
            }
        }
    }

    /// The request finished with `completion_tokens` in its usage: charges what the streamed
    /// events did not carry (tokens held back by a stop sequence are generated all the same).
    pub(crate) fn settle(&mut self, completion_tokens: u64) {
        let rest = completion_tokens.saturating_sub(self.charged);
        if rest > 0 {
            self.charge(u32::try_from(rest).unwrap_or(u32::MAX));
        }
    }
}

/// The gateway's admission hook: charges `tenant`'s request and its `input_tokens`, or refuses
/// it with a 429 whose `Retry-After` comes from the bucket; counts and logs either way.
pub(crate) fn admit(
    app: &AppState,
    tenant: Option<&Tenant>,
    id: RequestId,
    input_tokens: usize,
) -> Result<OutputMeter, Reject> {
    let name = tenant.map_or(ANONYMOUS_TENANT, |t| t.0.as_str());
    match app.limiter.admit(tenant, u64::try_from(input_tokens).unwrap_or(u64::MAX)) {
        Ok(meter) => {
            tracing::debug!(request = %id, tenant = name, input_tokens, "admitted");
            Ok(meter)
        }
        Err(limited) => {
            tracing::info!(
                request = %id,
                tenant = name,
                limit = limited.limit.label(),
                retry_after_s = limited.retry_after_s,
                "rate limited"
            );
            app.metrics.record_rate_limited(name, limited.limit.label());
            Err(Reject::rate_limited(&limited))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A clock the test moves by hand.
    #[derive(Debug, Default)]
    struct ManualClock(AtomicU64);

    impl ManualClock {
        fn advance(&self, ns: u64) {
            self.0.fetch_add(ns, Ordering::Relaxed);
        }
    }

    impl Clock for ManualClock {
        fn now_ns(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }
    }

    fn limiter(limits: RateLimits) -> (RateLimiter, Arc<ManualClock>, Tenant) {
        let clock = Arc::new(ManualClock::default());
        clock.advance(5 * SECOND_NS); // not at the origin
        let t = Tenant("a".into());
        let l = RateLimiter::new([(&t, &limits)], Arc::clone(&clock) as Arc<dyn Clock>);
        (l, clock, t)
    }

    #[test]
    fn requests_per_minute_refill_and_retry_after() {
        let (l, clock, t) = limiter(RateLimits { requests_per_minute: Some(6), ..Default::default() });
        for _ in 0..6 {
            assert!(l.admit(Some(&t), 100).is_ok());
        }
        let err = l.admit(Some(&t), 1).unwrap_err();
        assert_eq!(err.limit, Limit::Requests);
        assert_eq!(err.retry_after_s, 10, "one request every 10 s");
        assert!(err.message().contains("try again in 10s"), "{}", err.message());
        clock.advance(9 * SECOND_NS);
        assert_eq!(l.admit(Some(&t), 1).unwrap_err().retry_after_s, 1);
        clock.advance(SECOND_NS);
        assert!(l.admit(Some(&t), 1).is_ok());
        // Other tenants and anonymous requests are not limited.
        assert!(l.admit(Some(&Tenant("b".into())), 1).is_ok());
        assert!(l.admit(None, 1).is_ok());
    }

    #[test]
    fn input_refusal_refunds_the_request() {
        let limits = RateLimits {
            requests_per_minute: Some(2),
            input_tokens_per_minute: Some(600),
            ..Default::default()
        };
        let (l, clock, t) = limiter(limits);
        assert!(l.admit(Some(&t), 500).is_ok());
        let err = l.admit(Some(&t), 200).unwrap_err();
        assert_eq!(err.limit, Limit::InputTokens);
        // 100 tokens short at 10 tokens/s.
        assert_eq!(err.retry_after_s, 10);
        // The refused request was not counted: one request is still available.
        assert!(l.admit(Some(&t), 100).is_ok());
        assert_eq!(l.admit(Some(&t), 1).unwrap_err().limit, Limit::Requests);
        // Larger than a minute's budget: never fits, says so.
        clock.advance(MINUTE_NS);
        let err = l.admit(Some(&t), 601).unwrap_err();
        assert_eq!(err.too_large, Some(601));
        assert!(err.message().contains("Request too large"), "{}", err.message());
        assert!(l.admit(Some(&t), 600).is_ok());
    }

    #[test]
    fn output_tokens_go_into_debt_and_the_next_request_waits() {
        let (l, clock, t) = limiter(RateLimits { output_tokens_per_minute: Some(60), ..Default::default() });
        let mut meter = l.admit(Some(&t), 10).unwrap();
        for _ in 0..50 {
            meter.charge(2);
        }
        meter.settle(105); // 5 tokens held back by a stop sequence
                           // 105 generated from a bucket of 60: 45 in debt, and one token needed: 46 s at 1 token/s.
        let err = l.admit(Some(&t), 10).unwrap_err();
        assert_eq!((err.limit, err.retry_after_s), (Limit::OutputTokens, 46));
        clock.advance(45 * SECOND_NS);
        assert_eq!(l.admit(Some(&t), 10).unwrap_err().retry_after_s, 1);
        clock.advance(SECOND_NS);
        let mut meter = l.admit(Some(&t), 10).unwrap();
        meter.settle(0);
        // The unlimited meter charges nobody.
        OutputMeter::unlimited().charge(1000);
    }

    #[test]
    fn concurrent_admissions_never_exceed_the_bucket() {
        let (l, _clock, t) =
            limiter(RateLimits { input_tokens_per_minute: Some(1000), ..Default::default() });
        let admitted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        if l.admit(Some(&t), 7).is_ok() {
                            admitted.fetch_add(7, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let total = admitted.load(Ordering::Relaxed);
        assert!(total <= 1000 && total > 1000 - 7, "admitted {total}");
    }

    proptest! {
        /// Over any run, admitted input tokens never exceed the capacity plus the refill over the
        /// elapsed time, and a refusal's `Retry-After` is honest: waiting that long admits it.
        #[test]
        fn never_admits_more_than_capacity_plus_refill(
            per_minute in 1u64..5_000,
            steps in proptest::collection::vec((0u64..20_000_000_000, 0u64..3_000), 1..200),
        ) {
            let (l, clock, t) =
                limiter(RateLimits { input_tokens_per_minute: Some(per_minute), ..Default::default() });
            let mut admitted = 0u128;
            let mut elapsed = 0u128;
            for (dt, n) in steps {
                clock.advance(dt);
                elapsed += u128::from(dt);
                match l.admit(Some(&t), n) {
                    Ok(_) => admitted += u128::from(n),
                    Err(e) if e.too_large.is_some() => prop_assert!(n > per_minute),
                    Err(e) => {
                        prop_assert!(e.retry_after_s >= 1 && e.retry_after_s <= 60, "{e:?}");
                        // Retrying after Retry-After succeeds (the next step's time is then added).
                        let wait = e.retry_after_s * SECOND_NS;
                        clock.advance(wait);
                        elapsed += u128::from(wait);
                        prop_assert!(l.admit(Some(&t), n).is_ok());
                        admitted += u128::from(n);
                    }
                }
                // tokens ≤ capacity + rate × elapsed, in integers: × 1 min on both sides.
                prop_assert!(
                    admitted * u128::from(MINUTE_NS)
                        <= u128::from(per_minute) * (u128::from(MINUTE_NS) + elapsed),
                    "admitted {admitted} over {elapsed} ns at {per_minute}/min"
                );
            }
        }
    }
}
