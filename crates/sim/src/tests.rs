use super::*;
use crate::calib::{FitQuality, Linear, GAP_TERMS, STEP_TERMS, VERSION};
use crate::requests::{from_workload, Send};
use std::time::Duration;
use tokenpath_bench::workload::Workload;
use tokenpath_timeline::Stage;

/// A machine: 5 ms per step + 50 µs per prompt token + 0.5 ms per decode row; 1 ms gaps; no
/// spread (each draw is the point).
fn calib() -> Calibration {
    Calibration {
        version: VERSION,
        provenance: Provenance::default(),
        step: Linear {
            terms: STEP_TERMS.iter().map(|s| (*s).to_owned()).collect(),
            coef_us: vec![5000.0, 0.0, 50.0, 500.0, 0.0, 0.0, 0.0, 0.0],
            residuals: Vec::new(),
        },
        gap: Linear {
            terms: GAP_TERMS.iter().map(|s| (*s).to_owned()).collect(),
            coef_us: vec![1000.0, 0.0],
            residuals: Vec::new(),
        },
        gateway_us: 0.0,
        kv_bytes_per_token: 1000,
        link: LinkModel { latency_us: 2000.0, bytes_per_s: 1e8 },
        fit: FitQuality::default(),
        knee_rows: 0,
    }
}

fn cfg(colocated: usize, prefill: usize, decode: usize) -> SimConfig {
    SimConfig {
        topology: Topology { colocated, prefill, decode },
        worker: WorkerShape {
            kv_blocks: 512,
            block_size: 16,
            prefill_chunk: 512,
            max_batch: 64,
            prefix_cache: true,
            n_ctx: 8192,
        },
        seed: 3,
        keep_steps: true,
    }
}

fn input(w: &str, n: usize, gap_ms: u64) -> Input {
    let w: Workload = w.parse().unwrap();
    let offsets: Vec<Duration> = (0..n as u64).map(|i| Duration::from_millis(i * gap_ms)).collect();
    from_workload(&w, n, 0, None, Some(&offsets), None).unwrap()
}

fn stage(r: &ClientRecord, s: Stage) -> Option<f64> {
    r.server.as_ref().and_then(|t| t.stage_ms(s))
}

#[test]
fn one_lone_request_takes_exactly_its_modelled_steps() {
    let inp = input("fixed:256:4", 1, 0);
    let out = simulate(&cfg(1, 0, 0), &calib(), &inp).unwrap();
    let r = &out.records[0];
    assert!(r.is_ok());
    let prompt = inp.requests[0].prompt.len() as f64;
    // One prefill step (the prompt fits a chunk), then 3 decode steps each after a 1 ms gap.
    let prefill_ms = 5.0 + 0.05 * prompt;
    assert!((r.ttft_ns().unwrap() as f64 / 1e6 - prefill_ms).abs() < 1e-3, "{:?}", r.ttft_ns());
    assert_eq!(r.events.len(), 4);
    let e2e = r.e2e_ns().unwrap() as f64 / 1e6;
    assert!((e2e - (prefill_ms + 3.0 * (1.0 + 5.5))).abs() < 1e-3, "{e2e}");
    assert!((stage(r, Stage::Prefill).unwrap() - prefill_ms).abs() < 1e-6);
    assert!(stage(r, Stage::KvTransfer).is_none(), "colocated: no transfer stage");
    assert_eq!(r.usage.unwrap().completion_tokens, 4);
    assert_eq!(out.stats.steps, 4);
}

#[test]
fn the_same_seed_gives_the_same_run_and_a_shared_prefix_is_a_hit() {
    let inp = input("shared-prefix:1:256:8-32:8-8", 20, 40);
    let mut c = calib();
    c.step.residuals = vec![vec![0.9, 1.0, 1.3], vec![0.8, 1.0, 1.1]];
    let a = simulate(&cfg(1, 0, 0), &c, &inp).unwrap();
    let b = simulate(&cfg(1, 0, 0), &c, &inp).unwrap();
    assert_eq!(serde_json::to_string(&a.records).unwrap(), serde_json::to_string(&b.records).unwrap());
    let mut other = cfg(1, 0, 0);
    other.seed = 4;
    let d = simulate(&other, &c, &inp).unwrap();
    assert_ne!(serde_json::to_string(&a.records).unwrap(), serde_json::to_string(&d.records).unwrap());
    // The first request computes the shared system prompt; later ones find it cached.
    assert_eq!(a.records[0].cached_tokens(), 0);
    assert!(a.records[1..].iter().all(|r| r.cached_tokens() >= 256), "{:?}", a.records[1].usage);
}

