//! Engine micro-benchmarks behind `tokenpath bench-engine`: prefill and decode throughput on a
//! loaded model, and this machine's own limits measured in the same run (memory read bandwidth,
//! f32 multiply-add throughput), so every figure can be quoted as a fraction of what the machine
//! can do rather than as an absolute number from a shared, noisy machine.
//!
//! Prompts are real text tokenized by the model's own tokenizer, so the attention and the
//! tokenizer see what they see in serving.

use crate::error::Result;
use crate::kv_cache::BlockTable;
use crate::model::BatchItem;
use crate::Engine;
use rayon::prelude::*;
use std::time::Instant;

/// Public-domain text (the opening of "Alice's Adventures in Wonderland", Lewis Carroll, 1865)
/// repeated to build prompts of any length.
pub const PROSE: &str = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it, 'and what is the use of a book,' thought Alice 'without pictures or conversations?' So she was considering in her own mind (as well as she could, for the hot day made her feel very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close by her. There was nothing so very remarkable in that; nor did Alice think it so very much out of the way to hear the Rabbit say to itself, 'Oh dear! Oh dear! I shall be late!' ";

/// Exactly `n` prompt tokens of prose.
pub fn prose_tokens(engine: &Engine, n: usize) -> Result<Vec<u32>> {
    let one = engine.tokenizer().encode(PROSE, false, false)?;
    Ok(one.iter().copied().cycle().take(n).collect())
}

/// Prefill throughput in prompt tokens per second: one sequence of `n` tokens, run in chunks of
/// `chunk`, on an empty cache.
pub fn prefill_tok_s(engine: &Engine, n: usize, chunk: usize) -> Result<f64> {
    let prompt = prose_tokens(engine, n)?;
    let mut cache = engine.new_cache(n + 16, 16)?;
    let mut table = BlockTable::default();
    let t = Instant::now();
    for piece in prompt.chunks(chunk.max(1)) {
        let mut b = [BatchItem { table: &mut table, tokens: piece, all_logits: false }];
        engine.model().forward(&mut cache, &mut b)?;
    }
    let secs = t.elapsed().as_secs_f64();
    cache.free_table(&mut table)?;
    Ok(n as f64 / secs)
}

/// Aggregate decode throughput in generated tokens per second: `batch` sequences with a
/// `context`-token prompt each, then `steps` decode steps of the whole batch in one forward each.
pub fn decode_tok_s(engine: &Engine, batch: usize, context: usize, steps: usize) -> Result<f64> {
    let prompt = prose_tokens(engine, context)?;
    let mut cache = engine.new_cache(batch * (context + steps + 16), 16)?;
    let mut tables: Vec<BlockTable> = (0..batch).map(|_| BlockTable::default()).collect();
    {
        let mut items: Vec<BatchItem<'_>> =
            tables.iter_mut().map(|table| BatchItem { table, tokens: &prompt, all_logits: false }).collect();
        engine.model().forward(&mut cache, &mut items)?;
    }
    let next: Vec<u32> = (0..batch as u32).map(|i| prompt[i as usize % prompt.len()]).collect();
    let t = Instant::now();
    for _ in 0..steps {
        let mut items: Vec<BatchItem<'_>> = tables
            .iter_mut()
            .zip(&next)
            .map(|(table, tok)| BatchItem { table, tokens: std::slice::from_ref(tok), all_logits: false })
            .collect();
        engine.model().forward(&mut cache, &mut items)?;
    }
    let secs = t.elapsed().as_secs_f64();
    for t in &mut tables {
        cache.free_table(t)?;
    }
    Ok((batch * steps) as f64 / secs)
}

/// f32 GEMM throughput in GFLOP/s on SmolLM2's FFN shape (512 × 576 × 1536), best of 3: the
/// compute limit prefill is quoted against.
pub fn gemm_gflops() -> f64 {
    let (m, n, k) = (512, 1536, 576);
    let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut y = vec![0f32; m * n];
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        crate::model::gemm_xwt(&x, &w, &mut y, m, n, k);
        best = best.max(2.0 * (m * n * k) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&y);
    best
}

/// Peak resident memory of this process in MB (`VmHWM`), where the OS reports it.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// A 256 MiB buffer to measure the memory read bandwidth with, allocated and touched once: a
/// bench measures the bandwidth on both sides of every decode figure without paying for the
/// pages each time.
pub struct ReadBandwidth(Vec<u64>);

impl std::fmt::Debug for ReadBandwidth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReadBandwidth({} MiB)", (self.0.len() * 8) >> 20)
    }
}

impl Default for ReadBandwidth {
    fn default() -> Self {
        Self(vec![1u64; 32 << 20])
    }
}

