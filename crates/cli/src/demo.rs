//! `tokenpath demo`: the article's story measured on this machine in one command. The same seeded
//! long-tail workload runs through `tokenpath bench` (the same code path, flags parsed the same
//! way) against one colocated worker on both cores, then against one prefill worker pinned to
//! core 0 and one decode worker pinned to core 1; then one table side by side, one HTML page with
//! both runs, and the `tokenpath compare` line.
//!
//! Every server is a child `tokenpath serve` process owned by a guard that stops it on every way
//! out (success, error, Ctrl-C, SIGTERM), so the demo never leaves a process behind.

use anyhow::Context as _;
use clap::{Args, Parser};
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenpath_bench::html::{self, HtmlOptions, RunView};
use tokenpath_bench::report::{load_records, Report, ReportOptions};
use tokenpath_timeline::SloSpec;

/// The long-tail mix of the demo: 90% prompts of 32–160 tokens, 10% of 700–1,200, outputs of
/// 16–48 tokens.
pub const DEMO_WORKLOAD: &str = "agent-longtail:32-160:700-1200:0.1:16-48";

/// Flags of `tokenpath demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// A short version (≈ 1 minute), for CI.
    #[arg(long)]
    quick: bool,
    /// Offered rate, requests/s (the same for both topologies).
    #[arg(long, default_value_t = 0.6)]
    rate: f64,
    /// Seconds of load per topology (default 90; 20 with --quick).
    #[arg(long)]
    duration: Option<f64>,
    /// The workload (any `tokenpath bench --workload`).
    #[arg(long, default_value = DEMO_WORKLOAD)]
    workload: String,
    /// SLOs for goodput and attainment.
    #[arg(long, default_value = "ttft:2s,tpot:100ms")]
    slo: String,
    /// Seed of the workload and arrivals.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Where the run files, the HTML report and the server logs go.
    #[arg(long, default_value = "out/demo")]
    out_dir: PathBuf,
    /// Do not pin the PD workers to cores 0 and 1.
    #[arg(long)]
    no_pin: bool,
    /// Also run the colocated worker without chunked prefill (one step per whole prompt): the
    /// baseline the head-of-line blocking argument is about.
    #[arg(long)]
    unchunked: bool,
    #[command(flatten)]
    model: crate::generate::ModelArgs,
}

/// One topology of the comparison.
struct Topology {
    label: &'static str,
    what: &'static str,
    serve_args: Vec<String>,
    /// Engine instances (each busy at most 100% of the time).
    engines: f64,
}

/// A child `tokenpath serve`, stopped on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

fn terminate(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// PIDs of running servers, for the signal handler.
type Pids = Arc<Mutex<Vec<u32>>>;

fn start_server(model: &[String], extra: &[String], log: &Path, pids: &Pids) -> anyhow::Result<Server> {
    let exe = std::env::current_exe().context("finding the tokenpath executable")?;
    let mut child = Command::new(exe)
        .args(["serve", "--port", "0", "--kv-tokens", "16384"])
        .args(extra)
        .args(model)
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting tokenpath serve")?;
    if let Ok(mut p) = pids.lock() {
        p.push(child.id());
    }
    let stderr = child.stderr.take().context("server stderr")?;
    let mut file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(file, "{line}");
            if let Some(port) = line.split("http://127.0.0.1:").nth(1).and_then(|r| r.split('/').next()) {
                if let (Some(t), Ok(p)) = (tx.take(), port.parse::<u16>()) {
                    let _ = t.send(p);
                }
            }
        }
    });
    let mut server = Server { child, port: 0 };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Ok(p) = rx.recv_timeout(Duration::from_millis(200)) {
            server.port = p;
            return Ok(server);
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            anyhow::bail!("tokenpath serve exited ({status}) before listening; see {}", log.display());
        }
        if Instant::now() > deadline {
            anyhow::bail!("tokenpath serve did not start within 5 minutes; see {}", log.display());
        }
    }
}

/// Stops every server on Ctrl-C or SIGTERM, then exits.
fn on_signal(pids: Pids) {
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(tokenpath_gateway::shutdown_signal());
        eprintln!("demo: interrupted; stopping the servers");
        for pid in pids.lock().map(|p| p.clone()).unwrap_or_default() {
            let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
        std::thread::sleep(Duration::from_secs(2));
        std::process::exit(130);
    });
}

