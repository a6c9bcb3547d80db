//! Every Prometheus metric the gateway exports, named in one place.
//!
//! Values are *recorded* here, never *defined* here: stage durations, TTFT and E2E come from the
//! worker's [`ServerTiming`] and TPOT / per-token ITL from `tokenpath_timeline::ClientRecord`
//! over the events as the gateway sent them (invariant: metric definitions live only in the
//! timeline crate). Worker gauges (queue depth, batch size, KV blocks, busy time) are copied from
//! the worker's latest stats snapshot at scrape time, so the hot path never touches them.
//!
//! Mapping to vLLM's names, so existing dashboards carry over (counters carry `_total` on the
//! wire; the constants below are the names without it):
//!
//! | tokenpath | vLLM |
//! |---|---|
//! | `tokenpath_request_stage_seconds{stage="queue"}` | `vllm:request_queue_time_seconds` |
//! | `tokenpath_request_stage_seconds{stage="prefill"}` | `vllm:request_prefill_time_seconds` |
//! | `tokenpath_request_stage_seconds{stage="decode"}` | `vllm:request_decode_time_seconds` |
//! | `tokenpath_request_stage_seconds{stage="gateway"\|"decode_queue"\|"kv_transfer"}` | — (no equivalent) |
//! | `tokenpath_engine_span_stage_seconds{stage}` | — (the stages an upstream engine reported in its exported span, joined by trace id: `--otlp-listen`) |
//! | `tokenpath_engine_spans_total{outcome}` | — (forwarded requests whose span was `joined`, or `missing` when the wait ended) |
//! | `tokenpath_time_to_first_token_seconds` | `vllm:time_to_first_token_seconds` |
//! | `tokenpath_time_per_output_token_seconds` | `vllm:request_time_per_output_token_seconds` |
//! | `tokenpath_inter_token_latency_seconds` | `vllm:inter_token_latency_seconds` (`time_per_output_token_seconds` before v0.11) |
//! | `tokenpath_e2e_request_latency_seconds` | `vllm:e2e_request_latency_seconds` |
//! | `tokenpath_prompt_tokens_total` | `vllm:prompt_tokens_total` |
//! | `tokenpath_generation_tokens_total` | `vllm:generation_tokens_total` |
//! | `tokenpath_cached_prompt_tokens_total` | `vllm:prefix_cache_hits_total` (in tokens) |
//! | `tokenpath_tenant_requests_total{tenant}` | — (per API key owner; `anonymous` without keys) |
//! | `tokenpath_rate_limited_requests_total{tenant, limit}` | — (429s by tenant and by limit: `requests`, `input_tokens`, `output_tokens`) |
//! | `tokenpath_requests_total{status, finish_reason}` | `vllm:request_success_total{finished_reason}` (+ errors) |
//! | `tokenpath_num_requests_waiting` | `vllm:num_requests_waiting` |
//! | `tokenpath_num_requests_running` | `vllm:num_requests_running` |
//! | `tokenpath_kv_blocks_used`, `tokenpath_kv_blocks_free` | `vllm:num_gpu_blocks` (their sum) |
//! | `tokenpath_kv_cache_usage_perc` | `vllm:kv_cache_usage_perc` (= used / (used + free), 0..1) |
//! | `tokenpath_num_preemptions_total` | `vllm:num_preemptions_total` |
//! | `tokenpath_worker_busy_seconds_total`, `tokenpath_worker_flops_total` | — (busy fraction and achieved FLOP/s via `rate()`) |
//! | `tokenpath_worker_peak_flops` | — (`rate(tokenpath_worker_flops_total[1m]) / tokenpath_worker_peak_flops` = share of peak) |

mod pool;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use tokenpath_protocol::work::{TokenUsage, WorkerStats};
use tokenpath_timeline::{ClientRecord, ServerTiming, Stage};

