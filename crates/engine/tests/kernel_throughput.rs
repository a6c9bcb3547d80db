//! Kernel throughput sanity check (ignored by default; numbers only mean something in release):
//!     cargo test --release -p tokenpath-engine --test kernel_throughput -- --ignored --nocapture
//!
//! Measures matvec on SmolLM2's FFN shape (1536 × 576) in two regimes: one matrix hit over and
//! over (cache-resident, kernel speed) and a sweep over ~100 MB of distinct matrices (like one
//! decode step of the whole model, so DRAM-bound). Reported as weight GB/s; the machine streams
//! what `tokenpath bench-engine`'s read-bandwidth probe measures, which is the target for the sweep.

use std::time::Instant;

use tokenpath_engine::quant::{quantize, GgmlType, Kernel, QMatrix};

fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    quantize(ty, &x).expect("quantize")
}

fn bench(ty: GgmlType) {
    let (rows, cols) = (1536, 576);
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
    let mut y = vec![0f32; rows];

    let w = weights(ty, rows, cols, 1);
    let m = QMatrix::new(ty, rows, cols, &w).expect("matrix");
    for kernel in [Kernel::Scalar, Kernel::best()] {
        let act = m.prepare_input(&x).expect("bench setup");
        let iters = 2000;
        let t = Instant::now();
        for _ in 0..iters {
            m.matvec_with(kernel, &act, &mut y).expect("bench setup");
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{ty} {rows}x{cols} cached, {kernel:?}: {:.1} us/matvec, {:.1} GB/s",
            s / iters as f64 * 1e6,
            (w.len() * iters) as f64 / s / 1e9
        );
    }

    // The same product as a one-activation matmul (what the forward pass calls).
    {
        let act = vec![m.prepare_input(&x).expect("bench setup")];
        let iters = 2000;
        let t = Instant::now();
        for _ in 0..iters {
            m.matmul(&act, &mut y).expect("bench setup");
        }
        let s = t.elapsed().as_secs_f64();
        println!("{ty} {rows}x{cols} cached, matmul x1: {:.1} us", s / iters as f64 * 1e6);
    }

    // One row, one thread: the kernel's own cost per block, without rayon or cache misses.
    let act = m.prepare_input(&x).expect("bench setup");
    let row = m.row(0).expect("bench setup");
    let iters = 200_000;
    let t = Instant::now();
    let mut sink = 0f32;
    for _ in 0..iters {
        sink += tokenpath_engine::quant::vec_dot(ty, std::hint::black_box(row), &act).expect("bench setup");
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "{ty} single row-dot ({} blocks): {:.2} ns/block (sink {sink:.1})",
        cols / ty.block_size(),
        s / (iters * cols / ty.block_size()) as f64 * 1e9
    );

    // Batched decode: 16 sequences share each weight row (compute-bound rather than memory-bound).
    let acts: Vec<_> = (0..16).map(|_| m.prepare_input(&x).expect("bench setup")).collect();
    let mut out = vec![0f32; 16 * rows];
    let iters = 200;
    let t = Instant::now();
    for _ in 0..iters {
        m.matmul(&acts, &mut out).expect("bench setup");
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "{ty} {rows}x{cols} matmul x16: {:.1} us, {:.1} ns per row-dot",
        s / iters as f64 * 1e6,
        s / (iters * rows * 16) as f64 * 1e9
    );

    // Prefill-sized product: 512 activations.
    let acts: Vec<_> = (0..512).map(|_| m.prepare_input(&x).expect("bench setup")).collect();
    let mut out = vec![0f32; 512 * rows];
    let iters = 10;
    let t = Instant::now();
    for _ in 0..iters {
        m.matmul(&acts, &mut out).expect("bench setup");
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "{ty} {rows}x{cols} matmul x512: {:.1} ms, {:.1} GOP/s",
        s / iters as f64 * 1e3,
        2.0 * (iters * rows * cols * 512) as f64 / s / 1e9
    );

    let n = (100 << 20) / w.len();
    let all: Vec<Vec<u8>> = (0..n).map(|i| weights(ty, rows, cols, i as u32)).collect();
    let mats: Vec<QMatrix<'_>> =
        all.iter().map(|w| QMatrix::new(ty, rows, cols, w).expect("bench setup")).collect();
    for threads in [1, rayon::current_num_threads()] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("bench setup");
        pool.install(|| {
            let t = Instant::now();
            let sweeps = 5;
            for _ in 0..sweeps {
                for m in &mats {
                    m.matvec(&x, &mut y).expect("bench setup");
                }
            }
            let s = t.elapsed().as_secs_f64();
            println!(
                "{ty} sweep over {} MB, {threads} thread(s): {:.2} ms/sweep, {:.1} GB/s",
                (n * w.len()) >> 20,
                s / sweeps as f64 * 1e3,
                (n * w.len() * sweeps) as f64 / s / 1e9
            );
        });
    }
}

