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
use crate::tokenizer::{ModelTokenizer, PromptMessage, StreamDecoder, Tokenizer};
use std::path::Path;
use std::time::{Duration, Instant};

/// A model ready to generate text.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    prompts: ModelTokenizer,
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
        let prompts = ModelTokenizer::from_gguf(model.gguf())?;
        Ok(Self { model, prompts })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.prompts.tokenizer()
    }

    /// Whether `id` ends generation (EOS or an end-of-turn token).
    pub fn is_end(&self, id: u32) -> bool {
        self.prompts.tokenizer().is_eog(id)
    }

    /// A KV cache able to hold `tokens` tokens in blocks of `block_size`.
    pub fn new_cache(&self, tokens: usize, block_size: usize) -> Result<KvCache> {
        KvCache::new(self.kv_layout(block_size), tokens.div_ceil(block_size.max(1)))
    }

    /// The shape of this model's KV in blocks of `block_size` tokens.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        let c = self.model.config();
        KvLayout { n_layer: c.n_layer, kv_dim: c.kv_dim(), head_dim: c.head_dim, block_size }
    }

    /// Renders chat messages with the model's template (generation prompt appended).
    pub fn render_chat(&self, messages: &[PromptMessage]) -> Result<String> {
        self.prompts.render_chat(messages)
    }

    /// The tokenizer and chat template, as the gateway and the bench use them.
    pub fn prompts(&self) -> &ModelTokenizer {
        &self.prompts
    }

    /// [`ModelTokenizer::encode_chat_within`] with the model's context as the limit.
    pub fn encode_chat_within_context(&self, messages: &[PromptMessage]) -> Result<Vec<u32>> {
        self.prompts.encode_chat_within(messages, self.model().config().n_ctx)
    }

    /// Tokenizes a prompt as llama.cpp's server does: BOS when the model wants it, and special
    /// tokens in the text (from a chat template) parsed as such.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.prompts.tokenizer().encode(text, true, true)?)
    }

    /// [`Engine::encode_prompt`] for a prompt that must fit the context: refused with
    /// `TokenizerError::TooLong` (as [`crate::EngineError::Tokenizer`]) once it cannot, without
    /// tokenizing text that could never fit.
    pub fn encode_prompt_within_context(&self, text: &str) -> Result<Vec<u32>> {
        self.prompts.encode_prompt_within(text, self.model().config().n_ctx)
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
            logits = self.model.forward(cache, &mut batch)?.into_first();
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
            let step = stops.push(&decoder.push(self.tokenizer(), next)?);
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
            logits = self.model.forward(cache, &mut batch)?.into_first();
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

/// The engine tokenizes for a gateway in front of it in the same process (`tokenpath serve`):
/// its [`ModelTokenizer`], nothing of the weights.
impl tokenpath_protocol::tokenize::PromptTokenizer for Engine {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.prompts.encode(text)
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.prompts.decode(ids)
    }

    fn chat_prompt(
        &self,
        messages: &[PromptMessage],
        limit: usize,
    ) -> std::result::Result<Vec<u32>, tokenpath_protocol::ProtocolError> {
        self.prompts.chat_prompt(messages, limit)
    }

    fn text_prompt(
        &self,
        text: &str,
        limit: usize,
    ) -> std::result::Result<Vec<u32>, tokenpath_protocol::ProtocolError> {
        self.prompts.text_prompt(text, limit)
    }

    fn count_chat(&self, messages: &[PromptMessage]) -> Option<usize> {
        self.prompts.count_chat(messages)
    }
}
