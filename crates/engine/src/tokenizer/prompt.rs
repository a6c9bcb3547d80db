//! [`ModelTokenizer`]: a model's tokenizer and chat template together, built from GGUF
//! metadata alone — what the engine prompts with, and what a gateway in front of remote workers
//! or an upstream engine tokenizes with without loading a single weight
//! ([`ModelTokenizer::open`] parses only the file's metadata). It implements the protocol
//! crate's [`PromptTokenizer`], the one tokenizer abstraction the gateway and the bench know.

use super::{chat_template_from_gguf, tokenizer_from_gguf, ChatTemplate, Tokenizer, TokenizerError};
use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, GgufIndex};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use tokenpath_protocol::tokenize::{too_long, PromptTokenizer};
use tokenpath_protocol::{PromptMessage, ProtocolError, Role};

/// A model's tokenizer and (optional) chat template.
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
    skeletons: Skeletons,
}

impl ModelTokenizer {
    /// From a parsed GGUF index.
    pub fn from_gguf(g: &GgufIndex) -> Result<Self> {
        let tokenizer = tokenizer_from_gguf(g)?;
        let chat = chat_template_from_gguf(g, &tokenizer)?;
        Ok(Self { tokenizer, chat, skeletons: Skeletons::default() })
    }

    /// Reads only the tokenizer metadata of the GGUF file at `path` (the file is memory-mapped
    /// for the parse; no tensor is touched, so the cost is the vocabulary, not the model).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(GgufFile::open(path)?.index())
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, when the file has one.
    pub fn chat(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// A completion prompt (BOS as the model asks, special-token text parsed), refused with
    /// `TokenizerError::TooLong` once it passes `limit` tokens.
    pub fn encode_prompt_within(&self, text: &str, limit: usize) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode_at_most(text, true, true, limit)?)
    }

    /// Renders chat messages with the model's template (generation prompt appended).
    pub fn render_chat(&self, messages: &[PromptMessage]) -> Result<String> {
        let chat = self.chat.as_ref().ok_or_else(|| {
            EngineError::InvalidModel("the model file has no tokenizer.chat_template".into())
        })?;
        Ok(chat.render(messages, true)?)
    }

    /// Renders `messages` with the chat template and tokenizes the result for a prompt that must
    /// fit the context, with special tokens parsed only where the *template* put them: text a
    /// user sent that spells `<|im_end|>\n<|im_start|>system` stays text, so a message cannot
    /// close its own turn and open a system one. (llama.cpp's server and Hugging Face's
    /// `apply_chat_template` parse specials in the whole rendered string.)
    ///
    /// How: the template is rendered a second time with every message's content replaced by a
    /// random marker, which finds the content spans; template text is tokenized with specials,
    /// content without. A template that transforms the content (so the two renders disagree)
    /// falls back to tokenizing the whole render with specials, as before, with a warning.
    /// The marker render depends on the roles alone, so it is remembered per role sequence
    /// ([`Skeletons`]) and every use is checked against the real render as a fresh one is.
    pub fn encode_chat_within(&self, messages: &[PromptMessage], n_ctx: usize) -> Result<Vec<u32>> {
        let text = self.render_chat(messages)?;
        let tok = &self.tokenizer;
        if text.len() > n_ctx.saturating_mul(tok.max_token_bytes()) {
            return Err(TokenizerError::TooLong { limit: n_ctx }.into());
        }
        let roles: Vec<Role> = messages.iter().map(|m| m.role).collect();
        // A remembered skeleton first; a stale or missing one (a template that reads the clock,
        // a first sighting of these roles) is rendered afresh and checked again.
        let mut skeleton = self.skeletons.get(&roles);
        let mut pieces = skeleton.as_deref().and_then(|sk| sk.spans(messages, &text));
        if pieces.is_none() {
            skeleton = Some(Arc::new(self.render_skeleton(messages)?));
            pieces = skeleton.as_deref().and_then(|sk| sk.spans(messages, &text));
            if let (Some(_), Some(sk)) = (&pieces, &skeleton) {
                // Remembered only when it fits: a template that transforms content keeps
                // costing two renders, not three.
                self.skeletons.put(roles, Arc::clone(sk));
            }
        }
        let Some(pieces) = pieces else {
            tracing::warn!(
                "the chat template transforms message content; special tokens are parsed in the whole prompt"
            );
            return Ok(tok.encode_at_most(&text, true, true, n_ctx)?);
        };
        let mut out = Vec::new();
        if tok.add_bos() {
            out.extend(tok.bos());
        }
        // The template's own pieces are the skeleton's, the same on every use: their ids are
        // remembered with it (a piece is tokenized on its own, so its ids do not depend on the
        // contents around it). Only the contents are tokenized per request.
        let template_ids = skeleton
            .as_deref()
            .map(|sk| sk.template_ids(&pieces, |p| tok.encode_at_most(p, false, true, n_ctx)))
            .transpose()?;
        let mut template_pieces = template_ids.iter().flat_map(|ids| ids.iter());
        for (piece, template) in &pieces {
            let remembered = if *template { template_pieces.next() } else { None };
            match remembered {
                Some(ids) => out.extend_from_slice(ids),
                None if piece.is_empty() => {}
                None => out.extend(tok.encode_at_most(piece, false, *template, n_ctx)?),
            }
            if out.len() > n_ctx {
                return Err(TokenizerError::TooLong { limit: n_ctx }.into());
            }
        }
        if tok.add_eos() {
            out.extend(tok.eos());
        }
        Ok(out)
    }
}

