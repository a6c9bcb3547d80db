//! `tokenpath bench`: load against any OpenAI-compatible server, summarised with the metric
//! definitions of the `timeline` crate. Thin: parsing and printing here, the run and the report in
//! `tokenpath-bench`.

use crate::WindowArgs;
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;
use tokenpath_bench::arrival::{Arrival, Ramp};
use tokenpath_bench::client::Target;
use tokenpath_bench::report::{Report, ReportOptions};
use tokenpath_bench::run::{run, RunConfig};
use tokenpath_bench::search::{find_max_rate, SearchConfig};
use tokenpath_bench::workload::Workload;
use tokenpath_cli::tokenizer::FileTokenizer;
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
    #[arg(long, env = "TOKENPATH_API_KEY", hide_env_values = true)]
    api_key: Option<crate::secret::Secret>,
    /// Ask for non-streamed responses (no client TTFT/TPOT then).
    #[arg(long)]
    no_stream: bool,
    /// Send `ignore_eos` so outputs run to max_tokens (not accepted by OpenAI itself).
    #[arg(long)]
    ignore_eos: bool,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// The API: `chat` (/v1/chat/completions, the server's chat template) or `completions`
    /// (/v1/completions, the prompt text as is).
    #[arg(long, default_value = "chat")]
    endpoint: tokenpath_bench::client::Endpoint,
}

/// What load to offer.
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// `agent-longtail` (default), `agent-longtail:S_LO-S_HI:L_LO-L_HI:SHARE:O_LO-O_HI`,
    /// `fixed:IN:OUT`, `random:uniform:I_LO-I_HI:O_LO-O_HI`,
    /// `random:lognormal:I_MEDIAN,I_SIGMA:O_MEDIAN,O_SIGMA`,
    /// `shared-prefix[:GROUPS:PREFIX:S_LO-S_HI:O_LO-O_HI]`, `multi-turn[:TURNS:I_LO-I_HI:O_LO-O_HI]`
    /// (--rate then starts sessions) or `trace:FILE.jsonl` (its timestamps are the schedule).
    #[arg(long, default_value = "agent-longtail")]
    pub(crate) workload: Workload,
    /// The model's tokenizer: a GGUF file (only its metadata is read), or a Hugging Face
    /// `tokenizer.json` or its directory (chat template, `bos_token`, `add_bos_token` from the
    /// `tokenizer_config.json` beside it). Gives exact prompt lengths, and client token counts
    /// checked against the server's `usage` (prompt counts only with a chat template), and
    /// splits a streamed event's tokens by its text when the server does not say how many.
    #[arg(long, value_name = "FILE|DIR")]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Offered rate, requests/s.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) rate: f64,
    /// Arrival process.
    #[arg(long, value_enum, default_value_t = ArrivalKind::Poisson)]
    pub(crate) arrival: ArrivalKind,
    /// Gaps' coefficient of variation for `--arrival gamma` (1 = Poisson, >1 = bursty).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) burstiness: f64,
    /// Closed loop: this many clients, each sending its next request when the previous ends
    /// (replaces --rate/--arrival).
    #[arg(long)]
    pub(crate) concurrency: Option<usize>,
    /// Requests to send at most (default 50; 100000 when --duration, --ramp or a trace bounds
    /// the run).
    #[arg(long)]
    pub(crate) num_requests: Option<usize>,
    /// Schedule no send at or after this many seconds.
    #[arg(long)]
    pub(crate) duration: Option<f64>,
    /// Linear rate ramp `FROM:TO:SECONDS` (requests/s), warping the --arrival process; the ramp's
    /// end ends the run.
    #[arg(long)]
    pub(crate) ramp: Option<Ramp>,
    /// Seed of the workload and arrivals.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
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
    #[command(flatten)]
    search: SearchArgs,
    #[command(flatten)]
    output: crate::output::OutputArgs,
    #[command(flatten)]
    otlp: OtlpArgs,
}

