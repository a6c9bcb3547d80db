//! KV reuse and prefill/decode disaggregation inside one process, on a tiny random-weight model:
//! a prefix-cache hit and a PD handoff (KV exported by one worker, imported by another) must
//! generate exactly what one colocated worker generates, a corrupted or missing transfer falls
//! back to recomputation with the same output, and no path leaks a KV block.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_engine::model::Model;
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::Engine;
use tokenpath_timeline::{RequestId, Stage};
use tokenpath_worker::{
    TokenUsage, Transfer, TransferToken, WorkEvent, WorkMode, WorkRequest, WorkStream, Worker, WorkerConfig,
    WorkerHandle,
};

fn engine() -> Arc<Engine> {
    let bytes = tiny_model_bytes(&TinySpec { n_ctx: 512, ..TinySpec::default() }).unwrap();
    Arc::new(Engine::from_model(Model::from_bytes(bytes).unwrap()).unwrap())
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            3 + ((x >> 33) % 256) as u32
        })
        .collect()
}

fn request(id: u64, prompt: Vec<u32>, sampling: SamplingParams, mode: WorkMode) -> WorkRequest {
    let now = Instant::now();
    WorkRequest {
        id: RequestId(id),
        prompt,
        sampling,
        max_tokens: Some(24),
        stop: Vec::new(),
        ignore_eos: true,
        arrived: now,
        admitted: now,
        mode,
        meter: None,
        cache_scope: None,
        forward: None,
        trace: None,
    }
}

fn seeded() -> SamplingParams {
    SamplingParams { temperature: 0.9, seed: Some(7), frequency_penalty: 0.3, ..SamplingParams::default() }
}

