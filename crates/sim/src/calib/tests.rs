//! The calibration fit on machines whose truth is known.

use super::*;
use rand_chacha::rand_core::SeedableRng;

#[test]
fn a_fit_far_above_its_noise_floor_is_distrusted() {
    let fit = |median_ape, floor| FitQuality {
        median_ape,
        noise: Noise { steps: 100, median_ape: floor, p90_ape: 0.0 },
        ..FitQuality::default()
    };
    // This machine's healthy calibrations, and the one whose training log drifted.
    for (m, f) in [(5.4, 4.5), (7.4, 4.9), (6.6, 4.8), (2.9, 2.7)] {
        assert_eq!(fit(m, f).distrust(), None, "{m} on {f}");
    }
    assert!(fit(16.8, 7.3).distrust().is_some_and(|w| w.contains("2.3×")));
    assert_eq!(fit(16.8, 0.0).distrust(), None, "no floor measured: nothing to compare with");
}

fn link() -> LinkModel {
    LinkModel { latency_us: 200.0, bytes_per_s: 1e9 }
}

/// Steps of a known machine: 4 ms + 60 µs per prompt token + 0.2 µs per decode pair, ±5%.
fn synthetic(n: usize) -> Vec<StepRecord> {
    synthetic_with(n, 0.0, 0.0)
}

/// [`synthetic`] plus `sq` µs per (prompt tokens)² / 1000 and `past4` µs per row beyond 4.
fn synthetic_with(n: usize, sq: f64, past4: f64) -> Vec<StepRecord> {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut t = 0;
    (0..n)
        .map(|i| {
            let prefill = if i % 5 == 0 { 64 * (1 + i % 8) } else { 0 };
            let decode = 1 + i % 12;
            let decode_pairs = (decode * (200 + 37 * (i % 11))) as u64;
            let attn = decode_pairs + (prefill * prefill / 2) as u64;
            let truth = 4000.0
                + 60.0 * prefill as f64
                + 0.2 * decode_pairs as f64
                + sq * (prefill * prefill) as f64 / 1000.0
                + past4 * (decode + usize::from(prefill > 0)).saturating_sub(4) as f64;
            let noise = 0.95 + 0.1 * ((rng.next_u64() % 1000) as f64 / 1000.0);
            let dur = (truth * noise) as u64;
            t += dur + 300;
            StepRecord {
                start_us: t,
                dur_us: dur,
                gap_us: Some(300 + 20 * (decode as u64 + u64::from(prefill > 0))),
                rows: decode + usize::from(prefill > 0),
                prefill_tokens: prefill,
                decode_tokens: decode,
                attn_pairs: attn,
                decode_pairs,
                running: decode + 1,
                waiting: 0,
                free_blocks: 100,
            }
        })
        .collect()
}

#[test]
fn a_known_machine_is_recovered_within_its_noise() {
    let c = Calibration::fit(&[synthetic(600)], Provenance::default(), 23_040, link()).unwrap();
    c.check().unwrap();
    assert!(c.fit.median_ape < 5.0, "{:?}", c.fit);
    let decode_only = StepShape { rows: 4, decode_tokens: 4, decode_pairs: 2000, ..StepShape::default() };
    let p = c.step_point_us(&decode_only);
    assert!((p - 4400.0).abs() / 4400.0 < 0.06, "{p}");
    let prefill = StepShape { rows: 1, prefill_tokens: 512, prefill_pairs: 131_328, ..StepShape::default() };
    let want = 4000.0 + 60.0 * 512.0;
    assert!((c.step_point_us(&prefill) - want).abs() / want < 0.06);
    // Residuals reproduce the ±5% spread, sampled deterministically.
    let mut a = ChaCha8Rng::seed_from_u64(1);
    let mut b = ChaCha8Rng::seed_from_u64(1);
    let draws: Vec<f64> = (0..200).map(|_| c.step_us(&decode_only, &mut a)).collect();
    assert_eq!(draws, (0..200).map(|_| c.step_us(&decode_only, &mut b)).collect::<Vec<_>>());
    let (lo, hi) = draws.iter().fold((f64::MAX, 0.0f64), |(l, h), v| (l.min(*v), h.max(*v)));
    assert!(lo < p && hi > p && hi / lo < 1.3, "{lo} {hi}");
    assert!(c.gap_us(4, &mut a) > 300.0);
}

#[test]
fn a_machine_whose_longer_chunks_cost_more_per_token_is_recovered() {
    let c = Calibration::fit(&[synthetic_with(600, 30.0, 0.0)], Provenance::default(), 1, link()).unwrap();
    for n in [128usize, 256, 512] {
        let shape = StepShape {
            rows: 1,
            prefill_tokens: n,
            prefill_pairs: (n * n / 2) as u64,
            ..StepShape::default()
        };
        let want = 4000.0 + 60.0 * n as f64 + 30.0 * (n * n) as f64 / 1000.0;
        let got = c.step_point_us(&shape);
        assert!((got - want).abs() / want < 0.06, "{n} tokens: {got} against {want}");
    }
}