/// Engines' spans joined to the records (vLLM: `--otlp-traces-endpoint`).
#[derive(Debug, Args)]
#[command(next_help_heading = "Engine spans (OpenTelemetry)")]
struct OtlpArgs {
    /// Run an OTLP trace receiver here (OTLP/HTTP at /v1/traces and OTLP/gRPC on the same
    /// port), send a fresh W3C `traceparent` with every request, and join each span the engine
    /// exports to its request by trace id: per-stage distributions and tail attribution for an
    /// engine that reports no `timing`, each stage marked with who measured it.
    #[arg(long, env = "TOKENPATH_OTLP_LISTEN", conflicts_with = "find_max_rate")]
    otlp_listen: Option<std::net::SocketAddr>,
    /// How long to wait after the last request for spans still on their way (vLLM exports in
    /// batches, about every 5 s); requests without a span by then are counted and said so.
    #[arg(long, default_value_t = 10.0, requires = "otlp_listen")]
    otlp_wait_s: f64,
    /// Once every request has a span, how long without a new one before the wait ends: a
    /// trace's spans come from several processes, each in its own batch (the OpenTelemetry
    /// SDK's batch processor, vLLM's, flushes every 5 s), so a shorter quiet period can cut
    /// off the last batch. Bounded by --otlp-wait-s.
    #[arg(long, default_value_t = 6.0, requires = "otlp_listen")]
    otlp_settle_s: f64,
    /// Require `authorization: Bearer <token>` on every export (set the engine's
    /// `OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>`).
    #[arg(long, env = "TOKENPATH_OTLP_TOKEN", hide_env_values = true, requires = "otlp_listen")]
    otlp_token: Option<String>,
}

impl LoadArgs {
    /// The arrival process the flags ask for.
    pub(crate) fn arrival(&self) -> Arrival {
        match self.arrival {
            ArrivalKind::Poisson => Arrival::Poisson { rate: self.rate },
            ArrivalKind::Constant => Arrival::Constant { rate: self.rate },
            ArrivalKind::Gamma => Arrival::Gamma { rate: self.rate, cv: self.burstiness },
        }
    }

    /// Requests to send at most: the flag, else 50, or 100000 when a duration, ramp or trace
    /// bounds the run.
    pub(crate) fn num_requests(&self) -> usize {
        self.num_requests.unwrap_or(
            if self.duration.is_some() || self.ramp.is_some() || self.workload.schedule().is_some() {
                100_000
            } else {
                50
            },
        )
    }

    /// The `--tokenizer` file, opened.
    pub(crate) fn open_tokenizer(&self, who: &str) -> anyhow::Result<Option<std::sync::Arc<FileTokenizer>>> {
        let Some(p) = &self.tokenizer else { return Ok(None) };
        let tok = FileTokenizer::open(p)?;
        eprintln!("{who}: --tokenizer {}: {}", p.display(), tok.describe());
        if !tok.has_chat_template() {
            eprintln!(
                "{who}: without a chat template the prompt token counts are not checked \
                 against `usage` (exact prompt lengths and output counts still are)"
            );
        }
        Ok(Some(std::sync::Arc::new(tok)))
    }
}

impl LoadArgs {
    /// The simulated clients of `n` requests: the workload's prompts as token ids (through
    /// `--tokenizer` when given), sent on the arrival process, the trace's schedule or by
    /// `--concurrency` closed-loop clients.
    pub(crate) fn sim_input(&self, n: usize, who: &str) -> anyhow::Result<tokenpath_sim::Input> {
        let tok = self
            .open_tokenizer(who)?
            .map(|t| t as std::sync::Arc<dyn tokenpath_bench::tokens::PromptTokenizer>);
        let offsets = match (self.concurrency, self.workload.schedule()) {
            (Some(_), _) => None,
            (None, Some(s)) => Some(s),
            (None, None) => {
                let starts = self.workload.turns().map_or(n, |t| n.div_ceil(t));
                let duration = self.duration.map(Duration::from_secs_f64);
                Some(self.arrival().plan(self.ramp.as_ref(), starts, duration, self.seed)?)
            }
        };
        Ok(tokenpath_sim::requests::from_workload(
            &self.workload,
            n,
            self.seed,
            tok,
            offsets.as_deref(),
            self.concurrency,
        )?)
    }
}

