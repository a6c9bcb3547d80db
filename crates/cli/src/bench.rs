//! `tokenpath bench`: load against any OpenAI-compatible server, summarised with the metric
//! definitions of the `timeline` crate. Thin: parsing and printing here, the run and the report in
//! `tokenpath-bench`.

use crate::WindowArgs;
use clap::{Args, ValueEnum};
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;
use tokenpath_bench::arrival::Arrival;
use tokenpath_bench::client::Target;
use tokenpath_bench::report::{Report, ReportOptions};
use tokenpath_bench::run::{run, RunConfig};
use tokenpath_bench::workload::Workload;
use tokenpath_timeline::SloSpec;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ArrivalKind {
    /// Exponential gaps (open loop).
    Poisson,
    /// Evenly spaced.
    Constant,
    /// Gamma-distributed gaps with coefficient of variation --burstiness.
    Gamma,
}

/// The server under test.
#[derive(Debug, Args)]
pub struct TargetArgs {
    /// Base URL of the OpenAI-compatible server.
    #[arg(long, env = "TOKENPATH_URL", default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Model name to send (default: the first model the server lists at /v1/models).
    #[arg(long, env = "TOKENPATH_BENCH_MODEL", default_value = "")]
    model: String,
    /// API key (sent as a bearer token).
    #[arg(long, env = "TOKENPATH_API_KEY")]
    api_key: Option<String>,
    /// Ask for non-streamed responses (no client TTFT/TPOT then).
    #[arg(long)]
    no_stream: bool,
    /// Send `ignore_eos` so outputs run to max_tokens (not accepted by OpenAI itself).
    #[arg(long)]
    ignore_eos: bool,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
}

/// What load to offer.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// `agent-longtail` (default), `agent-longtail:S_LO-S_HI:L_LO-L_HI:SHARE:O_LO-O_HI`, or
    /// `fixed:IN:OUT` (token counts).
    #[arg(long, default_value = "agent-longtail")]
    workload: Workload,
    /// Offered rate, requests/s.
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Arrival process.
    #[arg(long, value_enum, default_value_t = ArrivalKind::Poisson)]
    arrival: ArrivalKind,
    /// Gaps' coefficient of variation for `--arrival gamma` (1 = Poisson, >1 = bursty).
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Closed loop: this many clients, each sending its next request when the previous ends
    /// (replaces --rate/--arrival).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Requests to send.
    #[arg(long, default_value_t = 50)]
    num_requests: usize,
    /// Seed of the workload and arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    window: WindowArgs,
    /// SLOs for goodput, e.g. `ttft:2s,tpot:100ms`.
    #[arg(long)]
    slo: Option<SloSpec>,
    /// Write the summary and every request record as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    let arrival = match args.load.arrival {
        ArrivalKind::Poisson => Arrival::Poisson { rate: args.load.rate },
        ArrivalKind::Constant => Arrival::Constant { rate: args.load.rate },
        ArrivalKind::Gamma => Arrival::Gamma { rate: args.load.rate, cv: args.load.burstiness },
    };
    let t = &args.target;
    let cfg = RunConfig {
        target: Target {
            url: t.url.clone(),
            model: t.model.clone(),
            api_key: t.api_key.clone(),
            stream: !t.no_stream,
            ignore_eos: t.ignore_eos,
            timeout: Duration::from_secs_f64(t.timeout_s.max(0.001)),
        },
        workload: args.load.workload.clone(),
        arrival,
        concurrency: args.load.concurrency,
        num_requests: args.load.num_requests,
        seed: args.load.seed,
    };
    eprintln!(
        "bench: {} requests at {} req/s ({:?}) against {} ({})",
        cfg.num_requests, args.load.rate, args.load.arrival, t.url, t.model
    );
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut failed = 0usize;
    let mut progress = |done: usize, total: usize, rec: &tokenpath_timeline::ClientRecord| {
        failed += usize::from(!rec.is_ok());
        eprint!("\r  {done}/{total} done, {failed} failed ");
        let _ = std::io::stderr().flush();
    };
    let records = rt.block_on(run(&cfg, &mut progress))?;
    eprintln!();
    let opts =
        ReportOptions { warmup_s: args.window.warmup_s, cooldown_s: args.window.cooldown_s, slo: args.slo };
    let report = Report::build(&records, &opts)?;
    print!("{}", report.render_table());
    if let Some(path) = &args.out {
        let mut doc = serde_json::to_value(&report)?;
        if let Some(obj) = doc.as_object_mut() {
            obj.insert(
                "config".into(),
                serde_json::json!({
                    "url": t.url, "model": t.model, "workload": format!("{:?}", cfg.workload),
                    "rate": args.load.rate, "arrival": format!("{:?}", args.load.arrival),
                    "num_requests": cfg.num_requests, "seed": cfg.seed, "stream": cfg.target.stream,
                }),
            );
            obj.insert("requests".into(), serde_json::to_value(&records)?);
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