#[test]
fn pd_moves_the_kv_over_the_link_and_decodes_on_the_decode_worker() {
    let inp = input("fixed:1000:6", 3, 500);
    let out = simulate(&cfg(0, 1, 1), &calib(), &inp).unwrap();
    for r in &out.records {
        assert!(r.is_ok(), "{:?}", r.outcome);
        let t = r.server.as_ref().unwrap();
        assert_eq!(t.workers.get("prefill").map(|w| w.0.as_str()), Some("p0"));
        assert_eq!(t.workers.get("decode").map(|w| w.0.as_str()), Some("d1"));
        // 1000+ tokens × 1000 B at 100 MB/s streamed during the prefill's two chunks: the rest
        // after the last chunk plus the 2 ms latency.
        let kv = stage(r, Stage::KvTransfer).unwrap();
        assert!((2.0..12.0).contains(&kv), "{kv}");
        assert!(t.kv_transfer_bytes.unwrap() >= 1_000_000);
        assert_eq!(r.events.len(), 6);
        assert!(stage(r, Stage::Decode).is_some());
    }
    assert!(out.stats.steps >= 3 * 2 + 3 * 5);
}

#[test]
fn a_small_cache_preempts_and_an_impossible_request_fails_cleanly() {
    let mut c = cfg(1, 0, 0);
    c.worker.kv_blocks = 40; // 640 tokens
    c.worker.prefix_cache = false;
    let inp = input("fixed:200:120", 6, 0);
    let out = simulate(&c, &calib(), &inp).unwrap();
    assert!(out.records.iter().all(ClientRecord::is_ok));
    assert!(out.stats.preempted > 0, "{:?}", out.stats);
    assert!(out.records.iter().all(|r| r.events.len() == 120));
    let big = input("fixed:1000:4", 1, 0);
    let out = simulate(&c, &calib(), &big).unwrap();
    assert!(!out.records[0].is_ok());
    let mut tiny = cfg(1, 0, 0);
    tiny.worker.n_ctx = 100;
    let out = simulate(&tiny, &calib(), &big).unwrap();
    assert!(
        matches!(&out.records[0].outcome, tokenpath_timeline::Outcome::Failed { message, .. } if message.contains("context"))
    );
}

#[test]
fn a_session_turn_is_sent_when_the_previous_one_ended_and_finds_its_prefix() {
    let inp = input("multi-turn:3:64-64:16-16", 3, 0);
    assert_eq!(inp.send[1], Send::After(0));
    let out = simulate(&cfg(1, 0, 0), &calib(), &inp).unwrap();
    let (a, b) = (&out.records[0], &out.records[1]);
    assert_eq!(b.t_sched, a.t_done.unwrap());
    assert!(b.cached_tokens() >= 64, "{:?}", b.usage);
}

#[test]
fn a_bad_topology_is_refused() {
    let inp = input("fixed:16:2", 1, 0);
    assert!(simulate(&cfg(1, 1, 1), &calib(), &inp).is_err());
    assert!(simulate(&cfg(0, 1, 0), &calib(), &inp).is_err());
    let mut bad = calib();
    bad.link.bytes_per_s = 0.0;
    assert!(simulate(&cfg(1, 0, 0), &bad, &inp).is_err());
}

/// Regression (the simulated 1P1D transfers were a third of the real ones at p50 and a quarter at
/// p99): the real decode worker reads a transfer's end only between its steps, so a transfer
/// whose bytes land mid-step ends when that step and its gap are over — never inside a step.
#[test]
fn a_transfer_landing_mid_step_ends_between_the_decode_workers_steps() {
    // Prompts of 1,000 tokens every 30 ms: the decode worker is decoding earlier requests
    // (5.5 ms steps, 1 ms gaps) when most later transfers land.
    let inp = input("fixed:1000:40", 8, 30);
    let mut c = cfg(0, 1, 1);
    c.worker.kv_blocks = 1024;
    let out = simulate(&c, &calib(), &inp).unwrap();
    let steps: Vec<(f64, f64)> = out
        .steps
        .iter()
        .filter(|(w, _)| w == "d1")
        .map(|(_, s)| (s.start_us as f64 / 1e3, (s.start_us + s.dur_us) as f64 / 1e3))
        .collect();
    assert!(steps.len() > 40, "{}", steps.len());
    let mut waited = 0;
    for r in &out.records {
        assert!(r.is_ok(), "{:?}", r.outcome);
        let ms = |s| stage(r, s).unwrap();
        let end = r.t_send as f64 / 1e6
            + ms(Stage::Gateway)
            + ms(Stage::Queue)
            + ms(Stage::Prefill)
            + ms(Stage::KvTransfer);
        // Step times are whole µs: 2 µs of slack either side.
        let inside = steps.iter().find(|(a, b)| end > a + 0.002 && end < b - 0.002);
        assert!(inside.is_none(), "request {} took its KV in at {end} ms, inside the step {inside:?}", r.id);
        // The link alone: the last chunk's 488 tokens × 1000 B at 100 MB/s, plus 2 ms.
        if ms(Stage::KvTransfer) > 2.0 + 4.88 + 0.01 {
            waited += 1;
        }
        // Taken in at a step boundary and planned at once: no decode queue to speak of.
        assert!(ms(Stage::DecodeQueue) < 0.01, "{}", ms(Stage::DecodeQueue));
    }
    assert!(waited >= 3, "only {waited} transfers waited for a step's end");
}
