//! What `tokenpath bench` shows and writes besides the table and the JSON: the live progress bar
//! and the self-contained HTML report. Kept apart from `bench.rs` (which owns the load flags) so
//! the two grow independently; the logic itself lives in `tokenpath_bench::{progress, html}`.

use clap::Args;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokenpath_bench::html::{self, HtmlOptions, RunView};
use tokenpath_bench::progress::{stderr_is_terminal, LiveProgress, LiveStats};
use tokenpath_bench::report::Report;
use tokenpath_bench::run::RunConfig;
use tokenpath_timeline::ClientRecord;

/// Output flags of `tokenpath bench`.
#[derive(Debug, Args)]
pub struct OutputArgs {
    /// Write a self-contained HTML report here (CDFs, chunk-gap histogram, per-stage bars, the
    /// slowest requests' timelines, the summary); opens offline.
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Name of the run in the HTML report (default: the stem of --out, else of --html).
    #[arg(long)]
    pub label: Option<String>,
    /// Do not draw the live progress bar (it is never drawn when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
}

/// The live progress of a run: stats fed by the run's callback, a bar redrawn on its own tick.
pub struct Live {
    stats: Arc<LiveStats>,
    bar: LiveProgress,
}

impl Live {
    /// Starts the bar for `cfg` (hidden under `--no-progress` or when stderr is not a terminal)
    /// and gives the run the bar's counter of requests sent.
    pub fn start(cfg: &mut RunConfig, out: &OutputArgs) -> Self {
        let stats = Arc::new(LiveStats::new(cfg.num_requests));
        cfg.send_counter = Some(stats.send_counter());
        let visible = !out.no_progress && stderr_is_terminal();
        let bar = LiveProgress::start(Arc::clone(&stats), visible, Duration::from_millis(200));
        Self { stats, bar }
    }

    /// The run's progress callback: records the ended request, draws nothing itself.
    pub fn callback(&self) -> impl FnMut(usize, usize, &ClientRecord) + Send + 'static {
        let stats = Arc::clone(&self.stats);
        move |_, total, rec: &ClientRecord| {
            stats.set_total(total);
            stats.record(rec);
        }
    }

    /// Draws the final counts and stops the bar's thread.
    pub fn finish(self) {
        self.bar.finish();
    }
}

/// Writes the HTML report of one bench run when `--html` was given.
pub fn write_bench_html(
    out: &OutputArgs,
    json_out: Option<&Path>,
    report: &Report,
    records: &[ClientRecord],
) -> anyhow::Result<()> {
    let Some(path) = &out.html else { return Ok(()) };
    let file = json_out.unwrap_or(path);
    let label = html::run_labels(&[file], out.label.as_slice()).pop().unwrap_or_else(|| "run".into());
    let run = RunView::from_report(label.clone(), report.clone(), records);
    let opts = HtmlOptions { title: format!("tokenpath bench: {label}"), ..HtmlOptions::default() };
    html::write_html(path, &html::render(&[run], &opts))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
