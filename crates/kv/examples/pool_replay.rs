//! A trace replayed straight through the KV pool, time-compressed (what `scripts/bench-kvpool`
//! runs on the hour-long Mooncake conversation trace): per tenth of the trace, the pool's hit
//! fraction next to an ideal prefix LRU of the same capacity, and the leases, pins and failed
//! loads at the end. Prints one JSON object.
//!
//!   cargo run --release -p tokenpath-kv --example pool_replay -- TRACE.jsonl DIR \
//!       [RAM_SLOTS SSD_SLOTS BLOCK_BYTES CLIENTS]

#[path = "../tests/support/replay.rs"]
mod replay;

use std::time::Instant;

use tokenpath_kv::pool::PoolConfig;
use tokenpath_kv::BlockHash;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let (Some(trace), Some(dir)) = (a.first(), a.get(1)) else {
        return Err("usage: pool_replay TRACE.jsonl DIR [RAM_SLOTS SSD_SLOTS BLOCK_BYTES CLIENTS]".into());
    };
    let num = |i: usize, d: usize| a.get(i).map_or(Ok(d), |v| v.parse::<usize>());
    let (ram, ssd, block, clients) = (num(2, 682)?, num(3, 11_500)?, num(4, 16_384)?, num(5, 2)?);
    let mut reqs: Vec<replay::Request> = Vec::new();
    let mut span = 0.0f64;
    for line in std::fs::read_to_string(trace)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let ids = v["hash_ids"].as_array().ok_or("a line without hash_ids")?;
        reqs.push(ids.iter().filter_map(serde_json::Value::as_u64).collect());
        span = span.max(v["timestamp"].as_f64().unwrap_or(0.0) / 1000.0);
    }
    let _ = std::fs::remove_dir_all(dir);
    let cfg = PoolConfig {
        ram_bytes: (ram * block.div_ceil(4096) * 4096) as u64,
        ssd_bytes: (4096 + ssd * (4096 + block.div_ceil(4096) * 4096)) as u64,
        ..PoolConfig::new(dir)
    };
    let ns = BlockHash::namespace(&[b"pool replay", trace.as_bytes()]);
    let t0 = Instant::now();
    let got = replay::replay(&cfg, ns, block, &reqs, clients, 0);
    let secs = t0.elapsed().as_secs_f64();
    let ideal = replay::ideal_hits(&reqs, ram.max(ssd));
    let tenth = reqs.len() / 10;
    let deciles: Vec<serde_json::Value> = (0..10)
        .map(|k| {
            let r = k * tenth..if k == 9 { reqs.len() } else { (k + 1) * tenth };
            serde_json::json!({"pool": replay::fraction(&got.hits, &reqs, r.clone()),
                "ideal": replay::fraction(&ideal, &reqs, r)})
        })
        .collect();
    let all = 0..reqs.len();
    let out = serde_json::json!({
        "requests": reqs.len(), "trace_seconds": span, "replay_seconds": secs,
        "ram_slots": ram, "ssd_slots": ssd, "block_bytes": block, "clients": clients,
        "hit_fraction": replay::fraction(&got.hits, &reqs, all.clone()),
        "ideal_hit_fraction": replay::fraction(&ideal, &reqs, all),
        "deciles": deciles, "failed_loads": got.failed,
        "leases_open": got.stats.leases, "pinned": got.stats.pinned, "dropped_clients": got.dropped,
        "stats": got.stats,
    });
    println!("{out}");
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
