//! The PD transfer's part of the event loop: exported blocks go onto a modelled link into the
//! decode worker, and the decode worker takes a landed transfer in only between its steps — as
//! the real batcher does, which reads a transfer's end (`Command::KvEnd`) from its command
//! channel before planning a step, never during one. A transfer whose bytes land mid-step ends
//! when that step and its gap are over: measured on the real 1P1D runs of the fifth, eighth and
//! ninth rounds, such a transfer's stage matched the rest of the step in flight to within 0.5 ms,
//! and that wait was most of the stage's tail.

use super::{us_to_ns, Event, Sim, SimSeq};
use crate::Outcome;
use tokenpath_timeline::{Mark, Nanos};

impl Sim<'_> {
    /// Prefill mode: the blocks filled since the last export go onto the link to the request's
    /// decode worker (all of them, the partial last one included, at the handoff).
    pub(super) fn export(&mut self, s: &mut SimSeq, last: bool, bytes_per_token: u64, bs: usize) {
        let upto = if last { s.table.blocks().len() } else { (s.fed / bs).min(s.table.blocks().len()) };
        if upto <= s.exported_blocks {
            return;
        }
        let Some(d) = self.reqs[s.req].decode_worker else { return };
        let bytes = (upto - s.exported_blocks) as u64 * bs as u64 * bytes_per_token;
        s.exported_blocks = upto;
        let link = self.calib.link;
        let dw = &mut self.workers[d];
        let start = dw.link_free_at.max(self.now);
        dw.link_free_at = start + (bytes as f64 / link.bytes_per_s * 1e9).round() as Nanos;
        *self.reqs[s.req].kv_bytes.get_or_insert(0) += bytes;
    }

    pub(super) fn handoff(&mut self, r: usize, t1: Nanos) {
        let Some(d) = self.reqs[r].decode_worker else { return };
        self.stamp(r, Mark::KvTransferStart, t1);
        let ready = self.workers[d].link_free_at.max(t1) + us_to_ns(self.calib.link.latency_us);
        self.push(ready, Event::KvReady { worker: d, req: r });
    }

    /// A request that ended on its prefill worker without a handoff gives its decode blocks back.
    pub(super) fn drop_awaiting(&mut self, r: usize) {
        let Some(d) = self.reqs[r].decode_worker.take() else { return };
        let dw = &mut self.workers[d];
        if let Some(i) = dw.awaiting.iter().position(|s| s.req == r) {
            let mut s = dw.awaiting.swap_remove(i);
            dw.sched.free(&mut s);
            dw.in_flight = dw.in_flight.saturating_sub(1);
        }
    }

    /// A transfer's last byte (and the link's latency) reached decode worker `worker`: taken in
    /// now when the worker is idle, else at the end of its step and gap ([`Sim::take_landed`]).
    pub(super) fn kv_ready(&mut self, worker: usize, req: usize) {
        if self.workers[worker].busy {
            self.workers[worker].landed.push(req);
            return;
        }
        self.take_in(worker, req);
        self.wake(worker);
    }

    /// The worker is between steps: every transfer that landed during the last one is taken in
    /// (all before the next plan, as the batcher drains its commands before planning).
    pub(super) fn take_landed(&mut self, worker: usize) {
        for req in std::mem::take(&mut self.workers[worker].landed) {
            self.take_in(worker, req);
        }
    }

    /// The transfer ends now: the request's KV is in its blocks and it waits to decode.
    fn take_in(&mut self, worker: usize, req: usize) {
        let d = worker;
        let Some(i) = self.workers[d].awaiting.iter().position(|s| s.req == req) else { return };
        let mut s = self.workers[d].awaiting.swap_remove(i);
        self.stamp(req, Mark::KvTransferEnd, self.now);
        let len = s.prompt_len;
        let dw = &mut self.workers[d];
        if dw.sched.cache.set_len(&mut s.core.table, len).is_err() {
            dw.sched.free(&mut s);
            dw.in_flight = dw.in_flight.saturating_sub(1);
            return self.end(req, Outcome::Failed("transferred KV does not fit its blocks".into()));
        }
        s.fed = len;
        let first = self.input.requests[req].answer.first().copied().unwrap_or(0);
        s.tokens.push(first);
        s.generated = 1;
        dw.sched.waiting.push_front(s);
    }
}
