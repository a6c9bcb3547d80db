//! The opt-in per-step log (`--step-log PATH`): one [`StepRecord`] per forward step, one JSON
//! line each, written by the batcher thread itself. A line is ~200 bytes against a step of
//! milliseconds, so the write costs nothing measurable; a write error turns the log off with one
//! warning instead of failing requests (the log is for calibration, serving comes first).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenpath_protocol::work::StepRecord;

/// The placeholder replaced by the worker's name in a `--step-log` path.
pub const WORKER_PLACEHOLDER: &str = "{worker}";

/// `path` with [`WORKER_PLACEHOLDER`] replaced by `worker`.
pub fn step_log_path(path: &Path, worker: &str) -> PathBuf {
    PathBuf::from(path.to_string_lossy().replace(WORKER_PLACEHOLDER, worker))
}

/// An open step log.
pub(crate) struct StepLog {
    out: Option<BufWriter<File>>,
    path: PathBuf,
    last_end: Option<Instant>,
}

impl StepLog {
    /// Creates (truncates) the log at `path`.
    pub(crate) fn create(path: &Path) -> std::io::Result<Self> {
        let file = File::create(path)?;
        Ok(Self { out: Some(BufWriter::new(file)), path: path.to_owned(), last_end: None })
    }

    /// Writes one step that ran from `t0` to `t1` of a worker started at `started`; `rec`'s
    /// times are filled in here.
    pub(crate) fn record(&mut self, started: Instant, t0: Instant, t1: Instant, mut rec: StepRecord) {
        let us = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        rec.start_us = us(t0.saturating_duration_since(started));
        rec.dur_us = us(t1.saturating_duration_since(t0));
        rec.gap_us = self.last_end.map(|e| us(t0.saturating_duration_since(e)));
        self.last_end = Some(t1);
        let Some(out) = self.out.as_mut() else { return };
        let written = serde_json::to_writer(&mut *out, &rec)
            .map_err(std::io::Error::from)
            .and_then(|()| out.write_all(b"\n"))
            .and_then(|()| out.flush());
        if let Err(e) = written {
            tracing::warn!(path = %self.path.display(), "step log write failed, log turned off: {e}");
            self.out = None;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Duration;

    #[test]
    fn steps_are_written_one_line_each_with_the_gap_between_them() {
        let dir = std::env::temp_dir().join(format!("tokenpath-steplog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = step_log_path(&dir.join("steps-{worker}.jsonl"), "d0");
        assert!(path.ends_with("steps-d0.jsonl"));
        let t = Instant::now();
        let mut log = StepLog::create(&path).unwrap();
        let ms = Duration::from_millis;
        log.record(t, t + ms(1), t + ms(4), StepRecord { rows: 2, ..StepRecord::default() });
        log.record(t, t + ms(6), t + ms(7), StepRecord { rows: 1, ..StepRecord::default() });
        let text = std::fs::read_to_string(&path).unwrap();
        let recs: Vec<StepRecord> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(recs.len(), 2);
        assert_eq!((recs[0].start_us, recs[0].dur_us, recs[0].gap_us), (1000, 3000, None));
        assert_eq!((recs[1].start_us, recs[1].dur_us, recs[1].gap_us), (6000, 1000, Some(2000)));
        assert_eq!(recs[1].rows, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
