//! The batcher against the single-sequence reference loop, on a tiny random-weight model:
//! batching, chunked prefill and preemption must not change what a sequence generates; a
//! dropped stream frees its blocks; a full queue and an oversized request are typed errors.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_engine::model::Model;
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::{Engine, GenerateRequest};
use tokenpath_protocol::ProtocolError;
use tokenpath_timeline::{FinishReason, RequestId, Stage};
use tokenpath_worker::{WorkEvent, WorkRequest, Worker, WorkerConfig, WorkerError, WorkerHandle};

fn engine(n_ctx: usize) -> Arc<Engine> {
    let bytes = tiny_model_bytes(&TinySpec { n_ctx, ..TinySpec::default() }).expect("tiny model");
    Arc::new(Engine::from_model(Model::from_bytes(bytes).expect("model")).expect("engine"))
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: Option<u32>) -> WorkRequest {
    let now = Instant::now();
    WorkRequest {
        id: RequestId(id),
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
        ignore_eos: false,
        arrived: now,
        admitted: now,
        mode: tokenpath_worker::WorkMode::Full,
        meter: None,
        cache_scope: None,
        forward: None,
        trace: None,
    }
}

/// Deterministic pseudo-random prompt of ordinary (non-special) tokens.
fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            3 + ((x >> 33) % 256) as u32
        })
        .collect()
}

struct Collected {
    text: String,
    tokens: u32,
    reason: FinishReason,
    completion_tokens: u64,
    prompt_tokens: u64,
}

fn collect(mut stream: tokenpath_worker::WorkStream) -> Collected {
    let (mut text, mut tokens) = (String::new(), 0);
    loop {
        match stream.blocking_next() {
            Some(WorkEvent::Text { delta, tokens: n }) => {
                assert!(n >= 1 && !delta.is_empty(), "text events carry tokens and text");
                text.push_str(&delta);
                tokens += n;
            }
            Some(WorkEvent::Finished { reason, usage, timing }) => {
                let sum: f64 = timing.stages_ms.values().sum();
                let e2e = timing.e2e_ms.expect("e2e");
                assert!((sum - e2e).abs() < 1.0, "stages {sum} ms vs e2e {e2e} ms");
                for stage in [Stage::Gateway, Stage::Queue, Stage::Prefill, Stage::DecodeQueue, Stage::Decode]
                {
                    assert!(timing.stage_ms(stage).is_some(), "{stage} missing");
                }
                return Collected {
                    text,
                    tokens,
                    reason,
                    completion_tokens: usage.completion_tokens,
                    prompt_tokens: usage.prompt_tokens,
                };
            }
            Some(WorkEvent::Failed { message }) => panic!("failed: {message}"),
            Some(other) => panic!("unexpected event in full mode: {other:?}"),
            None => panic!("stream ended without a closing event"),
        }
    }
}

fn wait_until(handle: &WorkerHandle, what: &str, ok: impl Fn(&tokenpath_worker::WorkerStats) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = handle.stats();
        if ok(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `cases` alone through `Engine::generate` and together through a worker with `config`,
/// and checks every sequence produced the same text, token count and finish reason.
fn assert_batching_matches_reference(
    cases: &[(Vec<u32>, u32)],
    config: WorkerConfig,
) -> tokenpath_worker::WorkerStats {
    let engine = engine(512);
    let mut reference = Vec::new();
    let mut cache = engine.new_cache(512, 16).expect("cache");
    for (p, max) in cases {
        let req =
            GenerateRequest { max_tokens: *max as usize, prefill_chunk: 512, ..GenerateRequest::default() };
        reference.push(engine.generate(&mut cache, p, &req, &mut |_| {}).expect("generate"));
    }
    let worker = Worker::spawn(Arc::clone(&engine), config).expect("worker");
    let handle = worker.handle();
    let streams: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, (p, max))| handle.submit(request(i as u64, p.clone(), Some(*max))).expect("submit"))
        .collect();
    for (stream, want) in streams.into_iter().zip(&reference) {
        let got = collect(stream);
        assert_eq!(got.text, want.text);
        assert_eq!(got.completion_tokens, want.tokens.len() as u64);
        assert_eq!(got.prompt_tokens, want.prompt_tokens as u64);
        assert!(u64::from(got.tokens) <= got.completion_tokens);
        let want_reason = match want.finish {
            tokenpath_engine::Finish::Stop => FinishReason::Stop,
            tokenpath_engine::Finish::Length => FinishReason::Length,
        };
        assert_eq!(got.reason, want_reason);
    }
    wait_until(&handle, "all blocks free", |s| s.kv_blocks_used == 0 && s.running == 0);
    let stats = handle.stats();
    assert!(stats.steps > 0 && stats.generated_tokens > 0 && stats.busy_seconds > 0.0);
    drop(handle);
    worker.join().expect("join");
    stats
}

