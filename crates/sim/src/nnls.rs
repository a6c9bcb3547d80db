//! Weighted non-negative least squares for the step-time model: a handful of columns (step terms)
//! over thousands of rows (steps). Written here because it is ~40 lines: projected coordinate
//! descent on the normal equations, which is exact at convergence for this convex problem and
//! deterministic (no crate on the registry does NNLS without pulling a linear-algebra stack).

/// Minimises `Σ wᵢ (aᵢ·x − bᵢ)²` subject to `x ≥ 0`. `rows[i]` is `aᵢ`; every row has the same
/// length. Returns `None` when there is nothing to fit.
pub fn nnls(rows: &[Vec<f64>], b: &[f64], w: &[f64]) -> Option<Vec<f64>> {
    let n = rows.first()?.len();
    if n == 0 || rows.len() != b.len() || rows.len() != w.len() || rows.iter().any(|r| r.len() != n) {
        return None;
    }
    // Columns scaled to unit weighted norm, so one step size suits every term (their raw scales
    // differ by nine orders of magnitude: a constant next to attention pairs).
    let mut scale = vec![0.0f64; n];
    for (r, &wi) in rows.iter().zip(w) {
        for (s, &a) in scale.iter_mut().zip(r) {
            *s += wi * a * a;
        }
    }
    let scale: Vec<f64> = scale.iter().map(|s| if *s > 0.0 { s.sqrt() } else { 1.0 }).collect();
    // Normal equations G x = h over the scaled columns.
    let mut g = vec![vec![0.0f64; n]; n];
    let mut h = vec![0.0f64; n];
    for ((r, &bi), &wi) in rows.iter().zip(b).zip(w) {
        for j in 0..n {
            let aj = r[j] / scale[j];
            h[j] += wi * aj * bi;
            for k in 0..n {
                g[j][k] += wi * aj * r[k] / scale[k];
            }
        }
    }
    let mut x = vec![0.0f64; n];
    for _ in 0..100_000 {
        let mut moved = 0.0f64;
        for j in 0..n {
            if g[j][j] <= 0.0 {
                continue;
            }
            let grad: f64 = (0..n).map(|k| g[j][k] * x[k]).sum::<f64>() - h[j];
            let next = (x[j] - grad / g[j][j]).max(0.0);
            moved = moved.max((next - x[j]).abs() / (1.0 + x[j].abs()));
            x[j] = next;
        }
        if moved < 1e-13 {
            break;
        }
    }
    Some(x.iter().zip(&scale).map(|(xi, s)| xi / s).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn loss(rows: &[Vec<f64>], b: &[f64], x: &[f64]) -> f64 {
        rows.iter()
            .zip(b)
            .map(|(r, bi)| (r.iter().zip(x).map(|(a, c)| a * c).sum::<f64>() - bi).powi(2))
            .sum()
    }

    #[test]
    fn an_exact_non_negative_model_is_recovered() {
        let truth = [2.0, 0.5, 0.001];
        let rows: Vec<Vec<f64>> =
            (0..50).map(|i| vec![1.0, (i % 7) as f64, (i * i * 13 % 1000) as f64]).collect();
        let b: Vec<f64> = rows.iter().map(|r| r.iter().zip(&truth).map(|(a, c)| a * c).sum()).collect();
        let x = nnls(&rows, &b, &vec![1.0; 50]).unwrap();
        for (got, want) in x.iter().zip(truth) {
            assert!((got - want).abs() < 1e-6 * want.max(1.0), "{x:?}");
        }
    }

    #[test]
    fn a_term_that_would_be_negative_is_zero() {
        // b falls with the second column: unconstrained least squares gives it a negative weight.
        let rows: Vec<Vec<f64>> = (0..20).map(|i| vec![1.0, i as f64]).collect();
        let b: Vec<f64> = (0..20).map(|i| 10.0 - 0.3 * i as f64).collect();
        let x = nnls(&rows, &b, &[1.0; 20]).unwrap();
        assert_eq!(x[1], 0.0);
        assert!((x[0] - b.iter().sum::<f64>() / 20.0).abs() < 1e-9);
    }

    #[test]
    fn nothing_to_fit_is_none() {
        assert!(nnls(&[], &[], &[]).is_none());
        assert!(nnls(&[vec![1.0]], &[1.0, 2.0], &[1.0]).is_none());
    }

    proptest! {
        /// No non-negative point does better than the answer (checked against every vertex of
        /// the active-set search: least squares on each subset of columns, clipped).
        #[test]
        fn no_feasible_point_beats_it(
            data in proptest::collection::vec((0.0f64..10.0, 0.0f64..10.0, -5.0f64..20.0), 3..30),
            probe in proptest::collection::vec((0.0f64..3.0, 0.0f64..3.0), 20),
        ) {
            let rows: Vec<Vec<f64>> = data.iter().map(|(a, c, _)| vec![1.0, *a, *c]).collect();
            let b: Vec<f64> = data.iter().map(|(_, _, y)| *y).collect();
            let x = nnls(&rows, &b, &vec![1.0; rows.len()]).unwrap();
            prop_assert!(x.iter().all(|v| *v >= 0.0));
            let best = loss(&rows, &b, &x);
            for (p, q) in probe {
                for c0 in [0.0, 1.0, 5.0] {
                    let other = [c0, p, q];
                    prop_assert!(best <= loss(&rows, &b, &other) * (1.0 + 1e-9) + 1e-9);
                }
            }
        }
    }
}
