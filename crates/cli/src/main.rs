//! `tokenpath`: the one binary. Thin by design — argument parsing, logging set-up and printing;
//! every decision lives in the library crates so it can be tested without a process.

mod generate;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use tokenpath_bench::report::{load_records, Report, ReportOptions};
use tokenpath_timeline::SloSpec;

/// tokenpath: an LLM serving stack timed at every stage of the request path.
#[derive(Debug, Parser)]
#[command(name = "tokenpath", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text from one prompt on the embedded CPU engine (default model: SmolLM2-135M).
    Generate(generate::GenerateArgs),
    /// Summarise a saved run (bench JSON or JSON Lines of request records) with explicit metric
    /// definitions: TTFT, TPOT, chunk gap, ITL, E2E, throughput, goodput, per-stage tails.
    Report(ReportArgs),
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
struct WindowArgs {
    /// Seconds of warm-up after the first scheduled request, excluded from every metric.
    #[arg(long, default_value_t = 0.0, env = "TOKENPATH_WARMUP_S")]
    warmup_s: f64,
    /// Seconds of drain before the last request ended, excluded from every metric.
    #[arg(long, default_value_t = 0.0, env = "TOKENPATH_COOLDOWN_S")]
    cooldown_s: f64,
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
        Command::Generate(args) => generate::run(args),
        Command::Report(args) => report(args),
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
