//! What the simulated clients send: the bench's workloads turned into prompt token ids, and the
//! Mooncake traces' block hashes turned into token ids with the same sharing structure.
//!
//! A prompt's ids come from the model's tokenizer and chat template when one is given (the
//! prompts a real run sends, token for token), otherwise from [`ByteTokenizer`]: one token per
//! byte, exact counts, and the same shared prefixes as the real prompts. A multi-turn session's
//! later turn carries the earlier turns and answers, like the bench's; the simulated answer is
//! prose of the requested length (a real model's words differ, their count does not).

use crate::SimError;
use std::sync::Arc;
use tokenpath_bench::client::messages_of;
use tokenpath_bench::tokens::{exact_prose, PromptMessage, PromptTokenizer, Role};
use tokenpath_bench::workload::Workload;
use tokenpath_protocol::ProtocolError;
use tokenpath_timeline::Nanos;

/// A prompt's token ids, or how to make them: a trace of a million long prompts would not fit in
/// memory as ids, so a trace's prompts are made when their request is admitted.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// The ids themselves.
    Tokens(Vec<u32>),
    /// `len` ids from blocks of [`MOONCAKE_BLOCK`] ids each derived from a hash id.
    Blocks {
        /// One hash id per block.
        ids: Vec<u64>,
        /// Ids in the prompt.
        len: usize,
        /// Vocabulary size the ids are drawn from.
        vocab: u32,
    },
}

impl Prompt {
    /// Ids in the prompt.
    pub fn len(&self) -> usize {
        match self {
            Prompt::Tokens(t) => t.len(),
            Prompt::Blocks { len, .. } => *len,
        }
    }

    /// Whether it has no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids.
    pub fn tokens(&self) -> Vec<u32> {
        match self {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Blocks { ids, len, vocab } => {
                let mut out = Vec::with_capacity(*len);
                'blocks: for &id in ids {
                    for j in 0..MOONCAKE_BLOCK as u64 {
                        if out.len() == *len {
                            break 'blocks;
                        }
                        out.push((mix(id, j) % u64::from((*vocab).max(1))) as u32);
                    }
                }
                out
            }
        }
    }
}

/// One simulated request.
#[derive(Clone, Debug, PartialEq)]
pub struct SimRequest {
    /// Its id (the bench's numbering).
    pub id: u64,
    /// The prompt's token ids as the server runs them.
    pub prompt: Prompt,
    /// The tokens it generates (its length is `max_tokens`: outputs run to their limit, as with
    /// `ignore_eos`).
    pub answer: Vec<u32>,
}

/// When each request is sent: at a fixed offset, or when another request ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Send {
    /// At this offset from the run's start.
    At(Nanos),
    /// When request `.0` (an index) ended: a closed-loop client's next request, a session's next
    /// turn.
    After(usize),
}

/// Every request of a run and when it goes out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Input {
    /// The requests, by index.
    pub requests: Vec<SimRequest>,
    /// When each is sent.
    pub send: Vec<Send>,
}

/// One token per byte of text; the chat "template" is `role: content\n` per message and
/// `assistant: ` after them. Exact counts without a model file.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl PromptTokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().map(|&i| (i & 0xff) as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn chat_prompt(&self, messages: &[PromptMessage], limit: usize) -> Result<Vec<u32>, ProtocolError> {
        let mut out = Vec::new();
        for m in messages {
            out.extend(self.encode(&format!("{}: {}\n", m.role.as_str(), m.content)));
        }
        out.extend(self.encode("assistant: "));
        if out.len() > limit {
            return Err(tokenpath_protocol::tokenize::too_long(limit));
        }
        Ok(out)
    }

    fn text_prompt(&self, text: &str, limit: usize) -> Result<Vec<u32>, ProtocolError> {
        let out = self.encode(text);
        if out.len() > limit {
            return Err(tokenpath_protocol::tokenize::too_long(limit));
        }
        Ok(out)
    }
}

/// The requests of `workload` (`n` of them, the bench's for the same seed), sent at `offsets`
/// (open loop: requests, or session starts for a multi-turn workload) or by `concurrency`
/// closed-loop clients.
pub fn from_workload(
    workload: &Workload,
    n: usize,
    seed: u64,
    tok: Option<Arc<dyn PromptTokenizer>>,
    offsets: Option<&[std::time::Duration]>,
    concurrency: Option<usize>,
) -> Result<Input, SimError> {
    let tok: Arc<dyn PromptTokenizer> = tok.unwrap_or_else(|| Arc::new(ByteTokenizer));
    let specs = workload.requests_with(n, seed, Some(&*tok));
    let mut input = Input::default();
    let mut history: Vec<PromptMessage> = Vec::new();
    let mut session = None;
    let mut starts = offsets.map(|o| o.iter().map(|d| d.as_nanos() as Nanos));
    let mut last_of_lane: Vec<Option<usize>> = vec![None; concurrency.unwrap_or(0)];
    for (i, spec) in specs.iter().enumerate() {
        let this = spec.session.map(|s| s.session);
        let new_session = this.is_none() || this != session;
        if new_session {
            history.clear();
            session = this;
        }
        let prompt = tok
            .chat_prompt(&messages_of(spec, &history), usize::MAX)
            .map_err(|e| SimError::Workload(format!("request {i}: {e}")))?;
        // The answer: prose of exactly max_tokens tokens (closest the tokenizer allows), padded.
        let want = spec.max_tokens.max(1) as usize;
        let text = exact_prose(&*tok, want, 7919 * (i + 1));
        let mut answer = tok.encode(&text);
        answer.resize(want, answer.last().copied().unwrap_or(0));
        if spec.session.is_some() {
            history.push(PromptMessage::new(Role::User, spec.prompt.clone()));
            history.push(PromptMessage::new(Role::Assistant, tok.decode(&answer)));
        }
        let send = match concurrency {
            Some(c) => {
                let lane = this.unwrap_or(i) % c.max(1);
                match last_of_lane[lane].replace(i) {
                    Some(prev) => Send::After(prev),
                    None => Send::At(0),
                }
            }
            None if !new_session => Send::After(i - 1),
            None => match starts.as_mut().and_then(Iterator::next) {
                Some(t) => Send::At(t),
                None => break,
            },
        };
        input.requests.push(SimRequest { id: i as u64, prompt: Prompt::Tokens(prompt), answer });
        input.send.push(send);
    }
    if input.requests.is_empty() {
        return Err(SimError::Workload("the workload gave no requests".into()));
    }
    Ok(input)
}