#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn matvec_throughput() {
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        bench(ty);
    }
}

/// A `rows × cols` matrix of `ty` from pseudo-random block bytes with small f16 scales (every
/// bit pattern of a block's quants is valid; `quantize` does not write Q5_0 or Q6_K).
fn random_blocks(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let (bs, n) = (ty.type_size(), rows * cols / ty.block_size());
    let mut data: Vec<u8> =
        (0..n * bs).map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    let scale = half::f16::from_f32(0.003).to_le_bytes();
    for blk in data.chunks_exact_mut(bs) {
        match ty {
            GgmlType::Q6_K => blk[208..210].copy_from_slice(&scale),
            // Q4_1's and Q4_K's second f16 (the minimum) too: random bits may be subnormal,
            // which slows the float unit and measures that instead of the kernel.
            GgmlType::Q4_K | GgmlType::Q4_1 => {
                blk[0..2].copy_from_slice(&scale);
                blk[2..4].copy_from_slice(&scale);
            }
            _ => blk[0..2].copy_from_slice(&scale),
        }
    }
    data
}

/// The repacked tiles of each weight type on a prefill-sized product (1536 × 512 weights, 512
/// activations), on every kernel path this CPU has: what the prefill of a model file of that
/// type can reach.
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn interleaved_prefill_throughput() {
    let (rows, cols, n) = (1536, 512, 512);
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        let w = random_blocks(ty, rows, cols);
        let m = QMatrix::new(ty, rows, cols, &w).expect("matrix");
        let il = tokenpath_engine::quant::Interleaved::from_matrix(&m).expect("repackable");
        let acts: Vec<_> = (0..n).map(|_| il.prepare_rows(&x).expect("acts").remove(0)).collect();
        let mut out = vec![0f32; rows * n];
        for kernel in Kernel::ALL.into_iter().filter(|k| k.is_available()) {
            let run = |out: &mut Vec<f32>| {
                tokenpath_engine::quant::matmul_group_interleaved_with(kernel, &[&il], &acts, &mut [out])
                    .expect("product")
            };
            run(&mut out);
            let iters = 5;
            let t = Instant::now();
            for _ in 0..iters {
                run(&mut out);
            }
            let s = t.elapsed().as_secs_f64() / iters as f64;
            println!(
                "{ty} {rows}x{cols} x{n}, {kernel}: {:.1} ms, {:.1} GOP/s",
                s * 1e3,
                2.0 * (rows * cols * n) as f64 / s / 1e9
            );
        }
    }
}

/// The bf16 prompt products (`quant::amx_bf16`, where the CPU has AMX-BF16) on the FFN's shapes:
/// 512 activations × 576 columns into 1,536 rows and back, every thread of the pool.
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn bf16_prefill_throughput() {
    use tokenpath_engine::quant::amx_bf16::{self, Bf16Matrix};
    if !amx_bf16::available() {
        println!("no AMX-BF16 here");
        return;
    }
    for (rows, cols, n) in [(1536, 576, 512), (576, 1536, 512), (576, 576, 512), (1536, 576, 2048)] {
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.13).sin()).collect();
        let b = Bf16Matrix::from_f32(&w, rows, cols).expect("matrix");
        let x: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut out = vec![0f32; rows * n];
        let run = |out: &mut Vec<f32>| amx_bf16::matmul_group(&[&b], &x, n, &mut [out]).expect("product");
        run(&mut out);
        let iters = 20;
        let t = Instant::now();
        for _ in 0..iters {
            run(&mut out);
        }
        let s = t.elapsed().as_secs_f64() / iters as f64;
        println!(
            "bf16 {rows}x{cols} x{n}: {:.2} ms, {:.0} GFLOP/s",
            s * 1e3,
            2.0 * (rows * cols * n) as f64 / s / 1e9
        );
    }
}

/// The repacked tiles at one activation (decode batch 1), in weight bytes per second: one
/// 1536 × 512 matrix over and over (cache-resident: the tile's own speed) against a sweep over
/// ~100 MB of distinct copies (DRAM, like a decode step of the whole model). When the two are
/// close the tile is the limit; when the cached figure is far higher, the memory is.
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn interleaved_decode_throughput() {
    let (rows, cols) = (1536, 512);
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    for ty in [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q8_0] {
        let w = random_blocks(ty, rows, cols);
        let m = QMatrix::new(ty, rows, cols, &w).expect("matrix");
        let copies = (100 << 20) / w.len();
        let ils: Vec<_> = (0..copies)
            .map(|_| tokenpath_engine::quant::Interleaved::from_matrix(&m).expect("repackable"))
            .collect();
        let acts = ils[0].prepare_rows(&x).expect("acts");
        let mut out = vec![0f32; rows];
        for kernel in Kernel::ALL.into_iter().filter(|k| k.is_available() && *k != Kernel::Amx) {
            let mut run = |i: usize| {
                tokenpath_engine::quant::matmul_group_interleaved_with(
                    kernel,
                    &[&ils[i]],
                    &acts,
                    &mut [&mut out],
                )
                .expect("product")
            };
            let iters = 4 * copies;
            let t = Instant::now();
            for _ in 0..iters {
                run(0);
            }
            let cached = (w.len() * iters) as f64 / t.elapsed().as_secs_f64() / 1e9;
            let t = Instant::now();
            for i in 0..iters {
                run(i % copies);
            }
            let swept = (w.len() * iters) as f64 / t.elapsed().as_secs_f64() / 1e9;
            println!("{ty} {rows}x{cols} x1, {kernel}: cached {cached:.1} GB/s, swept over {copies} copies {swept:.1} GB/s");
        }
    }
}

