//! A bench run: the schedule, the requests sent at their scheduled instants (each on its own
//! task, so a slow response never delays the next send), and the records collected. Always
//! bounded: by count (`num_requests`, a trace's length) and, when given, by duration (no send
//! scheduled at or after it; a ramp's end bounds it too). Multi-turn sessions are the one
//! place where a send waits on a response: a session's next turn carries the answer the server
//! gave, so it is scheduled when the previous turn ended (`t_sched` = that instant), while
//! sessions start under the arrival process and interleave freely.

use crate::arrival::{Arrival, Ramp};
use crate::client::{messages_of, send_chat, Ask, Target};
use crate::tokens::{PromptMessage, PromptTokenizer, Role};
use crate::workload::{RequestSpec, Workload};
use crate::BenchError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenpath_otlp::SpanStore;
use tokenpath_timeline::{ClientRecord, Nanos};

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The server.
    pub target: Target,
    /// What to ask.
    pub workload: Workload,
    /// When to ask (open loop). With a multi-turn workload it starts sessions; a trace workload
    /// brings its own schedule and this is not used.
    pub arrival: Arrival,
    /// Closed loop instead: this many clients, each sending its next request as soon as its
    /// previous one ended (`t_sched = t_send`; the arrival process is not used).
    pub concurrency: Option<usize>,
    /// How many requests at most.
    pub num_requests: usize,
    /// Seed of the workload and the arrival process.
    pub seed: u64,
    /// Send nothing scheduled at or after this long into the run.
    pub duration: Option<Duration>,
    /// A linear rate ramp warping the arrival process (its rate is then ignored).
    pub ramp: Option<Ramp>,
    /// The model's tokenizer: exact prompt lengths, and client-side token counts on each record.
    pub tokenizer: Option<Arc<dyn PromptTokenizer>>,
    /// Incremented (relaxed) as each request goes out, for a live display of what was really sent
    /// ([`crate::progress::LiveStats::send_counter`]); a config cloned for several runs counts the
    /// sends of all of them.
    pub send_counter: Option<Arc<AtomicUsize>>,
    /// Where engines' spans arrive (`--otlp-listen`): each request then carries a fresh
    /// `traceparent`, announced to the store before it is sent.
    pub traces: Option<SpanStore>,
}

impl RunConfig {
    /// A config with no duration, ramp, tokenizer or send counter.
    pub fn new(target: Target, workload: Workload, arrival: Arrival, num_requests: usize, seed: u64) -> Self {
        RunConfig {
            target,
            workload,
            arrival,
            concurrency: None,
            num_requests,
            seed,
            duration: None,
            ramp: None,
            tokenizer: None,
            send_counter: None,
            traces: None,
        }
    }

    /// The open-loop send offsets the run will use (request starts, or session starts for a
    /// multi-turn workload); `None` in a closed loop. Deterministic for the config, so a progress
    /// display can be driven from it.
    pub fn send_offsets(&self) -> Result<Option<Vec<Duration>>, BenchError> {
        if self.concurrency.is_some() {
            return Ok(None);
        }
        let before_end = |t: &Duration| self.duration.is_none_or(|d| *t < d);
        if let Some(s) = self.workload.schedule() {
            return Ok(Some(s.into_iter().take(self.num_requests).take_while(before_end).collect()));
        }
        let starts = match self.workload.turns() {
            Some(turns) => self.num_requests.div_ceil(turns),
            None => self.num_requests,
        };
        self.arrival.plan(self.ramp.as_ref(), starts, self.duration, self.seed).map(Some)
    }
}

/// Progress callback: (requests ended, requests total, the record that just ended).
pub type Progress<'a> = &'a mut (dyn FnMut(usize, usize, &ClientRecord) + Send);

/// One request ready to go: its id and content.
type Job = (u64, RequestSpec);

