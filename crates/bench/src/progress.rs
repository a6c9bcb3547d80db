//! The live progress bar of `tokenpath bench`: running counts (sent, done, failed, in flight) and
//! the current p99 of TTFT and chunk gap, drawn on stderr.
//!
//! It is split in two so it can never perturb the send schedule. [`LiveStats`] is fed by the run's
//! progress callback, which runs in the collector loop (after a request ended, never on a send
//! task): it takes a short lock and records into two HDR histograms of the `timeline` crate, with
//! the `timeline` definitions of TTFT and chunk gap. [`LiveProgress`] redraws from its own thread on
//! a fixed tick, reading a [`Snapshot`]. "Sent" is what the run really sent: the run increments
//! the [`LiveStats::send_counter`] (given to it as [`crate::run::RunConfig::send_counter`]) as each
//! request goes out, one relaxed atomic add on the send path and nothing else. A count derived from
//! the schedule would be wrong for multi-turn sessions, whose later turns are sent when the
//! previous turn ends, not at a precomputed offset. The bar is hidden (and no thread is started)
//! when stderr is not a terminal or the caller asked for none, so pipes and tests stay clean.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;
use tokenpath_timeline::{ms, ClientRecord, LatencyHistogram};

#[derive(Debug, Default)]
struct Counts {
    done: usize,
    failed: usize,
    ttft: LatencyHistogram,
    chunk_gap: LatencyHistogram,
}

/// Running counts and latency histograms of a run in progress; shared between the run's progress
/// callback (writer) and the drawing thread (reader).
#[derive(Debug)]
pub struct LiveStats {
    total: AtomicUsize,
    /// Requests sent so far, incremented by the run itself.
    sent: Arc<AtomicUsize>,
    counts: Mutex<Counts>,
}

/// What the bar shows at one instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Snapshot {
    /// Requests in the run.
    pub total: usize,
    /// Requests sent so far (as the run counted them going out).
    pub sent: usize,
    /// Requests ended, failed ones included.
    pub done: usize,
    /// Of which failed.
    pub failed: usize,
    /// Sent and not ended.
    pub in_flight: usize,
    /// p99 of client TTFT so far, ms.
    pub ttft_p99_ms: Option<f64>,
    /// p99 of chunk gaps so far, ms.
    pub chunk_gap_p99_ms: Option<f64>,
}

impl LiveStats {
    /// Stats for a run of `total` requests.
    pub fn new(total: usize) -> Self {
        Self { total: AtomicUsize::new(total), sent: Arc::default(), counts: Mutex::new(Counts::default()) }
    }

    /// The counter of requests sent, for the run to increment as each request goes out (put it
    /// in [`crate::run::RunConfig::send_counter`]).
    pub fn send_counter(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.sent)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        // A panic while holding the lock leaves counts that are still meaningful.
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Corrects the number of requests in the run (a run bounded by a duration knows it only from
    /// its schedule; multi-turn sessions add turns).
    pub fn set_total(&self, total: usize) {
        self.total.store(total, Ordering::Relaxed);
    }

    /// Records a request that ended.
    pub fn record(&self, rec: &ClientRecord) {
        let ttft = rec.ttft_ns().map(ms);
        let gaps = rec.chunk_gaps_ns();
        let mut c = self.lock();
        c.done += 1;
        if rec.is_ok() {
            if let Some(t) = ttft {
                c.ttft.record_ms(t);
            }
            for g in gaps {
                c.chunk_gap.record_ms(ms(g));
            }
        } else {
            c.failed += 1;
        }
    }

    /// The counts now.
    pub fn snapshot(&self) -> Snapshot {
        let c = self.lock();
        let total = self.total.load(Ordering::Relaxed);
        // A request is counted before it is sent and recorded after it ended (through the run's
        // channel and this lock), so `sent >= done` already; the bounds guard a counter that was
        // not wired to the run or is shared by several runs.
        let sent = self.sent.load(Ordering::Relaxed).max(c.done).min(total);
        let p99 = |h: &LatencyHistogram| (!h.is_empty()).then(|| h.percentile_ms(99.0));
        Snapshot {
            total,
            sent,
            done: c.done,
            failed: c.failed,
            in_flight: sent - c.done.min(sent),
            ttft_p99_ms: p99(&c.ttft),
            chunk_gap_p99_ms: p99(&c.chunk_gap),
        }
    }
}

impl Snapshot {
    /// The bar's message: `done 100/500 · sent 120 · failed 2 · in flight 20 · TTFT p99 41.2 ms ·
    /// gap p99 12.0 ms` (counts and bar fill are drawn from one snapshot, so they always agree).
    pub fn message(&self) -> String {
        let p = |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |v| format!("{v:.1} ms"));
        format!(
            "done {}/{} · sent {} · failed {} · in flight {} · TTFT p99 {} · gap p99 {}",
            self.done,
            self.total,
            self.sent,
            self.failed,
            self.in_flight,
            p(self.ttft_p99_ms),
            p(self.chunk_gap_p99_ms)
        )
    }
}

/// Whether stderr is a terminal (where a progress bar makes sense).
pub fn stderr_is_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// A progress bar redrawn from [`LiveStats`] on its own thread.
#[derive(Debug)]
pub struct LiveProgress {
    bar: ProgressBar,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    thread_was_started: bool,
}

