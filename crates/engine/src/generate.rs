//! [`Engine`]: a model with its tokenizer and chat template, and a simple single-sequence
//! generation loop (chunked prefill, then decode until EOS, a stop string, `max_tokens` or the
//! context end). The serving path drives [`Model::forward`] itself to batch many sequences; this
//! loop is what the CLI, the benchmarks and the parity checks use, and the reference the batcher
//! is tested against.

use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockTable, KvCache, KvLayout};
use crate::model::{BatchItem, Model};
use crate::sampling::{Sampler, SamplingParams};
use crate::stop::StopMatcher;
use crate::tokenizer::{
    chat_template_from_gguf, tokenizer_from_gguf, ChatMessage, ChatTemplate, StreamDecoder, Tokenizer,
};
use std::path::Path;
use std::time::{Duration, Instant};

/// A model ready to generate text.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Stop strings (not included in the output).
    pub stop: Vec<String>,
    /// Prompt tokens per prefill chunk.
    pub prefill_chunk: usize,
}

impl Default for GenerateRequest {
    fn default() -> Self {
        Self { sampling: SamplingParams::greedy(), max_tokens: 64, stop: Vec::new(), prefill_chunk: 512 }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// EOS / end-of-turn token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

/// The result of [`Engine::generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated token ids (the end-of-turn token excluded).
    pub tokens: Vec<u32>,
    /// Generated text (stop string excluded).
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
    /// Wall time of the prefill (all chunks, first token computed).
    pub prefill: Duration,
    /// Wall time of the decode loop.
    pub decode: Duration,
}

impl Engine {
    /// Loads the GGUF file at `path` with its tokenizer and chat template.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_model(Model::open(path)?)
    }

    /// Wraps a loaded model, building the tokenizer from its metadata.
    pub fn from_model(model: Model) -> Result<Self> {
        let tokenizer = tokenizer_from_gguf(model.gguf())?;
        let chat = chat_template_from_gguf(model.gguf(), &tokenizer)?;
        Ok(Self { model, tokenizer, chat })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Whether `id` ends generation (EOS or an end-of-turn token).
    pub fn is_end(&self, id: u32) -> bool {
        self.tokenizer.is_eog(id)
    }

    /// A KV cache able to hold `tokens` tokens in blocks of `block_size`.
    pub fn new_cache(&self, tokens: usize, block_size: usize) -> Result<KvCache> {
        let c = self.model.config();
        let layout = KvLayout { n_layer: c.n_layer, kv_dim: c.kv_dim(), block_size };
        KvCache::new(layout, tokens.div_ceil(block_size.max(1)))
    }

    /// Renders chat messages with the model's template (generation prompt appended).
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
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
    pub fn encode_chat_within_context(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.render_chat(messages)?;
        let n_ctx = self.model().config().n_ctx;
        let tok = &self.tokenizer;
        if text.len() > n_ctx.saturating_mul(tok.max_token_bytes()) {
            return Err(crate::tokenizer::TokenizerError::TooLong { limit: n_ctx }.into());
        }
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| EngineError::InvalidModel(format!("no randomness: {e}")))?;
        let tag: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let marker = |i: usize| format!("\u{e000}{tag}:{i}\u{e001}");
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage { role: m.role.clone(), content: marker(i) })
            .collect();
        let chat = self.chat.as_ref().ok_or_else(|| {
            EngineError::InvalidModel("the model file has no tokenizer.chat_template".into())
        })?;
        let skeleton = chat.render(&marked, true)?;
        // Split the skeleton at the markers, in order; each must appear exactly where the
        // content does in the real render.
        let mut pieces: Vec<(&str, bool)> = Vec::new();
        let mut rest = skeleton.as_str();
        let mut rebuilt = String::with_capacity(text.len());
        while let Some(at) = rest.find('\u{e000}') {
            let (before, tail) = rest.split_at(at);
            let Some(end) = tail.find('\u{e001}') else { break };
            let inner = &tail[3..end];
            let idx = inner
                .strip_prefix(&tag)
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
        if rebuilt != text {
            tracing::warn!(
                "the chat template transforms message content; special tokens are parsed in the whole prompt"
            );
            return Ok(tok.encode_at_most(&text, true, true, n_ctx)?);
        }
        let mut out = Vec::new();
        if tok.add_bos() {
            out.extend(tok.bos());
        }
        for (piece, template) in pieces.iter().filter(|(p, _)| !p.is_empty()) {
            out.extend(tok.encode_at_most(piece, false, *template, n_ctx)?);
            if out.len() > n_ctx {
                return Err(crate::tokenizer::TokenizerError::TooLong { limit: n_ctx }.into());
            }
        }
        if tok.add_eos() {
            out.extend(tok.eos());
        }
        Ok(out)
    }

