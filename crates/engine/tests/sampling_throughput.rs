//! What one random draw over SmolLM2's 49,152 logits costs (ignored by default; numbers only
//! mean something in release):
//!     cargo test --release -p tokenpath-engine --test sampling_throughput -- --ignored --nocapture
//!
//! Beside it, in the same run, the draw as it was written before (every weight through libm's
//! `expf` and added one after another, the best 64 of all 49k candidates selected before the
//! walk): a draw happens once per generated token, between two decode steps.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;
use tokenpath_engine::sampling::{Sampler, SamplingParams};

/// Logits shaped like a language model's: a broad mass around -5 (a sum of uniforms), a few
/// dozen plausible tokens well above it.
fn logits(seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut unit = || (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
    let mut l: Vec<f32> = (0..49_152).map(|_| (unit() + unit() + unit() - 1.5) * 4.0 - 5.0).collect();
    for i in 0..40 {
        let at = (unit() * 49_151.0) as usize;
        l[at] = 8.0 + unit() * 6.0 - i as f32 * 0.1;
    }
    l
}

/// The draw before: the cost to compare against (temperature 1, no top-k or top-p).
fn before(l: &[f32], u: f64) -> u32 {
    let mut c: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
    let sum: f64 = c.iter().map(|x| f64::from((x.1 - max).exp())).sum();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    c.select_nth_unstable_by(63, order);
    c[..64].sort_unstable_by(order);
    let r = u * sum;
    let mut acc = 0.0;
    for x in &c[..64] {
        acc += f64::from((x.1 - max).exp());
        if r < acc {
            return x.0;
        }
    }
    c[63].0
}

#[test]
#[ignore]
fn sampling_throughput() {
    // No penalties: a draw leaves its logits as they were, so the sets are reused as they are.
    let mut sets: Vec<Vec<f32>> = (0..16).map(logits).collect();
    let n = sets.len();
    let draws = 2000;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let t = Instant::now();
    let mut sink = 0u64;
    for i in 0..draws {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        sink += u64::from(before(&sets[i % n], u));
    }
    let was = t.elapsed().as_secs_f64() / draws as f64;
    println!("before (libm exp, serial sum, select over all): {:.1} us/draw", was * 1e6);
    for (name, params) in [
        ("temperature 1", SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() }),
        (
            "temperature 0.7, top-p 0.9",
            SamplingParams { temperature: 0.7, top_p: 0.9, seed: Some(7), ..Default::default() },
        ),
        ("top-k 40", SamplingParams { temperature: 1.0, top_k: 40, seed: Some(7), ..Default::default() }),
    ] {
        let mut s = Sampler::new(params).expect("valid");
        let t = Instant::now();
        for i in 0..draws {
            sink += u64::from(s.sample(&mut sets[i % n]).expect("draw"));
        }
        let now = t.elapsed().as_secs_f64() / draws as f64;
        println!("now, {name}: {:.1} us/draw ({:.1}x the draw before)", now * 1e6, was / now);
    }
    assert!(sink > 0);
}
