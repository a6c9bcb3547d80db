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

#[cfg(test)]
mod tests {
    use super::test_support::ByteTokenizer;
    use super::*;

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
