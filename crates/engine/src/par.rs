//! Parallel loops of the forward pass: rayon's, or — during a small-batch forward call — a second
//! thread that spins between regions instead of going back to rayon's idle loop.
//!
//! Why by hand: a batch-1 decode step opens five parallel regions a layer of 7–35 µs each, and
//! rayon's idle worker looks for new work between `sched_yield` calls, so it joins a region a
//! microsecond or more late (`kernel_throughput`'s `parallel_region_overhead`: 3 µs of work gains
//! nothing from the second thread). [`with_partner`] borrows one rayon worker for the whole
//! forward call and keeps it spinning on an atomic, so it starts each region's tasks within
//! nanoseconds. No crate offers "this pool's other worker, spinning, for the next few ms" without
//! replacing the pool.
//!
//! The protocol, one handshake a region: the owner publishes the region's job, then offers the
//! second half of its tasks; it runs the first half, then either takes the second half back (the
//! partner never claimed it) or waits until the partner says it is done. The partner claims the
//! offer by compare-and-swap and reads the job only after a successful claim, and the owner does
//! not leave the region before the claimed half is done — so a job is never read after its
//! region ended, and a pool whose other worker never comes still finishes every region alone.
//! Each shared word sits on its own cache line: per-task atomics on one shared line cost more
//! than the regions they split (measured: 10% slower batch-1 steps than rayon).

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering::SeqCst};

/// A region's tasks: `run(i)` for `i in 0..n`.
struct Job<'a> {
    run: &'a (dyn Fn(usize) + Sync),
    n: usize,
}

/// One shared word on a cache line of its own.
#[repr(align(128))]
struct Line<T>(T);

/// The offer's states, in its low two bits (the generation above them).
const OPEN: u64 = 1;
const CLAIMED: u64 = 2;
const TAKEN_BACK: u64 = 3;

/// Two threads' shared state for one forward call.
struct Pair {
    /// The current region's job (on the owner's stack).
    job: Line<AtomicPtr<Job<'static>>>,
    /// (generation << 2) | state of the second half's offer.
    offer: Line<AtomicU64>,
    /// The last generation whose second half the partner finished.
    done: Line<AtomicU64>,
    quit: Line<AtomicBool>,
    /// A task on the partner panicked (raised by the owner when the region ends).
    failed: Line<AtomicBool>,
    /// The owner's generation counter.
    generation: Cell<u64>,
    /// The owner is inside a region: a loop nested in one of its tasks runs serially (a second
    /// offer would overwrite the first).
    busy: Cell<bool>,
}

// SAFETY: `generation` and `busy` are touched by the owner only (in `region`); everything else
// is atomic.
unsafe impl Sync for Pair {}

impl Pair {
    fn new() -> Self {
        Pair {
            job: Line(AtomicPtr::new(std::ptr::null_mut())),
            offer: Line(AtomicU64::new(0)),
            done: Line(AtomicU64::new(0)),
            quit: Line(AtomicBool::new(false)),
            failed: Line(AtomicBool::new(false)),
            generation: Cell::new(0),
            busy: Cell::new(false),
        }
    }

    /// The owner: `run(i)` for `i in 0..n`, the second half offered to the partner.
    fn region(&self, n: usize, run: &(dyn Fn(usize) + Sync)) {
        if n < 2 || self.busy.get() {
            (0..n).for_each(run);
            return;
        }
        self.busy.set(true);
        let _busy = Busy(&self.busy);
        let g = self.generation.get() + 1;
        self.generation.set(g);
        let job = Job { run, n };
        // The lifetime is erased while published: this function returns only after the claimed
        // half is done (or was taken back), and the partner reads the job only under a claim.
        self.job.0.store(&job as *const Job<'_> as *mut Job<'static>, SeqCst);
        self.offer.0.store(g << 2 | OPEN, SeqCst);
        let half = n.div_ceil(2);
        // A panic in this half must not leave the region while the partner may still be running
        // the other half on this frame's closure: caught, the partner waited for, then resumed.
        let mine = catch_unwind(AssertUnwindSafe(|| (0..half).for_each(run)));
        if self.offer.0.compare_exchange(g << 2 | OPEN, g << 2 | TAKEN_BACK, SeqCst, SeqCst).is_ok() {
            if mine.is_ok() {
                (half..n).for_each(run);
            }
        } else {
            let mut spins = 0u32;
            while self.done.0.load(SeqCst) != g {
                pause(&mut spins);
            }
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if self.failed.0.swap(false, SeqCst) {
            panic!("a task of a parallel region panicked on the engine's other worker");
        }
    }

    /// The partner: claims every offer as it appears until told to quit.
    fn serve(&self) {
        let mut spins = 0u32;
        while !self.quit.0.load(SeqCst) {
            let o = self.offer.0.load(SeqCst);
            if o & 3 != OPEN || self.offer.0.compare_exchange(o, (o & !3) | CLAIMED, SeqCst, SeqCst).is_err()
            {
                pause(&mut spins);
                continue;
            }
            spins = 0;
            // SAFETY: the claim succeeded, so the owner is inside this generation's region and
            // waits for `done` before leaving it: the job it published before the offer is alive.
            let job = unsafe { &*self.job.0.load(SeqCst) };
            // A panic here is the owner's to raise: it is waiting for `done`, which must come.
            if catch_unwind(AssertUnwindSafe(|| (job.n.div_ceil(2)..job.n).for_each(job.run))).is_err() {
                self.failed.0.store(true, SeqCst);
            }
            self.done.0.store(o >> 2, SeqCst);
        }
    }
}

/// Clears the owner's in-a-region flag however the region ends.
struct Busy<'a>(&'a Cell<bool>);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

