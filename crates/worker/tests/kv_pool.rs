//! The KV pool through the worker: a prompt's blocks written by one worker are served to another
//! worker alive at the same time from the host-RAM tier, and to the next worker on the same
//! directory (a restart) from the SSD tier, checked, with the same tokens as a computed prefix;
//! another model's worker on that directory is never served them, and a damaged block is
//! recomputed, never served.

use std::sync::Arc;
use std::time::Instant;
use tokenpath_engine::model::Model;
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::Engine;
use tokenpath_timeline::{RequestId, ServerTiming, Stage};
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
    let (text, cached, _) = run_timed(worker, id, prompt);
    (text, cached)
}

/// The same, with the request's timing.
fn run_timed(worker: &Worker, id: u64, prompt: &[u32]) -> (String, u64, ServerTiming) {
    let mut s = worker.handle().submit(request(id, prompt.to_vec())).expect("submit");
    let mut text = String::new();
    loop {
        match s.blocking_next() {
            Some(WorkEvent::Text { delta, .. }) => text.push_str(&delta),
            Some(WorkEvent::Finished { usage, timing, .. }) => return (text, usage.cached_tokens, timing),
            Some(_) => {}
            None => panic!("the stream ended without finishing"),
        }
    }
}

/// Waits until every block `worker` computed so far is in the pool (its stores are written
/// behind, off the batcher's thread), at most 30 s.
fn stored(worker: &Worker) {
    let until = Instant::now() + std::time::Duration::from_secs(30);
    while worker.handle().stats().kv_pool_stores_pending > 0 {
        assert!(Instant::now() < until, "the worker's pool stores never ended");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The tests of this file one at a time: one of them tries to write every pool memfd of the
/// process, which must not be another test's pool.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn pool_config(dir: &std::path::Path, ssd_bytes: u64) -> KvPoolConfig {
    KvPoolConfig { ram_bytes: 64 << 20, ssd_bytes, ..KvPoolConfig::new(dir) }
}

/// Tries to write over every page of the pool's RAM tier, as a rogue process holding its
/// descriptor would (the pool is hosted in this process, so its memfd is one of ours): the pool
/// memfds found, and how many writes got through.
fn scribble_pool_memory() -> (usize, usize) {
    use std::os::unix::fs::FileExt;
    let (mut found, mut n) = (0, 0);
    for e in std::fs::read_dir("/proc/self/fd").expect("fds").filter_map(Result::ok) {
        let target =
            std::fs::read_link(e.path()).map(|t| t.to_string_lossy().into_owned()).unwrap_or_default();
        if !target.starts_with("/memfd:tokenpath-kv") {
            continue;
        }
        found += 1;
        let Ok(f) = std::fs::OpenOptions::new().write(true).open(e.path()) else { continue };
        let len = f.metadata().expect("len").len();
        for at in (0..len).step_by(4096) {
            n += usize::from(f.write_all_at(&[0x5A; 16], at + 100).is_ok());
        }
    }
    (found, n)
}

#[test]
fn a_block_computed_by_one_worker_is_served_to_another_from_host_ram_and_checked() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("tokenpath-kv-pool-ram-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = || WorkerConfig { kv_pool: Some(pool_config(&dir, 0)), ..WorkerConfig::default() };
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 37 % 200)).collect();
    let plain = Worker::spawn(engine(1), WorkerConfig::default()).expect("worker");
    let (want, _) = run(&plain, 0, &prompt);
    plain.join().expect("join");

    // Two workers on one pool at once (what `serve --prefill/--decode` children, or several
    // `tokenpath worker`s on a host, are): the first hosts it.
    let a = Worker::spawn(engine(1), config()).expect("worker");
    let b = Worker::spawn(engine(1), config()).expect("worker");
    let (text, cached, timing) = run_timed(&a, 1, &prompt);
    assert_eq!((text, cached), (want.clone(), 0));
    assert!(timing.stage_ms(Stage::KvLoad).is_none(), "nothing loaded: no kv_load stage");
    stored(&a);
    let (text, cached, timing) = run_timed(&b, 2, &prompt);
    assert_eq!((text, cached), (want.clone(), 64), "the same tokens, four blocks from the other worker");
    assert_eq!((timing.cached_tokens_host, timing.cached_tokens_ssd), (64, 0));
    assert!(timing.stage_ms(Stage::KvLoad).is_some(), "the load is a stage of its own");
    let stats = b.handle().stats();
    assert_eq!((stats.prompt_tokens_cached_host, stats.kv_pool_failed_loads), (64, 0));
    assert_eq!(
        stats.kv_pool_load_bytes,
        4 * engine(1).new_cache(1024, 16).expect("cache").block_bytes() as u64
    );

    // Nobody but the pool's owner can write its memory, not even a process holding its
    // descriptor: a third worker loads the blocks intact (the same tokens, nothing failed).
    let prompt2: Vec<u32> = (0..40).map(|i| 5 + (i * 11 % 190)).collect();
    let (want2, _) = run(&a, 3, &prompt2);
    stored(&a);
    let (found, written) = scribble_pool_memory();
    assert!(found >= 1, "the pool's RAM tier is this process's memfd");
    assert_eq!(written, 0, "every write to it is refused");
    let c = Worker::spawn(engine(1), config()).expect("worker");
    assert_eq!(run(&c, 4, &prompt2), (want2, 32), "two blocks from the pool, the same tokens");
    assert_eq!(
        (c.handle().stats().kv_pool_failed_loads, c.handle().stats().prompt_tokens_cached_host),
        (0, 32)
    );
    for w in [a, b, c] {
        w.join().expect("join");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A session moves to another worker (its first is drained or busy): the next turn's prompt —
/// the last prompt, the answer, and a new message — is served from the pool up to the end of the
/// answer's last full block, because the first worker stored the blocks it generated too.
#[test]
fn a_sessions_next_turn_on_another_worker_loads_its_answer_from_the_pool() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("tokenpath-kv-pool-session-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = || WorkerConfig { kv_pool: Some(pool_config(&dir, 0)), ..WorkerConfig::default() };
    let turn1: Vec<u32> = (0..60).map(|i| 3 + (i * 29 % 200)).collect();
    // The answer's token ids, from the engine's reference loop (a worker's greedy output is the
    // same, batched or not).
    let e = engine(1);
    let mut cache = e.new_cache(1024, 16).expect("cache");
    let req = tokenpath_engine::GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens: 40,
        ..Default::default()
    };
    let answer = e.generate(&mut cache, &turn1, &req, &mut |_| {}).expect("reference").tokens;
    assert!(answer.len() >= 8, "the tiny model answers with at least a few tokens: {}", answer.len());
    let a = Worker::spawn(engine(1), config()).expect("worker");
    let mut r = request(1, turn1.clone());
    (r.max_tokens, r.ignore_eos) = (Some(40), false);
    let mut s = a.handle().submit(r).expect("submit");
    while !matches!(s.blocking_next(), Some(WorkEvent::Finished { .. }) | None) {}
    stored(&a);
    // Fed: the prompt and every answer token but the last.
    let fed = turn1.len() + answer.len() - 1;
    let turn2: Vec<u32> = turn1.iter().chain(&answer).copied().chain([5, 6, 7, 8, 9]).collect();
    let want = (fed / 16).min((turn2.len() - 1) / 16) * 16;
    assert!(want > turn1.len() / 16 * 16, "at least one block holds answer tokens");
    let b = Worker::spawn(engine(1), config()).expect("worker");
    let (_, cached, timing) = run_timed(&b, 2, &turn2);
    assert_eq!(
        (cached, timing.cached_tokens_host),
        (want as u64, want as u64),
        "prompt and answer from the pool"
    );
    for w in [a, b] {
        w.join().expect("join");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression: a worker whose arena is full of cached blocks (the steady state) still loads a
/// prefix from the pool — cached-only blocks are given up for it — instead of loading nothing.
#[test]
fn a_worker_whose_arena_is_full_of_cached_blocks_still_loads_from_the_pool() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("tokenpath-kv-pool-full-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = |kv_tokens| WorkerConfig {
        kv_pool: Some(pool_config(&dir, 0)),
        kv_tokens,
        ..WorkerConfig::default()
    };
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 37 % 200)).collect();
    let a = Worker::spawn(engine(1), config(None)).expect("worker");
    let (want, _) = run(&a, 1, &prompt);
    stored(&a);
    // 256 tokens of arena (16 blocks); four prompts of 65 tokens leave every block cached.
    let b = Worker::spawn(engine(1), config(Some(256))).expect("worker");
    for i in 0..4u32 {
        let other: Vec<u32> = (0..65).map(|j| 7 + ((j * 13 + i * 101) % 190)).collect();
        run(&b, 10 + u64::from(i), &other);
    }
    let s = b.handle().stats();
    assert!(s.kv_blocks_cached >= 12, "the arena is (nearly) all cached blocks: {s:?}");
    let (text, cached, timing) = run_timed(&b, 2, &prompt);
    assert_eq!((text, cached, timing.cached_tokens_host), (want, 64, 64), "all four blocks loaded");
    for w in [a, b] {
        w.join().expect("join");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_restarted_worker_serves_the_prefix_from_the_ssd_tier_and_other_weights_never_see_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("tokenpath-kv-pool-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pool = pool_config(&dir, 64 << 20);
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
    assert!(slab(&dir).exists(), "the pool wrote its blocks down as it stopped");

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
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    use std::os::unix::fs::FileExt;
    let dir = std::env::temp_dir().join(format!("tokenpath-kv-pool-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pool = pool_config(&dir, 8 << 20);
    let config = || WorkerConfig { kv_pool: Some(pool.clone()), ..WorkerConfig::default() };
    let prompt: Vec<u32> = (0..40).map(|i| 5 + (i * 11 % 190)).collect();
    let first = Worker::spawn(engine(3), config()).expect("worker");
    let (want, _) = run(&first, 1, &prompt);
    first.join().expect("join");
    // Flip bytes in every slot's payload (a bad disk, or a write torn by a crash).
    let path = slab(&dir);
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
    assert_eq!((stats.prompt_tokens_cached_ssd, stats.prompt_tokens_cached_host), (0, 0));
    second.join().expect("join");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pool's slab file in `dir` (one per namespace; these tests use one model at a time).
fn slab(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "slab"))
        .expect("a slab file")
}
