//! `tokenpath bench-engine`: our engine's prefill and decode throughput next to llama.cpp's
//! (measured by `scripts/peer/bench_llama.py` in the same run and passed in with `--peer-json`),
//! each with the ratio and the fraction of this machine's limit measured in the same run.

use crate::generate::ModelArgs;
use anyhow::Context as _;
use clap::Args;
use std::path::PathBuf;
use tokenpath_engine::bench::{run_engine_bench_only, Repeats};
use tokenpath_engine::quant::{Kernel, KERNEL_ENV};

#[derive(Debug, Args)]
pub struct BenchEngineArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// llama.cpp's figures as JSON (`{"prefill_512": tok_s, ...}`), from scripts/peer/bench_llama.py.
    #[arg(long)]
    peer_json: Option<PathBuf>,
    /// Write the figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Decode steps per decode figure.
    #[arg(long, default_value_t = Repeats::default().steps)]
    steps: usize,
    /// Prefills per prefill figure (their median tok/s; `scripts/peer/bench_llama.py` takes the
    /// median of as many on llama.cpp's side).
    #[arg(long, default_value_t = Repeats::default().prefills as u32, value_parser = clap::value_parser!(u32).range(1..=100))]
    prefills: u32,
    /// Run only the figures named here (comma-separated, e.g. `decode_b16_ctx512`): for a
    /// profile of one of them.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

pub fn run(args: BenchEngineArgs) -> anyhow::Result<()> {
    let peer: serde_json::Value = match &args.peer_json {
        Some(p) => serde_json::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )?,
        None => serde_json::Value::Null,
    };
    let engine = args.model.open_engine()?;
    let peer_fig = |name: &str| peer.get(name).and_then(|v| v.as_f64());
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let repeats = Repeats { steps: args.steps, prefills: args.prefills as usize };
    let b = run_engine_bench_only(&engine, repeats, &peer_fig, &wanted)?;
    let kernel = Kernel::best();
    let has: Vec<&str> = Kernel::ALL.into_iter().filter(|k| k.is_available()).map(Kernel::name).collect();
    println!("kernels: {kernel} (this CPU runs {}; {KERNEL_ENV} caps the choice)", has.join(", "));
    println!(
        "machine (measured now): f32 GEMM {:.1} GFLOP/s, read bandwidth {:.1} GB/s (the highest measured)",
        b.gemm_gflops, b.read_gb_s
    );
    println!(
        "{:<14}{:>12}{:>12}{:>9}{:>16}{:>16}{:>12}",
        "figure (tok/s)", "ours", "llama.cpp", "ratio", "of mach. limit", "limit", "core trip"
    );
    let mut json = serde_json::Map::new();
    for (name, f) in &b.figures {
        let fmt = |v: Option<f64>, p: usize| v.map_or("-".to_owned(), |x| format!("{x:.p$}"));
        println!(
            "{:<14}{:>12.1}{:>12}{:>9}{:>15.0}%{:>16}{:>12}",
            name,
            f.ours,
            fmt(f.llama_cpp, 1),
            fmt(f.ratio(), 2),
            f.of_limit * 100.0,
            format!("{:.1} {}", f.limit, f.limit_unit),
            f.round_trip_ns.map_or("-".to_owned(), |ns| format!("{ns:.0} ns"))
        );
        json.insert(
            (*name).to_owned(),
            serde_json::json!({"ours": f.ours, "llama_cpp": f.llama_cpp, "ratio": f.ratio(), "of_machine_limit": f.of_limit, "limit": f.limit, "limit_unit": f.limit_unit, "core_round_trip_ns": f.round_trip_ns}),
        );
    }
    println!(
        "peak RSS {} MB, model file {:.1} MB",
        b.peak_rss_mb.map_or("?".into(), |v| format!("{v:.0}")),
        b.model_file_mb
    );
    json.insert("kernel".into(), serde_json::json!(kernel.name()));
    json.insert("peak_rss_mb".into(), serde_json::json!(b.peak_rss_mb));
    json.insert("model_file_mb".into(), serde_json::json!(b.model_file_mb));
    json.insert(
        "machine".into(),
        serde_json::json!({"gemm_gflops": b.gemm_gflops, "read_gb_s": b.read_gb_s}),
    );
    if let Some(peer_name) = peer.get("peer") {
        json.insert("peer".into(), peer_name.clone());
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&serde_json::Value::Object(json))?)?;
    }
    Ok(())
}
