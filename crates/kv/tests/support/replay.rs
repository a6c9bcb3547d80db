//! A request stream replayed straight through the KV pool — its real socket, shared memory and
//! SSD slab, no model — as fast as the pool answers: hours of a trace's lookups, loads and
//! stores in seconds. Each request looks up its chain of block keys, copies and checks the
//! leased run, releases it, and stores the blocks after the run (what a worker does once it
//! has computed them). Shared by the replay test and `examples/pool_replay.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tokenpath_kv::pool::{PoolClient, PoolConfig};
use tokenpath_kv::{chain_hash, BlockHash};
use tokenpath_protocol::pool::PoolStats;

/// One request: the ids of its prompt's blocks, first to last (equal ids, equal blocks).
pub type Request = Vec<u64>;

/// The chained keys of a request's blocks.
pub fn keys_of(ns: BlockHash, ids: &[u64]) -> Vec<BlockHash> {
    let mut prev = ns;
    ids.iter()
        .map(|&id| {
            prev = chain_hash(prev, &[id as u32, (id >> 32) as u32]);
            prev
        })
        .collect()
}

/// The bytes of a block: its key, repeated.
pub fn block_bytes(key: &BlockHash, len: usize) -> Vec<u8> {
    key.0.iter().copied().cycle().take(len).collect()
}

/// Per request, the blocks an ideal prefix LRU of `capacity` blocks hits (its longest run of
/// held keys from the first; then every key of the request is touched, first to last).
pub fn ideal_hits(reqs: &[Request], capacity: usize) -> Vec<usize> {
    // An O(1) LRU: key -> last-use tick, and ticks in order (stale entries skipped).
    let mut last: HashMap<u64, u64> = HashMap::new();
    let mut order: VecDeque<(u64, u64)> = VecDeque::new();
    let mut tick = 0u64;
    let mut out = Vec::with_capacity(reqs.len());
    let mut chain: Vec<u64> = Vec::new();
    for r in reqs {
        // Keys are prefix chains: a block id stands for the chain up to it only within one
        // request's order, so the LRU is over (chain position hash) = the chained id sequence.
        chain.clear();
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for &id in r {
            h = (h ^ id).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(17) ^ id;
            chain.push(h);
        }
        let hit = chain.iter().take_while(|k| last.contains_key(k)).count();
        out.push(hit);
        for &k in &chain {
            tick += 1;
            last.insert(k, tick);
            order.push_back((k, tick));
        }
        while last.len() > capacity {
            let Some((k, t)) = order.pop_front() else { break };
            if last.get(&k) == Some(&t) {
                last.remove(&k);
            }
        }
        // Keep the queue from growing without bound on stale entries.
        if order.len() > 4 * capacity.max(1024) {
            order.retain(|(k, t)| last.get(k) == Some(t));
        }
    }
    out
}

/// What a replay found.
#[derive(Debug)]
pub struct Replayed {
    /// Per request, the blocks loaded from the pool and checked.
    pub hits: Vec<usize>,
    /// Leased blocks whose copy failed its check (never counted as hits).
    pub failed: usize,
    /// Clients dropped while they held a lease (what a killed worker does).
    pub dropped: usize,
    /// The pool's counters at the end, once every client is gone but one.
    pub stats: PoolStats,
}

/// Replays `reqs` through the pool in `cfg.dir` with `clients` threads taking requests in
/// order; every `drop_every`-th request (0: never) its client leases the run and is dropped
/// holding it, then reconnects.
pub fn replay(
    cfg: &PoolConfig,
    ns: BlockHash,
    block: usize,
    reqs: &[Request],
    clients: usize,
    drop_every: usize,
) -> Replayed {
    // The first client hosts the pool, and lives to read the counters at the end.
    let mut host = PoolClient::new(cfg.clone(), ns, block);
    assert!(host.connected(), "the pool came up");
    let next = AtomicUsize::new(0);
    let hits = Mutex::new(vec![0usize; reqs.len()]);
    let failed = AtomicUsize::new(0);
    let dropped = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..clients {
            s.spawn(|| {
                let mut c = PoolClient::new(cfg.clone(), ns, block);
                let mut bufs: Vec<Vec<u8>> = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(ids) = reqs.get(i) else { break };
                    let keys = keys_of(ns, ids);
                    let lease = c.lookup(&keys);
                    if drop_every > 0 && i % drop_every == drop_every - 1 && !lease.blocks.is_empty() {
                        // Killed mid-load: the connection goes with its lease.
                        drop(c);
                        dropped.fetch_add(1, Ordering::Relaxed);
                        c = PoolClient::new(cfg.clone(), ns, block);
                        continue;
                    }
                    let n = lease.blocks.len();
                    while bufs.len() < n {
                        bufs.push(vec![0; block]);
                    }
                    let ok = c.load_all(&lease.blocks, &mut bufs[..n]);
                    let run = ok.iter().take_while(|&&b| b).count();
                    failed.fetch_add(ok.iter().filter(|&&b| !b).count(), Ordering::Relaxed);
                    for (j, b) in bufs[..run].iter().enumerate() {
                        assert!(*b == block_bytes(&keys[j], block), "a loaded block is its key's");
                    }
                    c.release(lease, run);
                    hits.lock().expect("hits")[i] = run;
                    c.store(&keys[run..], |j| block_bytes(&keys[run + j], block));
                }
            });
        }
    });
    let stats = host.stats().expect("the pool's counters");
    Replayed {
        hits: hits.into_inner().expect("hits"),
        failed: failed.into_inner(),
        dropped: dropped.into_inner(),
        stats,
    }
}

/// Hit fraction (blocks hit / blocks asked) of requests `range`.
pub fn fraction(hits: &[usize], reqs: &[Request], range: std::ops::Range<usize>) -> f64 {
    let asked: usize = reqs[range.clone()].iter().map(Vec::len).sum();
    hits[range].iter().sum::<usize>() as f64 / asked.max(1) as f64
}