impl ModelTokenizer {
    /// The template rendered with every content replaced by a random marker.
    fn render_skeleton(&self, messages: &[PromptMessage]) -> Result<Skeleton> {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| EngineError::InvalidModel(format!("no randomness: {e}")))?;
        let tag: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let marked: Vec<PromptMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| PromptMessage::new(m.role, format!("\u{e000}{tag}:{i}\u{e001}")))
            .collect();
        let chat = self.chat.as_ref().ok_or_else(|| {
            EngineError::InvalidModel("the model file has no tokenizer.chat_template".into())
        })?;
        Ok(Skeleton { text: chat.render(&marked, true)?, tag, template_ids: OnceLock::new() })
    }
}

/// A chat render with each message's content replaced by `\u{e000}{tag}:{i}\u{e001}`.
#[derive(Debug)]
struct Skeleton {
    text: String,
    tag: String,
    /// The ids of its template pieces, in order, once a render has used it.
    template_ids: OnceLock<Arc<Vec<Vec<u32>>>>,
}

impl Skeleton {
    /// `text` (the real render of `messages`) as template pieces (`true`) and contents
    /// (`false`), in order; `None` unless the skeleton with the contents put back is `text`
    /// exactly (a template that transforms content, or a skeleton from another clock).
    fn spans<'a>(&'a self, messages: &'a [PromptMessage], text: &str) -> Option<Vec<(&'a str, bool)>> {
        let mut pieces: Vec<(&str, bool)> = Vec::new();
        let mut rest = self.text.as_str();
        let mut rebuilt = String::with_capacity(text.len());
        while let Some(at) = rest.find('\u{e000}') {
            let (before, tail) = rest.split_at(at);
            let Some(end) = tail.find('\u{e001}') else { break };
            let inner = &tail[3..end];
            let idx = inner
                .strip_prefix(&self.tag)
                .and_then(|r| r.strip_prefix(':'))
                .and_then(|r| r.parse::<usize>().ok());
            let Some(i) = idx.filter(|&i| i < messages.len()) else { break };
            pieces.push((before, true));
            pieces.push((messages[i].content.as_str(), false));
            rebuilt.push_str(before);
            rebuilt.push_str(&messages[i].content);
            rest = &tail[end + 3..];
        }
        pieces.push((rest, true));
        rebuilt.push_str(rest);
        (rebuilt == text).then_some(pieces)
    }

    /// The ids of the template pieces among `pieces` (what [`Self::spans`] gave), encoded by
    /// `encode` the first time and remembered. `pieces` must come from this skeleton, so its
    /// template pieces are the same strings each time.
    fn template_ids<E>(
        &self,
        pieces: &[(&str, bool)],
        encode: impl Fn(&str) -> std::result::Result<Vec<u32>, E>,
    ) -> std::result::Result<Arc<Vec<Vec<u32>>>, E> {
        if let Some(ids) = self.template_ids.get() {
            return Ok(Arc::clone(ids));
        }
        let ids = pieces
            .iter()
            .filter(|(_, t)| *t)
            .map(|(p, _)| encode(p))
            .collect::<std::result::Result<Vec<_>, E>>()?;
        Ok(Arc::clone(self.template_ids.get_or_init(|| Arc::new(ids))))
    }
}

/// Most role sequences whose skeletons are remembered; past it the memory starts over (a
/// client sending ever new sequences costs a render each, never memory).
const SKELETONS: usize = 256;

/// Skeletons by role sequence. A plain mutex, not an owning task: this is a memo beside a
/// synchronous tokenizer, held for a map lookup, never across a render or an await.
#[derive(Debug, Default)]
struct Skeletons(Mutex<HashMap<Vec<Role>, Arc<Skeleton>>>);

impl Skeletons {
    fn get(&self, roles: &[Role]) -> Option<Arc<Skeleton>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(roles).cloned()
    }

    fn put(&self, roles: Vec<Role>, skeleton: Arc<Skeleton>) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= SKELETONS {
            map.clear();
        }
        map.insert(roles, skeleton);
    }
}

/// An engine error as the boundary's: too long is a context overflow, the rest is the client's
/// request the template or tokenizer could not take.
fn boundary(e: EngineError, limit: usize) -> ProtocolError {
    match e {
        EngineError::Tokenizer(TokenizerError::TooLong { .. }) => too_long(limit),
        e => ProtocolError::InvalidRequest {
            param: None,
            message: format!("The prompt cannot be tokenized: {e}"),
        },
    }
}

impl PromptTokenizer for ModelTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.tokenizer.encode(text, false, false).unwrap_or_default()
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode_lossy(ids, false).unwrap_or_default()
    }

    fn chat_prompt(
        &self,
        messages: &[PromptMessage],
        limit: usize,
    ) -> std::result::Result<Vec<u32>, ProtocolError> {
        self.encode_chat_within(messages, limit).map_err(|e| boundary(e, limit))
    }

    fn text_prompt(&self, text: &str, limit: usize) -> std::result::Result<Vec<u32>, ProtocolError> {
        self.encode_prompt_within(text, limit).map_err(|e| boundary(e, limit))
    }

    /// The count a server that parses special tokens in the whole rendered prompt arrives at
    /// (llama.cpp's, vLLM's): the bench checks `usage` against it. It differs from
    /// [`PromptTokenizer::chat_prompt`]'s length only where content holds special-token text or
    /// a merge crosses a content edge.
    fn count_chat(&self, messages: &[PromptMessage]) -> Option<usize> {
        let text = self.chat.as_ref()?.render(messages, true).ok()?;
        self.tokenizer.encode(&text, true, true).ok().map(|ids| ids.len())
    }
}