impl ReadBandwidth {
    /// Memory read bandwidth in GB/s now: summing the buffer on every rayon thread, best of 3.
    pub fn measure(&self) -> f64 {
        let buf = &self.0;
        let mut best = 0.0f64;
        for _ in 0..3 {
            let t = Instant::now();
            let s: u64 =
                buf.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x))).sum();
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(s);
            best = best.max((buf.len() * 8) as f64 / secs / 1e9);
        }
        best
    }
}

/// One cache line's round trip between two threads spinning on two cores, in ns (the median of
/// three runs of up to 20,000 trips), or `None` when no second thread answers within 50 ms (one
/// core). On this project's 2-vCPU VMs it tells where the hypervisor has put the two vCPUs: it
/// reads ~110–150 ns or 500–800 ns, and moves between the two within seconds (2026-12-06: 24
/// samples 4 s apart). A batch-1 decode step hands work between its two threads ~150 times, so a
/// decode figure carries the round trip measured around it beside the read bandwidth.
pub fn core_round_trip_ns() -> Option<f64> {
    use std::sync::atomic::{
        AtomicU64,
        Ordering::{Acquire, Release},
    };
    #[repr(align(128))]
    struct Line(AtomicU64);
    const TRIPS: u64 = 20_000;
    let budget = std::time::Duration::from_millis(50);
    let once = || {
        let (ping, pong) = (Line(AtomicU64::new(0)), Line(AtomicU64::new(0)));
        std::thread::scope(|s| {
            // No second thread (the OS refused one): no figure, like no second core.
            let answer = std::thread::Builder::new().spawn_scoped(s, || {
                let until = Instant::now() + budget;
                for i in 1..=TRIPS {
                    while ping.0.load(Acquire) < i {
                        if Instant::now() > until {
                            return;
                        }
                        std::hint::spin_loop();
                    }
                    pong.0.store(i, Release);
                }
            });
            answer.ok()?;
            let (start, until) = (Instant::now(), Instant::now() + budget);
            let mut done = 0;
            'trips: for i in 1..=TRIPS {
                ping.0.store(i, Release);
                while pong.0.load(Acquire) < i {
                    if Instant::now() > until {
                        break 'trips;
                    }
                    std::hint::spin_loop();
                }
                done = i;
            }
            let secs = start.elapsed().as_secs_f64();
            // Releases the other side whatever it waits for.
            ping.0.store(u64::MAX, Release);
            (done >= 100).then(|| secs * 1e9 / done as f64)
        })
    };
    median((0..3).filter_map(|_| once()).collect())
}

/// The middle value of `runs` once sorted (the upper of the two middle ones for an even count),
/// `None` for none.
fn median(mut runs: Vec<f64>) -> Option<f64> {
    runs.sort_by(f64::total_cmp);
    runs.get(runs.len() / 2).copied()
}

/// One figure, ours next to the peer's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figure {
    /// Our engine.
    pub ours: f64,
    /// llama.cpp on the same file and threads, when measured.
    pub llama_cpp: Option<f64>,
    /// Fraction of this machine's limit that `ours` reaches (compute for prefill, read bandwidth
    /// for decode).
    pub of_limit: f64,
    /// That limit as measured: f32 GFLOP/s for prefill, read GB/s for decode (the higher of the
    /// two measurements just before and just after the figure).
    pub limit: f64,
    /// The limit's unit.
    pub limit_unit: &'static str,
    /// Decode figures: the longer of the two cores' round trips ([`core_round_trip_ns`]) measured
    /// just before and just after the figure.
    pub round_trip_ns: Option<f64>,
}

impl Figure {
    /// ours / llama.cpp.
    pub fn ratio(&self) -> Option<f64> {
        self.llama_cpp.filter(|&p| p > 0.0).map(|p| self.ours / p)
    }
}

/// Every figure of `tokenpath bench-engine`.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBench {
    /// (name, figure) in report order: prefill_512, prefill_2048, decode_b1, decode_b16,
    /// decode_b1_ctx512, decode_b16_ctx512.
    pub figures: Vec<(&'static str, Figure)>,
    /// f32 GEMM GFLOP/s measured in the same run.
    pub gemm_gflops: f64,
    /// Read bandwidth GB/s measured in the same run: the highest of every measurement.
    pub read_gb_s: f64,
    /// Peak resident memory, MB.
    pub peak_rss_mb: Option<f64>,
    /// Model file size, MB.
    pub model_file_mb: f64,
}

/// How much each figure measures: decode steps per decode figure, prefills per prefill figure
/// (their median).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeats {
    pub steps: usize,
    pub prefills: usize,
}

impl Default for Repeats {
    /// 32 steps; 3 prefills, as `scripts/peer/bench_llama.py` measures llama.cpp's: one
    /// 512-token prefill takes ~0.4 s here, and single ones moved a round's ratio by a third.
    fn default() -> Self {
        Repeats { steps: 32, prefills: 3 }
    }
}