/// One wait of a spin loop: a `pause`, and every 4,096th time a yield to the OS — so two threads
/// sharing one core (a pool larger than its CPU set) hand it over within microseconds instead of
/// spinning out each other's time slices.
fn pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(4096) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

thread_local! {
    /// The pair this thread owns during [`with_partner`].
    static PAIR: Cell<*const Pair> = const { Cell::new(std::ptr::null()) };
}

/// Runs `f` on this thread with the other worker of the current two-thread rayon pool spinning
/// beside it: every [`for_each`] inside `f` on this thread is split between the two. When no
/// worker comes, `f`'s loops run here alone — never blocked on the partner; with a pool of any
/// other size, `f` runs as it is.
pub fn with_partner<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // A pool of exactly two (this project's two-core target): a wider pool keeps rayon, whose
    // regions a pair would leave all but two of its threads out of.
    if rayon::current_num_threads() != 2 {
        return f();
    }
    /// Sends the partner home and restores this thread's pair however `f` ends (a panic too:
    /// `join` waits for the partner before it unwinds).
    struct Done<'a>(&'a Pair, *const Pair);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            PAIR.with(|p| p.set(self.1));
            self.0.quit.0.store(true, SeqCst);
        }
    }
    let pair = Pair::new();
    let (out, ()) = rayon::join(
        || {
            let _done = Done(&pair, PAIR.with(|p| p.replace(&pair)));
            f()
        },
        || pair.serve(),
    );
    out
}

/// Whether this thread's [`for_each`] splits its regions with a partner, in two halves by task
/// index: a caller cutting finer tasks then gets halves of more even work.
pub fn partnered() -> bool {
    !PAIR.with(Cell::get).is_null()
}

/// `run(i)` for every `i in 0..n`, in parallel: on this thread's partner during
/// [`with_partner`], else on the rayon pool.
pub fn for_each(n: usize, run: impl Fn(usize) + Sync + Send) {
    let pair = PAIR.with(Cell::get);
    if pair.is_null() {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(run);
    } else {
        // SAFETY: set by `with_partner` on this thread for as long as its `pair` lives.
        unsafe { (*pair).region(n, &run) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// `f` inside [`with_partner`] on a fresh pool of `threads`.
    fn paired<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| with_partner(f))
    }

    /// `n` tasks, each counting itself in `ran`.
    fn count_each(n: usize, ran: &AtomicU32) {
        for_each(n, |_| {
            ran.fetch_add(1, Ordering::Relaxed);
        });
    }

    #[test]
    fn every_task_runs_once_in_every_region_with_or_without_a_partner() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for partnered in [false, true] {
            let counts: Vec<AtomicU32> = (0..97).map(|_| AtomicU32::new(0)).collect();
            let body = || {
                for region in 0..2000 {
                    let n = region % 97 + 1;
                    for_each(n, |i| {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
            };
            pool.install(|| if partnered { with_partner(body) } else { body() });
            let expected = |i: usize| (0..2000).filter(|r| r % 97 >= i).count() as u32;
            for (i, c) in counts.iter().enumerate() {
                assert_eq!(c.load(Ordering::Relaxed), expected(i), "task {i}, partnered {partnered}");
            }
        }
    }

    #[test]
    fn a_panicking_task_on_either_thread_reaches_the_caller_and_the_pair_goes_on() {
        let ran = AtomicU32::new(0);
        let caught = paired(2, || {
            let mut caught = 0;
            for bad in [0usize, 7] {
                let r = catch_unwind(AssertUnwindSafe(|| {
                    for_each(8, |i| {
                        assert_ne!(i, bad, "task {i} fails");
                    })
                }));
                caught += r.is_err() as u32;
            }
            count_each(8, &ran);
            caught
        });
        assert_eq!(caught, 2, "the first half's panic and the second half's both reach the caller");
        assert_eq!(ran.load(Ordering::Relaxed), 8, "a region after a panic still runs every task");
    }

    #[test]
    fn the_second_half_runs_on_the_partner_while_the_first_still_runs() {
        // Task 0 (the caller's half) waits for task 1 (the offered half): only a partner
        // running at the same time can let it finish.
        let second = AtomicBool::new(false);
        let met = paired(2, || {
            let met = AtomicBool::new(false);
            for_each(2, |i| {
                if i == 1 {
                    second.store(true, SeqCst);
                    return;
                }
                let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while !second.load(SeqCst) && std::time::Instant::now() < until {
                    std::thread::yield_now();
                }
                met.store(second.load(SeqCst), SeqCst);
            });
            met.load(SeqCst)
        });
        assert!(met, "the partner never ran the offered half");
    }

    #[test]
    fn a_loop_nested_in_a_task_runs_and_the_outer_region_still_ends() {
        let inner = AtomicU32::new(0);
        paired(2, || for_each(4, |_| count_each(3, &inner)));
        assert_eq!(inner.load(Ordering::Relaxed), 12);
    }

    #[test]
    fn a_partner_waiting_before_the_first_region_claims_nothing() {
        // The state before any region must not look like an offer (a partner that claimed
        // there would read a job nobody published).
        let ran = AtomicU32::new(0);
        paired(2, || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            count_each(8, &ran);
        });
        assert_eq!(ran.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_pool_of_one_runs_everything_on_the_caller() {
        let sum = AtomicU32::new(0);
        paired(1, || {
            for_each(10, |i| {
                sum.fetch_add(i as u32, Ordering::Relaxed);
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }
}
