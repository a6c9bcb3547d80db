//! `tokenpath compare A.json B.json`: the stage-by-stage diff of two saved runs, with bootstrap
//! confidence intervals, and `--fail-if` gates that make the exit code fail a CI pipeline.

use clap::Args;
use std::path::PathBuf;
use tokenpath_bench::compare::{compare, violations, Gate};
use tokenpath_bench::report::load_records;

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The baseline run (bench JSON or JSON Lines of records).
    a: PathBuf,
    /// The candidate run.
    b: PathBuf,
    /// Fail (exit 1) when a statistic grows past a threshold, e.g. `ttft.p99>+10%` (repeatable).
    #[arg(long = "fail-if")]
    fail_if: Vec<Gate>,
    /// Seed of the bootstrap.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Returns whether every gate passed.
pub fn run(args: CompareArgs) -> anyhow::Result<bool> {
    let a = load_records(&args.a)?;
    let b = load_records(&args.b)?;
    let changes = compare(&a, &b, args.seed);
    println!("A = {}\nB = {}", args.a.display(), args.b.display());
    println!(
        "{:<16}{:<5}{:>11}{:>11}  change [bootstrap 95% CI]   (* = significant)",
        "metric (ms)", "stat", "A", "B"
    );
    for c in &changes {
        println!("{c}");
    }
    let failed = violations(&changes, &args.fail_if);
    for f in &failed {
        eprintln!("FAIL: {f}");
    }
    Ok(failed.is_empty())
}
