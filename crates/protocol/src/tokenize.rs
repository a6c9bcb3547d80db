//! [`PromptTokenizer`]: the model's tokenizer as far as the gateway and the load generator need
//! it — count and cut prompts, render a chat with the model's template, refuse what cannot fit.
//!
//! A trait so that neither the gateway nor the bench depends on the engine: the binary
//! implements it over a GGUF file's tokenizer metadata (no weights loaded) or a Hugging Face
//! `tokenizer.json` + chat template, and a gateway in front of remote workers or an HTTP
//! upstream reads only that.

use crate::params::PromptMessage;
use crate::ProtocolError;

/// The model's tokenizer.
pub trait PromptTokenizer: Send + Sync + std::fmt::Debug {
    /// Token ids of plain text (no BOS, special-token text not parsed).
    fn encode(&self, text: &str) -> Vec<u32>;

    /// Text of token ids (lossy at a cut UTF-8 sequence).
    fn decode(&self, ids: &[u32]) -> String;

    /// The prompt ids a server runs for `messages`: the chat template applied with the
    /// generation prompt, BOS added as the model asks. Refused with
    /// [`ProtocolError::ContextOverflow`] as soon as the count passes `limit` (the cost of a
    /// refusal does not grow with the prompt), and with [`ProtocolError::InvalidRequest`] when the
    /// template fails or the model has none.
    fn chat_prompt(&self, messages: &[PromptMessage], limit: usize) -> Result<Vec<u32>, ProtocolError>;

    /// The prompt ids of a completion prompt (BOS added as the model asks), refused past `limit`
    /// like [`PromptTokenizer::chat_prompt`].
    fn text_prompt(&self, text: &str, limit: usize) -> Result<Vec<u32>, ProtocolError>;

    /// The prompt tokens a server would count for `messages`; `None` when that cannot be known
    /// (no chat template).
    fn count_chat(&self, messages: &[PromptMessage]) -> Option<usize> {
        self.chat_prompt(messages, usize::MAX).ok().map(|ids| ids.len())
    }
}

/// The error for a prompt of more than `limit` tokens, counted up to `limit + 1`.
pub fn too_long(limit: usize) -> ProtocolError {
    ProtocolError::ContextOverflow { prompt_tokens: limit.saturating_add(1), max_tokens: 0, limit }
}
