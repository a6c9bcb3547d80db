//! The rate limiter's parts below the tenant: the clock, what a refusal says, and the GCRA
//! bucket (one `AtomicU64`, see the shape note in `ratelimit.rs`).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub(super) const MINUTE_NS: u64 = 60_000_000_000;
pub(super) const SECOND_NS: u64 = 1_000_000_000;

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
    Concurrency,
}

impl Limit {
    /// The metrics label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::InputTokens => "input_tokens",
            Limit::OutputTokens => "output_tokens",
            Limit::Concurrency => "concurrent_requests",
        }
    }

    pub(super) fn unit(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::InputTokens => "input tokens",
            Limit::OutputTokens => "output tokens",
            Limit::Concurrency => "concurrent requests",
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
    pub(super) fn new(limit: Limit, per_minute: u64, wait_ns: u64) -> Self {
        RateLimited { limit, per_minute, retry_after_s: wait_ns.div_ceil(SECOND_NS).max(1), too_large: None }
    }

    /// The message of the OpenAI error body (never names the key).
    pub(crate) fn message(&self) -> String {
        let (unit, limit) = (self.limit.unit(), self.per_minute);
        if self.limit == Limit::Concurrency {
            return format!(
                "Too many concurrent requests (limit {limit}). Please wait for one to finish and try again."
            );
        }
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
pub(super) struct Bucket {
    /// Units per minute: the refill rate, and (one minute's worth) the capacity.
    pub(super) per_minute: u64,
    /// The theoretical arrival time, in ns on the limiter's clock: the bucket is full when
    /// `tat <= now` and holds `(now + 1 min − tat) × per_minute / 1 min` units (negative: debt).
    tat: AtomicU64,
}

impl Bucket {
    pub(super) fn new(per_minute: u64) -> Self {
        Bucket { per_minute: per_minute.max(1), tat: AtomicU64::new(0) }
    }

    /// Nanoseconds of refill that `n` units cost, rounded up so rounding never over-admits.
    pub(super) fn cost_ns(&self, n: u64) -> u64 {
        let c = (u128::from(n) * u128::from(MINUTE_NS)).div_ceil(u128::from(self.per_minute));
        u64::try_from(c).unwrap_or(u64::MAX)
    }

    /// Where `tat` moves when `cost` is charged at `now`, and how far past a full minute's
    /// allowance that is (0: it fits).
    pub(super) fn after(tat: u64, now: u64, cost: u64) -> (u64, u64) {
        let new = tat.max(now).saturating_add(cost);
        (new, new.saturating_sub(now.saturating_add(MINUTE_NS)))
    }

    /// Takes `n` units if the bucket holds them: `Ok(cost charged)`, or `Err(ns to wait)`.
    pub(super) fn try_take(&self, n: u64, now: u64) -> Result<u64, u64> {
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
    pub(super) fn wait_for(&self, n: u64, now: u64) -> u64 {
        Self::after(self.tat.load(Ordering::Acquire), now, self.cost_ns(n)).1
    }

    /// Takes `n` units whatever the level: tokens already generated. May go into debt.
    pub(super) fn charge(&self, n: u64, now: u64) {
        let cost = self.cost_ns(n);
        // `fetch_update` with a closure that always returns `Some` cannot fail.
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| Some(tat.max(now).saturating_add(cost)));
    }

    /// Gives back what [`Bucket::try_take`] charged (a later bucket refused the request).
    pub(super) fn refund(&self, cost: u64) {
        let _ =
            self.tat.fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| Some(tat.saturating_sub(cost)));
    }
}
