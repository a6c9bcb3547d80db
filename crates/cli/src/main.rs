//! `tokenpath`: the one binary. Thin by design — argument parsing, logging set-up and printing;
//! every decision lives in the library crates so it can be tested without a process.

mod bench;
mod bench_engine;
mod compare;
mod generate;
mod serve;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use tokenpath_bench::report::{load_records, Report, ReportOptions};
use tokenpath_timeline::SloSpec;

/// tokenpath: an LLM serving stack timed at every stage of the request path.
#[derive(Debug, Parser)]
#[command(name = "tokenpath", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Load-test any OpenAI-compatible server with explicit metric definitions: TTFT, TPOT, chunk
    /// gap, ITL, E2E, throughput, goodput under SLOs, per-stage tails when the server sends timing.
    Bench(bench::BenchArgs),
    /// Measure the embedded engine's prefill and decode throughput (next to llama.cpp's with
    /// --peer-json; `scripts/bench-engine` runs both).
    BenchEngine(bench_engine::BenchEngineArgs),
    /// Diff two saved runs metric by metric and stage by stage, with bootstrap 95% confidence
    /// intervals; `--fail-if ttft.p99>+10%` exits non-zero on a regression.
    Compare(compare::CompareArgs),
    /// Generate text from one prompt on the embedded CPU engine (default model: SmolLM2-135M).
    Generate(generate::GenerateArgs),
    /// Summarise a saved run (bench JSON or JSON Lines of request records) with explicit metric
    /// definitions: TTFT, TPOT, chunk gap, ITL, E2E, throughput, goodput, per-stage tails.
    Report(ReportArgs),
    /// Serve the OpenAI-compatible API (gateway + one colocated worker on the embedded engine).
    Serve(serve::ServeArgs),
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// Records file: a bench JSON (with a `requests` array) or JSON Lines, one record per line.
    file: PathBuf,
    #[command(flatten)]
    window: WindowArgs,
    /// SLOs for goodput, e.g. `ttft:2s,tpot:100ms,e2e:30s`.
    #[arg(long, env = "TOKENPATH_SLO")]
    slo: Option<SloSpec>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The steady-state window: what is excluded at both ends of a run.
#[derive(Debug, Args)]
pub struct WindowArgs {
    /// Seconds of warm-up after the first scheduled request, excluded from every metric.
    #[arg(long, default_value_t = 0.0, env = "TOKENPATH_WARMUP_S")]
    pub warmup_s: f64,
    /// Seconds of drain before the last request ended, excluded from every metric.
    #[arg(long, default_value_t = 0.0, env = "TOKENPATH_COOLDOWN_S")]
    pub cooldown_s: f64,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Bench(args) => bench::run_bench(args),
        Command::BenchEngine(args) => bench_engine::run(args),
        Command::Compare(args) => {
            if !compare::run(args)? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Generate(args) => generate::run(args),
        Command::Report(args) => report(args),
        Command::Serve(args) => serve::run(args),
    }
}

fn report(args: ReportArgs) -> anyhow::Result<()> {
    let records = load_records(&args.file)?;
    let opts =
        ReportOptions { warmup_s: args.window.warmup_s, cooldown_s: args.window.cooldown_s, slo: args.slo };
    let report = Report::build(&records, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render_table());
    }
    Ok(())
}