impl LiveProgress {
    /// Starts drawing `stats` on stderr every `tick` when `visible` (callers pass
    /// `!no_progress && stderr_is_terminal()`); otherwise draws nothing and starts no thread.
    pub fn start(stats: Arc<LiveStats>, visible: bool, tick: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        if !visible {
            return Self { bar: ProgressBar::hidden(), stop, thread: None, thread_was_started: false };
        }
        let total = stats.snapshot().total as u64;
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        // The template is a constant; should it ever fail to parse, the default bar is still a bar.
        let style = ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {msg}")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        let (b, s, st) = (bar.clone(), Arc::clone(&stats), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("bench-progress".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    draw(&b, &s.snapshot());
                    std::thread::sleep(tick);
                }
                draw(&b, &s.snapshot());
            })
            .ok();
        Self { bar, stop, thread, thread_was_started: false }
    }

    /// Whether anything is drawn.
    pub fn is_visible(&self) -> bool {
        self.thread.is_some()
    }

    /// Stops the drawing thread and replaces the bar by one plain line with the final counts
    /// (nothing when hidden), so what follows on stdout starts on a line of its own.
    pub fn finish(mut self) {
        self.stop_thread();
        if self.thread_was_started {
            let last = self.bar.message();
            self.bar.finish_and_clear();
            eprintln!("bench: {last}");
        }
    }

    fn stop_thread(&mut self) {
        self.thread_was_started |= self.thread.is_some();
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for LiveProgress {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

fn draw(bar: &ProgressBar, s: &Snapshot) {
    bar.set_message(s.message());
    bar.set_length(s.total as u64);
    bar.set_position(s.done as u64);
    // Each setter may draw on its own (rate-limited); one forced draw per tick shows them together.
    bar.force_draw();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_timeline::{Outcome, RequestId, StreamEvent};

    const MS: u64 = 1_000_000;

    fn rec(id: u64, first_ms: u64, gap_ms: u64) -> ClientRecord {
        let mut r = ClientRecord::new(RequestId(id), 0, 0, true);
        r.events.push(StreamEvent { at_ns: MS, tokens: 0 }); // role-only: not the first token
        for k in 0..3 {
            r.events.push(StreamEvent { at_ns: (first_ms + k * gap_ms) * MS, tokens: 1 });
        }
        r
    }

    #[test]
    fn counts_follow_the_sends_and_the_timeline_definitions() {
        let stats = LiveStats::new(10);
        let sent = stats.send_counter();
        sent.fetch_add(3, Ordering::Relaxed);
        let s = stats.snapshot();
        assert_eq!((s.sent, s.done, s.in_flight), (3, 0, 3));
        assert_eq!(s.ttft_p99_ms, None);
        stats.record(&rec(0, 40, 10));
        let mut failed = rec(1, 50, 10);
        failed.outcome = Outcome::Failed { kind: "http_503".into(), message: String::new() };
        stats.record(&failed);
        let s = stats.snapshot();
        assert_eq!((s.sent, s.done, s.failed, s.in_flight), (3, 2, 1, 1));
        // HDR values: within 0.1% of the exact ones.
        let near = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() <= want * 1e-3);
        assert!(near(s.ttft_p99_ms, 40.0), "TTFT from the first token-bearing event: {s:?}");
        assert!(near(s.chunk_gap_p99_ms, 10.0), "{s:?}");
        sent.fetch_add(7, Ordering::Relaxed);
        let end = stats.snapshot();
        assert_eq!((end.sent, end.in_flight), (10, 8));
        assert!(end.message().contains("TTFT p99 40.0 ms · gap p99 10.0 ms"), "{}", end.message());
        assert!(
            end.message().starts_with("done 2/10 · sent 10 · failed 1 · in flight 8"),
            "{}",
            end.message()
        );
    }

    /// Regression: the bar used to derive "sent" from the precomputed schedule, which for a
    /// multi-turn workload holds only the session starts, so a later turn (sent when the previous
    /// one ended) was never counted: one session of three turns showed "sent 1" and nothing in
    /// flight while its second turn was running.
    #[test]
    fn later_turns_of_a_session_count_as_sent_when_they_go_out() {
        let stats = LiveStats::new(3);
        let sent = stats.send_counter();
        for turn in 0..3u64 {
            sent.fetch_add(1, Ordering::Relaxed); // the run sends turn `turn`
            let s = stats.snapshot();
            assert_eq!((s.sent, s.done, s.in_flight), (turn as usize + 1, turn as usize, 1), "turn {turn}");
            stats.record(&rec(turn, 10, 5));
        }
        let s = stats.snapshot();
        assert_eq!((s.sent, s.done, s.in_flight), (3, 3, 0));
    }

    #[test]
    fn sent_stays_within_done_and_total() {
        let stats = LiveStats::new(2);
        stats.record(&rec(0, 10, 5)); // a counter not wired to the run: sent is at least done
        assert_eq!((stats.snapshot().sent, stats.snapshot().in_flight), (1, 0));
        stats.send_counter().fetch_add(5, Ordering::Relaxed); // shared by several runs
        assert_eq!(stats.snapshot().sent, 2);
        stats.set_total(7);
        assert_eq!(stats.snapshot().in_flight, 4, "a larger total (more turns) lets more be sent");
    }

    #[test]
    fn hidden_progress_starts_no_thread() {
        let stats = Arc::new(LiveStats::new(1));
        let p = LiveProgress::start(stats, false, Duration::from_millis(10));
        assert!(!p.is_visible());
        p.finish();
    }
}
