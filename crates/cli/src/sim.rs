//! `tokenpath sim` and `tokenpath calibrate`: the simulator's flags and files. Thin: the
//! simulation and the fit live in `tokenpath-sim`; the report is the bench's.

use crate::bench::{write_run_json, LoadArgs};
use crate::WindowArgs;
use anyhow::Context as _;
use clap::Args;
use std::io::Write as _;
use std::path::PathBuf;
use tokenpath_bench::report::{Report, ReportOptions};
use tokenpath_protocol::work::StepRecord;
use tokenpath_sim::{Calibration, LinkModel, Provenance, SimConfig, Topology, WorkerShape};
use tokenpath_timeline::SloSpec;

/// Who serves, and each worker's limits (`tokenpath serve`'s flags of the same names).
#[derive(Debug, Args)]
#[command(next_help_heading = "Simulated server")]
pub struct SimServerArgs {
    /// Colocated workers (ignored with --prefill/--decode).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Prefill workers (with --decode: prefill/decode disaggregated).
    #[arg(long, default_value_t = 0)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 0)]
    decode: usize,
    /// KV cache per worker, tokens (default: 4 × --n-ctx, as `serve`).
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// Most prompt tokens per step.
    #[arg(long, default_value_t = tokenpath_worker::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Most sequences per step.
    #[arg(long, default_value_t = tokenpath_worker::DEFAULT_MAX_BATCH)]
    max_batch: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = tokenpath_worker::DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// No prefix cache.
    #[arg(long)]
    no_prefix_cache: bool,
    /// The model's context length (SmolLM2-135M: 8192).
    #[arg(long, default_value_t = 8192)]
    n_ctx: usize,
}

/// A Mooncake-format trace instead of --workload (`sim` and `plan`).
#[derive(Debug, Args)]
pub struct MooncakeArgs {
    /// Replay a Mooncake-format trace (timestamp ms, input_length, output_length, hash_ids of
    /// 512-token blocks) instead of --workload; at most --num-requests of its lines.
    #[arg(long, value_name = "FILE")]
    mooncake: Option<PathBuf>,
    /// Divide the trace's timestamps by this: 2 replays it at twice its rate (a capacity scan).
    #[arg(long, default_value_t = 1.0, requires = "mooncake")]
    time_scale: f64,
}

impl MooncakeArgs {
    /// The requests: the trace's (whole unless --num-requests cuts it), else the workload's.
    pub(crate) fn input(&self, load: &LoadArgs, who: &str) -> anyhow::Result<tokenpath_sim::Input> {
        let Some(path) = &self.mooncake else { return load.sim_input(load.num_requests(), who) };
        anyhow::ensure!(
            self.time_scale.is_finite() && self.time_scale > 0.0,
            "--time-scale must be positive"
        );
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut input =
            tokenpath_sim::requests::mooncake(&text, load.num_requests.unwrap_or(1_000_000), 49_152)?;
        if self.time_scale != 1.0 {
            for s in &mut input.send {
                if let tokenpath_sim::requests::Send::At(t) = s {
                    *t = (*t as f64 / self.time_scale) as tokenpath_timeline::Nanos;
                }
            }
        }
        Ok(input)
    }

    /// What the run replays, for its configuration and header.
    pub(crate) fn name(&self, load: &LoadArgs) -> String {
        match &self.mooncake {
            Some(p) if self.time_scale != 1.0 => format!("mooncake:{} ×{}", p.display(), self.time_scale),
            Some(p) => format!("mooncake:{}", p.display()),
            None => load.workload.to_string(),
        }
    }
}

