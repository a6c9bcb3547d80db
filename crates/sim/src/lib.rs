//! `tokenpath sim`: a discrete-event simulator of tokenpath serving, so "colocated or PD, how
//! many of each, at this rate and context?" can be asked of hardware and loads we cannot run.
//!
//! It is shaped around one rule: share the decisions, model only the compute. Every step is
//! planned by the worker's own scheduler (`tokenpath_scheduler`: admission, chunked prefill,
//! preemption, the prefix cache, block accounting), requests are placed by the gateway's own
//! cache-aware choice (`tokenpath_gateway::route`), and only a step's duration, the gap between
//! steps and the KV transfer are modelled — by a [`Calibration`] fitted from a real worker's
//! step log (`calib.rs`, non-negative least squares plus the measured residuals). The output is
//! the bench's own `ClientRecord`s with a `ServerTiming` per request on the virtual clock, so
//! `tokenpath report`, `compare` and the HTML report read a simulated run like a measured one,
//! and "sim vs real" is one `tokenpath compare`.

pub mod calib;
mod engine;
mod nnls;
pub mod plan;
pub mod requests;

pub use calib::{Calibration, LinkModel, Provenance, StepShape};
pub use requests::{ByteTokenizer, Input, Prompt, SimRequest};

use serde::Serialize;
use std::collections::BTreeMap;
use tokenpath_protocol::work::StepRecord;
use tokenpath_timeline::{ClientRecord, FinishReason, RequestId, StreamEvent, Usage, WorkerId};

/// Errors of a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The topology or worker shape cannot run.
    #[error("invalid simulation: {0}")]
    Config(String),
    /// The calibration cannot be fitted or used.
    #[error("calibration: {0}")]
    Calibration(String),
    /// The workload cannot be turned into requests.
    #[error("workload: {0}")]
    Workload(String),
}

/// The serving topology.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// Colocated workers (each runs prefill and decode); 0 with PD.
    pub colocated: usize,
    /// Prefill workers.
    pub prefill: usize,
    /// Decode workers.
    pub decode: usize,
}

/// Each worker's limits (`tokenpath serve`'s flags of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerShape {
    /// KV blocks per worker.
    pub kv_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Most prompt tokens per step.
    pub prefill_chunk: usize,
    /// Most sequences per step.
    pub max_batch: usize,
    /// Keep a prefix cache.
    pub prefix_cache: bool,
    /// The model's context length.
    pub n_ctx: usize,
}

/// A simulation's set-up.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimConfig {
    /// Who serves.
    pub topology: Topology,
    /// Each worker's limits.
    pub worker: WorkerShape,
    /// Seed of the residual draws.
    pub seed: u64,
    /// Keep every simulated step (a step log like `--step-log`'s).
    pub keep_steps: bool,
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Normally.
    Finished(FinishReason),
    /// With this error.
    Failed(String),
}

/// What the run did, beyond the records.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimStats {
    /// Steps run over all workers.
    pub steps: u64,
    /// Sequences preempted or parked.
    pub preempted: u64,
    /// Each worker's busy seconds (inside steps).
    pub busy_s: Vec<(String, f64)>,
    /// The virtual time the run took, seconds.
    pub sim_seconds: f64,
}

/// A simulated run.
#[derive(Clone, Debug)]
pub struct SimOutput {
    /// One record per request, in id order, as the bench would have recorded it.
    pub records: Vec<ClientRecord>,
    /// Every step, by worker, when [`SimConfig::keep_steps`].
    pub steps: Vec<(String, StepRecord)>,
    /// Counters.
    pub stats: SimStats,
}

/// The timing of each kind of worker: PD workers usually have fewer cores each than a
/// colocated one, so they step at their own speed.
#[derive(Clone, Copy, Debug)]
pub struct Calibrations<'a> {
    /// Colocated workers, and every worker without its own; also the gateway's time and the link.
    pub default: &'a Calibration,
    /// Prefill workers'.
    pub prefill: Option<&'a Calibration>,
    /// Decode workers'.
    pub decode: Option<&'a Calibration>,
}

/// Simulates `input` on `cfg` with `calib`'s timing for every worker.
pub fn simulate(cfg: &SimConfig, calib: &Calibration, input: &Input) -> Result<SimOutput, SimError> {
    simulate_with(cfg, &Calibrations { default: calib, prefill: None, decode: None }, input)
}

/// Simulates `input` on `cfg`, each kind of worker with its own timing.
pub fn simulate_with(
    cfg: &SimConfig,
    calib: &Calibrations<'_>,
    input: &Input,
) -> Result<SimOutput, SimError> {
    for c in [Some(calib.default), calib.prefill, calib.decode].into_iter().flatten() {
        c.check()?;
    }
    let w = &cfg.worker;
    if w.kv_blocks == 0 || w.block_size == 0 || w.prefill_chunk == 0 || w.max_batch == 0 || w.n_ctx < 2 {
        return Err(SimError::Config(format!("{w:?}")));
    }
    let mut sim = engine::Sim::new(cfg, calib, input)?;
    sim.run();
    let mut records = Vec::with_capacity(input.requests.len());
    let mut end = 0;
    for (req, st) in input.requests.iter().zip(&sim.reqs) {
        let Some(t0) = st.arrived else { continue };
        let mut rec = ClientRecord::new(RequestId(req.id), t0, t0, true);
        rec.events = st.tokens.iter().map(|&at| StreamEvent { at_ns: at, tokens: 1 }).collect();
        rec.t_done = st.done;
        end = end.max(st.done.unwrap_or(t0));
        let mut timing = st.timeline.timing();
        timing.cached_tokens = st.cached as u64;
        timing.kv_transfer_bytes = st.kv_bytes;
        timing.workers =
            st.workers.iter().map(|(k, v)| (k.clone(), WorkerId(v.clone()))).collect::<BTreeMap<_, _>>();
        match &st.outcome {
            Some(Outcome::Finished(reason)) => {
                rec.outcome =
                    tokenpath_timeline::Outcome::Ok { finish_reason: Some(reason_name(*reason).into()) };
                rec.usage = Some(Usage {
                    prompt_tokens: req.prompt.len() as u64,
                    completion_tokens: st.tokens.len() as u64,
                    cached_tokens: Some(st.cached as u64),
                });
            }
            Some(Outcome::Failed(m)) => {
                rec.outcome =
                    tokenpath_timeline::Outcome::Failed { kind: "http_500".into(), message: m.clone() };
            }
            None => {
                rec.outcome = tokenpath_timeline::Outcome::Failed {
                    kind: "stream_error".into(),
                    message: "never ended".into(),
                };
            }
        }
        rec.server = Some(timing);
        records.push(rec);
    }
    sim.stats.sim_seconds = end as f64 / 1e9;
    Ok(SimOutput { records, steps: std::mem::take(&mut sim.steps), stats: sim.stats.clone() })
}

fn reason_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    }
}

#[cfg(test)]
mod tests;