/// Writes a run's report, its configuration and every record as the bench's JSON.
pub(crate) fn write_run_json(
    path: &std::path::Path,
    report: &Report,
    config: serde_json::Value,
    records: &[tokenpath_timeline::ClientRecord],
) -> anyhow::Result<()> {
    /// The document, streamed to the file as it is serialized (a million-request simulation
    /// would otherwise build its whole JSON tree in memory first).
    #[derive(serde::Serialize)]
    struct Doc<'a> {
        #[serde(flatten)]
        report: &'a Report,
        config: serde_json::Value,
        requests: &'a [tokenpath_timeline::ClientRecord],
    }
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    serde_json::to_writer_pretty(&mut out, &Doc { report, config, requests: records })?;
    std::io::Write::flush(&mut out)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

pub fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    let arrival = args.load.arrival();
    let t = &args.target;
    let mut cfg = RunConfig {
        target: Target {
            url: t.url.clone(),
            model: t.model.clone(),
            api_key: t.api_key.as_ref().map(|k| k.expose().to_owned()),
            stream: !t.no_stream,
            ignore_eos: t.ignore_eos,
            timeout: Duration::from_secs_f64(t.timeout_s.max(0.001)),
            endpoint: t.endpoint,
        },
        workload: args.load.workload.clone(),
        arrival,
        concurrency: args.load.concurrency,
        num_requests: args.load.num_requests(),
        seed: args.load.seed,
        duration: args.load.duration.map(|d| Duration::from_secs_f64(d.max(0.0))),
        ramp: args.load.ramp,
        tokenizer: args
            .load
            .open_tokenizer("bench")?
            .map(|t| t as std::sync::Arc<dyn tokenpath_bench::tokens::PromptTokenizer>),
        send_counter: None,
        traces: None,
    };
    if args.search.find_max_rate {
        return search_max_rate(&args, &cfg);
    }
    eprintln!(
        "bench: {} ≤ {} requests at {} req/s ({:?}{}{}) against {} ({})",
        cfg.workload,
        cfg.num_requests,
        args.load.rate,
        args.load.arrival,
        args.load
            .ramp
            .map_or(String::new(), |r| format!(", ramp {}→{} req/s over {} s", r.from, r.to, r.duration_s)),
        args.load.duration.map_or(String::new(), |d| format!(", for {d} s")),
        t.url,
        t.model
    );
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let receiver = match args.otlp.otlp_listen {
        Some(listen) => {
            let rc = tokenpath_otlp::ReceiverConfig::new(listen).with_token(args.otlp.otlp_token.clone());
            let r = rt.block_on(tokenpath_otlp::Receiver::start(rc))?;
            eprintln!(
                "bench: receiving engine spans on {} (OTLP/HTTP {} and OTLP/gRPC)",
                r.addr,
                tokenpath_otlp::HTTP_TRACES_PATH
            );
            cfg.traces = Some(r.store.clone());
            Some(r)
        }
        None => None,
    };
    let live = crate::output::Live::start(&mut cfg, &args.output);
    let records = rt.block_on(run(&cfg, &mut live.callback()));
    live.finish();
    let mut records = records?;
    if let Some(r) = &receiver {
        let wait = Duration::from_secs_f64(args.otlp.otlp_wait_s.clamp(0.0, 600.0));
        eprintln!("bench: waiting up to {:.0} s for the engine's spans", wait.as_secs_f64());
        let settle = Duration::from_secs_f64(args.otlp.otlp_settle_s.clamp(0.0, 600.0));
        let collected = rt.block_on(r.store.collect(wait, settle))?;
        let j = tokenpath_bench::spans::join(&mut records, collected);
        eprintln!(
            "bench: spans joined to {} of {} requests ({} with stages); {} spans of other traces ignored",
            j.joined, j.sent, j.timed, j.unexpected
        );
    }
    let opts =
        ReportOptions { warmup_s: args.window.warmup_s, cooldown_s: args.window.cooldown_s, slo: args.slo };
    let report = Report::build(&records, &opts)?;
    print!("{}", report.render_table());
    if let Some(path) = &args.out {
        let config = serde_json::json!({
                    "url": t.url, "model": t.model, "workload": cfg.workload.to_string(),
                    "rate": args.load.rate, "arrival": format!("{:?}", args.load.arrival),
                    "num_requests": cfg.num_requests, "seed": cfg.seed, "stream": cfg.target.stream,
                    "duration_s": args.load.duration, "ramp": args.load.ramp.map(|r| format!("{}:{}:{}", r.from, r.to, r.duration_s)),
                    "tokenizer": args.load.tokenizer.as_ref().map(|p| p.display().to_string()),
        });
        write_run_json(path, &report, config, &records)?;
    }
    crate::output::write_bench_html(&args.output, args.out.as_deref(), &report, &records)?;
    Ok(())
}

