//! The discrete-event loop: requests arrive, the gateway's router places them, each worker runs
//! steps — planned by the shared scheduler, timed by the calibration — and PD transfers move KV
//! over a modelled link. One virtual clock in nanoseconds; ties broken by event order, so a seed
//! gives one outcome.

use crate::calib::{Calibration, StepShape};
use crate::requests::{Input, Send};
use crate::{Outcome, SimConfig, SimError, SimStats};
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::{Deref, DerefMut};
use tokenpath_engine::kv_cache::{KvCache, KvLayout};
use tokenpath_gateway::route::{cache_aware, decode_pick, Candidate, DecodeCandidate, PrefixIndex};
use tokenpath_kv::BlockHash;
use tokenpath_protocol::work::StepRecord;
use tokenpath_scheduler::{ArenaOnly, Policy, Scheduler, SeqCore, Sequence, Stuck};
use tokenpath_timeline::{FinishReason, Mark, Nanos, ServerTimeline};

mod transfer;

/// What a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Full,
    Prefill,
    Decode,
}

/// A request on a worker.
#[derive(Debug)]
struct SimSeq {
    core: SeqCore,
    req: usize,
    generated: usize,
    decode_started: bool,
    exported_blocks: usize,
}

impl Deref for SimSeq {
    type Target = SeqCore;
    fn deref(&self) -> &SeqCore {
        &self.core
    }
}
impl DerefMut for SimSeq {
    fn deref_mut(&mut self) -> &mut SeqCore {
        &mut self.core
    }
}
impl Sequence for SimSeq {}

struct Worker<'a> {
    name: String,
    /// This worker's step timing (a prefill or decode worker may have fewer cores).
    calib: &'a Calibration,
    mode: Mode,
    sched: Scheduler<SimSeq>,
    busy: bool,
    plan: Vec<usize>,
    shape: StepShape,
    step_start: Nanos,
    last_end: Option<Nanos>,
    awaiting: Vec<SimSeq>,
    in_flight: u64,
    /// When the link into this (decode) worker is free again.
    link_free_at: Nanos,
    /// Requests whose KV landed during the step (or gap) in flight, taken in when it is over.
    landed: Vec<usize>,
    rng: ChaCha8Rng,
    steps: u64,
    busy_ns: Nanos,
}

/// A request's state over the whole run.
#[derive(Debug, Default)]
pub(crate) struct ReqState {
    pub(crate) arrived: Option<Nanos>,
    pub(crate) timeline: ServerTimeline,
    pub(crate) tokens: Vec<Nanos>,
    pub(crate) done: Option<Nanos>,
    pub(crate) outcome: Option<Outcome>,
    pub(crate) cached: usize,
    pub(crate) workers: Vec<(String, String)>,
    pub(crate) kv_bytes: Option<u64>,
    decode_worker: Option<usize>,
    last_mark: Nanos,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(usize),
    Admit(usize),
    StepEnd(usize),
    KvReady {
        worker: usize,
        req: usize,
    },
    /// The gap after a worker's step is over: its next step starts.
    Resume(usize),
}

/// The whole simulated system.
pub(crate) struct Sim<'a> {
    cfg: &'a SimConfig,
    calib: &'a Calibration,
    input: &'a Input,
    workers: Vec<Worker<'a>>,
    queue: BinaryHeap<Reverse<(Nanos, u64, Event)>>,
    order: u64,
    now: Nanos,
    pub(crate) reqs: Vec<ReqState>,
    next: Vec<Vec<usize>>,
    router: PrefixIndex,
    root: BlockHash,
    pub(crate) steps: Vec<(String, StepRecord)>,
    pub(crate) stats: SimStats,
}

fn us_to_ns(us: f64) -> Nanos {
    (us.max(0.0) * 1e3).round() as Nanos
}