/// The sum of every sample of counter `name` on the server's `/metrics` (plain HTTP/1.1: the
/// demo needs one number, not a client).
fn scrape(port: u16, name: &str) -> Option<f64> {
    use std::io::Read as _;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let values: Vec<f64> = body
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

#[derive(Debug, Parser)]
struct BenchCli {
    #[command(flatten)]
    args: crate::bench::BenchArgs,
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let model = args.model.path();
    if !model.is_file() {
        anyhow::bail!(
            "the model file {} is missing: run `scripts/setup --model` (or pass --model PATH)",
            model.display()
        );
    }
    let slo: SloSpec = args.slo.parse().map_err(|e| anyhow::anyhow!("--slo: {e}"))?;
    let duration = args.duration.unwrap_or(if args.quick { 20.0 } else { 90.0 });
    std::fs::create_dir_all(&args.out_dir).with_context(|| format!("creating {}", args.out_dir.display()))?;
    let pids: Pids = Arc::default();
    on_signal(Arc::clone(&pids));
    let pin = |c: &str| if args.no_pin { Vec::new() } else { vec![c.to_owned()] };
    let mut pd_args: Vec<String> = ["--prefill", "1", "--decode", "1"].map(String::from).to_vec();
    for (flag, core) in [("--prefill-cpus", "0"), ("--decode-cpus", "1")] {
        for c in pin(core) {
            pd_args.extend([flag.to_owned(), c]);
        }
    }
    let mut topologies = vec![
        Topology {
            label: "colocated",
            what: "one worker on both cores (chunked prefill, 512 tokens)",
            serve_args: Vec::new(),
            engines: 1.0,
        },
        Topology {
            label: "pd-1p1d",
            what: "prefill worker on core 0, decode worker on core 1",
            serve_args: pd_args,
            engines: 2.0,
        },
    ];
    if args.unchunked {
        topologies.insert(
            1,
            Topology {
                label: "colocated-unchunked",
                what: "one worker on both cores, each prompt prefilled in one step",
                serve_args: vec!["--prefill-chunk=8192".into()],
                engines: 1.0,
            },
        );
    }
    let n = topologies.len();
    let mut files = Vec::new();
    let mut busy = Vec::new();
    for (i, t) in topologies.iter().enumerate() {
        eprintln!("\ndemo {}/{n}: {} — {}", i + 1, t.label, t.what);
        let log = args.out_dir.join(format!("{}-serve.log", t.label));
        let mut server = start_server(&args.model.to_args(), &t.serve_args, &log, &pids)?;
        let out = args.out_dir.join(format!("{}.json", t.label));
        let argv: Vec<String> = vec![
            "bench".into(),
            format!("--url=http://127.0.0.1:{}", server.port),
            format!("--workload={}", args.workload),
            format!("--rate={}", args.rate),
            format!("--duration={duration}"),
            format!("--seed={}", args.seed),
            "--ignore-eos".into(),
            format!("--slo={}", args.slo),
            format!("--out={}", out.display()),
            format!("--label={}", t.label),
        ];
        let bench = BenchCli::try_parse_from(&argv).context("building the bench arguments")?;
        let busy0 = scrape(server.port, "tokenpath_worker_busy_seconds_total");
        let t0 = Instant::now();
        crate::bench::run_bench(bench.args).with_context(|| format!("benchmarking {}", t.label))?;
        let busy1 = scrape(server.port, "tokenpath_worker_busy_seconds_total");
        if let (Some(a), Some(b)) = (busy0, busy1) {
            busy.push((t.label, (b - a) / (t0.elapsed().as_secs_f64() * t.engines)));
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            anyhow::bail!("the {} server crashed during the run ({status}); see {}", t.label, log.display());
        }
        terminate(&mut server.child);
        files.push(out);
    }
    let opts = ReportOptions { slo: Some(slo), ..ReportOptions::default() };
    let mut views = Vec::new();
    for (t, f) in topologies.iter().zip(&files) {
        let records = load_records(f).with_context(|| format!("reading {}", f.display()))?;
        let report = Report::build(&records, &opts)?;
        views.push(RunView::from_report(t.label, report, &records));
    }
    let table: Vec<(&str, &Report)> = views.iter().map(|v| (v.label.as_str(), &v.report)).collect();
    println!("\n=== colocated vs prefill/decode-disaggregated, same workload, same two cores ===");
    println!(
        "workload {} at {} req/s for {duration} s, seed {}, SLO {}\n",
        args.workload, args.rate, args.seed, args.slo
    );
    print!("{}", tokenpath_bench::side_by_side::render(&table));
    println!("\nengine busy (share of wall time inside forward steps, per engine, over the run):");
    for (label, b) in &busy {
        println!("  {label}: {:.0}%", b * 100.0);
    }
    if let (Some(first), Some(last)) = (views.first(), views.last().filter(|_| views.len() > 1)) {
        println!();
        print!(
            "{}",
            tokenpath_bench::verdict::render(
                (first.label.as_str(), &first.report),
                (last.label.as_str(), &last.report),
                &args.workload,
                args.rate,
                &args.slo,
            )
        );
    }
    let page = args.out_dir.join("report.html");
    let html_opts = HtmlOptions { title: "tokenpath demo: colocated vs PD".into(), ..HtmlOptions::default() };
    html::write_html(&page, &html::render(&views, &html_opts))?;
    println!("\nHTML report (both runs): {}", page.display());
    let pd = files.last().map_or_else(String::new, |f| f.display().to_string());
    println!("stage-by-stage diff:     tokenpath compare {} {pd}", files[0].display());
    Ok(())
}