#[test]
fn concurrent_sequences_generate_what_each_generates_alone() {
    // Small chunks force chunked prefill and steps that mix prefill chunks with decodes.
    let cases: Vec<(Vec<u32>, u32)> =
        (0..8).map(|i| (prompt(i, 5 + 23 * i as usize), 20 + 5 * i as u32)).collect();
    let config = WorkerConfig { prefill_chunk: 13, kv_tokens: Some(1024), ..WorkerConfig::default() };
    assert_batching_matches_reference(&cases, config);
}

#[test]
fn preemption_under_kv_pressure_does_not_change_results() {
    // Eight short prompts all fit at admission; their decodes outgrow a one-context cache.
    let cases: Vec<(Vec<u32>, u32)> = (0..8).map(|i| (prompt(100 + i, 20), 150)).collect();
    let config = WorkerConfig { prefill_chunk: 64, kv_tokens: Some(512), ..WorkerConfig::default() };
    let stats = assert_batching_matches_reference(&cases, config);
    assert!(stats.preempted > 0, "the cache was meant to run out: {stats:?}");
}

#[test]
fn ignore_eos_runs_to_max_tokens_and_stop_strings_end_early() {
    let engine = engine(256);
    let worker = Worker::spawn(Arc::clone(&engine), WorkerConfig::default()).expect("worker");
    let handle = worker.handle();
    let mut req = request(1, prompt(3, 10), Some(40));
    req.ignore_eos = true;
    let got = collect(handle.submit(req).expect("submit"));
    assert_eq!(got.completion_tokens, 40);
    assert_eq!(got.reason, FinishReason::Length);
    // A stop string taken from the middle of that output ends the next run before it.
    let stop: String = got.text.chars().skip(5).take(2).collect();
    if !stop.trim().is_empty() {
        let mut req = request(2, prompt(3, 10), Some(40));
        req.ignore_eos = true;
        req.stop = vec![stop.clone()];
        let cut = collect(handle.submit(req).expect("submit"));
        assert_eq!(cut.reason, FinishReason::Stop);
        assert!(!cut.text.contains(&stop), "{:?} contains {stop:?}", cut.text);
        assert!(got.text.starts_with(&cut.text));
    }
}

#[test]
fn dropping_the_stream_cancels_and_frees_every_block() {
    let engine = engine(8192);
    let worker = Worker::spawn(Arc::clone(&engine), WorkerConfig::default()).expect("worker");
    let handle = worker.handle();
    let mut streams = Vec::new();
    for i in 0..4 {
        let mut req = request(i, prompt(i, 100), Some(8000));
        req.ignore_eos = true;
        streams.push(handle.submit(req).expect("submit"));
    }
    for s in &mut streams {
        assert!(matches!(s.blocking_next(), Some(WorkEvent::Text { .. })));
    }
    wait_until(&handle, "blocks in use", |s| s.kv_blocks_used > 0);
    drop(streams);
    wait_until(&handle, "cancellation", |s| s.kv_blocks_used == 0 && s.running == 0 && s.cancelled == 4);
}

#[test]
fn full_queue_is_overloaded_and_recovers() {
    let engine = engine(8192);
    let config = WorkerConfig { max_queue: 2, max_batch: 1, prefill_chunk: 16, ..WorkerConfig::default() };
    let worker = Worker::spawn(Arc::clone(&engine), config).expect("worker");
    let handle = worker.handle();
    let mut long = request(0, prompt(0, 1500), Some(6000));
    long.ignore_eos = true;
    let mut first = handle.submit(long).expect("first");
    // Once the first is running (max_batch 1), two more fill the queue and a fourth is refused.
    wait_until(&handle, "first running", |s| s.running == 1);
    let b = handle.submit(request(1, prompt(1, 8), Some(2))).expect("second");
    let c = handle.submit(request(2, prompt(2, 8), Some(2))).expect("third");
    let err = handle.submit(request(3, prompt(3, 8), Some(2))).expect_err("queue is full");
    assert!(matches!(err, ProtocolError::Overloaded { max: 2 }), "{err}");
    drop(first.blocking_next());
    drop(first);
    collect(b);
    collect(c);
    collect(handle.submit(request(4, prompt(4, 8), Some(2))).expect("accepted again"));
}

