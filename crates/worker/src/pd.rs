//! The decode half of prefill/decode disaggregation inside the batcher: a decode-mode request
//! waits in `awaiting` with its blocks reserved until two things have arrived — its KV (from the
//! prefill worker, over its own connection) and its first token (from the gateway) — in either
//! order. Then it joins the waiting queue at the front, already holding its KV, and decodes like
//! any other sequence.
//!
//! Nothing from the wire is trusted: a chunk outside the reserved blocks, a token count that is
//! not the prompt's, a transfer the sender could not finish, or a transfer that is still missing
//! `KV_WAIT_AFTER_HANDOFF` after the first token arrived all end the same way: the KV is
//! declared failed and the prompt is recomputed here (the prompt ids came with the request),
//! which the timeline records as `kv_recomputed`. The client sees a slower token, never a wrong
//! one.
//!
//! Over the network the KV does not pass through the batcher at all: the task receiving the
//! transfer borrows the request's reserved blocks ([`KvBlocks`], a lease of the cache) and
//! reads the socket straight into them, so the batcher neither copies the bytes nor waits for
//! them between steps. It gets the blocks back with the verdict (or, if the receiver goes away,
//! when the [`KvBlocks`] is dropped), and only then does anything read them.

use crate::batcher::{Batcher, Command};
use crate::seq::{Ending, KvState, Seq};
use crate::WorkerError;
use crate::{Transfer, WorkMode};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokenpath_engine::kv_cache::KvLease;
use tokenpath_engine::sampling::SamplerState;
use tokenpath_timeline::Mark;
use tokio::sync::oneshot;

/// A decode-mode request's reserved KV blocks, lent to the task receiving its transfer
/// ([`crate::WorkerHandle::kv_lease`]). Write the transfer's bytes into them, then hand them
/// back with the verdict ([`KvBlocks::end`]); dropping them instead returns them unverified and
/// the transfer counts as failed.
#[derive(Debug)]
pub struct KvBlocks {
    transfer: Transfer,
    lease: Option<KvLease>,
    tx: mpsc::Sender<Command>,
}

impl KvBlocks {
    pub(crate) fn new(transfer: Transfer, lease: KvLease, tx: mpsc::Sender<Command>) -> Self {
        Self { transfer, lease: Some(lease), tx }
    }

    /// Blocks lent (the prompt's).
    pub fn blocks(&self) -> usize {
        self.lease.as_ref().map_or(0, KvLease::blocks)
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.lease.as_ref().map_or(0, KvLease::block_bytes)
    }

    /// The bytes of block `i` (little-endian f16, the wire format), `None` past the last one.
    pub fn block_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        self.lease.as_mut()?.block_mut(i)
    }

    /// The transfer of `n_tokens` tokens ended, intact (`ok`) or not: the blocks go back and the
    /// receiver says whether (and when) they were imported, as [`crate::WorkerHandle::kv_end`].
    pub fn end(
        mut self,
        n_tokens: usize,
        ok: bool,
    ) -> Result<oneshot::Receiver<Result<Instant, String>>, WorkerError> {
        let (reply, rx) = oneshot::channel();
        let lease = self.lease.take();
        let cmd = Command::KvEnd { transfer: self.transfer, n_tokens, ok, lease, reply };
        self.tx.send(cmd).map_err(|_| WorkerError::Stopped)?;
        Ok(rx)
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            // A stopped worker has dropped its cache; the lease's memory goes with this value.
            let _ = self.tx.send(Command::ReturnLease { transfer: self.transfer.id, lease });
        }
    }
}

/// How long a decode-mode request waits for its KV after the handoff before recomputing it.
pub(crate) const KV_WAIT_AFTER_HANDOFF: Duration = Duration::from_secs(10);
/// How long a decode-mode request waits for its handoff at all by default
/// ([`crate::WorkerConfig::handoff_wait`]; its prompt's KV blocks are reserved meanwhile): long
/// enough for a long prompt's queue wait and prefill elsewhere.
pub const HANDOFF_WAIT: Duration = Duration::from_secs(120);