#[test]
fn a_roofline_knee_is_found_and_priced() {
    // Up to four rows a step reads the weights once; each further row adds 900 µs.
    let c = Calibration::fit(&[synthetic_with(600, 0.0, 900.0)], Provenance::default(), 1, link()).unwrap();
    assert_eq!(c.knee_rows, 4, "{:?}", c.step.coef_us);
    for rows in [1usize, 4, 8, 12] {
        let shape =
            StepShape { rows, decode_tokens: rows, decode_pairs: 300 * rows as u64, ..StepShape::default() };
        let want = 4000.0 + 0.2 * (300 * rows) as f64 + 900.0 * rows.saturating_sub(4) as f64;
        let got = c.step_point_us(&shape);
        assert!((got - want).abs() / want < 0.06, "{rows} rows: {got} against {want}");
    }
    // A machine without a knee is not given one that matters.
    let flat = Calibration::fit(&[synthetic(600)], Provenance::default(), 1, link()).unwrap();
    let shape = StepShape { rows: 12, decode_tokens: 12, decode_pairs: 3600, ..StepShape::default() };
    let want = 4000.0 + 0.2 * 3600.0;
    assert!((flat.step_point_us(&shape) - want).abs() / want < 0.06);
}

/// A machine whose steps are mostly on time and one in eight 3× late (a noisy neighbour):
/// the fit finds the on-time step, the residuals carry the late ones, and a held-out log's
/// score sits at its own noise floor.
#[test]
fn a_noisy_tail_does_not_move_the_point_and_held_out_steps_score_at_their_floor() {
    let late = |log: Vec<StepRecord>| -> Vec<StepRecord> {
        log.into_iter()
            .enumerate()
            .map(|(i, mut r)| {
                if i % 8 == 3 {
                    r.dur_us *= 3;
                }
                r
            })
            .collect()
    };
    let c = Calibration::fit(&[late(synthetic(800))], Provenance::default(), 1, link()).unwrap();
    let decode_only = StepShape { rows: 4, decode_tokens: 4, decode_pairs: 2000, ..StepShape::default() };
    let p = c.step_point_us(&decode_only);
    assert!((p - 4400.0).abs() / 4400.0 < 0.05, "the point follows the on-time steps: {p}");
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mean = (0..4000).map(|_| c.step_us(&decode_only, &mut rng)).sum::<f64>() / 4000.0;
    assert!((mean / 4400.0 - 1.25).abs() < 0.06, "the residuals keep the late steps: {mean}");
    let held_out: Vec<StepRecord> = synthetic(1600).into_iter().skip(800).collect();
    let s = c.score(&held_out);
    assert_eq!(s.steps, 800);
    assert!(s.median_ape < 4.0 && s.median_signed.abs() < 2.0, "{s:?}");
    assert!(s.noise.steps > 100 && s.noise.median_ape > 1.0 && s.noise.median_ape < 4.0, "{s:?}");
    // A model that is 20% slow is told apart from the noise.
    let s = c.clone().scaled(1.2).unwrap().score(&held_out);
    assert!(s.median_ape > 15.0 && s.median_signed > 15.0, "{s:?}");
}

#[test]
fn too_few_steps_or_a_bad_file_is_refused() {
    assert!(Calibration::fit(&[synthetic(5)], Provenance::default(), 1, link()).is_err());
    let mut c = Calibration::fit(&[synthetic(100)], Provenance::default(), 1, link()).unwrap();
    let d = c.digest();
    c.step.coef_us[0] = -1.0;
    assert!(c.check().is_err());
    assert_ne!(c.digest(), d);
    c.step.coef_us[0] = 1.0;
    c.version = 99;
    assert!(c.check().is_err());
}

#[test]
fn a_scaled_calibration_prices_every_step_and_gap_by_its_factor_and_refuses_a_bad_one() {
    let c = Calibration::fit(&[synthetic(600)], Provenance::default(), 23_040, link()).unwrap();
    let shapes = [
        StepShape { rows: 4, decode_tokens: 4, decode_pairs: 2000, ..StepShape::default() },
        StepShape { rows: 1, prefill_tokens: 512, prefill_pairs: 131_328, ..StepShape::default() },
    ];
    let slow = c.clone().scaled(1.15).unwrap();
    slow.check().unwrap();
    assert_ne!(slow.digest(), c.digest(), "a scaled calibration is another simulator");
    for s in &shapes {
        let (a, b) = (c.step_point_us(s), slow.step_point_us(s));
        assert!((b / a - 1.15).abs() < 1e-9, "{a} {b}");
        // The same draw (same seed) scales by the same factor: the residuals are ratios.
        let (mut r1, mut r2) = (ChaCha8Rng::seed_from_u64(3), ChaCha8Rng::seed_from_u64(3));
        let (d1, d2) = (c.step_us(s, &mut r1), slow.step_us(s, &mut r2));
        assert!((d2 / d1 - 1.15).abs() < 1e-9, "{d1} {d2}");
        let (g1, g2) = (c.gap_us(2, &mut r1), slow.gap_us(2, &mut r2));
        assert!((g2 / g1 - 1.15).abs() < 1e-9, "{g1} {g2}");
    }
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(c.clone().scaled(bad).is_err(), "{bad}");
    }
}
