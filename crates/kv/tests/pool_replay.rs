//! A long request stream through the real pool (socket, shared memory, SSD slab), time-compressed:
//! clients killed mid-load along the way leave nothing pinned, every lease has ended at the end,
//! and the hit fraction keeps up with an ideal prefix LRU of the same capacity from the first
//! quarter to the last (no decay: the failure of pools whose leaked pins eat their capacity).

mod support;

use support::replay::{fraction, ideal_hits, replay, Request};
use tokenpath_kv::pool::PoolConfig;
use tokenpath_kv::BlockHash;

const BLOCK: usize = 4096;

/// Sessions over shared documents: a request is a popular document's blocks (a few hundred
/// documents, popularity falling as 1/rank), then its session's growing history, then a block
/// of its own. Seeded, so every run is the same stream.
fn stream(n: usize, seed: u64) -> Vec<Request> {
    let mut x = seed | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let docs = 300u64;
    let weights: Vec<f64> = (1..=docs).map(|r| 1.0 / r as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut sessions: Vec<(u64, Vec<u64>)> = Vec::new();
    let mut out = Vec::with_capacity(n);
    let mut fresh = 1u64 << 40;
    for _ in 0..n {
        // A new session a third of the time (or while there are few), else a turn of a live one.
        if sessions.len() < 8 || rnd() % 3 == 0 {
            let mut u = (rnd() % 1_000_000) as f64 / 1e6 * total;
            let mut doc = 0;
            while doc + 1 < docs as usize && u > weights[doc] {
                u -= weights[doc];
                doc += 1;
            }
            sessions.push((doc as u64, Vec::new()));
            if sessions.len() > 40 {
                sessions.remove(0);
            }
        }
        let s = (rnd() % sessions.len() as u64) as usize;
        let (doc, history) = &mut sessions[s];
        let doc_len = 4 + *doc % 13;
        let mut r: Request = (0..doc_len).map(|b| (*doc << 20) | b).collect();
        r.extend(history.iter().copied());
        for _ in 0..1 + rnd() % 3 {
            fresh += 1;
            history.push(fresh);
        }
        fresh += 1;
        r.push(fresh);
        if r.len() > 200 {
            history.clear();
        }
        out.push(r);
    }
    out
}

#[test]
fn a_long_time_compressed_replay_keeps_its_hit_rate_and_ends_every_lease() {
    let dir = std::env::temp_dir().join(format!("tokenpath-pool-replay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (ram_slots, ssd_slots) = (96usize, 768usize);
    let cfg = PoolConfig {
        ram_bytes: (ram_slots * BLOCK) as u64,
        ssd_bytes: (4096 + ssd_slots * (4096 + BLOCK)) as u64,
        ..PoolConfig::new(&dir)
    };
    let ns = BlockHash::namespace(&[b"pool replay test"]);
    let reqs = stream(6000, 7);
    let got = replay(&cfg, ns, BLOCK, &reqs, 2, 97);
    let s = &got.stats;
    assert_eq!((s.leases, s.pinned), (0, 0), "every lease ended: {s:?}");
    assert!(got.dropped > 10 && s.leases_expired >= got.dropped as u64, "dropped {} {s:?}", got.dropped);
    assert_eq!(got.failed, 0, "no block failed its check");
    assert!(s.ssd_slots as usize >= ssd_slots && !s.ssd_degraded, "{s:?}");

    let ideal = ideal_hits(&reqs, ssd_slots.max(ram_slots));
    let q = reqs.len() / 4;
    let mut line = Vec::new();
    for k in 0..4 {
        let r = k * q..(k + 1) * q;
        let (pool, best) = (fraction(&got.hits, &reqs, r.clone()), fraction(&ideal, &reqs, r));
        line.push(format!("q{}: {pool:.3} / ideal {best:.3}", k + 1));
        assert!(best > 0.2, "the stream reuses: {line:?}");
        // Two clients take requests in nearly trace order, and a few loads are cut short on
        // purpose: a little under the sequential ideal, the same in every quarter.
        assert!(pool >= 0.9 * best, "quarter {} fell behind the ideal: {line:?}", k + 1);
    }
    let (all, best) = (fraction(&got.hits, &reqs, 0..reqs.len()), fraction(&ideal, &reqs, 0..reqs.len()));
    assert!(all >= 0.95 * best, "{all:.3} vs ideal {best:.3}: {line:?}");
    eprintln!("{line:?}; overall {all:.3} / {best:.3}; {s:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
