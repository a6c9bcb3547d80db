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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokenpath_timeline::RequestId;

/// One minute in nanoseconds: the buckets' capacity is one minute's worth of refill.
mod bucket;

use bucket::{Bucket, MINUTE_NS, SECOND_NS};
pub(crate) use bucket::{Clock, Limit, MonotonicClock, RateLimited};

/// A tenant's limits; `None` means unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateLimits {
    /// Requests admitted per minute.
    pub requests_per_minute: Option<u64>,
    /// Prompt tokens admitted per minute.
    pub input_tokens_per_minute: Option<u64>,
    /// Tokens generated per minute.
    pub output_tokens_per_minute: Option<u64>,
    /// Requests of the tenant running at once (admitted and not ended): one tenant cannot fill
    /// the workers' queues and starve the others.
    pub max_concurrent_requests: Option<u64>,
}

impl RateLimits {
    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.input_tokens_per_minute.is_none()
            && self.output_tokens_per_minute.is_none()
            && self.max_concurrent_requests.is_none()
    }
}

/// The buckets of one tenant (only the limits it has).
#[derive(Debug)]
struct TenantBuckets {
    clock: Arc<dyn Clock>,
    requests: Option<Bucket>,
    input: Option<Bucket>,
    output: Option<Bucket>,
    /// Requests admitted and not ended, and their cap.
    running: AtomicU64,
    max_running: Option<u64>,
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
                    running: AtomicU64::new(0),
                    max_running: l.max_concurrent_requests,
                };
                (t.0.clone(), Arc::new(buckets))
            })
            .collect();
        RateLimiter { tenants }
    }

    /// Starts admitting one request of `tenant`, before anything about it is parsed or
    /// tokenized: refused when the tenant's output bucket is in debt, it runs its maximum of
    /// concurrent requests, or its request bucket is empty. The [`Pass`] holds the request's
    /// charge and its concurrency slot; [`Pass::input`] charges its prompt.
    pub(crate) fn begin(&self, tenant: Option<&Tenant>) -> Result<Pass, RateLimited> {
        let Some(b) = tenant.and_then(|t| self.tenants.get(&t.0)) else {
            return Ok(Pass::unlimited());
        };
        let now = b.clock.now_ns();
        if let Some(out) = &b.output {
            let wait = out.wait_for(1, now);
            if wait > 0 {
                return Err(RateLimited::new(Limit::OutputTokens, out.per_minute, wait));
            }
        }
        let slot = Slot::take(b)?;
        let mut request_cost = 0;
        if let Some(req) = &b.requests {
            match req.try_take(1, now) {
                Ok(cost) => request_cost = cost,
                Err(wait) => return Err(RateLimited::new(Limit::Requests, req.per_minute, wait)),
            }
        }
        Ok(Pass { buckets: Some(Arc::clone(b)), request_cost, input_cost: 0, input_tokens: 0, slot })
    }

    /// Admits one request with `input_tokens` prompt tokens at once ([`RateLimiter::begin`]
    /// then [`Pass::input`]); a refusal charges nothing.
    #[cfg(test)]
    pub(crate) fn admit(
        &self,
        tenant: Option<&Tenant>,
        input_tokens: u64,
    ) -> Result<OutputMeter, RateLimited> {
        let mut pass = self.begin(tenant)?;
        match pass.input(input_tokens) {
            Ok(()) => Ok(pass.into_meter()),
            Err(e) => {
                pass.refund();
                Err(e)
            }
        }
    }
}

/// A tenant's concurrency slot, given back when dropped.
#[derive(Debug)]
struct Slot(Arc<TenantBuckets>);