#[test]
fn oversized_requests_are_rejected_before_any_work() {
    let engine = engine(256);
    let worker = Worker::spawn(Arc::clone(&engine), WorkerConfig::default()).expect("worker");
    let handle = worker.handle();
    let err = handle.submit(request(0, prompt(0, 256), None)).expect_err("prompt fills the context");
    assert!(matches!(err, ProtocolError::ContextOverflow { prompt_tokens: 256, limit: 256, .. }), "{err}");
    let err = handle.submit(request(1, prompt(1, 200), Some(57))).expect_err("prompt + max_tokens");
    assert!(matches!(err, ProtocolError::ContextOverflow { max_tokens: 57, .. }), "{err}");
    let err = handle.submit(request(2, vec![], Some(1))).expect_err("empty");
    assert!(matches!(err, ProtocolError::InvalidRequest { .. }), "{err}");
    let err = handle.submit(request(3, vec![99_999], Some(1))).expect_err("bad id");
    assert!(matches!(err, ProtocolError::InvalidRequest { .. }), "{err}");
    // Stop strings are work on every token: bounded here too, not only at the gateway.
    for stop in [vec!["x".repeat(1025)], (0..5).map(|i| i.to_string()).collect()] {
        let err =
            handle.submit(WorkRequest { stop, ..request(5, prompt(5, 10), Some(4)) }).expect_err("stops");
        assert!(matches!(err, ProtocolError::InvalidRequest { .. }), "{err}");
    }
    // Exactly at the limit is fine; no context end means "until the context is full".
    let ok = collect(handle.submit(request(4, prompt(4, 200), Some(56))).expect("fits"));
    assert!(ok.completion_tokens <= 56);
    wait_until(&handle, "blocks freed", |s| s.kv_blocks_used == 0);
    let err = Worker::spawn(engine, WorkerConfig { kv_tokens: Some(100), ..WorkerConfig::default() })
        .expect_err("kv smaller than a context");
    assert!(matches!(err, WorkerError::Config(_)), "{err}");
}

#[test]
fn random_mix_of_submissions_and_cancellations_never_leaks_blocks() {
    // Small cache, small chunks, many sequences: admission holds, preemption and cancellation all
    // happen; every block must come back and every kept stream must close properly.
    let engine = engine(512);
    let config = WorkerConfig {
        prefill_chunk: 24,
        max_batch: 12,
        max_queue: 64,
        kv_tokens: Some(512),
        block_size: 8,
        ..WorkerConfig::default()
    };
    let worker = Worker::spawn(Arc::clone(&engine), config).expect("worker");
    let handle = worker.handle();
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut kept = Vec::new();
    for round in 0..3 {
        let mut cancel = Vec::new();
        for i in 0..20u64 {
            let len = 1 + next(200) as usize;
            let max = 1 + next(120) as u32;
            let mut req = request(round * 100 + i, prompt(round * 100 + i, len), Some(max));
            req.ignore_eos = next(2) == 0;
            let stream = handle.submit(req).expect("submit");
            if next(3) == 0 {
                cancel.push((stream, next(4)));
            } else {
                kept.push((stream, max));
            }
        }
        for (mut stream, after) in cancel {
            for _ in 0..after {
                if !matches!(stream.blocking_next(), Some(WorkEvent::Text { .. })) {
                    break;
                }
            }
        }
    }
    for (stream, max) in kept {
        let got = collect(stream);
        assert!(got.completion_tokens <= u64::from(max));
    }
    wait_until(&handle, "every block back", |s| s.kv_blocks_used == 0 && s.running == 0 && s.waiting == 0);
    let stats = handle.stats();
    assert!(stats.cancelled > 0, "{stats:?}");
}