/// What one parallel region costs on a two-thread pool, as the forward pass opens five a layer:
/// sixteen tasks summing `work` cached u64 each, then a short serial part, back to back inside
/// `install` (as `forward` runs), against the same work serially on one thread. Measured
/// 2026-12-06 (2-core EPYC): an empty region 0.24 µs; 3 µs of work gains nothing from the second
/// thread (2.84 vs 2.99 µs: rayon's idle worker yields to the OS between looks for work —
/// 93k `sched_yield` calls in a 256-step decode under strace);
/// 31 µs of work runs in 17 µs (1.8×). The small products of a batch-1 step (Q/K/V ~12 µs, the
/// output projection ~7 µs a layer) sit where the second thread arrives late.
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn parallel_region_overhead() {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
    let buf: Vec<u64> = (0..(1u64 << 20)).collect();
    let regions = 20_000;
    let region = |work: usize, par: bool| {
        let task = |i: usize| buf[i * work..(i + 1) * work].iter().sum::<u64>();
        let s: u64 = if par { (0..16).into_par_iter().map(task).sum() } else { (0..16).map(task).sum() };
        (0..200u64).fold(s, |a, j| a.wrapping_mul(31).wrapping_add(j))
    };
    for work in [0usize, 2_000, 20_000] {
        let two = pool.install(|| {
            let t = Instant::now();
            let acc = (0..regions).fold(0u64, |a, _| a.wrapping_add(region(work, true)));
            std::hint::black_box(acc);
            t.elapsed()
        });
        let t = Instant::now();
        let acc = (0..regions).fold(0u64, |a, _| a.wrapping_add(region(work, false)));
        std::hint::black_box(acc);
        let one = t.elapsed();
        let us = |d: std::time::Duration| d.as_secs_f64() / regions as f64 * 1e6;
        println!(
            "{work:>6} u64 a task: two threads {:.2} µs a region, one thread serially {:.2} µs",
            us(two),
            us(one)
        );
    }
}

/// A batch-1 decode step with its weights in the caches: SmolLM2-135M's layer shapes (576 wide,
/// 9 query and 3 KV heads of 64, a 1536-wide FFN, Q4_1) on two layers (4.4 MB of weights, L3
/// resident), at 32 positions of context, each step rolled back so the context stays put. What
/// the real step costs beyond streaming 2.2 MB of weights a layer from memory: the products'
/// arithmetic and everything serial around them (norms, RoPE, attention, quantizing
/// activations, each product's set-up and the two threads' hand-offs). Measured 2026-12-06:
/// 56–64 µs a layer, against ~110 for a layer of the real step.
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn decode_step_cache_resident() {
    use tokenpath_engine::kv_cache::{BlockTable, KvCache, KvLayout};
    use tokenpath_engine::model::{BatchItem, Model};
    use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
    let spec = TinySpec {
        n_layer: 2,
        n_embd: 576,
        n_head: 9,
        n_head_kv: 3,
        n_ff: 1536,
        n_ctx: 512,
        ty: GgmlType::Q4_1,
        ..TinySpec::default()
    };
    let m = Model::from_bytes(tiny_model_bytes(&spec).expect("tiny model")).expect("load");
    let c = m.config();
    let layout = KvLayout { n_layer: c.n_layer, kv_dim: c.kv_dim(), head_dim: c.head_dim, block_size: 16 };
    let mut kv = KvCache::new(layout, 8).expect("cache");
    let mut table = BlockTable::default();
    let prompt: Vec<u32> = (0..32).map(|i| 3 + i % 250).collect();
    m.forward(&mut kv, &mut [BatchItem { table: &mut table, tokens: &prompt, all_logits: false }])
        .expect("prefill");
    let steps = 20_000;
    for round in 0..3 {
        let t = Instant::now();
        for s in 0..steps {
            let tok = [3 + (s % 250) as u32];
            m.forward(&mut kv, &mut [BatchItem { table: &mut table, tokens: &tok, all_logits: false }])
                .expect("step");
            kv.set_len(&mut table, 32).expect("roll back");
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / steps as f64;
        println!(
            "round {round}: {us:.1} us a step, {:.1} us a layer (head and embedding included)",
            us / 2.0
        );
    }
}