/// `tokenpath sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// The machine's calibration (`tokenpath calibrate`).
    #[arg(long, value_name = "FILE")]
    calibration: PathBuf,
    /// The prefill workers' own calibration (a PD worker usually has fewer cores than a
    /// colocated one: calibrate on a server pinned to as many).
    #[arg(long, value_name = "FILE")]
    prefill_calibration: Option<PathBuf>,
    /// The decode workers' own calibration.
    #[arg(long, value_name = "FILE")]
    decode_calibration: Option<PathBuf>,
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    trace: MooncakeArgs,
    #[command(flatten)]
    server: SimServerArgs,
    #[command(flatten)]
    window: WindowArgs,
    /// SLOs for goodput, e.g. `ttft:2s,tpot:100ms`.
    #[arg(long)]
    slo: Option<SloSpec>,
    #[command(flatten)]
    search: crate::bench::SearchArgs,
    /// Write the summary and every request record as the bench's JSON here (with
    /// --find-max-rate: the search).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write every simulated step as a step log (the `--step-log` format) here.
    #[arg(long)]
    step_log_out: Option<PathBuf>,
    /// Seed of the step-time draws (the workload's is --seed).
    #[arg(long, default_value_t = 0)]
    sim_seed: u64,
    /// Every calibration's step and gap prices times this: the machine measured slower (> 1) or
    /// faster than when it was calibrated, by the same fixed probe at both times.
    #[arg(long, default_value_t = 1.0)]
    step_scale: f64,
    #[command(flatten)]
    output: crate::output::OutputArgs,
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let load = |p: &std::path::Path| -> anyhow::Result<Calibration> {
        Ok(Calibration::load(p)?.scaled(args.step_scale)?)
    };
    let calib = load(&args.calibration)?;
    let prefill = args.prefill_calibration.as_deref().map(load).transpose()?;
    let decode = args.decode_calibration.as_deref().map(load).transpose()?;
    let calibs =
        tokenpath_sim::Calibrations { default: &calib, prefill: prefill.as_ref(), decode: decode.as_ref() };
    let s = &args.server;
    let topology = if s.prefill > 0 || s.decode > 0 {
        Topology { colocated: 0, prefill: s.prefill, decode: s.decode }
    } else {
        Topology { colocated: s.workers, prefill: 0, decode: 0 }
    };
    let kv_tokens = s.kv_tokens.unwrap_or(s.n_ctx.saturating_mul(4));
    anyhow::ensure!(
        s.block_size > 0 && kv_tokens >= s.n_ctx,
        "--kv-tokens must hold one full context (--n-ctx)"
    );
    let cfg = SimConfig {
        topology,
        worker: WorkerShape {
            kv_blocks: kv_tokens.div_ceil(s.block_size),
            block_size: s.block_size,
            prefill_chunk: s.prefill_chunk,
            max_batch: s.max_batch,
            prefix_cache: !s.no_prefix_cache,
            n_ctx: s.n_ctx,
        },
        seed: args.sim_seed,
        keep_steps: args.step_log_out.is_some(),
    };
    if args.search.find_max_rate {
        return search_max_rate(&args, &cfg, &calibs);
    }
    let started = std::time::Instant::now();
    let input = args.trace.input(&args.load, "sim")?;
    let built = started.elapsed();
    let out = tokenpath_sim::simulate_with(&cfg, &calibs, &input)?;
    let wall = started.elapsed();
    eprintln!(
        "sim: {} requests, {} steps, {:.1} s simulated in {:.2} s ({:.2} s building prompts; {:.0} requests/s); calibration {} ({}, {})",
        out.records.len(),
        out.stats.steps,
        out.stats.sim_seconds,
        wall.as_secs_f64(),
        built.as_secs_f64(),
        out.records.len() as f64 / (wall - built).as_secs_f64().max(1e-9),
        calib.digest(),
        calib.provenance.machine,
        calib.provenance.model,
    );
    let opts = ReportOptions {
        warmup_s: args.window.warmup_s,
        cooldown_s: args.window.cooldown_s,
        slo: args.slo.clone(),
    };
    let report = Report::build(&out.records, &opts)?;
    print!("{}", report.render_table());
    if let Some(path) = &args.out {
        let config = serde_json::json!({
            "simulated": true,
            "calibration": args.calibration.display().to_string(),
            "calibration_digest": calib.digest(),
            "step_scale": args.step_scale,
            "machine": calib.provenance.machine,
            "model": calib.provenance.model,
            "sim": cfg,
            "workload": args.trace.name(&args.load),
            "rate": args.load.rate, "arrival": format!("{:?}", args.load.arrival),
            "concurrency": args.load.concurrency,
            "num_requests": input.requests.len(), "seed": args.load.seed,
            "stats": out.stats,
        });
        write_run_json(path, &report, config, &out.records)?;
    }
    if let Some(path) = &args.step_log_out {
        let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
        for (_, rec) in &out.steps {
            serde_json::to_writer(&mut w, rec)?;
            w.write_all(b"\n")?;
        }
        w.flush()?;
        eprintln!("wrote {}", path.display());
    }
    crate::output::write_bench_html(&args.output, args.out.as_deref(), &report, &out.records)?;
    Ok(())
}

/// `tokenpath calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// Step logs of real workers on this machine (`serve --step-log`), one or more.
    #[arg(long = "step-log", required = true, num_args = 1..)]
    step_logs: Vec<PathBuf>,
    /// The model file the logs were measured with (its KV size per token is read from it).
    #[arg(long, env = "TOKENPATH_MODEL")]
    model: Option<PathBuf>,
    /// A bench run (`--out` JSON) against the same server: its median gateway stage becomes
    /// the time from arrival to admission.
    #[arg(long, value_name = "RUN.json")]
    run: Option<PathBuf>,
    /// KV transfer latency, µs (`tokenpath bench-kv` measures it).
    #[arg(long, default_value_t = 300.0)]
    kv_latency_us: f64,
    /// KV transfer bandwidth into one decode worker, GB/s (`tokenpath bench-kv`).
    #[arg(long, default_value_t = 2.0)]
    kv_gbps: f64,
    /// Write the calibration here.
    #[arg(long, required_unless_present = "score")]
    out: Option<PathBuf>,
    /// Fit nothing: score this calibration's step model on the step logs (held-out steps),
    /// next to the logs' own noise floor.
    #[arg(long, value_name = "CALIB.json", conflicts_with = "out")]
    score: Option<PathBuf>,
    /// With --score: the calibration's prices times this first (as `sim --step-scale`).
    #[arg(long, default_value_t = 1.0, requires = "score")]
    step_scale: f64,
}