/// The median of `times` (at least one) runs of [`prefill_tok_s`].
pub fn prefill_tok_s_median(engine: &Engine, n: usize, chunk: usize, times: usize) -> Result<f64> {
    let runs = (0..times.max(1)).map(|_| prefill_tok_s(engine, n, chunk)).collect::<Result<Vec<f64>>>()?;
    Ok(median(runs).unwrap_or_default())
}

/// Runs the figures `wanted` accepts (all of them, or one for a profile); `peer` gives
/// llama.cpp's numbers by figure name.
pub fn run_engine_bench_only(
    engine: &Engine,
    Repeats { steps, prefills }: Repeats,
    peer: &dyn Fn(&str) -> Option<f64>,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<EngineBench> {
    let gemm = gemm_gflops();
    let bandwidth = ReadBandwidth::default();
    let mut bw = bandwidth.measure();
    let flops = engine.model().config().flops_per_token() as f64;
    let bytes = engine.model().file_bytes() as f64;
    let mut figures = Vec::new();
    // Warm-up (first touch of the weights, scratch buffers and threads), as on the peer's side:
    // one 512-token prefill.
    prefill_tok_s(engine, 512, 512)?;
    for (name, n) in [("prefill_512", 512), ("prefill_2048", 2048)].into_iter().filter(|f| wanted(f.0)) {
        let ours = prefill_tok_s_median(engine, n, 512, prefills)?;
        let of_limit = ours * flops / (gemm * 1e9);
        figures.push((
            name,
            Figure {
                ours,
                llama_cpp: peer(name),
                of_limit,
                limit: gemm,
                limit_unit: "GFLOP/s",
                round_trip_ns: None,
            },
        ));
    }
    // Also at the serving benchmark's context (512-token prompts), where attention over the cache
    // is part of every step: one sequence (its c=1 step) and sixteen (its c=16 step).
    // Four, five and eight sequences bracket the knee where a step stops being bound by one read
    // of the weights (the AVX-512 tiles take up to eight activations per read).
    let shapes = [
        ("decode_b1", 1, 32),
        ("decode_b4", 4, 32),
        ("decode_b5", 5, 32),
        ("decode_b8", 8, 32),
        ("decode_b16", 16, 32),
        ("decode_b1_ctx512", 1, 512),
        ("decode_b16_ctx512", 16, 512),
    ];
    // This VM's read bandwidth moves by tens of percent between minutes (31–60 GB/s in one
    // session), so each decode figure is held against the bandwidth measured just before and just
    // after it — the higher of the two, never one from minutes earlier.
    for (name, batch, context) in shapes.into_iter().filter(|f| wanted(f.0)) {
        let (before, trip_before) = (bandwidth.measure(), core_round_trip_ns());
        let ours = decode_tok_s(engine, batch, context, steps)?;
        let limit = before.max(bandwidth.measure());
        let round_trip_ns = trip_before.into_iter().chain(core_round_trip_ns()).reduce(f64::max);
        bw = bw.max(limit);
        // Each step streams the weights once, whatever the batch.
        let of_limit = ours / batch as f64 * bytes / (limit * 1e9);
        figures.push((
            name,
            Figure { ours, llama_cpp: peer(name), of_limit, limit, limit_unit: "GB/s", round_trip_ns },
        ));
    }
    Ok(EngineBench {
        figures,
        gemm_gflops: gemm,
        read_gb_s: bw,
        peak_rss_mb: peak_rss_mb(),
        model_file_mb: bytes / 1e6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_figure_runs_as_often_as_asked_at_least_once() {
        use crate::model::Model;
        use crate::tiny::{tiny_model_bytes, TinySpec};
        let model = Model::from_bytes(tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
        let engine = Engine::from_model(model).unwrap();
        for times in [0, 1, 3] {
            let t = prefill_tok_s_median(&engine, 24, 8, times).unwrap();
            assert!(t.is_finite() && t > 0.0, "{times} runs: {t}");
        }
        assert_eq!(Repeats::default(), Repeats { steps: 32, prefills: 3 });
    }

    #[test]
    fn the_median_is_the_middle_run() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(4.0));
        assert_eq!(median(Vec::new()), None);
    }

    #[test]
    fn the_core_round_trip_is_bounded_and_answers_in_range() {
        // Three runs of at most 50 ms each, whether or not a second core answers; an answer
        // needs at least 100 trips in its 50 ms, so it is under half a millisecond.
        let t = Instant::now();
        let trip = core_round_trip_ns();
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "took {:?}", t.elapsed());
        if let Some(ns) = trip {
            assert!(ns.is_finite() && ns > 0.0 && ns <= 5e5, "round trip {ns} ns");
        }
    }
}
