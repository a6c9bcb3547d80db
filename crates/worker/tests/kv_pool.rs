//! The KV pool's SSD tier through the worker: a prompt's blocks written by one worker are
//! served to the next worker on the same directory (a restart), verified, with the same tokens
//! as a computed prefix; another model's worker on that directory is never served them.

use std::sync::Arc;
use std::time::Instant;
use tokenpath_engine::model::Model;
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::Engine;
use tokenpath_timeline::RequestId;
use tokenpath_worker::{KvPoolConfig, WorkEvent, WorkRequest, Worker, WorkerConfig};

fn engine(seed: u64) -> Arc<Engine> {
    let bytes = tiny_model_bytes(&TinySpec { seed, ..TinySpec::default() }).expect("tiny model");
    Arc::new(Engine::from_model(Model::from_bytes(bytes).expect("model")).expect("engine"))
}

fn request(id: u64, prompt: Vec<u32>) -> WorkRequest {
    let now = Instant::now();
    WorkRequest {
        id: RequestId(id),
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(6),
        stop: Vec::new(),
        ignore_eos: true,
        arrived: now,
        admitted: now,
        mode: tokenpath_worker::WorkMode::Full,
        meter: None,
        cache_scope: None,
        forward: None,
        trace: None,
    }
}

/// (generated text, cached prompt tokens) of one request.
fn run(worker: &Worker, id: u64, prompt: &[u32]) -> (String, u64) {
    let mut s = worker.handle().submit(request(id, prompt.to_vec())).expect("submit");
    let mut text = String::new();
    loop {
        match s.blocking_next() {
            Some(WorkEvent::Text { delta, .. }) => text.push_str(&delta),
            Some(WorkEvent::Finished { usage, .. }) => return (text, usage.cached_tokens),
            Some(_) => {}
            None => panic!("the stream ended without finishing"),
        }
    }
}

#[test]
fn a_restarted_worker_serves_the_prefix_from_the_ssd_tier_and_other_weights_never_see_it() {
    let dir = std::env::temp_dir().join(format!("tokenpath-kv-pool-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pool = KvPoolConfig { dir: dir.clone(), ssd_bytes: 64 << 20 };
    let config = || WorkerConfig { kv_pool: Some(pool.clone()), ..WorkerConfig::default() };
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 37 % 200)).collect();
    // The reference: no pool at all.
    let plain = Worker::spawn(engine(1), WorkerConfig::default()).expect("worker");
    let (want, cached) = run(&plain, 0, &prompt);
    assert_eq!(cached, 0);
    plain.join().expect("join");

    let first = Worker::spawn(engine(1), config()).expect("worker");
    assert_eq!(run(&first, 1, &prompt), (want.clone(), 0));
    assert_eq!(first.handle().stats().prompt_tokens_cached_ssd, 0);
    first.join().expect("join");
    assert!(dir.join("w0.slab").exists());

    // A new process's worker (a fresh arena) on the same directory: the 64 tokens of the four
    // full blocks before the last prompt token come from the SSD tier.
    let second = Worker::spawn(engine(1), config()).expect("worker");
    assert_eq!(run(&second, 2, &prompt), (want.clone(), 64), "the same tokens, four blocks loaded");
    assert_eq!(second.handle().stats().prompt_tokens_cached_ssd, 64);
    // Now in the arena as well: the next request hits there, not on disk.
    assert_eq!(run(&second, 3, &prompt), (want, 64));
    assert_eq!(second.handle().stats().prompt_tokens_cached_ssd, 64);
    second.join().expect("join");

    // Other weights of the same shape: nothing is served.
    let other = Worker::spawn(engine(2), config()).expect("worker");
    let (_, cached) = run(&other, 4, &prompt);
    assert_eq!(cached, 0);
    assert_eq!(other.handle().stats().prompt_tokens_cached_ssd, 0);
    other.join().expect("join");

    // The pool needs the prefix cache.
    let bad = WorkerConfig { prefix_cache: false, ..config() };
    assert!(Worker::spawn(engine(1), bad).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_pool_block_is_recomputed_and_counted_never_served() {
    use std::os::unix::fs::FileExt;
    let dir = std::env::temp_dir().join(format!("tokenpath-kv-pool-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pool = KvPoolConfig { dir: dir.clone(), ssd_bytes: 8 << 20 };
    let config = || WorkerConfig { kv_pool: Some(pool.clone()), ..WorkerConfig::default() };
    let prompt: Vec<u32> = (0..40).map(|i| 5 + (i * 11 % 190)).collect();
    let first = Worker::spawn(engine(3), config()).expect("worker");
    let (want, _) = run(&first, 1, &prompt);
    first.join().expect("join");
    // Flip bytes in every slot's payload (a bad disk, or a write torn by a crash).
    let path = dir.join("w0.slab");
    let f = std::fs::OpenOptions::new().write(true).open(&path).expect("slab");
    let len = f.metadata().expect("len").len();
    let block = engine(3).new_cache(1024, 16).expect("cache").block_bytes() as u64;
    let slot = 4096 + block.div_ceil(4096) * 4096;
    let mut at = 4096;
    while at + slot <= len {
        f.write_all_at(&[0xA5; 32], at + 4096 + 1000).expect("write");
        at += slot;
    }
    let second = Worker::spawn(engine(3), config()).expect("worker");
    assert_eq!(run(&second, 2, &prompt), (want, 0), "recomputed, the same tokens");
    let stats = second.handle().stats();
    assert_eq!((stats.kv_pool_failed_loads, stats.prompt_tokens_cached_ssd), (1, 0));
    second.join().expect("join");
    let _ = std::fs::remove_dir_all(&dir);
}
