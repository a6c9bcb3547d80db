//! The queue/scheduler stage: which sequences run in the next step, how many tokens each feeds,
//! who is admitted, preempted or parked, and which cached prefix a fresh sequence starts from.
//!
//! It is clock-free and compute-free on purpose. The worker's batcher calls it before every
//! forward step; the simulator (`tokenpath sim`) calls the very same code before every modelled
//! step, so a simulated run makes the same decisions — the same admissions, chunk sizes,
//! preemptions, prefix hits and block counts — as a real one given the same arrivals; only the
//! step's duration is modelled. That is why the block accounting here is the engine's own
//! allocator ([`KvCache`]; the simulator gives it a one-element layout, so it holds no KV worth
//! speaking of) and the prefix index is `tokenpath_kv`'s: nothing is re-implemented for the
//! simulator, so nothing can drift.
//!
//! Sequences are the caller's type ([`Sequence`]): the worker's carries channels, samplers and
//! timelines, the simulator's a virtual clock; both deref to the [`SeqCore`] the decisions read.
//! Where a prefix comes from past the arena (the host's KV pool) is the caller's too
//! ([`PrefixSource`]).

mod prefix;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::ops::DerefMut;
use tokenpath_engine::kv_cache::{BlockId, BlockTable, KvCache};
use tokenpath_kv::{BlockHash, PrefixCache};

pub use prefix::Attached;

/// Errors of the scheduler's set-up.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// The policy cannot schedule anything.
    #[error("invalid scheduling policy: {0}")]
    Policy(String),
    /// The block allocator could not be built.
    #[error(transparent)]
    Cache(#[from] tokenpath_engine::error::EngineError),
}

/// What a worker is configured to do per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most prompt tokens prefilled per step, over all sequences.
    pub prefill_chunk: usize,
    /// Most sequences running at once.
    pub max_batch: usize,
}

/// What every decision reads of a sequence: its tokens, how many are in the KV cache, and the
/// blocks that hold them.
#[derive(Debug)]
pub struct SeqCore {
    /// The prompt, then every sampled token.
    pub tokens: Vec<u32>,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub fed: usize,
    /// The blocks holding them.
    pub table: BlockTable,
    /// Chained hashes of the blocks registered in the prefix cache so far.
    pub hashes: Vec<BlockHash>,
    /// The root of the sequence's hash chain (the worker's namespace, scoped).
    pub root: BlockHash,
    /// The first token was sampled (here or, for a decode-mode sequence, on a prefill worker).
    pub first_token_done: bool,
    /// The first prefill chunk was scheduled.
    pub prefill_started: bool,
    /// Prompt tokens served from a cache at first admission (arena and pool).
    pub cached_tokens: usize,
    /// The chained hashes of the cacheable blocks of `tokens` when last attached, kept (a
    /// request waiting at the head of a full queue is attached again every step).
    pub prompt_hashes: Vec<BlockHash>,
}

impl SeqCore {
    /// A fresh sequence of `prompt` in the namespace `root`.
    pub fn new(prompt: Vec<u32>, root: BlockHash) -> Self {
        Self {
            prompt_len: prompt.len(),
            tokens: prompt,
            fed: 0,
            table: BlockTable::default(),
            hashes: Vec::new(),
            root,
            first_token_done: false,
            prefill_started: false,
            cached_tokens: 0,
            prompt_hashes: Vec::new(),
        }
    }

    /// Tokens not in the cache yet.
    pub fn unfed(&self) -> usize {
        self.tokens.len() - self.fed
    }

    /// A decoding sequence feeds exactly its last sampled token.
    pub fn is_decoding(&self) -> bool {
        self.first_token_done && self.unfed() == 1
    }
}

/// A sequence the scheduler can place: its [`SeqCore`] plus whether its reader keeps up.
pub trait Sequence: DerefMut<Target = SeqCore> {
    /// Its reader fell behind: not stepped until it catches up.
    fn paused(&self) -> bool {
        false
    }
    /// A parked sequence's reader caught up again.
    fn may_resume(&self) -> bool {
        true
    }
    /// It left the waiting queue for the running set (the worker gives back its queue slot).
    fn admitted(&mut self) {}
}

/// Where a fresh sequence's cached prefix comes from: the arena alone ([`ArenaOnly`]), or the
/// arena and then the host's KV pool (the worker's).
pub trait PrefixSource<S> {
    /// Attaches the longest cached prefix of `seq`'s prompt (see [`Scheduler::attach_arena`]).
    fn attach(&mut self, sched: &mut Scheduler<S>, seq: &mut S);
}

/// Prefixes from the arena's prefix cache only.
#[derive(Debug)]
pub struct ArenaOnly;