/// Stage durations (histogram, `stage` label).
pub const REQUEST_STAGE_SECONDS: &str = "tokenpath_request_stage_seconds";
/// Stages an upstream engine's exported span gave (histogram, `stage` label).
pub const ENGINE_SPAN_STAGE_SECONDS: &str = "tokenpath_engine_span_stage_seconds";
/// Forwarded requests by whether their engine span arrived (`outcome`: joined, missing).
pub const ENGINE_SPANS: &str = "tokenpath_engine_spans";
/// Server TTFT: first token sent − arrived.
pub const TTFT_SECONDS: &str = "tokenpath_time_to_first_token_seconds";
/// Per-request TPOT.
pub const TPOT_SECONDS: &str = "tokenpath_time_per_output_token_seconds";
/// Per-token ITL (each gap ÷ tokens in the event ending it).
pub const ITL_SECONDS: &str = "tokenpath_inter_token_latency_seconds";
/// Server E2E: finished − arrived.
pub const E2E_SECONDS: &str = "tokenpath_e2e_request_latency_seconds";
/// Prompt tokens of finished requests (counter).
pub const PROMPT_TOKENS: &str = "tokenpath_prompt_tokens";
/// Generated tokens of finished requests (counter).
pub const GENERATION_TOKENS: &str = "tokenpath_generation_tokens";
/// Prompt tokens served from the prefix cache (counter).
pub const CACHED_PROMPT_TOKENS: &str = "tokenpath_cached_prompt_tokens";
/// Requests by HTTP status and finish reason (counter).
pub const REQUESTS: &str = "tokenpath_requests";
/// Authenticated requests per tenant (API key owner), whatever their outcome (counter).
pub const TENANT_REQUESTS: &str = "tokenpath_tenant_requests";
/// Requests refused by their tenant's rate limit, by tenant and limit (counter).
pub const RATE_LIMITED_REQUESTS: &str = "tokenpath_rate_limited_requests";
/// The `tenant` label of requests when no API keys are configured (tenants otherwise come only
/// from the key configuration, so the label's cardinality is bounded).
pub const ANONYMOUS_TENANT: &str = "anonymous";
/// Requests waiting for their first prefill chunk.
pub const NUM_REQUESTS_WAITING: &str = "tokenpath_num_requests_waiting";
/// Sequences in the running batch.
pub const NUM_REQUESTS_RUNNING: &str = "tokenpath_num_requests_running";
/// KV blocks in use.
pub const KV_BLOCKS_USED: &str = "tokenpath_kv_blocks_used";
/// KV blocks free.
pub const KV_BLOCKS_FREE: &str = "tokenpath_kv_blocks_free";
/// The share of KV blocks in use, 0..=1: what an endpoint picker (llm-d / Gateway API Inference
/// Extension, vllm-router) reads as KV-cache utilization, named like vLLM's.
pub const KV_CACHE_USAGE: &str = "tokenpath_kv_cache_usage_perc";
/// Preemptions (counter).
pub const NUM_PREEMPTIONS: &str = "tokenpath_num_preemptions";
/// Seconds the worker spent computing (counter).
pub const WORKER_BUSY_SECONDS: &str = "tokenpath_worker_busy_seconds";
/// Model FLOPs the worker ran (counter).
pub const WORKER_FLOPS: &str = "tokenpath_worker_flops";
/// Blocks held by each tier of the host's KV pool, `tier` = `host` | `ssd` (gauge).
pub const KV_POOL_BLOCKS: &str = "tokenpath_kv_pool_blocks";
/// Blocks each tier can hold (gauge).
pub const KV_POOL_SLOTS: &str = "tokenpath_kv_pool_slots";
/// Blocks loaded from the pool and checked by their reader, by the tier they were found in (counter).
pub const KV_POOL_HITS: &str = "tokenpath_kv_pool_hits";
/// Prompt tokens served from the KV pool, by tier (counter).
pub const KV_POOL_HIT_TOKENS: &str = "tokenpath_kv_pool_hit_tokens";
/// Pool lookups whose first block was not held (counter).
pub const KV_POOL_MISSES: &str = "tokenpath_kv_pool_misses";
/// Bytes of KV loaded from the pool (counter).
pub const KV_POOL_LOAD_BYTES: &str = "tokenpath_kv_pool_load_bytes";
/// KV pool loads that failed verification and were recomputed (counter).
pub const KV_POOL_FAILED_LOADS: &str = "tokenpath_kv_pool_failed_loads";
/// Blocks pushed out of the pool's RAM tier (counter).
pub const KV_POOL_EVICTIONS: &str = "tokenpath_kv_pool_evictions";
/// Blocks written down from the pool's RAM tier, `tier` = `ssd` | `remote` (counter).
pub const KV_POOL_WRITTEN: &str = "tokenpath_kv_pool_written";
/// Blocks that left the pool's RAM tier unwritten, seen once under the second-sighting filter
/// (counter).
pub const KV_POOL_FILTERED: &str = "tokenpath_kv_pool_filtered";
/// Pool leases open (gauge).
pub const KV_POOL_LEASES: &str = "tokenpath_kv_pool_leases";
/// Pool RAM blocks pinned by leases (gauge).
pub const KV_POOL_PINNED_BLOCKS: &str = "tokenpath_kv_pool_pinned_blocks";
/// Age of the oldest open pool lease, seconds (gauge).
pub const KV_POOL_LEASE_AGE_SECONDS: &str = "tokenpath_kv_pool_oldest_lease_seconds";
/// 1 when the pool's SSD tier failed and it runs on RAM only (gauge).
pub const KV_POOL_SSD_DEGRADED: &str = "tokenpath_kv_pool_ssd_degraded";
/// Gauge: workers' jobs storing fresh blocks in the KV pool, in flight.
pub const KV_POOL_STORES_PENDING: &str = "tokenpath_kv_pool_stores_pending";
/// Counter: workers' store jobs not taken (too many in flight): those blocks were not stored.
pub const KV_POOL_STORES_DROPPED: &str = "tokenpath_kv_pool_stores_dropped";
/// The machine's peak FLOP/s as configured (`--peak-gflops`); absent when not configured.
pub const WORKER_PEAK_FLOPS: &str = "tokenpath_worker_peak_flops";