impl<'a> Sim<'a> {
    pub(crate) fn new(
        cfg: &'a SimConfig,
        calib: &crate::Calibrations<'a>,
        input: &'a Input,
    ) -> Result<Self, SimError> {
        let w = &cfg.worker;
        let layout = KvLayout { n_layer: 1, kv_dim: 1, head_dim: 1, block_size: w.block_size };
        let policy =
            Policy { block_size: w.block_size, prefill_chunk: w.prefill_chunk, max_batch: w.max_batch };
        let mut workers = Vec::new();
        let t = &cfg.topology;
        let modes = std::iter::repeat_n((Mode::Full, "w"), t.colocated)
            .chain(std::iter::repeat_n((Mode::Prefill, "p"), t.prefill))
            .chain(std::iter::repeat_n((Mode::Decode, "d"), t.decode));
        for (i, (mode, tag)) in modes.enumerate() {
            let cache = KvCache::new(layout, w.kv_blocks).map_err(|e| SimError::Config(e.to_string()))?;
            let sched =
                Scheduler::new(cache, policy, w.prefix_cache).map_err(|e| SimError::Config(e.to_string()))?;
            let own = match mode {
                Mode::Full => calib.default,
                Mode::Prefill => calib.prefill.unwrap_or(calib.default),
                Mode::Decode => calib.decode.unwrap_or(calib.default),
            };
            workers.push(Worker {
                name: format!("{tag}{i}"),
                calib: own,
                mode,
                sched,
                busy: false,
                plan: Vec::new(),
                shape: StepShape::default(),
                step_start: 0,
                last_end: None,
                awaiting: Vec::new(),
                in_flight: 0,
                link_free_at: 0,
                landed: Vec::new(),
                rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ (0x5717_0000 + i as u64)),
                steps: 0,
                busy_ns: 0,
            });
        }
        let full = workers.iter().any(|w| w.mode == Mode::Full);
        let pd =
            workers.iter().any(|w| w.mode == Mode::Prefill) && workers.iter().any(|w| w.mode == Mode::Decode);
        if full == pd {
            return Err(SimError::Config(
                "a topology is colocated workers or prefill and decode workers".into(),
            ));
        }
        let n = input.requests.len();
        let mut next = vec![Vec::new(); n];
        let mut sim = Self {
            cfg,
            calib: calib.default,
            input,
            workers,
            queue: BinaryHeap::new(),
            order: 0,
            now: 0,
            reqs: (0..n).map(|_| ReqState::default()).collect(),
            next: Vec::new(),
            router: PrefixIndex::default(),
            root: BlockHash::namespace(&[b"tokenpath sim"]),
            steps: Vec::new(),
            stats: SimStats::default(),
        };
        for (i, s) in input.send.iter().enumerate() {
            match *s {
                Send::At(t) => sim.push(t, Event::Arrive(i)),
                Send::After(j) if j < i => next[j].push(i),
                Send::After(_) => {
                    return Err(SimError::Workload(format!("request {i} waits for a later one")))
                }
            }
        }
        sim.next = next;
        Ok(sim)
    }

    fn push(&mut self, at: Nanos, e: Event) {
        self.order += 1;
        self.queue.push(Reverse((at, self.order, e)));
    }

    /// Runs until every request ended.
    pub(crate) fn run(&mut self) {
        while let Some(Reverse((t, _, e))) = self.queue.pop() {
            self.now = t;
            match e {
                Event::Arrive(r) => {
                    self.reqs[r].arrived = Some(t);
                    self.push(t + us_to_ns(self.calib.gateway_us), Event::Admit(r));
                }
                Event::Admit(r) => self.admit(r),
                Event::StepEnd(w) => self.step_end(w),
                Event::KvReady { worker, req } => self.kv_ready(worker, req),
                Event::Resume(w) => {
                    self.workers[w].busy = false;
                    self.take_landed(w);
                    self.wake(w);
                }
            }
        }
        for w in &self.workers {
            self.stats.steps += w.steps;
            self.stats.preempted += w.sched.counters.preempted;
            self.stats.busy_s.push((w.name.clone(), w.busy_ns as f64 / 1e9));
        }
    }

    fn stamp(&mut self, r: usize, mark: Mark, at: Nanos) {
        let st = &mut self.reqs[r];
        let Some(arrived) = st.arrived else { return };
        let ns = at.saturating_sub(arrived).max(st.last_mark);
        st.last_mark = ns;
        let _ = st.timeline.stamp(mark, ns);
    }

    fn end(&mut self, r: usize, outcome: Outcome) {
        let at = self.now;
        let st = &mut self.reqs[r];
        if st.outcome.is_some() {
            return;
        }
        st.done = Some(at);
        let mark = match &outcome {
            Outcome::Finished(reason) => Mark::Finished(*reason),
            Outcome::Failed(why) => {
                tracing::debug!(request = r, at_ns = at, "failed: {why}");
                Mark::Failed
            }
        };
        st.outcome = Some(outcome);
        self.stamp(r, mark, at);
        for i in std::mem::take(&mut self.next[r]) {
            self.push(at, Event::Arrive(i));
        }
    }

    fn seq(&self, r: usize, mode: Mode) -> SimSeq {
        let mut core = SeqCore::new(self.input.requests[r].prompt.tokens(), self.root);
        if mode == Mode::Decode {
            core.first_token_done = true;
            core.prefill_started = true;
        }
        SimSeq { core, req: r, generated: 0, decode_started: false, exported_blocks: 0 }
    }

    fn admit(&mut self, r: usize) {
        self.stamp(r, Mark::Admitted, self.now);
        let prompt = &self.input.requests[r].prompt;
        let n_ctx = self.cfg.worker.n_ctx;
        if prompt.is_empty() || prompt.len() + 1 > n_ctx {
            let msg = format!("prompt of {} tokens does not fit the context of {n_ctx}", prompt.len());
            return self.end(r, Outcome::Failed(msg));
        }
        // The router's keys, only when there is a choice to make.
        let choice = |m: Mode| self.workers.iter().filter(|w| w.mode == m).count() > 1;
        let hashes = if choice(Mode::Full) || choice(Mode::Prefill) {
            PrefixIndex::hashes(&prompt.tokens(), None)
        } else {
            Vec::new()
        };
        let room: Vec<usize> = self
            .workers
            .iter_mut()
            .map(|w| if w.mode == Mode::Decode { w.sched.available() } else { 0 })
            .collect();
        let prompt = &self.input.requests[r].prompt;
        let first = |m: Mode| self.workers.iter().enumerate().filter(move |(_, w)| w.mode == m);
        let names: Vec<String> = self.workers.iter().map(|w| w.name.clone()).collect();
        let pick_cached = |m: Mode| {
            let cands: Vec<Candidate<'_>> = first(m)
                .map(|(i, w)| Candidate {
                    key: &names[i],
                    load: w.in_flight,
                    matched: 2 * self.router.matched(&names[i], &hashes),
                })
                .collect();
            let key = cache_aware(&cands)?;
            names.iter().position(|n| n == key)
        };
        if self.workers.iter().any(|w| w.mode == Mode::Full) {
            let Some(w) = pick_cached(Mode::Full) else {
                return self.end(r, Outcome::Failed("no worker".into()));
            };
            self.router.remember(&names[w], &hashes);
            self.reqs[r].workers.push(("worker".into(), names[w].clone()));
            let seq = self.seq(r, Mode::Full);
            self.workers[w].in_flight += 1;
            self.workers[w].sched.waiting.push_back(seq);
            return self.wake(w);
        }
        // PD: the decode worker first (its blocks reserved), then the prefill worker.
        let bs = self.cfg.worker.block_size;
        let dcands: Vec<DecodeCandidate<'_>> = first(Mode::Decode)
            .map(|(i, w)| DecodeCandidate {
                key: &names[i],
                load: w.in_flight + w.sched.running.len() as u64,
                room: Some((room[i] as u64, bs as u64)),
            })
            .collect();
        let d = decode_pick(&dcands, prompt.len()).and_then(|key| names.iter().position(|n| n == key));
        let Some(p) = pick_cached(Mode::Prefill) else {
            return self.end(r, Outcome::Failed("no worker".into()));
        };
        let Some(d) = d else {
            return self.end(r, Outcome::Failed("no decode worker has room for the KV".into()));
        };
        let mut dseq = self.seq(r, Mode::Decode);
        let dw = &mut self.workers[d];
        if dw.sched.reserve_prompt(&mut dseq).is_err() {
            return self.end(r, Outcome::Failed("no room for the transferred KV".into()));
        }
        dw.awaiting.push(dseq);
        dw.in_flight += 1;
        self.router.remember(&names[p], &hashes);
        let st = &mut self.reqs[r];
        st.decode_worker = Some(d);
        st.workers.push(("prefill".into(), names[p].clone()));
        st.workers.push(("decode".into(), names[d].clone()));
        let seq = self.seq(r, Mode::Prefill);
        self.workers[p].in_flight += 1;
        self.workers[p].sched.waiting.push_back(seq);
        self.wake(p);
    }

    fn has_work(w: &Worker<'_>) -> bool {
        !w.sched.waiting.is_empty() || !w.sched.running.is_empty()
    }

    /// Starts a step on an idle worker with work.
    fn wake(&mut self, w: usize) {
        if self.workers[w].busy || !Self::has_work(&self.workers[w]) {
            return;
        }
        // A few tries: a step that planned nothing may have made room (a preemption).
        for _ in 0..4 {
            let worker = &mut self.workers[w];
            let plan = worker.sched.plan(&mut ArenaOnly);
            if plan.iter().any(|&n| n > 0) {
                return self.start(w, plan);
            }
            match worker.sched.unstick() {
                Stuck::Fail(seq) => {
                    worker.in_flight = worker.in_flight.saturating_sub(1);
                    self.end(seq.req, Outcome::Failed("the KV cache cannot hold this request".into()));
                }
                Stuck::Preempted => {}
                Stuck::Paused | Stuck::Idle => return,
            }
            if !Self::has_work(&self.workers[w]) {
                return;
            }
        }
    }

    fn start(&mut self, w: usize, plan: Vec<usize>) {
        let t0 = self.now;
        let mut shape = StepShape::default();
        let mut marks = Vec::new();
        let worker = &mut self.workers[w];
        for (s, &n) in worker.sched.running.iter_mut().zip(&plan) {
            if n == 0 {
                continue;
            }
            // The step's blocks are taken as it starts, as the engine's forward call takes them:
            // a PD request arriving mid-step reserves its decode blocks from what is left.
            // (Regression: reserving at the step's end let such a reservation take blocks the
            // plan had counted on, and planned steps failed.) A failure shows at the step's end.
            let to = s.fed + n;
            let _ = worker.sched.cache.reserve(&mut s.core.table, to);
            shape.rows += 1;
            let pairs = StepRecord::pairs(s.fed, n);
            if s.is_decoding() {
                shape.decode_tokens += 1;
                shape.decode_pairs += pairs;
            } else {
                shape.prefill_tokens += n;
                shape.prefill_pairs += pairs;
            }
            if !s.prefill_started {
                s.prefill_started = true;
                marks.push((s.req, Mark::PrefillStart));
            } else if s.is_decoding() && !s.decode_started {
                s.decode_started = true;
                marks.push((s.req, Mark::DecodeStart));
            }
        }
        let dur = us_to_ns(worker.calib.step_us(&shape, &mut worker.rng)).max(1);
        worker.busy = true;
        worker.plan = plan;
        worker.shape = shape;
        worker.step_start = t0;
        for (r, m) in marks {
            self.stamp(r, m, t0);
        }
        self.push(t0 + dur, Event::StepEnd(w));
    }

    fn step_end(&mut self, w: usize) {
        let t1 = self.now;
        let n_ctx = self.cfg.worker.n_ctx;
        let bs = self.cfg.worker.block_size;
        let bytes_per_token = self.calib.kv_bytes_per_token;
        let mut worker_plan = std::mem::take(&mut self.workers[w].plan);
        let mode = self.workers[w].mode;
        let mut running = std::mem::take(&mut self.workers[w].sched.running);
        let mut endings: Vec<Option<Outcome>> = Vec::with_capacity(running.len());
        let mut tokens_at = Vec::new();
        let mut handoffs = Vec::new();
        let mut first_tokens = Vec::new();
        {
            let worker = &mut self.workers[w];
            worker_plan.resize(running.len(), 0);
            for (s, &n) in running.iter_mut().zip(&worker_plan) {
                if n == 0 {
                    endings.push(None);
                    continue;
                }
                // What the forward call does to the block table.
                let to = s.fed + n;
                if worker.sched.cache.reserve(&mut s.core.table, to).is_err()
                    || worker.sched.cache.set_len(&mut s.core.table, to).is_err()
                {
                    endings.push(Some(Outcome::Failed("KV cache full in a planned step (a bug)".into())));
                    continue;
                }
                s.fed = to;
                if s.unfed() > 0 {
                    endings.push(None);
                    continue;
                }
                if !s.first_token_done {
                    s.first_token_done = true;
                    first_tokens.push(s.req);
                }
                let answer = &self.input.requests[s.req].answer;
                let tok = answer.get(s.generated).copied().unwrap_or(0);
                s.tokens.push(tok);
                s.generated += 1;
                tokens_at.push(s.req);
                let ending = if s.generated >= answer.len() || s.fed + 1 >= n_ctx {
                    Some(Outcome::Finished(FinishReason::Length))
                } else if mode == Mode::Prefill {
                    handoffs.push(s.req);
                    Some(Outcome::Finished(FinishReason::Length))
                } else {
                    None
                };
                endings.push(ending);
            }
        }
        for r in first_tokens {
            self.stamp(r, Mark::PrefillEnd, t1);
        }
        for r in tokens_at {
            self.stamp(r, Mark::Token, t1);
            self.reqs[r].tokens.push(t1);
        }
        let rows = self.workers[w].shape.rows;
        let mut kept = Vec::with_capacity(running.len());
        for (mut s, ending) in running.drain(..).zip(endings) {
            self.workers[w].sched.register(&mut s);
            let handoff = handoffs.contains(&s.req) && matches!(ending, Some(Outcome::Finished(_)));
            if mode == Mode::Prefill {
                self.export(&mut s, handoff, bytes_per_token, bs);
            }
            match ending {
                None => kept.push(s),
                Some(outcome) => {
                    let worker = &mut self.workers[w];
                    worker.sched.free(&mut s);
                    worker.in_flight = worker.in_flight.saturating_sub(1);
                    let r = s.req;
                    self.reqs[r].cached = self.reqs[r].cached.max(s.cached_tokens);
                    if handoff {
                        self.handoff(r, t1);
                    } else {
                        self.drop_awaiting(r);
                        self.end(r, outcome);
                    }
                }
            }
        }
        let worker = &mut self.workers[w];
        worker.sched.running = kept;
        worker.busy = false;
        worker.steps += 1;
        worker.busy_ns += t1 - worker.step_start;
        let shape = worker.shape;
        let rec = StepRecord {
            start_us: worker.step_start / 1000,
            dur_us: (t1 - worker.step_start) / 1000,
            gap_us: worker.last_end.map(|e| worker.step_start.saturating_sub(e) / 1000),
            rows: shape.rows,
            prefill_tokens: shape.prefill_tokens,
            decode_tokens: shape.decode_tokens,
            attn_pairs: shape.prefill_pairs + shape.decode_pairs,
            decode_pairs: shape.decode_pairs,
            running: worker.sched.running.len(),
            waiting: worker.sched.waiting.len(),
            free_blocks: worker.sched.available(),
        };
        worker.last_end = Some(t1);
        if self.cfg.keep_steps {
            self.steps.push((worker.name.clone(), rec));
        }
        // The next step after the inter-step gap (sampling, streaming, planning).
        let gap = us_to_ns(worker.calib.gap_us(rows, &mut worker.rng));
        if Self::has_work(worker) || !worker.landed.is_empty() {
            worker.busy = true;
            self.push(t1 + gap, Event::Resume(w));
        }
    }
}
