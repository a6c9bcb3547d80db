//! Counting prompt tokens the way the server will. The bench crate does not depend on the engine:
//! a [`PromptTokenizer`] is a small trait the binary implements over the model's tokenizer (a GGUF
//! file's metadata, no weights, or a Hugging Face `tokenizer.json`), so this crate stays a light
//! HTTP client that can measure any server, and its tests use a byte-level stand-in. With a tokenizer, prompt texts are cut to an
//! exact token count and each record carries the client's count of the rendered chat prompt, to
//! be checked against the server's `usage`; without one, lengths are approximate and `usage` is
//! the only truth.

use crate::text::prose;

/// The tokenizer abstraction, defined once on the boundary (the gateway uses the same one).
pub use tokenpath_protocol::tokenize::PromptTokenizer;
/// One chat message as sent (the same type the gateway validates requests into).
pub use tokenpath_protocol::{PromptMessage, Role};

/// Text of exactly `tokens` tokens of the shipped prose starting at word `offset`, when the
/// tokenizer allows it (a cut through a multi-byte sequence or a merge across the cut can move the
/// count by one; the closest candidate is kept then).
pub fn exact_prose(tok: &dyn PromptTokenizer, tokens: usize, offset: usize) -> String {
    let tokens = tokens.max(1);
    // Twice the usual words-per-token estimate, so the text is long enough to cut.
    let source = prose(tokens * 2 + 8, offset);
    let ids = tok.encode(&source);
    let mut best: Option<(usize, String)> = None;
    let mut take = tokens.min(ids.len());
    for _ in 0..4 {
        let text = tok.decode(&ids[..take]);
        let n = tok.encode(&text).len();
        let miss = n.abs_diff(tokens);
        if best.as_ref().is_none_or(|(m, _)| miss < *m) {
            best = Some((miss, text));
        }
        if miss == 0 {
            break;
        }
        take = if n > tokens {
            take.saturating_sub(n - tokens).max(1)
        } else {
            (take + tokens - n).min(ids.len())
        };
    }
    best.map_or_else(|| prose(tokens, offset), |(_, t)| t)
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// One token per byte: exact by construction; the chat "template" is `role: content\n` per
    /// message.
    #[derive(Debug)]
    pub struct ByteTokenizer;

    impl PromptTokenizer for ByteTokenizer {
        fn encode(&self, text: &str) -> Vec<u32> {
            text.bytes().map(u32::from).collect()
        }
        fn decode(&self, ids: &[u32]) -> String {
            String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<u8>>()).into_owned()
        }
        fn chat_prompt(
            &self,
            messages: &[PromptMessage],
            limit: usize,
        ) -> Result<Vec<u32>, tokenpath_protocol::ProtocolError> {
            let text: String =
                messages.iter().map(|m| format!("{}: {}\n", m.role.as_str(), m.content)).collect();
            self.text_prompt(&text, limit)
        }
        fn text_prompt(
            &self,
            text: &str,
            limit: usize,
        ) -> Result<Vec<u32>, tokenpath_protocol::ProtocolError> {
            let ids = self.encode(text);
            if ids.len() > limit {
                return Err(tokenpath_protocol::tokenize::too_long(limit));
            }
            Ok(ids)
        }
    }
}