/// What every send task shares.
#[derive(Clone)]
struct Ctx {
    client: reqwest::Client,
    target: Target,
    tok: Option<Arc<dyn PromptTokenizer>>,
    sent: Option<Arc<AtomicUsize>>,
    traces: Option<SpanStore>,
    t0: Instant,
    tx: tokio::sync::mpsc::UnboundedSender<ClientRecord>,
}

impl Ctx {
    /// Sends one request after `history`, records the client's token counts when it has a
    /// tokenizer (after the response, off the send path), hands the record over and returns the
    /// answer text and when the request ended.
    async fn send(
        &self,
        id: u64,
        spec: &RequestSpec,
        history: &[PromptMessage],
        t_sched: Option<Nanos>,
    ) -> (String, Nanos) {
        let messages = messages_of(spec, history);
        if let Some(sent) = &self.sent {
            sent.fetch_add(1, Ordering::Relaxed);
        }
        let trace = self.traces.as_ref().map(|store| {
            let tp = tokenpath_otlp::fresh_context();
            // A store that stopped only loses the join; the request still goes.
            let _ = store.expect(tp.trace_id);
            tp
        });
        let ask = Ask { id, messages: &messages, max_tokens: spec.max_tokens, t_sched, trace };
        let (mut rec, answer) = send_chat(&self.client, &self.target, ask, self.t0).await;
        if let Some(tok) = &self.tok {
            rec.prompt_tokens_hint = tok.count_chat(&messages).map(|n| n as u64);
            if rec.is_ok() {
                rec.retokenized_output = Some(tok.encode(&answer.text).len() as u64);
                crate::tokens::split_events(&mut rec, &answer.spoken, &answer.ends, tok.as_ref());
            }
        }
        let ended = rec.t_end().unwrap_or(rec.t_send);
        let _ = self.tx.send(rec);
        (answer.text, ended)
    }

    /// Runs jobs one after the other (a closed-loop client or one multi-turn session); a later
    /// turn of a session carries the earlier turns and answers. With `deadline`, sends nothing
    /// once it has passed (a session is cut short there).
    async fn sequence(&self, jobs: Vec<Job>, first_sched: Option<Nanos>, deadline: Option<Duration>) {
        let mut history: Vec<PromptMessage> = Vec::new();
        let mut session = None;
        let mut t_sched = first_sched;
        for (id, spec) in jobs {
            let this_session = spec.session.map(|s| s.session);
            let new_session = this_session.is_none() || this_session != session;
            if deadline.is_some_and(|d| self.t0.elapsed() >= d) {
                break;
            }
            if new_session {
                history.clear();
                session = this_session;
            }
            let (answer, ended) = self.send(id, &spec, &history, t_sched).await;
            if spec.session.is_some() {
                history.push(PromptMessage::new(Role::User, spec.prompt.clone()));
                history.push(PromptMessage::new(Role::Assistant, answer));
                // The next turn is due the moment this one ended (client work in between, such
                // as counting tokens, shows as schedule lag).
                t_sched = first_sched.map(|_| ended);
            } else {
                t_sched = None;
            }
        }
    }
}