impl<S: Sequence> PrefixSource<S> for ArenaOnly {
    fn attach(&mut self, sched: &mut Scheduler<S>, seq: &mut S) {
        if let Some(a) = sched.attach_arena(seq) {
            let have = a.arena;
            sched.finish_attach(seq, a, have);
        }
    }
}

/// Counters of the decisions taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Sequences preempted or parked (their KV given up, recomputed later).
    pub preempted: u64,
    /// Prompt tokens served from a cache at first admission.
    pub prompt_tokens_cached: u64,
}

/// The queues, the block accounting and the prefix index of one worker.
#[derive(Debug)]
pub struct Scheduler<S> {
    /// The block allocator (the engine's cache on a worker).
    pub cache: KvCache,
    prefix: Option<PrefixCache<BlockId>>,
    /// The token ids of every block in the prefix cache, checked on every hit (a hit is served
    /// only for the very tokens it was computed from).
    prefix_tokens: prefix::BlockTokens,
    /// Sequences waiting for admission, oldest (or preempted) first.
    pub waiting: VecDeque<S>,
    /// Sequences in the batch, oldest first (the youngest is preempted first).
    pub running: Vec<S>,
    /// Paused sequences whose KV was given up for waiting requests.
    pub parked: Vec<S>,
    /// The per-step limits.
    pub policy: Policy,
    /// What was decided so far.
    pub counters: Counters,
}

/// What to do when a step could plan nothing.
#[derive(Debug)]
pub enum Stuck<S> {
    /// Only paused sequences: wait for a reader.
    Paused,
    /// The youngest running sequence was preempted to make room.
    Preempted,
    /// This sequence can never fit the cache (its blocks are freed): fail it.
    Fail(S),
    /// Nothing to do.
    Idle,
}

impl<S: Sequence> Scheduler<S> {
    /// A scheduler over `cache`, with a prefix cache when `prefix_cache`.
    pub fn new(mut cache: KvCache, policy: Policy, prefix_cache: bool) -> Result<Self, SchedError> {
        if policy.block_size == 0 || policy.prefill_chunk == 0 || policy.max_batch == 0 {
            return Err(SchedError::Policy(format!("{policy:?}")));
        }
        if cache.layout().block_size != policy.block_size {
            return Err(SchedError::Policy(format!(
                "block size {} differs from the cache's {}",
                policy.block_size,
                cache.layout().block_size
            )));
        }
        if prefix_cache {
            cache.track_shared();
        }
        Ok(Self {
            cache,
            prefix: prefix_cache.then(PrefixCache::new),
            prefix_tokens: prefix::BlockTokens::new(policy.block_size),
            waiting: VecDeque::new(),
            running: Vec::new(),
            parked: Vec::new(),
            policy,
            counters: Counters::default(),
        })
    }