/// Text, usage and timing of a finished stream.
fn finish(mut s: WorkStream, mut text: String) -> (String, TokenUsage, tokenpath_timeline::ServerTiming) {
    loop {
        match s.blocking_next() {
            Some(WorkEvent::Text { delta, .. }) => text.push_str(&delta),
            Some(WorkEvent::Finished { usage, timing, .. }) => return (text, usage, timing),
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn spawn(e: &Arc<Engine>, id: &str) -> (Worker, WorkerHandle) {
    let cfg = WorkerConfig {
        id: tokenpath_timeline::WorkerId(id.into()),
        prefill_chunk: 48,
        kv_tokens: Some(2048),
        ..WorkerConfig::default()
    };
    let w = Worker::spawn(Arc::clone(e), cfg).unwrap();
    let h = w.handle();
    (w, h)
}

fn wait_free(h: &WorkerHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.stats().kv_blocks_used != 0 || h.stats().running != 0 || h.stats().waiting != 0 {
        assert!(Instant::now() < deadline, "blocks leaked: {:?}", h.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn prefix_cache_hits_reuse_blocks_and_change_nothing() {
    let e = engine();
    let (w, h) = spawn(&e, "c0");
    let shared = prompt(1, 100);
    let mut second = shared.clone();
    second.extend(prompt(2, 20));
    let (a, ua, _) =
        finish(h.submit(request(1, shared.clone(), seeded(), WorkMode::Full)).unwrap(), String::new());
    assert_eq!(ua.cached_tokens, 0);
    let (b, ub, tb) =
        finish(h.submit(request(2, shared.clone(), seeded(), WorkMode::Full)).unwrap(), String::new());
    assert_eq!(a, b, "a cache hit generates the same text");
    assert_eq!(ub.cached_tokens, 96, "six full blocks of 16; the last token is always computed");
    assert_eq!(tb.cached_tokens, 96);
    let (_, uc, _) = finish(h.submit(request(3, second, seeded(), WorkMode::Full)).unwrap(), String::new());
    assert!(uc.cached_tokens >= 96, "a longer prompt reuses the shared prefix: {uc:?}");
    wait_free(&h);
    assert!(h.stats().kv_blocks_cached > 0 && h.stats().prompt_tokens_cached >= 192);
    drop(h);
    w.join().unwrap();
}

/// Runs one PD request: prefill on `p`, KV moved by hand (optionally corrupted), decode on `d`.
fn pd_run(
    p: &WorkerHandle,
    d: &WorkerHandle,
    id: u64,
    tokens: Vec<u32>,
    corrupt: bool,
) -> (String, TokenUsage, tokenpath_timeline::ServerTiming) {
    let transfer = Transfer { id: 1000 + id, token: TransferToken::random().unwrap() };
    let dstream = d.submit(request(id, tokens.clone(), seeded(), WorkMode::Decode(transfer))).unwrap();
    let mut pstream = p.submit(request(id, tokens.clone(), seeded(), WorkMode::Prefill)).unwrap();
    let mut text = String::new();
    let mut blocks = 0usize;
    loop {
        match pstream.blocking_next() {
            Some(WorkEvent::Kv { first_block, mut bytes, .. }) => {
                assert_eq!(first_block as usize, blocks, "blocks leave in order");
                let per = p.kv_layout().block_bytes();
                blocks += bytes.len() / per;
                if corrupt && first_block == 0 {
                    bytes.truncate(bytes.len() - 1);
                }
                d.kv_chunk(transfer, first_block, bytes).unwrap();
            }
            Some(WorkEvent::Text { delta, .. }) => text.push_str(&delta),
            Some(WorkEvent::Handoff { first_token, sampler, timing, .. }) => {
                assert!(timing.stage_ms(Stage::Prefill).is_some());
                let verdict = d.kv_end(transfer, tokens.len(), true).unwrap().blocking_recv().unwrap();
                assert_eq!(verdict.is_ok(), !corrupt, "{verdict:?}");
                d.handoff(transfer.id, first_token, sampler).unwrap();
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(pstream.blocking_next().is_none(), "the prefill stream ends at the handoff");
    finish(dstream, text)
}

#[test]
fn handoff_between_workers_generates_what_one_worker_generates() {
    let e = engine();
    let (wc, c) = spawn(&e, "c0");
    let (wp, p) = spawn(&e, "p0");
    let (wd, d) = spawn(&e, "d0");
    for (i, len) in [(1u64, 7usize), (2, 16), (3, 130)] {
        let tokens = prompt(10 + i, len);
        let (want, _, _) =
            finish(c.submit(request(i, tokens.clone(), seeded(), WorkMode::Full)).unwrap(), String::new());
        let (got, usage, timing) = pd_run(&p, &d, i, tokens.clone(), false);
        assert_eq!(got, want, "prompt of {len} tokens");
        assert_eq!(usage.completion_tokens, 24);
        assert!(!timing.kv_recomputed);
        assert!(timing.stage_ms(Stage::DecodeQueue).is_some() && timing.stage_ms(Stage::Decode).is_some());
        let (again, _, timing) = pd_run(&p, &d, 10 + i, tokens, true);
        assert_eq!(again, want, "a corrupted transfer is recomputed, same text");
        assert!(timing.kv_recomputed);
    }
    assert_eq!(d.stats().kv_fallbacks, 3);
    assert_eq!(d.stats().kv_imports, 3);
    for h in [&c, &p, &d] {
        wait_free(h);
    }
    drop((c, p, d));
    for w in [wc, wp, wd] {
        w.join().unwrap();
    }
}

#[test]
fn decode_requests_whose_client_leaves_free_their_reserved_blocks() {
    let e = engine();
    let (wd, d) = spawn(&e, "d0");
    let five = Transfer { id: 5, token: TransferToken([5; 16]) };
    let s = d.submit(request(1, prompt(3, 200), seeded(), WorkMode::Decode(five))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.stats().kv_blocks_used == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(s);
    wait_free(&d);
    assert!(d.kv_end(five, 200, true).unwrap().blocking_recv().unwrap().is_err(), "the transfer is gone");
    drop(d);
    wd.join().unwrap();
}