/// Runs the load and returns one record per request, in id order.
pub async fn run(cfg: &RunConfig, progress: Progress<'_>) -> Result<Vec<ClientRecord>, BenchError> {
    if cfg.ramp.is_none() {
        cfg.arrival.validate()?;
    }
    if cfg.concurrency == Some(0) {
        return Err(BenchError::BadArrival("concurrency must be at least 1".into()));
    }
    if cfg.ramp.is_some() && (cfg.concurrency.is_some() || cfg.workload.schedule().is_some()) {
        return Err(BenchError::BadArrival(
            "a ramp shapes an open-loop rate: not with a closed loop or a trace's own schedule".into(),
        ));
    }
    let offsets = cfg.send_offsets()?;
    let turns = cfg.workload.turns();
    let n = match (&offsets, turns) {
        (Some(o), Some(t)) => (o.len() * t).min(cfg.num_requests),
        (Some(o), None) => o.len(),
        (None, _) => cfg.workload.len_limit().map_or(cfg.num_requests, |l| l.min(cfg.num_requests)),
    };
    if n == 0 {
        return Err(BenchError::NoRequests);
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| BenchError::Client(e.to_string()))?;
    let mut target = cfg.target.clone();
    if target.model.is_empty() {
        target.model = first_model(&client, &target).await?;
    }
    let specs = cfg.workload.requests_with(n, cfg.seed, cfg.tokenizer.as_deref());
    let total = specs.len();
    let t0 = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let ctx = Ctx {
        client,
        target,
        tok: cfg.tokenizer.clone(),
        sent: cfg.send_counter.clone(),
        traces: cfg.traces.clone(),
        t0,
        tx,
    };
    let mut tasks = tokio::task::JoinSet::new();
    let jobs = specs.into_iter().enumerate().map(|(id, spec)| (id as u64, spec));
    let start = tokio::time::Instant::from_std(t0);
    match (cfg.concurrency, offsets) {
        (Some(c), _) => {
            // Client k sends requests k, k + c, k + 2c, ... back to back; a multi-turn session
            // stays on one client.
            let mut lanes: Vec<Vec<Job>> = vec![Vec::new(); c];
            for (i, (id, spec)) in jobs.enumerate() {
                let lane = spec.session.map_or(i, |s| s.session) % c;
                lanes[lane].push((id, spec));
            }
            for lane in lanes.into_iter().filter(|l| !l.is_empty()) {
                let (ctx, deadline) = (ctx.clone(), cfg.duration);
                tasks.spawn(async move { ctx.sequence(lane, None, deadline).await });
            }
        }
        (None, Some(offsets)) if turns.is_some() => {
            // One task per session, started at its offset; its turns follow each other.
            let mut sessions: Vec<Vec<Job>> = vec![Vec::new(); offsets.len()];
            for (id, spec) in jobs {
                let s = spec.session.map_or(0, |s| s.session);
                if let Some(lane) = sessions.get_mut(s) {
                    lane.push((id, spec));
                }
            }
            for (lane, at) in sessions.into_iter().zip(offsets) {
                let (ctx, deadline) = (ctx.clone(), cfg.duration);
                tasks.spawn(async move {
                    tokio::time::sleep_until(start + at).await;
                    ctx.sequence(lane, Some(at.as_nanos() as Nanos), deadline).await;
                });
            }
        }
        (None, Some(offsets)) => {
            for ((id, spec), at) in jobs.zip(offsets) {
                let ctx = ctx.clone();
                tasks.spawn(async move {
                    tokio::time::sleep_until(start + at).await;
                    ctx.send(id, &spec, &[], Some(at.as_nanos() as Nanos)).await;
                });
            }
        }
        (None, None) => return Err(BenchError::BadArrival("an open-loop run needs a schedule".into())),
    }
    drop(ctx);
    let mut records = Vec::with_capacity(total);
    while let Some(rec) = rx.recv().await {
        progress(records.len() + 1, total, &rec);
        records.push(rec);
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| BenchError::Client(format!("request task failed: {e}")))?;
    }
    records.sort_by_key(|r| r.id);
    Ok(records)
}

/// The first model the server lists at `/v1/models`, for runs that did not name one.
pub async fn first_model(client: &reqwest::Client, target: &Target) -> Result<String, BenchError> {
    let url = format!("{}/v1/models", target.url.trim_end_matches('/'));
    let mut req = client.get(&url);
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    let fail =
        |why: String| BenchError::Client(format!("no --model given and {url} did not name one: {why}"));
    let body: serde_json::Value =
        req.send().await.map_err(|e| fail(e.to_string()))?.json().await.map_err(|e| fail(e.to_string()))?;
    body["data"][0]["id"].as_str().map(str::to_owned).ok_or_else(|| fail("empty model list".into()))
}
