//! `tokenpath`: the one binary. Thin by design — argument parsing, logging set-up and printing;
//! every decision lives in the library crates so it can be tested without a process.

mod bench;
mod bench_engine;
mod bench_kv;
mod compare;
mod config;
mod demo;
mod generate;
mod kv_pool;
mod mock_engine;
mod output;
mod plan;
mod secret;
mod serve;
mod sim;
mod topology;
mod upstream;
mod worker;

use anyhow::Context as _;
use clap::{Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use std::path::PathBuf;
use tokenpath_bench::html::{self, HtmlOptions, RunView};
use tokenpath_bench::report::{load_records, Report, ReportOptions};
use tokenpath_engine::tokenizer::sandbox;
use tokenpath_timeline::SloSpec;

/// mimalloc instead of glibc's malloc: the gateway allocates and frees small buffers for every
/// chunk it relays (measured: glibc's malloc/free were ~12% of the gateway's CPU per request).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// tokenpath: an LLM serving stack timed at every stage of the request path.
#[derive(Debug, Parser)]
#[command(name = "tokenpath", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Longest one chat-template render may take. A model's template is untrusted code, so it
    /// renders in a sandbox process (no environment, 2 GiB of address space) that is killed
    /// and replaced when it crashes, runs out of memory or passes this.
    #[arg(long, global = true, default_value_t = 5.0, env = "TOKENPATH_TEMPLATE_TIMEOUT_S")]
    template_timeout_s: f64,
    /// BLAKE3 digest (hex) of a chat template you have read and found bounded: it renders
    /// in-process instead of in the sandbox (the log prints each template's digest at start;
    /// the default model's template is reviewed already). Repeat or separate with commas.
    #[arg(long, global = true, env = "TOKENPATH_TRUST_TEMPLATE", value_delimiter = ',')]
    trust_template: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Load-test any OpenAI-compatible server with explicit metric definitions: TTFT, TPOT, chunk
    /// gap, ITL, E2E, throughput, goodput under SLOs, per-stage tails when the server sends timing.
    Bench(bench::BenchArgs),
    /// Measure the embedded engine's prefill and decode throughput (next to llama.cpp's with
    /// --peer-json; `scripts/bench-engine` runs both).
    BenchEngine(bench_engine::BenchEngineArgs),
    /// Measure KV transfer between workers over loopback next to a plain TCP copy of the same
    /// bytes (GB/s, ratio, and the 4,096-token target).
    BenchKv(bench_kv::BenchKvArgs),
    /// The main job: the same long-tail workload against one colocated worker and against a
    /// prefill/decode-disaggregated pair on the same two cores, side by side, with an HTML report.
    Demo(demo::DemoArgs),
    /// Diff two saved runs metric by metric and stage by stage, with bootstrap 95% confidence
    /// intervals; `--fail-if ttft.p99>+10%` exits non-zero on a regression.
    Compare(compare::CompareArgs),
    /// Generate text from one prompt on the embedded CPU engine (default model: SmolLM2-135M).
    Generate(generate::GenerateArgs),
    /// Summarise saved runs (bench JSON or JSON Lines of request records) with explicit metric
    /// definitions: TTFT, TPOT, chunk gap, ITL, E2E, throughput, goodput, per-stage tails;
    /// `--html` draws several runs side by side on one self-contained page.
    Report(ReportArgs),
    /// Serve the OpenAI-compatible API: gateway + one colocated worker on the embedded engine, or
    /// prefill/decode worker processes (--prefill N --decode M, --cluster FILE).
    Serve(Box<serve::ServeArgs>),
    /// A model-less OpenAI server that answers at once (or plays one half of a vLLM/SGLang PD
    /// pair), for measuring gateways and routers in front of it.
    MockEngine(mock_engine::MockEngineArgs),
    /// Host the KV pool of a directory in a process of its own, so its RAM tier outlives every
    /// server and worker that shares it (otherwise the first of them to open it hosts it).
    KvPool(kv_pool::KvPoolHostArgs),
    /// Simulate serving on a virtual clock — the real scheduler and router, a calibrated step
    /// time — for topologies, loads and contexts this machine cannot run; writes the bench's
    /// JSON, so `report` and `compare` read it like a measured run.
    Sim(Box<sim::SimArgs>),
    /// Colocated or PD, and how many of each, for a GPU fleet: every split simulated over a
    /// roofline model of the GPU and the model, goodput under the SLOs, and how much the answer
    /// depends on the assumed efficiencies.
    Plan(Box<plan::PlanArgs>),
    /// Fit a machine's step-time calibration for `sim` from real workers' step logs
    /// (`serve --step-log`).
    Calibrate(sim::CalibrateArgs),
    /// Run one engine instance as a worker process (role prefill, decode or both) for a gateway
    /// started with --prefill/--decode, --cluster or --accept-workers.
    Worker(worker::WorkerArgs),
    /// Print a shell completion script: `tokenpath completions bash > /etc/bash_completion.d/tokenpath`
    /// (or zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Internal: the chat-template sandbox child (`tokenpath_engine::tokenizer::sandbox`).
    #[command(name = "__render-template", hide = true)]
    RenderTemplate,
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// Records files: bench JSON (with a `requests` array) or JSON Lines, one record per line.
    /// Several runs go side by side in the HTML report.
    #[arg(required = true, num_args = 1..)]
    files: Vec<PathBuf>,
    /// Name of each run, in the order of the files (default: the file's stem).
    #[arg(long)]
    label: Vec<String>,
    /// Write a self-contained HTML report of every run, overlaid on one page, here.
    #[arg(long)]
    html: Option<PathBuf>,
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
    let base = Cli::command();
    let expanded = config::expand(&base, std::env::args_os().collect())?;
    let command = with_config_flags(base).long_version(long_version());
    if expanded.print {
        print!("{}", config::render(command, &expanded.args, &expanded.from_file)?);
        return Ok(());
    }
    let cli = Cli::from_arg_matches(&command.get_matches_from(&expanded.args)).unwrap_or_else(|e| e.exit());
    if matches!(cli.command, Command::RenderTemplate) {
        return Ok(sandbox::serve_stdio()?);
    }
    install_template_sandbox(cli.template_timeout_s, &cli.trust_template)?;
    match cli.command {
        Command::RenderTemplate => unreachable!("handled above"),
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
        Command::BenchKv(args) => bench_kv::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Serve(args) => serve::run(*args),
        Command::Worker(args) => worker::run(args),
        Command::KvPool(args) => kv_pool::run(args),
        Command::MockEngine(args) => mock_engine::run(args),
        Command::Sim(args) => sim::run(*args),
        Command::Calibrate(args) => sim::calibrate(args),
        Command::Plan(args) => plan::run(*args),
        Command::Completions { shell } => {
            let mut cmd = with_config_flags(Cli::command());
            clap_complete::generate(shell, &mut cmd, "tokenpath", &mut std::io::stdout());
            Ok(())
        }
    }
}

