use super::*;
use proptest::prelude::*;
use std::ops::Deref;
use tokenpath_engine::kv_cache::KvLayout;

/// A sequence with nothing but its core (what the simulator's sequences are, minus the clock).
#[derive(Debug)]
struct Plain(SeqCore, bool);

impl Deref for Plain {
    type Target = SeqCore;
    fn deref(&self) -> &SeqCore {
        &self.0
    }
}
impl DerefMut for Plain {
    fn deref_mut(&mut self) -> &mut SeqCore {
        &mut self.0
    }
}
impl Sequence for Plain {
    fn paused(&self) -> bool {
        self.1
    }
}

fn sched(blocks: usize, chunk: usize, prefix: bool) -> Scheduler<Plain> {
    let layout = KvLayout { n_layer: 1, kv_dim: 1, head_dim: 1, block_size: 4 };
    let cache = KvCache::new(layout, blocks).unwrap();
    Scheduler::new(cache, Policy { block_size: 4, prefill_chunk: chunk, max_batch: 8 }, prefix).unwrap()
}

fn seq(tokens: &[u32]) -> Plain {
    Plain(SeqCore::new(tokens.to_vec(), BlockHash::namespace(&[b"test"])), false)
}

/// Feeds the planned tokens as a forward step would (blocks reserved, lengths advanced) and
/// samples token `next` for every sequence whose tokens are all fed.
fn feed(s: &mut Scheduler<Plain>, plan: &[usize], next: u32) {
    for (q, &n) in s.running.iter_mut().zip(plan) {
        if n == 0 {
            continue;
        }
        let to = q.fed + n;
        s.cache.reserve(&mut q.0.table, to).unwrap();
        s.cache.set_len(&mut q.0.table, to).unwrap();
        q.fed = to;
        if q.unfed() == 0 {
            q.first_token_done = true;
            q.tokens.push(next);
        }
    }
    let mut running = std::mem::take(&mut s.running);
    for q in &mut running {
        s.register(q);
    }
    s.running = running;
}

#[test]
fn a_prompt_is_chunked_then_decoded_and_a_second_request_reuses_its_prefix() {
    let mut s = sched(64, 8, true);
    let prompt: Vec<u32> = (0..20).collect();
    s.waiting.push_back(seq(&prompt));
    let plan = s.plan(&mut ArenaOnly);
    assert_eq!(plan, vec![8]);
    feed(&mut s, &plan, 100);
    // 12 left under a chunk of 8: 4 left is more than an eighth of the chunk, so 8 then 4.
    assert_eq!(s.plan(&mut ArenaOnly), vec![8]);
    feed(&mut s, &[8], 100);
    assert_eq!(s.plan(&mut ArenaOnly), vec![4]);
    feed(&mut s, &[4], 100);
    assert!(s.running[0].is_decoding());
    // The same prompt again: its four whole blocks of the first 19 tokens are cached (the last
    // token is always computed), so it starts at 16.
    s.waiting.push_back(seq(&prompt));
    let plan = s.plan(&mut ArenaOnly);
    assert_eq!(plan, vec![1, 4]);
    assert_eq!(s.running[1].cached_tokens, 16);
    assert_eq!(s.counters.prompt_tokens_cached, 16);
}

#[test]
fn a_full_cache_preempts_the_youngest_and_frees_its_blocks() {
    // 6 blocks of 4: two sequences of 8-token prompts fit (2 blocks each + headroom).
    let mut s = sched(6, 64, false);
    s.waiting.push_back(seq(&[1; 8]));
    s.waiting.push_back(seq(&[2; 8]));
    let plan = s.plan(&mut ArenaOnly);
    assert_eq!(plan, vec![8, 8]);
    let mut t = 0;
    feed(&mut s, &plan, 7);
    // Decode until the two need more than the six blocks: the younger is preempted.
    while s.counters.preempted == 0 {
        let plan = s.plan(&mut ArenaOnly);
        feed(&mut s, &plan, 7);
        t += 1;
        assert!(t < 100, "never preempted");
    }
    assert_eq!(s.running.len(), 1);
    assert_eq!(s.waiting.len(), 1);
    assert_eq!(s.waiting[0].fed, 0, "a preempted sequence recomputes from scratch");
    assert!(s.waiting[0].table.blocks().is_empty());
}

#[test]
fn a_request_larger_than_the_cache_is_handed_back_to_fail() {
    let mut s = sched(2, 64, true);
    s.waiting.push_back(seq(&[5; 20]));
    let plan = s.plan(&mut ArenaOnly);
    assert!(plan.is_empty());
    match s.unstick() {
        Stuck::Fail(q) => assert_eq!(q.tokens.len(), 20),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert_eq!(s.cache.free_blocks(), 2);
}

#[test]
fn a_paused_sequence_is_parked_when_a_request_waits_and_resumes_ahead_of_newer_ones() {
    let mut s = sched(64, 64, false);
    s.waiting.push_back(seq(&[1; 8]));
    let plan = s.plan(&mut ArenaOnly);
    feed(&mut s, &plan, 3);
    s.running[0].1 = true;
    s.waiting.push_back(seq(&[2; 8]));
    let plan = s.plan(&mut ArenaOnly);
    assert_eq!(s.parked.len(), 1);
    assert!(s.parked[0].table.blocks().is_empty());
    assert_eq!(plan, vec![8]);
    s.parked[0].1 = false;
    s.resume_parked();
    assert_eq!(s.waiting.len(), 1);
}

proptest! {
    /// Whatever arrives, is cancelled or preempted, every block comes back: once every sequence
    /// is gone and the prefix cache is emptied, the cache is whole again.
    #[test]
    fn no_block_is_ever_lost(
        ops in proptest::collection::vec((0u8..4, 1usize..40, 0u32..3), 1..60),
        blocks in 4usize..40,
        chunk in 1usize..32,
        prefix in any::<bool>(),
    ) {
        let mut s = sched(blocks, chunk, prefix);
        for (i, (op, len, family)) in ops.into_iter().enumerate() {
            match op {
                0 | 1 => {
                    // Prompts of a family share their first tokens.
                    let prompt: Vec<u32> = (0..len as u32).map(|t| if t < 8 { family } else { t + i as u32 }).collect();
                    s.waiting.push_back(seq(&prompt));
                }
                2 => {
                    let mut k = 0;
                    s.reap(|_| { k += 1; k % 3 == 0 });
                }
                _ => {}
            }
            let plan = s.plan(&mut ArenaOnly);
            if plan.iter().all(|&n| n == 0) {
                if let Stuck::Fail(mut q) = s.unstick() {
                    prop_assert!(q.table.blocks().is_empty());
                    s.free(&mut q);
                }
            } else {
                feed(&mut s, &plan, 9);
            }
            // Every planned block was there: the plan never overcommits.
            prop_assert!(s.cache.used_blocks() <= s.cache.total_blocks());
        }
        s.reap(|_| true);
        s.reclaim(usize::MAX);
        prop_assert_eq!(s.cache.free_blocks(), s.cache.total_blocks());
    }
}