/// `stage` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: &'static str,
}

/// `tenant` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

/// `tenant` and `limit` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RateLimitLabels {
    tenant: String,
    limit: &'static str,
}

/// `outcome` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// `status` and `finish_reason` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    status: u16,
    finish_reason: &'static str,
}

type FloatCounter = Counter<f64, AtomicU64>;

/// The registry and handles to every metric.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    stages: Family<StageLabel, Histogram, fn() -> Histogram>,
    span_stages: Family<StageLabel, Histogram, fn() -> Histogram>,
    spans: Family<OutcomeLabel, Counter>,
    ttft: Histogram,
    tpot: Histogram,
    itl: Histogram,
    e2e: Histogram,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    cached_tokens: Counter,
    requests: Family<RequestLabels, Counter>,
    tenants: Family<TenantLabel, Counter>,
    rate_limited: Family<RateLimitLabels, Counter>,
    waiting: Gauge,
    running: Gauge,
    kv_used: Gauge,
    kv_free: Gauge,
    kv_usage: Gauge<f64, std::sync::atomic::AtomicU64>,
    preemptions: Counter,
    pool: pool::PoolMetrics,
    busy_seconds: FloatCounter,
    flops: FloatCounter,
    /// The highest worker totals mirrored so far (`f64` bits for the float ones): a scrape adds
    /// only what it raised the mark by, so concurrent scrapes never both add the same delta, and
    /// a cluster total that dips (a worker marked down) and comes back adds nothing twice.
    seen_preempted: AtomicU64,
    seen_busy: AtomicU64,
    seen_flops: AtomicU64,
}

/// Raises `mark` to `v` and returns by how much it rose (0 when it was already there).
fn raise(mark: &AtomicU64, v: u64) -> u64 {
    v.saturating_sub(mark.fetch_max(v, Ordering::AcqRel))
}