/// Tokens per hash id in the Mooncake traces.
pub const MOONCAKE_BLOCK: usize = 512;

/// A Mooncake-format trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`: one id
/// per 512-token block, equal ids meaning equal blocks): each block's tokens derived from its
/// id, so requests share exactly the prefixes the trace says they share. At most `limit` lines.
pub fn mooncake(text: &str, limit: usize, vocab: u32) -> Result<Input, SimError> {
    let mut input = Input::default();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).take(limit).enumerate() {
        let bad = |m: &str| SimError::Workload(format!("trace line {}: {m}", i + 1));
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        let num = |k: &str| v[k].as_f64().filter(|x| x.is_finite() && *x >= 0.0).ok_or_else(|| bad(k));
        let ts_ms = num("timestamp")?;
        let input_len = num("input_length")? as usize;
        let output_len = (num("output_length")? as usize).max(1);
        let ids = v["hash_ids"].as_array().ok_or_else(|| bad("hash_ids"))?;
        if input_len == 0 || input_len > ids.len() * MOONCAKE_BLOCK || output_len > 1 << 20 {
            return Err(bad("input_length does not match its hash_ids"));
        }
        let ids = ids
            .iter()
            .map(|id| id.as_u64().ok_or_else(|| bad("a hash id is not an integer")))
            .collect::<Result<Vec<u64>, _>>()?;
        let prompt = Prompt::Blocks { ids, len: input_len, vocab };
        let answer = (0..output_len as u64)
            .map(|j| (mix(u64::MAX - i as u64, j) % u64::from(vocab.max(1))) as u32)
            .collect();
        input.requests.push(SimRequest { id: i as u64, prompt, answer });
        input.send.push(Send::At((ts_ms * 1e6) as Nanos));
    }
    if input.requests.is_empty() {
        return Err(SimError::Workload("the trace has no requests".into()));
    }
    Ok(input)
}

/// SplitMix64 of a pair: a token id that depends only on (block, position).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_add(0x632b_e59b_d9b4_e019);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_prompts_share_their_system_prompt_tokens() {
        let w: Workload = "shared-prefix:2:64:8-16:4-4".parse().unwrap();
        let input = from_workload(&w, 6, 1, None, Some(&[std::time::Duration::ZERO; 6]), None).unwrap();
        assert_eq!(input.requests.len(), 6);
        let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let first = input.requests[0].prompt.tokens();
        let shared = (1..6).map(|i| common(&first, &input.requests[i].prompt.tokens())).max().unwrap();
        assert!(shared >= 64, "{shared}");
        assert!(input.requests.iter().all(|r| r.answer.len() == 4));
    }

    #[test]
    fn a_later_turn_carries_the_earlier_turn_and_its_answer_and_waits_for_it() {
        let w: Workload = "multi-turn:3:16-16:8-8".parse().unwrap();
        let input = from_workload(&w, 6, 1, None, Some(&[std::time::Duration::ZERO; 2]), None).unwrap();
        let (a, b) = (&input.requests[0], &input.requests[1]);
        // Turn 2's prompt starts with turn 1's messages (the generation prompt aside) and has
        // turn 1's answer in it.
        let text = ByteTokenizer.decode(&b.prompt.tokens());
        assert!(text.contains(&ByteTokenizer.decode(&a.answer)));
        assert_eq!(input.send[1], Send::After(0));
        assert_eq!(input.send[3], Send::At(0));
    }

    #[test]
    fn a_closed_loop_chains_each_clients_requests() {
        let input =
            from_workload(&Workload::Fixed { input: 32, output: 4 }, 5, 0, None, None, Some(2)).unwrap();
        assert_eq!(
            input.send,
            vec![Send::At(0), Send::At(0), Send::After(0), Send::After(1), Send::After(2)]
        );
    }

    #[test]
    fn mooncake_blocks_with_equal_ids_have_equal_tokens() {
        let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n\
                    {\"timestamp\": 5, \"input_length\": 520, \"output_length\": 2, \"hash_ids\": [1, 3]}\n";
        let input = mooncake(text, 10, 49_152).unwrap();
        let (a, b) = (input.requests[0].prompt.tokens(), input.requests[1].prompt.tokens());
        assert_eq!((a.len(), b.len()), (600, 520));
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..520], b[512..520]);
        assert_eq!(input.send[1], Send::At(5_000_000));
        assert!(mooncake("{\"timestamp\": 0}", 10, 10).is_err());
        assert!(mooncake(
            "{\"timestamp\": 0, \"input_length\": 2000, \"output_length\": 1, \"hash_ids\": [1]}",
            10,
            10
        )
        .is_err());
    }
}