impl Slot {
    fn take(b: &Arc<TenantBuckets>) -> Result<Option<Self>, RateLimited> {
        let Some(max) = b.max_running else { return Ok(None) };
        b.running.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).map_err(
            |_| RateLimited { too_large: None, ..RateLimited::new(Limit::Concurrency, max, SECOND_NS) },
        )?;
        Ok(Some(Slot(Arc::clone(b))))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request being admitted: what it was charged (refundable) and its concurrency slot.
#[derive(Debug)]
pub(crate) struct Pass {
    buckets: Option<Arc<TenantBuckets>>,
    request_cost: u64,
    input_cost: u64,
    /// Prompt tokens charged (for [`OutputMeter::settle_input`]).
    input_tokens: u64,
    slot: Option<Slot>,
}

impl Pass {
    fn unlimited() -> Self {
        Pass { buckets: None, request_cost: 0, input_cost: 0, input_tokens: 0, slot: None }
    }

    /// Charges `tokens` prompt tokens (refused, charging nothing more, when they do not fit).
    pub(crate) fn input(&mut self, tokens: u64) -> Result<(), RateLimited> {
        let Some(b) = &self.buckets else { return Ok(()) };
        let Some(input) = &b.input else { return Ok(()) };
        if tokens > input.per_minute {
            return Err(RateLimited {
                too_large: Some(tokens),
                ..RateLimited::new(Limit::InputTokens, input.per_minute, MINUTE_NS)
            });
        }
        match input.try_take(tokens, b.clock.now_ns()) {
            Ok(cost) => {
                self.input_cost += cost;
                self.input_tokens += tokens;
                Ok(())
            }
            Err(wait) => Err(RateLimited::new(Limit::InputTokens, input.per_minute, wait)),
        }
    }

    /// Gives back everything charged: the request was refused before any work (the worker was
    /// full, or a later limit refused it).
    pub(crate) fn refund(mut self) {
        if let Some(b) = self.buckets.take() {
            if let Some(r) = &b.requests {
                r.refund(self.request_cost);
            }
            if let Some(i) = &b.input {
                i.refund(self.input_cost);
            }
        }
    }

    /// The admitted request's output meter; it keeps the concurrency slot until dropped.
    pub(crate) fn into_meter(self) -> OutputMeter {
        OutputMeter {
            buckets: self.buckets,
            charged: AtomicU64::new(0),
            _slot: self.slot,
            refund: (self.request_cost, self.input_cost),
            input_tokens: self.input_tokens,
        }
    }
}

/// Charges one request's output tokens to its tenant as they are generated.
///
/// Shared with whoever produces the request's tokens (the worker's batcher thread, or the task
/// relaying a remote worker's stream), which charges each token the moment it exists: what the
/// client reads, or whether it reads at all, changes nothing. Atomic, like the buckets.
#[derive(Debug)]
pub(crate) struct OutputMeter {
    buckets: Option<Arc<TenantBuckets>>,
    charged: AtomicU64,
    /// Held until the request ends.
    _slot: Option<Slot>,
    /// What admission charged, for [`OutputMeter::refund`].
    refund: (u64, u64),
    /// Prompt tokens admission charged (the gateway's count).
    input_tokens: u64,
}

impl OutputMeter {
    /// `tokens` more tokens were generated.
    pub(crate) fn charge(&self, tokens: u32) {
        self.charged.fetch_add(u64::from(tokens), Ordering::AcqRel);
        if let Some(b) = &self.buckets {
            if let Some(out) = &b.output {
                out.charge(u64::from(tokens), b.clock.now_ns());
            }
        }
    }

    /// The request finished with `completion_tokens` in its usage: charges what the streamed
    /// events did not carry (tokens held back by a stop sequence are generated all the same).
    pub(crate) fn settle(&self, completion_tokens: u64) {
        let rest = completion_tokens.saturating_sub(self.charged.load(Ordering::Acquire));
        if rest > 0 {
            self.charge(u32::try_from(rest).unwrap_or(u32::MAX));
        }
    }