    /// Blocks the prefix cache holds.
    pub fn cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::len)
    }

    /// The block the prefix cache holds under `hash`, if any (nothing is touched).
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.prefix.as_ref().and_then(|p| p.peek(hash))
    }

    /// Whether a prefix cache is kept.
    pub fn has_prefix_cache(&self) -> bool {
        self.prefix.is_some()
    }

    /// Releases a sequence's blocks (it keeps its tokens: fed again from 0 if it comes back).
    pub fn free(&mut self, seq: &mut SeqCore) {
        if let Err(e) = self.cache.free_table(&mut seq.table) {
            tracing::error!("freeing KV blocks failed: {e}");
        }
        seq.fed = 0;
    }

    /// Drops every sequence `gone` says is gone (its client went away), returning its blocks;
    /// how many were dropped.
    pub fn reap(&mut self, mut gone: impl FnMut(&S) -> bool) -> usize {
        let mut tables = Vec::new();
        let mut take = |s: &mut S| {
            let g = gone(s);
            if g {
                tables.push(std::mem::take(&mut s.table));
            }
            !g
        };
        self.running.retain_mut(&mut take);
        self.parked.retain_mut(&mut take);
        self.waiting.retain_mut(&mut take);
        let n = tables.len();
        for mut table in tables {
            if let Err(e) = self.cache.free_table(&mut table) {
                tracing::error!("freeing KV blocks of a cancelled request failed: {e}");
            }
        }
        n
    }

    /// Queues parked sequences whose readers caught up again (ahead of newer requests).
    pub fn resume_parked(&mut self) {
        let mut i = 0;
        while i < self.parked.len() {
            if self.parked[i].may_resume() {
                let seq = self.parked.swap_remove(i);
                self.waiting.push_front(seq);
            } else {
                i += 1;
            }
        }
    }

    /// With a request waiting for room, paused sequences give their KV up (they recompute it on
    /// resuming): a client that stopped reading never holds blocks another request needs.
    fn park_paused(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].paused() {
                let mut seq = self.running.remove(i);
                self.free(&mut seq);
                tracing::debug!("parked: its reader is behind and a request waits");
                self.counters.preempted += 1;
                self.parked.push(seq);
            } else {
                i += 1;
            }
        }
    }

    /// Moves the youngest running sequence back to the front of the waiting queue.
    pub fn preempt_youngest(&mut self) -> bool {
        let Some(mut seq) = self.running.pop() else { return false };
        self.free(&mut seq);
        tracing::debug!("preempted: KV cache full");
        self.counters.preempted += 1;
        self.waiting.push_front(seq);
        true
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.policy.block_size)
    }

    /// New blocks `s` needs to hold `n` more tokens.
    fn new_blocks(&self, s: &SeqCore, n: usize) -> usize {
        self.blocks_for(s.fed + n).saturating_sub(s.table.blocks().len())
    }

    /// Prompt tokens a sequence with `unfed` left feeds this step with `budget` left: the budget,
    /// or the whole rest when what the budget would leave is at most an eighth of a chunk (a
    /// 543-token prompt under a 512-token chunk takes one step, not a second one for 31 tokens —
    /// a whole step of time to first token for ~6% more work in that step).
    fn chunk_of(&self, unfed: usize, budget: usize) -> usize {
        let n = unfed.min(budget);
        if n > 0 && unfed - n <= self.policy.prefill_chunk / 8 {
            unfed
        } else {
            n
        }
    }

    /// Decides how many tokens each running sequence feeds this step, admitting waiting ones.
    /// `plan[i]` belongs to `running[i]`; 0 means "not this step". The KV of every planned token
    /// fits the blocks the cache has (reclaimed from the prefix cache as needed).
    pub fn plan(&mut self, source: &mut impl PrefixSource<S>) -> Vec<usize> {
        self.park_paused();
        // Decodes first: they may preempt the youngest sequences to get their next block.
        loop {
            let need: usize = self
                .running
                .iter()
                .filter(|s| s.is_decoding() && !s.paused())
                .map(|s| self.new_blocks(s, 1))
                .sum();
            if need <= self.available() || self.running.len() <= 1 {
                break;
            }
            self.preempt_youngest();
        }
        let bs = self.policy.block_size;
        let mut planned = 0;
        let mut free = self.available();
        let mut budget = self.policy.prefill_chunk;
        let mut plan = vec![0; self.running.len()];
        for (i, s) in self.running.iter().enumerate() {
            if s.is_decoding() && !s.paused() {
                let need = self.new_blocks(s, 1);
                if need <= free {
                    free -= need;
                    planned += need;
                    plan[i] = 1;
                }
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.is_decoding() || budget == 0 {
                continue;
            }
            let fits = ((s.table.blocks().len() + free) * bs).saturating_sub(s.fed);
            let n = self.chunk_of(s.unfed(), budget).min(fits);
            if n == 0 {
                continue;
            }
            let need = self.new_blocks(s, n);
            free -= need;
            planned += need;
            budget = budget.saturating_sub(n);
            plan[i] = n;
        }
        // Admission: FIFO, whole prompt must fit, one block of headroom per decoding sequence.
        let headroom = self.running.iter().filter(|s| s.is_decoding()).count();
        while budget > 0 && self.running.len() < self.policy.max_batch {
            let Some(mut seq) = self.waiting.pop_front() else { break };
            let attached = seq.table.blocks().is_empty();
            source.attach(self, &mut seq);
            // Sharing may have pinned blocks that were reclaimable: count again.
            let free_now = self.available().saturating_sub(planned);
            let need_all = self.blocks_for(seq.tokens.len()).saturating_sub(seq.table.blocks().len());
            if need_all + headroom > free_now {
                if attached {
                    // A waiting sequence must not pin cached blocks others were planned on.
                    self.free(&mut seq);
                }
                self.waiting.push_front(seq);
                break;
            }
            seq.admitted();
            let n = self.chunk_of(seq.unfed(), budget);
            let need = self.new_blocks(&seq, n);
            planned += need;
            budget = budget.saturating_sub(n);
            self.running.push(seq);
            plan.push(n);
        }
        self.reclaim(planned);
        plan
    }

    /// A step planned nothing: makes room (preempting the youngest running sequence), or hands
    /// back the one request that can never fit the cache, its blocks freed, for the caller to fail.
    pub fn unstick(&mut self) -> Stuck<S> {
        if self.waiting.is_empty() && self.running.iter().any(|s| s.paused()) {
            return Stuck::Paused;
        }
        let total = self.cache.total_blocks();
        if self.running.len() > 1 {
            self.preempt_youngest();
            return Stuck::Preempted;
        }
        let all_free = self.available() == total;
        let lone = match self.running.pop() {
            Some(s) => Some(s),
            None if all_free => self.waiting.pop_front(),
            None => None,
        };
        match lone {
            Some(mut seq) => {
                self.free(&mut seq);
                Stuck::Fail(seq)
            }
            None => Stuck::Idle,
        }
    }
}