/// Security review H7: generation pauses for a reader that stopped (it never runs ahead of its
/// client), a paused request gives up KV another request needs, and once read again it ends
/// with exactly the text it would have generated unpaused.
#[test]
fn a_reader_that_stops_pauses_its_sequence_and_never_holds_kv_others_need() {
    let engine = engine(512);
    // 64 blocks of 8: the unread request holds ~22, the second needs 50 for its prompt alone.
    let config = WorkerConfig { kv_tokens: Some(512), block_size: 8, ..WorkerConfig::default() };
    let worker = Worker::spawn(Arc::clone(&engine), config).expect("worker");
    let handle = worker.handle();
    let unread = |id| {
        let mut r = request(id, prompt(1, 100), Some(300));
        r.ignore_eos = true;
        r
    };
    let reference = collect(handle.submit(unread(1)).expect("submit"));
    assert_eq!(reference.completion_tokens, 300);

    let before = handle.stats().generated_tokens;
    let slow = handle.submit(unread(2)).expect("submit");
    wait_until(&handle, "the reader to fall behind", |s| s.generated_tokens >= before + 64);
    // The pause takes effect at the step that sees 64 unread text events, which may be a step
    // or two after 64 tokens (a token can end inside a UTF-8 sequence and send no event yet):
    // wait (bounded) for the count to stop moving, then it must stay put.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut held = handle.stats().generated_tokens;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = handle.stats().generated_tokens;
        if now == held {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "generation never paused for a reader that stopped");
        held = now;
    }
    // Paused: a few hundred milliseconds pass and not one token more is generated.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(handle.stats().generated_tokens, held, "generation ran ahead of a reader that stopped");
    assert!(held - before < 300);

    // A request that needs more KV than is free while the unread one holds its blocks.
    let mut big = request(3, prompt(3, 400), Some(100));
    big.ignore_eos = true;
    let big = collect(handle.submit(big).expect("submit"));
    assert_eq!(big.completion_tokens, 100, "served while the unread request waited");
    assert!(handle.stats().preempted > 0, "the unread request gave its KV up: {:?}", handle.stats());

    let slow = collect(slow);
    assert_eq!(slow.text, reference.text, "pausing (and recomputing) changed nothing");
    wait_until(&handle, "every block back", |s| s.kv_blocks_used == 0 && s.running == 0 && s.waiting == 0);
}

/// Security review M3: a decode-mode reservation whose first token never comes ends after
/// `handoff_wait` with an error and gives its KV back (it used to hold it for ten minutes).
#[test]
fn a_decode_reservation_without_a_handoff_ends_and_frees_its_kv() {
    let engine = engine(512);
    let config = WorkerConfig { handoff_wait: Duration::from_millis(300), ..WorkerConfig::default() };
    let worker = Worker::spawn(Arc::clone(&engine), config).expect("worker");
    let handle = worker.handle();
    let mut req = request(1, prompt(1, 100), Some(8));
    req.mode = tokenpath_worker::WorkMode::Decode(tokenpath_worker::Transfer {
        id: 7,
        token: tokenpath_worker::TransferToken([7; 16]),
    });
    let mut stream = handle.submit(req).expect("submit");
    wait_until(&handle, "the reservation", |s| s.kv_blocks_used > 0);
    match stream.blocking_next() {
        Some(WorkEvent::Failed { message }) => {
            assert!(message.contains("first token never arrived"), "{message}")
        }
        other => panic!("expected the reservation to fail, got {other:?}"),
    }
    wait_until(&handle, "the blocks back", |s| s.kv_blocks_used == 0 && s.waiting == 0);
}

#[test]
fn a_prompt_a_little_over_the_chunk_is_prefilled_in_one_step_and_the_step_log_shows_it() {
    let dir = std::env::temp_dir().join(format!("tokenpath-steps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // 64-token chunks: a rest of 8 (an eighth) is finished in the same step, a rest of 9 is not.
    for (len, want) in [(72usize, vec![72usize]), (73, vec![64, 9]), (40, vec![40])] {
        let path = dir.join("steps-{worker}.jsonl");
        let config = WorkerConfig { prefill_chunk: 64, step_log: Some(path), ..WorkerConfig::default() };
        let worker = Worker::spawn(engine(256), config).unwrap();
        let out = collect(worker.handle().submit(request(1, prompt(len as u64, len), Some(2))).unwrap());
        assert_eq!(out.completion_tokens, 2);
        worker.join().unwrap();
        let text = std::fs::read_to_string(dir.join("steps-w0.jsonl")).unwrap();
        let steps: Vec<tokenpath_worker::StepRecord> =
            text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let prefill: Vec<usize> =
            steps.iter().filter(|s| s.prefill_tokens > 0).map(|s| s.prefill_tokens).collect();
        assert_eq!(prefill, want, "{len}-token prompt: {steps:?}");
        // Then one decode step for the second token; every step after the first has its gap.
        assert_eq!(steps.iter().filter(|s| s.decode_tokens == 1).count(), 1);
        assert!(steps[0].gap_us.is_none() && steps[1..].iter().all(|s| s.gap_us.is_some()));
        let pairs: u64 = steps.iter().map(|s| s.attn_pairs).sum();
        assert_eq!(
            pairs,
            tokenpath_worker::StepRecord::pairs(0, len + 1),
            "every fed token's causal context"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