/// The capacity search's flags (`bench` runs its probes, `sim` simulates them).
#[derive(Debug, Args)]
pub struct SearchArgs {
    /// Search the highest --rate whose --slo attainment reaches --attainment, each probe a run
    /// of --num-requests / --duration starting at --rate (×2 up, then bisection).
    #[arg(long, requires = "slo")]
    pub(crate) find_max_rate: bool,
    /// Fraction of requests that must meet every SLO, for --find-max-rate.
    #[arg(long, default_value_t = 0.9)]
    attainment: f64,
    /// Most probes of --find-max-rate.
    #[arg(long, default_value_t = 8)]
    max_probes: usize,
    /// Stop bisecting when the lowest failing rate is within this fraction above the highest
    /// passing one.
    #[arg(long, default_value_t = 0.1)]
    search_tolerance: f64,
}

impl SearchArgs {
    /// The search these flags describe, from `start_rate`.
    pub(crate) fn config(&self, start_rate: f64, slo: SloSpec, window: &WindowArgs) -> SearchConfig {
        SearchConfig {
            start_rate,
            attainment: self.attainment,
            slo,
            max_probes: self.max_probes,
            tolerance: self.search_tolerance,
            report: ReportOptions { warmup_s: window.warmup_s, cooldown_s: window.cooldown_s, slo: None },
        }
    }
}

/// The search's header and the probe table's header.
pub(crate) fn print_search_start(search: &SearchConfig, requests: usize, duration: Option<f64>) {
    eprintln!(
        "find-max-rate: {} at ≥ {:.1}% attainment, from {} req/s, ≤ {} probes of {} requests{}, bracket within {:.0}%",
        search.slo,
        search.attainment * 100.0,
        search.start_rate,
        search.max_probes,
        requests,
        duration.map_or(String::new(), |d| format!(" / {d:.1} s")),
        search.tolerance * 100.0
    );
    println!(
        "{:>12}{:>13}{:>15}{:>12}{:>8}",
        "rate (r/s)", "attainment", "goodput (r/s)", "sent (r/s)", "pass"
    );
}

/// One probe's row.
pub(crate) fn print_probe(p: &tokenpath_bench::search::Probe) {
    println!(
        "{:>12.3}{:>12.1}%{:>15.3}{:>12.3}{:>8}",
        p.rate,
        p.attainment * 100.0,
        p.goodput_rps,
        p.achieved_send_rps,
        if p.passed { "yes" } else { "no" }
    );
}

/// The answer, and the search as JSON to `out`.
pub(crate) fn finish_search(
    result: &tokenpath_bench::search::SearchResult,
    out: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    match (result.max_rate, result.first_failing_rate) {
        (Some(r), Some(f)) => println!("max rate meeting {}: {r:.3} req/s (fails at {f:.3})", result.slo),
        (Some(r), None) => println!("max rate meeting {}: ≥ {r:.3} req/s (no probe failed)", result.slo),
        (None, _) => {
            println!("no probed rate met {} at {:.1}%", result.slo, result.target_attainment * 100.0)
        }
    }
    if let Some(path) = out {
        let doc = serde_json::json!({ "find_max_rate": result });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `--find-max-rate`: probes printed as they finish, the answer last; `--out` gets the search.
fn search_max_rate(args: &BenchArgs, cfg: &RunConfig) -> anyhow::Result<()> {
    let slo = args.slo.clone().ok_or_else(|| anyhow::anyhow!("--find-max-rate needs --slo"))?;
    let search = args.search.config(args.load.rate, slo, &args.window);
    print_search_start(&search, cfg.num_requests, cfg.duration.map(|d| d.as_secs_f64()));
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut on_probe = |p: &tokenpath_bench::search::Probe| print_probe(p);
    let result = rt.block_on(find_max_rate(cfg, &search, &mut |_, _, _| {}, &mut on_probe))?;
    finish_search(&result, args.out.as_deref())
}