/// Splits the tokens of a streamed answer among its events by the text each carried, when the
/// server put several tokens in an event without saying how many: every content event was
/// counted as one (no cumulative usage per chunk) and `usage` counts more, or there is no
/// `usage` at all. Each content event gets the tokenizer's count of its text (at least one), and
/// when `usage` is known the counts are scaled to add up to it exactly (largest remainder, every
/// content event keeping at least one). `spoken` is the events' text and reasoning text
/// concatenated and `ends[i]` where event `i` ends in it. Returns whether it split.
///
/// Each event's text is tokenized alone, so a merge across two events can count one token
/// twice; with `usage` the scaling corrects the total, not the place.
pub fn split_events(
    rec: &mut tokenpath_timeline::ClientRecord,
    spoken: &str,
    ends: &[usize],
    tok: &dyn PromptTokenizer,
) -> bool {
    let content: Vec<usize> = (0..rec.events.len()).filter(|&i| rec.events[i].tokens > 0).collect();
    let usage = rec.usage.map(|u| u.completion_tokens);
    let unsplit =
        content.iter().all(|&i| rec.events[i].tokens == 1) && usage.is_none_or(|n| n > content.len() as u64);
    if !rec.streamed || content.is_empty() || !unsplit || ends.len() != rec.events.len() {
        return false;
    }
    let mut counts = Vec::with_capacity(content.len());
    for &i in &content {
        let start = if i == 0 { 0 } else { ends[i - 1] };
        let Some(text) = spoken.get(start..ends[i]) else { return false };
        counts.push(tok.encode(text).len().max(1) as u64);
    }
    let split = match usage {
        None => counts,
        Some(n) => {
            // One each, then the rest in proportion to what the tokenizer saw beyond one.
            let extra: Vec<u64> = counts.iter().map(|c| c - 1).collect();
            let (rest, weight) = (n - content.len() as u64, extra.iter().sum::<u64>());
            if weight == 0 {
                return false; // the text says one token per event: nothing to go by
            }
            let mut out: Vec<u64> = extra.iter().map(|&e| 1 + rest * e / weight).collect();
            let mut left = n - out.iter().sum::<u64>();
            let mut order: Vec<usize> = (0..out.len()).collect();
            order.sort_by_key(|&k| (std::cmp::Reverse(rest * extra[k] % weight), k));
            for &k in order.iter().cycle().take(out.len() * 2) {
                if left == 0 {
                    break;
                }
                out[k] += 1;
                left -= 1;
            }
            out
        }
    };
    for (&i, t) in content.iter().zip(split) {
        rec.events[i].tokens = u32::try_from(t).unwrap_or(u32::MAX);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::test_support::ByteTokenizer;
    use super::*;

    fn streamed(tokens: &[u32], usage: Option<u64>) -> tokenpath_timeline::ClientRecord {
        use tokenpath_timeline::{ClientRecord, RequestId, StreamEvent, Usage};
        let mut r = ClientRecord::new(RequestId(1), 0, 0, true);
        r.events = tokens.iter().map(|&t| StreamEvent { at_ns: 1, tokens: t }).collect();
        r.usage = usage.map(|n| Usage { prompt_tokens: 3, completion_tokens: n, cached_tokens: None });
        r
    }

    #[test]
    fn events_are_split_by_their_text_and_add_up_to_usage() {
        // Role-only event, then three content events of 2, 3 and 1 bytes.
        let (spoken, ends) = ("abcdef", [0usize, 2, 5, 6]);
        let mut r = streamed(&[0, 1, 1, 1], Some(6));
        assert!(split_events(&mut r, spoken, &ends, &ByteTokenizer));
        assert_eq!(r.events.iter().map(|e| e.tokens).collect::<Vec<_>>(), [0, 2, 3, 1]);
        // Usage says fewer than the text: scaled down, each keeping one, the total exact.
        let mut r = streamed(&[0, 1, 1, 1], Some(4));
        assert!(split_events(&mut r, spoken, &ends, &ByteTokenizer));
        let t: Vec<u32> = r.events.iter().map(|e| e.tokens).collect();
        assert_eq!((t.iter().sum::<u32>(), t.iter().skip(1).all(|&x| x >= 1)), (4, true), "{t:?}");
        // No usage: the tokenizer's counts as they are.
        let mut r = streamed(&[0, 1, 1, 1], None);
        assert!(split_events(&mut r, spoken, &ends, &ByteTokenizer));
        assert_eq!(r.events.iter().map(|e| e.tokens).sum::<u32>(), 6);
    }

    #[test]
    fn a_split_the_server_gave_or_usage_that_agrees_is_kept() {
        let (spoken, ends) = ("abcdef", [2usize, 5, 6]);
        for (tokens, usage) in [([2u32, 3, 1], Some(6)), ([1, 1, 1], Some(3))] {
            let mut r = streamed(&tokens, usage);
            assert!(!split_events(&mut r, spoken, &ends, &ByteTokenizer));
            assert_eq!(r.events.iter().map(|e| e.tokens).collect::<Vec<_>>(), tokens);
        }
        let mut r = streamed(&[1, 1, 1], Some(6));
        assert!(!split_events(&mut r, spoken, &[2, 5], &ByteTokenizer), "ends must match the events");
    }

    proptest::proptest! {
        #[test]
        fn a_split_with_usage_always_adds_up(lens in proptest::collection::vec(1usize..9, 1..12), more in 1u64..40) {
            let mut spoken = String::new();
            let mut ends = Vec::new();
            for l in &lens {
                spoken.push_str(&"x".repeat(*l));
                ends.push(spoken.len());
            }
            let n = lens.len() as u64 + more;
            let mut r = streamed(&vec![1; lens.len()], Some(n));
            if split_events(&mut r, &spoken, &ends, &ByteTokenizer) {
                proptest::prop_assert_eq!(r.events.iter().map(|e| u64::from(e.tokens)).sum::<u64>(), n);
                proptest::prop_assert!(r.events.iter().all(|e| e.tokens >= 1));
            } else {
                proptest::prop_assert!(lens.iter().all(|&l| l == 1));
            }
        }
    }

    #[test]
    fn exact_prose_has_the_exact_count() {
        for n in [1, 2, 7, 100, 1000] {
            let t = exact_prose(&ByteTokenizer, n, 5);
            assert_eq!(ByteTokenizer.encode(&t).len(), n, "{t:?}");
        }
    }
}

/// How far the client's token counts are from the server's `usage`, over the records that have
/// both.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Disagreement {
    /// Requests with both counts.
    pub compared: u64,
    /// Of which the counts differ.
    pub disagree: u64,
    /// Largest |client − usage|.
    pub max_abs_diff: u64,
}

/// Prompt and output token counts re-tokenized on the client against `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenCheck {
    /// `prompt_tokens_hint` (the chat prompt as rendered and tokenized by the client) against
    /// `usage.prompt_tokens`.
    pub prompt: Disagreement,
    /// `retokenized_output` against `usage.completion_tokens`.
    pub output: Disagreement,
}

impl TokenCheck {
    /// The check over `records`; `None` when no record carries a client count (no tokenizer).
    pub fn of<'a>(records: impl IntoIterator<Item = &'a tokenpath_timeline::ClientRecord>) -> Option<Self> {
        let mut c = TokenCheck::default();
        let mut any = false;
        let add = |d: &mut Disagreement, client: Option<u64>, server: Option<u64>| {
            if let (Some(a), Some(b)) = (client, server) {
                d.compared += 1;
                d.disagree += u64::from(a != b);
                d.max_abs_diff = d.max_abs_diff.max(a.abs_diff(b));
            }
        };
        for r in records {
            any |= r.prompt_tokens_hint.is_some() || r.retokenized_output.is_some();
            let usage = r.usage;
            add(&mut c.prompt, r.prompt_tokens_hint, usage.map(|u| u.prompt_tokens));
            add(&mut c.output, r.retokenized_output, usage.map(|u| u.completion_tokens));
        }
        any.then_some(c)
    }
}
