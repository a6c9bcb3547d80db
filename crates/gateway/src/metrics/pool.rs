//! The KV pool's metrics: occupancy, hits and misses per tier, bytes loaded, evictions,
//! failed loads and leases (their count and the oldest one's age — a lease leak shows there
//! long before it shows in hit rates). Names are constants in the parent module.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokenpath_protocol::work::WorkerStats;

use super::{
    raise, KV_POOL_BLOCKS, KV_POOL_EVICTIONS, KV_POOL_FAILED_LOADS, KV_POOL_FILTERED, KV_POOL_HITS,
    KV_POOL_HIT_TOKENS, KV_POOL_LEASES, KV_POOL_LEASE_AGE_SECONDS, KV_POOL_LOAD_BYTES, KV_POOL_MISSES,
    KV_POOL_PINNED_BLOCKS, KV_POOL_SLOTS, KV_POOL_SSD_DEGRADED, KV_POOL_STORES_DROPPED,
    KV_POOL_STORES_PENDING, KV_POOL_WRITTEN,
};

/// `tier` label: `host` (the host-RAM tier) or `ssd`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: &'static str,
}

const HOST: TierLabel = TierLabel { tier: "host" };
const SSD: TierLabel = TierLabel { tier: "ssd" };
const REMOTE: TierLabel = TierLabel { tier: "remote" };

/// Handles to the pool's metrics, and the high-water marks its counters are mirrored through.
#[derive(Debug, Default)]
pub(super) struct PoolMetrics {
    blocks: Family<TierLabel, Gauge>,
    slots: Family<TierLabel, Gauge>,
    hits: Family<TierLabel, Counter>,
    hit_tokens: Family<TierLabel, Counter>,
    misses: Counter,
    load_bytes: Counter,
    failed: Counter,
    evictions: Counter,
    filtered: Counter,
    written: Family<TierLabel, Counter>,
    leases: Gauge,
    pinned: Gauge,
    lease_age: Gauge<f64, AtomicU64>,
    degraded: Gauge,
    stores_pending: Gauge,
    stores_dropped: Counter,
    /// Marks, in the order of `MARKS`: host/ssd hits, host/ssd hit tokens, misses, load bytes,
    /// failed loads (worker's + pool's), evictions, remote hits, remote hit tokens, filtered,
    /// written to ssd / remote, store jobs dropped.
    seen: [AtomicU64; 14],
}

impl PoolMetrics {
    pub(super) fn register(&self, r: &mut Registry) {
        r.register(KV_POOL_BLOCKS, "Blocks held by each tier of the host's KV pool", self.blocks.clone());
        r.register(KV_POOL_SLOTS, "Blocks each tier of the host's KV pool can hold", self.slots.clone());
        r.register(
            KV_POOL_HITS,
            "Blocks loaded from the KV pool and checked by their reader, by the tier they were found in",
            self.hits.clone(),
        );
        r.register(
            KV_POOL_HIT_TOKENS,
            "Prompt tokens served from the KV pool, by tier",
            self.hit_tokens.clone(),
        );
        r.register(KV_POOL_MISSES, "KV pool lookups whose first block was not held", self.misses.clone());
        r.register(KV_POOL_LOAD_BYTES, "Bytes of KV loaded from the KV pool", self.load_bytes.clone());
        r.register(
            KV_POOL_FAILED_LOADS,
            "KV pool blocks that failed their check (recomputed, never served)",
            self.failed.clone(),
        );
        r.register(KV_POOL_EVICTIONS, "Blocks pushed out of the KV pool's RAM tier", self.evictions.clone());
        r.register(
            KV_POOL_WRITTEN,
            "Blocks written down from the KV pool's RAM tier, by the tier written",
            self.written.clone(),
        );
        r.register(
            KV_POOL_FILTERED,
            "Blocks that left the KV pool's RAM unwritten, seen once (--kv-pool-second-sighting)",
            self.filtered.clone(),
        );
        r.register(KV_POOL_LEASES, "KV pool leases open", self.leases.clone());
        r.register(KV_POOL_PINNED_BLOCKS, "KV pool RAM blocks pinned by leases", self.pinned.clone());
        r.register(KV_POOL_LEASE_AGE_SECONDS, "Age of the oldest open KV pool lease", self.lease_age.clone());
        r.register(
            KV_POOL_SSD_DEGRADED,
            "1 when the KV pool's SSD tier failed and it runs on RAM",
            self.degraded.clone(),
        );
        r.register(
            KV_POOL_STORES_PENDING,
            "Workers' jobs storing fresh blocks in the KV pool, in flight",
            self.stores_pending.clone(),
        );
        r.register(
            KV_POOL_STORES_DROPPED,
            "Workers' KV pool store jobs not taken (too many in flight): those blocks were not stored",
            self.stores_dropped.clone(),
        );
    }

    /// Refreshes every pool metric from a scrape's worker stats.
    pub(super) fn update(&self, stats: &WorkerStats) {
        let mirror = |i: usize, v: u64, c: &Counter| {
            c.inc_by(raise(&self.seen[i], v));
        };
        mirror(2, stats.prompt_tokens_cached_host, &self.hit_tokens.get_or_create(&HOST));
        mirror(3, stats.prompt_tokens_cached_ssd, &self.hit_tokens.get_or_create(&SSD));
        mirror(9, stats.prompt_tokens_cached_remote, &self.hit_tokens.get_or_create(&REMOTE));
        mirror(5, stats.kv_pool_load_bytes, &self.load_bytes);
        mirror(13, stats.kv_pool_stores_dropped, &self.stores_dropped);
        self.stores_pending.set(i64::try_from(stats.kv_pool_stores_pending).unwrap_or(i64::MAX));
        let Some(p) = &stats.kv_pool else {
            mirror(6, stats.kv_pool_failed_loads, &self.failed);
            return;
        };
        let g = |v: u32| i64::from(v);
        self.blocks.get_or_create(&HOST).set(g(p.ram_blocks));
        self.blocks.get_or_create(&SSD).set(g(p.ssd_blocks));
        self.slots.get_or_create(&HOST).set(g(p.ram_slots));
        self.slots.get_or_create(&SSD).set(g(p.ssd_slots));
        mirror(0, p.hits_ram, &self.hits.get_or_create(&HOST));
        mirror(1, p.hits_ssd, &self.hits.get_or_create(&SSD));
        mirror(8, p.hits_remote, &self.hits.get_or_create(&REMOTE));
        mirror(4, p.misses, &self.misses);
        mirror(6, stats.kv_pool_failed_loads.saturating_add(p.failed), &self.failed);
        mirror(7, p.evictions_ram, &self.evictions);
        mirror(10, p.filtered, &self.filtered);
        mirror(11, p.written_ssd, &self.written.get_or_create(&SSD));
        mirror(12, p.written_remote, &self.written.get_or_create(&REMOTE));
        self.leases.set(g(p.leases));
        self.pinned.set(g(p.pinned));
        self.lease_age.set(p.oldest_lease_ms as f64 / 1e3);
        self.degraded.set(i64::from(p.ssd_degraded));
    }
}