    /// The request finished with `prompt_tokens` in its usage: an upstream engine that counted
    /// its prompt otherwise than the gateway (another template, another BOS rule) is believed,
    /// the difference charged or given back.
    pub(crate) fn settle_input(&self, prompt_tokens: u64) {
        let Some(b) = &self.buckets else { return };
        let Some(input) = &b.input else { return };
        match prompt_tokens.cmp(&self.input_tokens) {
            std::cmp::Ordering::Greater => input.charge(prompt_tokens - self.input_tokens, b.clock.now_ns()),
            std::cmp::Ordering::Less => input.refund(input.cost_ns(self.input_tokens - prompt_tokens)),
            std::cmp::Ordering::Equal => {}
        }
    }

    /// The worker refused the request before running it (503): the request and its prompt are
    /// given back.
    pub(crate) fn refund(&self) {
        if let Some(b) = &self.buckets {
            if let Some(r) = &b.requests {
                r.refund(self.refund.0);
            }
            if let Some(i) = &b.input {
                i.refund(self.refund.1);
            }
        }
    }
}

impl tokenpath_protocol::work::TokenMeter for OutputMeter {
    fn generated(&self, tokens: u32) {
        self.charge(tokens);
    }
}

/// The gateway's admission hooks: [`begin`] before the body is parsed (request bucket, output
/// debt, concurrency), [`input`] once the prompt is tokenized; a refusal is a 429 whose
/// `Retry-After` comes from the bucket, counted and logged.
pub(crate) fn begin(app: &AppState, tenant: Option<&Tenant>) -> Result<Pass, Reject> {
    app.limiter.begin(tenant).map_err(|l| refused(app, tenant, &l))
}

/// Charges the prompt's `input_tokens` (see [`begin`]).
pub(crate) fn input(
    app: &AppState,
    mut pass: Pass,
    tenant: Option<&Tenant>,
    id: RequestId,
    input_tokens: usize,
) -> Result<OutputMeter, Reject> {
    match pass.input(u64::try_from(input_tokens).unwrap_or(u64::MAX)) {
        Ok(()) => {
            let name = tenant.map_or(ANONYMOUS_TENANT, |t| t.0.as_str());
            tracing::debug!(request = %id, tenant = name, input_tokens, "admitted");
            Ok(pass.into_meter())
        }
        Err(limited) => {
            pass.refund();
            Err(refused(app, tenant, &limited))
        }
    }
}

fn refused(app: &AppState, tenant: Option<&Tenant>, limited: &RateLimited) -> Reject {
    let name = tenant.map_or(ANONYMOUS_TENANT, |t| t.0.as_str());
    tracing::info!(
        tenant = name,
        limit = limited.limit.label(),
        retry_after_s = limited.retry_after_s,
        "rate limited"
    );
    app.metrics.record_rate_limited(name, limited.limit.label());
    Reject::rate_limited(limited)
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
        let meter = l.admit(Some(&t), 10).unwrap();
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
        let meter = l.admit(Some(&t), 10).unwrap();
        meter.settle(0);
        meter.settle_input(10);
        // The unlimited meter charges nobody.
        Pass::unlimited().into_meter().charge(1000);
    }

    /// An upstream that counted the prompt otherwise is believed: more is charged, fewer given
    /// back, so the next admission sees the engine's count.
    #[test]
    fn input_tokens_are_settled_with_the_engines_count() {
        let (l, _clock, t) = limiter(RateLimits { input_tokens_per_minute: Some(100), ..Default::default() });
        let meter = l.admit(Some(&t), 50).unwrap();
        meter.settle_input(80);
        assert_eq!(l.admit(Some(&t), 21).unwrap_err().limit, Limit::InputTokens, "80 charged, 20 left");
        let meter = l.admit(Some(&t), 20).unwrap();
        meter.settle_input(10);
        assert!(l.admit(Some(&t), 10).is_ok(), "10 given back");
        assert_eq!(l.admit(Some(&t), 1).unwrap_err().limit, Limit::InputTokens);
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