/// Whether `seq` waits for the transfer with id `id` (whatever its token: only for messages
/// that come on the request's own connection or from inside the worker).
fn awaits_id(seq: &Seq, id: u64) -> bool {
    matches!(seq.mode, WorkMode::Decode(t) if t.id == id)
}

impl Batcher {
    fn awaiting_mut(&mut self, transfer: u64) -> Option<&mut Seq> {
        self.awaiting.iter_mut().find(|s| awaits_id(s, transfer))
    }

    /// The awaiting request whose transfer is `transfer`, id and token both (a wrong token finds
    /// nothing, exactly like an unknown id: the peer learns nothing from the difference).
    fn awaiting_idx(&self, transfer: Transfer) -> Option<usize> {
        self.awaiting.iter().position(|s| s.mode == WorkMode::Decode(transfer))
    }

    /// A new decode-mode request: reserve blocks for its prompt's KV and wait.
    pub(crate) fn await_kv(&mut self, mut seq: Seq) {
        if let Err(e) = self.sched.reserve_prompt(&mut seq) {
            seq.end(
                Ending::Failed(format!("no room for the transferred KV: {e}")),
                Instant::now(),
                &self.cfg.id,
            );
            return;
        }
        self.awaiting.push(seq);
    }

    pub(crate) fn kv_chunk(&mut self, transfer: Transfer, first_block: u32, bytes: &[u8]) {
        let now = Instant::now();
        let Some(idx) = self.awaiting_idx(transfer) else {
            tracing::debug!(transfer = transfer.id, "KV chunk for an unknown or finished transfer");
            return;
        };
        let seq = &self.awaiting[idx];
        if seq.kv != KvState::Pending {
            return;
        }
        if let Err(e) = self.sched.cache.write_blocks(&seq.table, first_block as usize, bytes) {
            tracing::warn!(transfer = transfer.id, "bad KV chunk: {e}");
            self.awaiting[idx].kv = KvState::Failed(now);
        }
    }

    /// Lends the reserved blocks of `transfer` (a transfer of `n_tokens` tokens) to its receiver.
    pub(crate) fn kv_lease(&mut self, transfer: Transfer, n_tokens: usize) -> Result<KvLease, String> {
        let Some(idx) = self.awaiting_idx(transfer) else {
            return Err(format!("transfer {} is not expected here", transfer.id));
        };
        let seq = &mut self.awaiting[idx];
        let transfer = transfer.id;
        if seq.kv != KvState::Pending || seq.kv_lent {
            return Err(format!("transfer {transfer} is already being received or over"));
        }
        if n_tokens != seq.prompt_len {
            return Err(format!("the transfer holds {n_tokens} tokens, the prompt has {}", seq.prompt_len));
        }
        let lease = self.sched.cache.lease(&mut seq.table).map_err(|e| e.to_string())?;
        seq.kv_lent = true;
        Ok(lease)
    }