/// `tokenpath --version`: the version, then what this build runs on this CPU.
fn long_version() -> String {
    use tokenpath_engine::quant::{Kernel, KERNEL_ENV};
    let runs: Vec<&str> = Kernel::ALL.into_iter().filter(|k| k.is_available()).map(Kernel::name).collect();
    format!(
        "{}\nkernels: {} (this CPU runs {}; {KERNEL_ENV} caps the choice)\nbuild: {} {}, {} profile",
        env!("CARGO_PKG_VERSION"),
        Kernel::best().name(),
        runs.join(", "),
        std::env::consts::ARCH,
        std::env::consts::OS,
        if cfg!(debug_assertions) { "debug" } else { "release" },
    )
}

/// `--config` and `--print-config` on every subcommand, for `--help` (both are taken out of the
/// arguments before clap parses them: see `config.rs`).
fn with_config_flags(cmd: clap::Command) -> clap::Command {
    cmd.mut_subcommands(|s| {
        s.arg(
            clap::Arg::new("config")
                .long("config")
                .value_name("FILE")
                .help_heading("Configuration")
                .help("A TOML file of settings: each key a long flag of this command (`kv-pool-ram = \"1GiB\"`); flags and environment variables override it [env: TOKENPATH_CONFIG]"),
        )
        .arg(
            clap::Arg::new("print_config")
                .long("print-config")
                .action(clap::ArgAction::SetTrue)
                .help_heading("Configuration")
                .help("Print the effective configuration as TOML (where each setting came from; secrets redacted) and exit"),
        )
    })
}

/// Every chat template this process builds renders in children of this same binary.
fn install_template_sandbox(timeout_s: f64, trusted: &[String]) -> anyhow::Result<()> {
    anyhow::ensure!(
        timeout_s.is_finite() && timeout_s > 0.0 && timeout_s <= 3600.0,
        "--template-timeout-s must be in (0, 3600]"
    );
    if let Some(bad) = trusted.iter().find(|d| d.len() != 64 || !d.bytes().all(|b| b.is_ascii_hexdigit())) {
        anyhow::bail!("--trust-template {bad:?} is not a BLAKE3 digest (64 hex digits)");
    }
    let program = std::env::current_exe().context("locating this binary for the template sandbox")?;
    sandbox::install(sandbox::SandboxProgram {
        program,
        args: vec!["__render-template".into()],
        deadline: std::time::Duration::from_secs_f64(timeout_s),
        trusted: trusted.to_vec(),
    });
    Ok(())
}

fn report(args: ReportArgs) -> anyhow::Result<()> {
    let opts =
        ReportOptions { warmup_s: args.window.warmup_s, cooldown_s: args.window.cooldown_s, slo: args.slo };
    let paths: Vec<&std::path::Path> = args.files.iter().map(PathBuf::as_path).collect();
    let labels = html::run_labels(&paths, &args.label);
    let mut runs = Vec::with_capacity(paths.len());
    for (path, label) in paths.iter().zip(labels) {
        let records = load_records(path)?;
        let report = Report::build(&records, &opts).with_context(|| format!("{}", path.display()))?;
        runs.push(RunView::from_report(label, report, &records));
    }
    match (args.json, runs.as_slice()) {
        (true, [one]) => println!("{}", serde_json::to_string_pretty(&one.report)?),
        (true, _) => {
            let by_label: serde_json::Map<String, serde_json::Value> = runs
                .iter()
                .map(|r| Ok((r.label.clone(), serde_json::to_value(&r.report)?)))
                .collect::<anyhow::Result<_>>()?;
            println!("{}", serde_json::to_string_pretty(&by_label)?);
        }
        (false, [one]) => print!("{}", one.report.render_table()),
        (false, _) => {
            for r in &runs {
                println!("== {} ==", r.label);
                print!("{}", r.report.render_table());
            }
        }
    }
    if let Some(path) = &args.html {
        let names: Vec<&str> = runs.iter().map(|r| r.label.as_str()).collect();
        let opts =
            HtmlOptions { title: format!("tokenpath report: {}", names.join(" vs ")), ..Default::default() };
        html::write_html(path, &html::render(&runs, &opts))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