pub fn calibrate(args: CalibrateArgs) -> anyhow::Result<()> {
    let mut logs = Vec::new();
    for p in &args.step_logs {
        let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let recs: Vec<StepRecord> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("{} line {}", p.display(), i + 1)))
            .collect::<anyhow::Result<_>>()?;
        logs.push(recs);
    }
    if let Some(path) = &args.score {
        let calib = Calibration::load(path)?.scaled(args.step_scale)?;
        let s = calib.score(&logs.concat());
        println!(
            "score: {} held-out steps: step model median error {:.1}% (signed {:+.1}%), p90 {:.1}%; \
             noise floor (steps of one shape against their own median, {} steps) median {:.1}%, p90 {:.1}%",
            s.steps,
            s.median_ape,
            s.median_signed,
            s.p90_ape,
            s.noise.steps,
            s.noise.median_ape,
            s.noise.p90_ape
        );
        return Ok(());
    }
    let Some(out) = &args.out else { anyhow::bail!("--out or --score is needed") };
    let model = args.model.clone().unwrap_or_else(tokenpath_engine::default_model_path);
    let engine =
        tokenpath_engine::Engine::open(&model).with_context(|| format!("opening {}", model.display()))?;
    let bytes_per_token = engine.kv_layout(tokenpath_worker::DEFAULT_BLOCK_SIZE).bytes_per_token() as u64;
    let provenance = Provenance {
        machine: cpu_model(),
        model: model.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        notes: vec![format!("kernels: {}", tokenpath_engine::quant::Kernel::best().name())],
    };
    anyhow::ensure!(args.kv_gbps > 0.0 && args.kv_latency_us >= 0.0, "--kv-gbps must be positive");
    let link = LinkModel { latency_us: args.kv_latency_us, bytes_per_s: args.kv_gbps * 1e9 };
    let mut calib = Calibration::fit(&logs, provenance, bytes_per_token, link)?;
    if let Some(run) = &args.run {
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run)?)?;
        if let Some(g) = doc["stages"]["gateway_ms"]["p50"].as_f64() {
            calib.gateway_us = g * 1e3;
        }
    }
    std::fs::write(out, serde_json::to_string_pretty(&calib)?)?;
    let f = &calib.fit;
    eprintln!(
        "calibrate: {} steps and {} busy gaps from {} log(s): step model median error {:.1}%, p90 {:.1}% (on the fitted steps; their noise floor {:.1}%, p90 {:.1}%); {} → {}",
        f.steps,
        f.gaps,
        logs.len(),
        f.median_ape,
        f.p90_ape,
        f.noise.median_ape,
        f.noise.p90_ape,
        calib.digest(),
        out.display()
    );
    if let Some(why) = f.distrust() {
        eprintln!("calibrate: distrusted: {why}");
    }
    for (name, c) in calib.step.terms.iter().zip(&calib.step.coef_us) {
        eprintln!("  step {name:>15}: {c:.4} µs");
    }
    for (name, c) in calib.gap.terms.iter().zip(&calib.gap.coef_us) {
        eprintln!("  gap  {name:>15}: {c:.4} µs");
    }
    eprintln!("  knee: {} rows", calib.knee_rows);
    Ok(())
}

/// The CPU's model name (`/proc/cpuinfo`), which the calibration is valid for.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .map(|m| format!("{m} × {}", std::thread::available_parallelism().map_or(1, |n| n.get())))
        .unwrap_or_else(|| "unknown".into())
}

/// `sim --find-max-rate`: the bench's capacity search, each probe simulated.
fn search_max_rate(
    args: &SimArgs,
    cfg: &SimConfig,
    calibs: &tokenpath_sim::Calibrations<'_>,
) -> anyhow::Result<()> {
    let load = &args.load;
    anyhow::ensure!(
        args.trace.mooncake.is_none()
            && load.concurrency.is_none()
            && load.ramp.is_none()
            && load.workload.schedule().is_none(),
        "the search sets the offered rate: not with --concurrency, --ramp, --mooncake or a trace workload"
    );
    let slo = args.slo.clone().ok_or_else(|| anyhow::anyhow!("--find-max-rate needs --slo"))?;
    let config = args.search.config(load.rate, slo, &args.window);
    crate::bench::print_search_start(&config, load.num_requests(), load.duration);
    let mut search = tokenpath_bench::search::Search::new(config)?;
    while let Some(rate) = search.next_rate() {
        let mut probe = load.clone();
        probe.seed = search.next_seed(load.seed);
        probe.rate = rate;
        let input = probe.sim_input(probe.num_requests(), "sim")?;
        let out = tokenpath_sim::simulate_with(cfg, calibs, &input)?;
        crate::bench::print_probe(search.record(&out.records)?);
    }
    crate::bench::finish_search(&search.finish(), args.out.as_deref())
}
