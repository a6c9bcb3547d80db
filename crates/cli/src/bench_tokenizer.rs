//! `tokenpath bench --tokenizer FILE.gguf`: the model's tokenizer and chat template read from a
//! GGUF file's metadata, behind the bench crate's `PromptTokenizer` trait. The file is memory-
//! mapped and only its metadata is parsed; no weight is read, so pointing it at a multi-gigabyte
//! model costs the vocabulary, not the model. Lives in the binary because the bench crate does
//! not depend on the engine.

use std::path::Path;
use tokenpath_bench::tokens::{ChatMsg, PromptTokenizer};
use tokenpath_engine::gguf::GgufFile;
use tokenpath_engine::tokenizer::{
    chat_template_from_gguf, tokenizer_from_gguf, ChatMessage, ChatTemplate, Tokenizer,
};

/// A GGUF file's tokenizer and chat template.
#[derive(Debug)]
pub struct GgufTokenizer {
    tok: Tokenizer,
    chat: Option<ChatTemplate>,
}

impl GgufTokenizer {
    /// Reads the tokenizer metadata of the GGUF file at `path`.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let file =
            GgufFile::open(path).map_err(|e| anyhow::anyhow!("--tokenizer {}: {e}", path.display()))?;
        let tok = tokenizer_from_gguf(file.index())?;
        let chat = chat_template_from_gguf(file.index(), &tok)?;
        Ok(Self { tok, chat })
    }
}

impl PromptTokenizer for GgufTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.tok.encode(text, false, false).unwrap_or_default()
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.tok.decode_lossy(ids, false).unwrap_or_default()
    }

    fn count_chat(&self, messages: &[ChatMsg]) -> Option<usize> {
        let msgs: Vec<ChatMessage> =
            messages.iter().map(|m| ChatMessage::new(m.role, m.content.clone())).collect();
        let text = self.chat.as_ref()?.render(&msgs, true).ok()?;
        self.tok.encode(&text, true, true).ok().map(|ids| ids.len())
    }
}