    /// Lent blocks come back: to their request if it still waits for them, else to the cache.
    pub(crate) fn return_lease(&mut self, transfer: u64, lease: KvLease) {
        let mut table = match self.sched.cache.end_lease(lease) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(transfer, "taking back lent KV blocks: {e}");
                return;
            }
        };
        match self.awaiting.iter_mut().find(|s| awaits_id(s, transfer) && s.kv_lent) {
            Some(seq) => {
                seq.table = table;
                seq.kv_lent = false;
            }
            // Cancelled, or given up on and recomputing with blocks of its own.
            None => {
                if let Err(e) = self.sched.cache.free_table(&mut table) {
                    tracing::error!(transfer, "freeing returned KV blocks: {e}");
                }
            }
        }
    }

    /// A transfer's end. Without the transfer's token nothing changes; with it, a verdict from
    /// anyone but the receiver holding the blocks (a second `KvBegin` of the same transfer)
    /// changes nothing either, so only the one transfer in progress decides.
    pub(crate) fn kv_end(
        &mut self,
        transfer: Transfer,
        n_tokens: usize,
        ok: bool,
    ) -> Result<Instant, String> {
        let now = Instant::now();
        let Some(idx) = self.awaiting_idx(transfer) else {
            return Err(format!("transfer {} is not expected here", transfer.id));
        };
        let transfer = transfer.id;
        let seq = &mut self.awaiting[idx];
        if seq.kv_lent {
            return Err("the transfer is being received on another connection".to_owned());
        }
        let result = if seq.kv != KvState::Pending {
            Err("a chunk of the transfer was rejected".to_owned())
        } else if !ok {
            Err("the transfer was incomplete or corrupted".to_owned())
        } else if n_tokens != seq.prompt_len {
            Err(format!("the transfer holds {n_tokens} tokens, the prompt has {}", seq.prompt_len))
        } else {
            self.sched.cache.set_len(&mut seq.table, n_tokens).map_err(|e| e.to_string())
        };
        match &result {
            Ok(()) => {
                seq.kv = KvState::Done(now);
                self.stats.kv_imports += 1;
            }
            Err(e) => {
                tracing::warn!(transfer, "KV transfer failed, the prompt will be recomputed: {e}");
                seq.kv = KvState::Failed(now);
            }
        }
        result.map(|()| now)
    }

    pub(crate) fn set_handoff(&mut self, transfer: u64, first_token: u32, sampler: SamplerState) {
        match self.awaiting_mut(transfer) {
            Some(seq) => seq.handoff = Some((first_token, sampler, Instant::now())),
            None => tracing::debug!(transfer, "handoff for an unknown or finished transfer"),
        }
    }

    /// Moves every decode-mode request that has both its KV (or a verdict on it) and its first
    /// token to the front of the waiting queue; fails or falls back on the ones out of time.
    pub(crate) fn activate_ready(&mut self) {
        if self.awaiting.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.awaiting.len() {
            let s = &mut self.awaiting[i];
            if let (Some((_, _, at)), KvState::Pending) = (s.handoff, s.kv) {
                if now.duration_since(at) > KV_WAIT_AFTER_HANDOFF {
                    tracing::warn!(request = %s.id, "KV transfer timed out, recomputing the prompt");
                    s.kv = KvState::Failed(now);
                }
            }
            if s.handoff.is_none() && now.duration_since(s.arrived) > self.cfg.handoff_wait {
                let mut seq = self.awaiting.swap_remove(i);
                self.free(&mut seq);
                seq.end(Ending::Failed("the first token never arrived".into()), now, &self.cfg.id);
                continue;
            }
            let s = &self.awaiting[i];
            if s.handoff.is_none() || s.kv == KvState::Pending {
                i += 1;
                continue;
            }
            let seq = self.awaiting.remove(i);
            self.activate(seq);
        }
    }

    fn activate(&mut self, mut seq: Seq) {
        let Some((first, sampler, _)) = seq.handoff else { return };
        seq.sampler.continue_from(sampler, &[first]);
        match seq.kv {
            KvState::Done(at) => {
                seq.stamp(Mark::KvTransferEnd, at);
                seq.fed = seq.prompt_len;
                seq.first_token_done = true;
                seq.prefill_started = true;
            }
            other => {
                seq.stamp(Mark::KvTransferEnd, at_or_now(other));
                seq.recomputed = true;
                self.stats.kv_fallbacks += 1;
                if let Err(e) = self.sched.cache.set_len(&mut seq.table, 0) {
                    tracing::error!("resetting a failed transfer's blocks: {e}");
                }
                seq.fed = 0;
            }
        }
        if let Err(e) = seq.replay_first(&self.engine, first) {
            self.free(&mut seq);
            seq.end(Ending::Failed(e), Instant::now(), &self.cfg.id);
            return;
        }
        self.sched.waiting.push_front(seq);
    }
}

fn at_or_now(kv: KvState) -> Instant {
    match kv {
        KvState::Done(at) | KvState::Failed(at) => at,
        KvState::Pending => Instant::now(),
    }
}