    /// Tokenizes a prompt as llama.cpp's server does: BOS when the model wants it, and special
    /// tokens in the text (from a chat template) parsed as such.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(text, true, true)?)
    }

    /// [`Engine::encode_prompt`] for a prompt that must fit the context: refused with
    /// `TokenizerError::TooLong` (as [`crate::EngineError::Tokenizer`]) once it cannot, without
    /// tokenizing text that could never fit.
    pub fn encode_prompt_within_context(&self, text: &str) -> Result<Vec<u32>> {
        let n_ctx = self.model().config().n_ctx;
        Ok(self.tokenizer.encode_at_most(text, true, true, n_ctx)?)
    }

    /// Generates from `prompt`, calling `on_text` with each piece of text as soon as it is safe to
    /// send. The sequence's KV blocks are returned to `cache` whatever happens.
    pub fn generate(
        &self,
        cache: &mut KvCache,
        prompt: &[u32],
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        let mut table = BlockTable::default();
        let result = self.generate_in(cache, &mut table, prompt, req, on_text);
        cache.free_table(&mut table)?;
        result
    }

    fn generate_in(
        &self,
        cache: &mut KvCache,
        table: &mut BlockTable,
        prompt: &[u32],
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        let n_ctx = self.model.config().n_ctx;
        if prompt.is_empty() {
            return Err(EngineError::InvalidArgument("the prompt has no tokens".into()));
        }
        if prompt.len() >= n_ctx {
            return Err(EngineError::ContextOverflow { tokens: prompt.len() + 1, limit: n_ctx });
        }
        let mut sampler = Sampler::new(req.sampling.clone())?;
        let chunk = req.prefill_chunk.max(1);
        let t0 = Instant::now();
        let mut logits = Vec::new();
        for piece in prompt.chunks(chunk) {
            let mut batch = [BatchItem { table: &mut *table, tokens: piece, all_logits: false }];
            logits = self.model.forward(cache, &mut batch)?.logits.swap_remove(0);
        }
        let mut next = sampler.sample(&mut logits)?;
        let prefill = t0.elapsed();

        let t1 = Instant::now();
        let mut decoder = StreamDecoder::new(false);
        let mut stops = StopMatcher::new(req.stop.iter().cloned());
        let (mut tokens, mut text) = (Vec::new(), String::new());
        let mut finish = Finish::Length;
        while tokens.len() < req.max_tokens {
            if self.is_end(next) {
                finish = Finish::Stop;
                break;
            }
            tokens.push(next);
            let step = stops.push(&decoder.push(&self.tokenizer, next)?);
            if !step.emit.is_empty() {
                on_text(&step.emit);
                text.push_str(&step.emit);
            }
            if step.stopped {
                finish = Finish::Stop;
                break;
            }
            if tokens.len() == req.max_tokens || table.len() + 1 >= n_ctx {
                break;
            }
            let mut batch = [BatchItem { table: &mut *table, tokens: &[next], all_logits: false }];
            logits = self.model.forward(cache, &mut batch)?.logits.swap_remove(0);
            next = sampler.sample(&mut logits)?;
        }
        if !stops.is_stopped() {
            let rest = stops.push(&decoder.finish());
            let tail = rest.emit + &stops.finish();
            if !tail.is_empty() {
                on_text(&tail);
                text.push_str(&tail);
            }
        }
        Ok(Generation { prompt_tokens: prompt.len(), tokens, text, finish, prefill, decode: t1.elapsed() })
    }
}
