//! The model's tokenizer and chat template behind the protocol crate's `PromptTokenizer` trait
//! (what the gateway admits requests with and `tokenpath bench --tokenizer PATH` cuts prompts
//! with), read from either
//! - a GGUF file's metadata (the engine's [`ModelTokenizer`]): the file is memory-mapped and only
//!   its metadata is parsed; no weight is read, so pointing it at a multi-gigabyte model costs the
//!   vocabulary, not the model (a cluster gateway tokenizes with this); or
//! - a Hugging Face `tokenizer.json`, or the directory holding one ([`HfTokenizer`], in `hf.rs`):
//!   what vLLM and SGLang users have next to their model, with the chat template of the sibling
//!   `tokenizer_config.json`.
//!
//! The kind is told by content: the GGUF magic, or a JSON object. Lives here rather than in the
//! bench or gateway crates because neither depends on the engine (whose chat-template renderer
//! both kinds use).

mod hf;

pub use hf::HfTokenizer;

use anyhow::Context as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};
pub use tokenpath_engine::tokenizer::ModelTokenizer;
use tokenpath_protocol::tokenize::PromptTokenizer;
use tokenpath_protocol::{PromptMessage, ProtocolError};

/// The tokenizer `--tokenizer PATH` names, of either kind.
#[derive(Debug)]
pub enum FileTokenizer {
    /// From a GGUF file's metadata.
    Gguf(Box<ModelTokenizer>),
    /// From a Hugging Face `tokenizer.json`.
    Hf(Box<HfTokenizer>),
}

/// What kind of tokenizer file a path holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerFile {
    /// A GGUF file (its magic seen).
    Gguf(PathBuf),
    /// A JSON file: a Hugging Face `tokenizer.json` (for a directory, the one inside it).
    HfJson(PathBuf),
}

impl TokenizerFile {
    /// Tells the kind of `path` by content: a directory stands for its `tokenizer.json`, a file
    /// starting with `GGUF` is a GGUF file, one whose first non-blank byte is `{` is JSON.
    /// Errors name the path.
    pub fn detect(path: &Path) -> anyhow::Result<Self> {
        let meta = std::fs::metadata(path).with_context(|| format!("--tokenizer {}", path.display()))?;
        if meta.is_dir() {
            let json = path.join("tokenizer.json");
            anyhow::ensure!(
                json.is_file(),
                "--tokenizer {}: a directory without a tokenizer.json (give a tokenizer.json, its \
                 directory, or a GGUF file)",
                path.display()
            );
            return Ok(Self::HfJson(json));
        }
        let mut head = Vec::with_capacity(64);
        std::fs::File::open(path)
            .and_then(|f| f.take(64).read_to_end(&mut head))
            .with_context(|| format!("--tokenizer {}", path.display()))?;
        if head.starts_with(b"GGUF") {
            return Ok(Self::Gguf(path.to_owned()));
        }
        let body = head.strip_prefix(b"\xEF\xBB\xBF".as_slice()).unwrap_or(&head);
        if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') {
            return Ok(Self::HfJson(path.to_owned()));
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
        let why = match ext.as_str() {
            "gguf" => "named .gguf but has no GGUF magic (truncated or not a GGUF file?)",
            "json" => "named .json but does not hold a JSON object",
            _ => "neither a GGUF file (no GGUF magic) nor a JSON tokenizer.json",
        };
        anyhow::bail!("--tokenizer {}: {why}", path.display())
    }
}

impl FileTokenizer {
    /// Opens the tokenizer at `path` (GGUF file, `tokenizer.json`, or a directory holding one).
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        Ok(match TokenizerFile::detect(path)? {
            TokenizerFile::Gguf(p) => Self::Gguf(Box::new(
                ModelTokenizer::open(&p).with_context(|| format!("--tokenizer {}", p.display()))?,
            )),
            TokenizerFile::HfJson(p) => Self::Hf(Box::new(HfTokenizer::open(&p)?)),
        })
    }

    /// Whether a chat template was found (without one, prompt counts are not checked).
    pub fn has_chat_template(&self) -> bool {
        match self {
            Self::Gguf(t) => t.chat().is_some(),
            Self::Hf(t) => t.has_chat_template(),
        }
    }

    /// One line for the log: the kind, the vocabulary and where the chat template came from.
    pub fn describe(&self) -> String {
        match self {
            Self::Gguf(t) => format!(
                "GGUF tokenizer, {} tokens, {}",
                t.tokenizer().vocab_size(),
                if t.chat().is_some() { "chat template from the file" } else { "no chat template" }
            ),
            Self::Hf(t) => t.describe(),
        }
    }

    fn inner(&self) -> &dyn PromptTokenizer {
        match self {
            Self::Gguf(t) => t.as_ref(),
            Self::Hf(t) => t.as_ref(),
        }
    }
}

impl PromptTokenizer for FileTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.inner().encode(text)
    }
    fn decode(&self, ids: &[u32]) -> String {
        self.inner().decode(ids)
    }
    fn chat_prompt(&self, messages: &[PromptMessage], limit: usize) -> Result<Vec<u32>, ProtocolError> {
        self.inner().chat_prompt(messages, limit)
    }
    fn text_prompt(&self, text: &str, limit: usize) -> Result<Vec<u32>, ProtocolError> {
        self.inner().text_prompt(text, limit)
    }
}