/// [`raise`] for a non-negative `f64` kept as bits (their order is the numbers' order).
fn raise_f64(mark: &AtomicU64, v: f64) -> f64 {
    if !(v.is_finite() && v >= 0.0) {
        return 0.0;
    }
    let prev = f64::from_bits(mark.fetch_max(v.to_bits(), Ordering::AcqRel));
    (v - prev).max(0.0)
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~ 4.6 h in ×2 steps: gateway overheads and long generations alike.
    Histogram::new(exponential_buckets(0.0005, 2.0, 25))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric registered, all zero; `peak_flops` (the machine's peak FLOP/s) is exported
    /// as a constant gauge so dashboards can show achieved FLOP/s as a share of it.
    pub fn with_peak_flops(peak_flops: Option<f64>) -> Self {
        let mut m = Self::new();
        if let Some(peak) = peak_flops {
            let g = Gauge::<f64, AtomicU64>::default();
            g.set(peak);
            m.registry.register(WORKER_PEAK_FLOPS, "The machine's peak FLOP/s (configured)", g);
        }
        m
    }

    /// Every metric registered, all zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let stages =
            Family::<StageLabel, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let span_stages =
            Family::<StageLabel, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let m = Metrics {
            registry: Registry::default(),
            stages,
            span_stages,
            spans: Family::default(),
            ttft: latency_histogram(),
            tpot: latency_histogram(),
            itl: latency_histogram(),
            e2e: latency_histogram(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            requests: Family::default(),
            tenants: Family::default(),
            rate_limited: Family::default(),
            waiting: Gauge::default(),
            running: Gauge::default(),
            kv_used: Gauge::default(),
            kv_usage: Gauge::default(),
            kv_free: Gauge::default(),
            preemptions: Counter::default(),
            pool: pool::PoolMetrics::default(),
            busy_seconds: FloatCounter::default(),
            flops: FloatCounter::default(),
            seen_preempted: AtomicU64::new(0),
            seen_busy: AtomicU64::new(0f64.to_bits()),
            seen_flops: AtomicU64::new(0f64.to_bits()),
        };
        registry.register(
            REQUEST_STAGE_SECONDS,
            "Duration of each stage of the request path",
            m.stages.clone(),
        );
        registry.register(
            ENGINE_SPAN_STAGE_SECONDS,
            "Duration of each stage an upstream engine reported in its exported span",
            m.span_stages.clone(),
        );
        registry.register(
            ENGINE_SPANS,
            "Forwarded requests by whether their engine span arrived",
            m.spans.clone(),
        );
        registry.register(
            TTFT_SECONDS,
            "Server time to first token (first token sent - arrived)",
            m.ttft.clone(),
        );
        registry.register(TPOT_SECONDS, "Per-request time per output token after the first", m.tpot.clone());
        registry.register(ITL_SECONDS, "Per-token inter-token latency as sent by the gateway", m.itl.clone());
        registry.register(E2E_SECONDS, "Server end-to-end latency (finished - arrived)", m.e2e.clone());
        registry.register(PROMPT_TOKENS, "Prompt tokens of finished requests", m.prompt_tokens.clone());
        registry.register(
            GENERATION_TOKENS,
            "Generated tokens of finished requests",
            m.generation_tokens.clone(),
        );
        registry.register(
            CACHED_PROMPT_TOKENS,
            "Prompt tokens served from the prefix cache",
            m.cached_tokens.clone(),
        );
        registry.register(REQUESTS, "Requests by HTTP status and finish reason", m.requests.clone());
        registry.register(TENANT_REQUESTS, "Authenticated requests per tenant", m.tenants.clone());
        registry.register(
            RATE_LIMITED_REQUESTS,
            "Requests refused by their tenant's rate limit, by limit",
            m.rate_limited.clone(),
        );
        registry.register(
            NUM_REQUESTS_WAITING,
            "Requests waiting for their first prefill chunk",
            m.waiting.clone(),
        );
        registry.register(NUM_REQUESTS_RUNNING, "Sequences in the running batch", m.running.clone());
        registry.register(KV_BLOCKS_USED, "KV cache blocks in use", m.kv_used.clone());
        registry.register(KV_BLOCKS_FREE, "KV cache blocks free", m.kv_free.clone());
        registry.register(KV_CACHE_USAGE, "Share of KV cache blocks in use (0..1)", m.kv_usage.clone());
        registry.register(
            NUM_PREEMPTIONS,
            "Sequences preempted for lack of KV blocks",
            m.preemptions.clone(),
        );
        registry.register(
            WORKER_BUSY_SECONDS,
            "Seconds the worker spent in forward steps",
            m.busy_seconds.clone(),
        );
        registry.register(WORKER_FLOPS, "Model FLOPs the worker computed", m.flops.clone());
        m.pool.register(&mut registry);
        Metrics { registry, ..m }
    }

    /// A request that finished normally: its stages, latencies and tokens.
    pub fn record_finished(
        &self,
        finish_reason: &'static str,
        usage: TokenUsage,
        timing: &ServerTiming,
        sent: &ClientRecord,
    ) {
        for (stage, ms) in &timing.stages_ms {
            self.stages.get_or_create(&StageLabel { stage: Stage::name(*stage) }).observe(ms / 1e3);
        }
        if let Some(ms) = timing.ttft_ms {
            self.ttft.observe(ms / 1e3);
        }
        if let Some(ms) = timing.e2e_ms {
            self.e2e.observe(ms / 1e3);
        }
        if let Some(ns) = sent.tpot_ns() {
            self.tpot.observe(ns / 1e9);
        }
        for ns in sent.per_token_itl_ns() {
            self.itl.observe(ns / 1e9);
        }
        self.prompt_tokens.inc_by(usage.prompt_tokens);
        self.generation_tokens.inc_by(usage.completion_tokens);
        self.cached_tokens.inc_by(usage.cached_tokens);
        self.record_status(200, finish_reason);
    }

    /// What an upstream engine's spans of one request said (nothing arrived: `missing`).
    pub fn record_engine_spans(&self, spans: &[tokenpath_timeline::EngineSpan]) {
        let outcome = if spans.is_empty() { "missing" } else { "joined" };
        self.spans.get_or_create(&OutcomeLabel { outcome }).inc();
        if let Some(t) = tokenpath_timeline::engines::spans_timing(spans) {
            for (stage, ms) in &t.stages_ms {
                self.span_stages.get_or_create(&StageLabel { stage: Stage::name(*stage) }).observe(ms / 1e3);
            }
        }
    }

    /// A request that ended with `status` (an error, or a stream cut short: `cancelled`).
    pub fn record_status(&self, status: u16, finish_reason: &'static str) {
        self.requests.get_or_create(&RequestLabels { status, finish_reason }).inc();
    }

    /// An authenticated request of `tenant`.
    pub fn record_tenant(&self, tenant: &str) {
        self.tenants.get_or_create(&TenantLabel { tenant: tenant.to_owned() }).inc();
    }

    /// A request of `tenant` refused by its `limit` (`requests`, `input_tokens`,
    /// `output_tokens`).
    pub fn record_rate_limited(&self, tenant: &str, limit: &'static str) {
        self.rate_limited.get_or_create(&RateLimitLabels { tenant: tenant.to_owned(), limit }).inc();
    }

    /// The Prometheus text exposition, worker gauges refreshed from `stats`.
    pub fn render(&self, stats: &WorkerStats) -> String {
        let as_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.waiting.set(as_i64(stats.waiting));
        self.running.set(as_i64(stats.running));
        self.kv_used.set(as_i64(stats.kv_blocks_used));
        self.kv_free.set(as_i64(stats.kv_blocks_free));
        self.kv_usage.set(stats.kv_usage());
        // Counters mirror the worker's monotonic totals, through high-water marks (see them).
        self.preemptions.inc_by(raise(&self.seen_preempted, stats.preempted));
        self.pool.update(stats);
        let busy = raise_f64(&self.seen_busy, stats.busy_seconds);
        if busy > 0.0 {
            self.busy_seconds.inc_by(busy);
        }
        let flops = raise_f64(&self.seen_flops, stats.flops);
        if flops > 0.0 {
            self.flops.inc_by(flops);
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!("encoding metrics failed: {e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrent_scrapes_and_dipping_totals_never_count_twice() {
        let m = std::sync::Arc::new(Metrics::new());
        let stats = WorkerStats { busy_seconds: 10.0, preempted: 7, flops: 1e9, ..WorkerStats::default() };
        let threads: Vec<_> = (0..16)
            .map(|_| {
                let (m, s) = (std::sync::Arc::clone(&m), stats.clone());
                std::thread::spawn(move || m.render(&s))
            })
            .collect();
        for t in threads {
            let _ = t.join();
        }
        assert_eq!(m.busy_seconds.get(), 10.0);
        assert_eq!(m.preemptions.get(), 7);
        // A cluster total that dips (a worker marked down) and returns adds nothing.
        m.render(&WorkerStats { busy_seconds: 4.0, preempted: 2, ..WorkerStats::default() });
        m.render(&stats);
        assert_eq!((m.busy_seconds.get(), m.preemptions.get()), (10.0, 7));
        m.render(&WorkerStats { busy_seconds: 12.5, preempted: 9, flops: 2e9, ..WorkerStats::default() });
        assert_eq!((m.busy_seconds.get(), m.preemptions.get(), m.flops.get()), (12.5, 9, 2e9));
    }

    #[test]
    fn every_named_metric_is_exported() {
        let m = Metrics::new();
        let mut timing = ServerTiming::default();
        timing.stages_ms.insert(Stage::Queue, 12.0);
        timing.ttft_ms = Some(30.0);
        timing.e2e_ms = Some(90.0);
        let usage = TokenUsage { prompt_tokens: 7, completion_tokens: 3, cached_tokens: 0 };
        let rec = ClientRecord::new(tokenpath_timeline::RequestId(1), 0, 0, true);
        m.record_finished("stop", usage, &timing, &rec);
        m.record_status(503, "none");
        m.record_tenant("alice");
        m.record_rate_limited("alice", "input_tokens");
        let stats = WorkerStats {
            waiting: 2,
            running: 5,
            kv_blocks_used: 9,
            kv_blocks_free: 11,
            ..WorkerStats::default()
        };
        let text = m.render(&stats);
        for name in [
            REQUEST_STAGE_SECONDS,
            TTFT_SECONDS,
            TPOT_SECONDS,
            ITL_SECONDS,
            E2E_SECONDS,
            PROMPT_TOKENS,
            GENERATION_TOKENS,
            CACHED_PROMPT_TOKENS,
            REQUESTS,
            TENANT_REQUESTS,
            RATE_LIMITED_REQUESTS,
            NUM_REQUESTS_WAITING,
            NUM_REQUESTS_RUNNING,
            KV_BLOCKS_USED,
            KV_BLOCKS_FREE,
            NUM_PREEMPTIONS,
            WORKER_BUSY_SECONDS,
            WORKER_FLOPS,
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
        }
        assert!(text.contains("tokenpath_request_stage_seconds_count{stage=\"queue\"} 1"), "{text}");
        assert!(text.contains("tokenpath_prompt_tokens_total 7"), "{text}");
        assert!(text.contains("tokenpath_requests_total{status=\"503\",finish_reason=\"none\"} 1"), "{text}");
        assert!(text.contains("tokenpath_kv_blocks_used 9"), "{text}");
        let usage: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(KV_CACHE_USAGE).and_then(|r| r.trim().parse().ok()))
            .expect("the KV usage gauge");
        let want = stats.kv_blocks_used as f64 / (stats.kv_blocks_used + stats.kv_blocks_free) as f64;
        assert!((usage - want).abs() < 1e-9, "{usage} vs {want}");
        assert!(text.contains("tokenpath_tenant_requests_total{tenant=\"alice\"} 1"), "{text}");
        assert!(
            text.contains("tokenpath_rate_limited_requests_total{tenant=\"alice\",limit=\"input_tokens\"} 1"),
            "{text}"
        );
        assert!(!text.contains(WORKER_PEAK_FLOPS));
        let text = Metrics::with_peak_flops(Some(1e11)).render(&stats);
        assert!(text.contains("tokenpath_worker_peak_flops 100000000000"), "{text}");
    }
}
