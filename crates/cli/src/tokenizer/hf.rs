//! A Hugging Face `tokenizer.json`, loaded by HF's own `tokenizers` crate, with the chat template,
//! BOS/EOS texts and `add_bos_token` of its sibling `tokenizer_config.json` (a sibling
//! `chat_template.jinja` takes precedence over the config's template, as in `transformers`). The
//! template is rendered by the engine's [`ChatTemplate`]: the same minijinja set-up as for a GGUF
//! file's template, so both kinds render alike.
//!
//! Token semantics follow the `PromptTokenizer` trait and what an HF-based server (vLLM, SGLang)
//! does with a chat request:
//! - `encode`: plain text with `add_special_tokens = false`; special-token text (`<|im_start|>`)
//!   stays text (`encode_special_tokens`), as the GGUF tokenizer does without `parse_special`;
//!   non-special added tokens are matched, as llama.cpp's user-defined tokens are.
//! - `chat_prompt` / `count_chat`: the template rendered with the generation prompt, encoded with special tokens
//!   matched and `add_special_tokens = false` (what `apply_chat_template` and vLLM's chat path do:
//!   the template writes its own BOS); then, when `add_bos_token` is set and the rendered prompt
//!   does not already start with BOS, one BOS is counted first, as a server that adds the model's
//!   BOS does (llama.cpp's, tokenpath's). vLLM adds none, but the templates of models that set
//!   `add_bos_token` write `bos_token` themselves, so the two agree on those; a BOS is never
//!   counted twice.
//! - `decode`: special tokens skipped, invalid UTF-8 replaced (the byte-level decoder is lossy).
//!
//! Truncation and padding saved in the file are switched off, as `transformers` does for a call
//! that asks for neither.

use anyhow::Context as _;
use std::path::Path;
use tokenizers::Tokenizer;
use tokenpath_engine::tokenizer::ChatTemplate;
use tokenpath_protocol::tokenize::{too_long, PromptTokenizer};
use tokenpath_protocol::{PromptMessage, ProtocolError};

/// The chat-relevant part of a `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// `chat_template`: the string, or of the list of named templates the one named `default`.
    pub chat_template: Option<String>,
    /// Why there is no template when the config has a `chat_template` that could not be used.
    pub no_template: Option<String>,
    /// `bos_token` (a string or an `{"content": ...}` object).
    pub bos_token: Option<String>,
    /// `eos_token` (a string or an `{"content": ...}` object).
    pub eos_token: Option<String>,
    /// `add_bos_token` (absent: false).
    pub add_bos_token: bool,
}

impl TokenizerConfig {
    /// Parses the text of a `tokenizer_config.json`. Unknown keys are ignored; the known ones
    /// must have the types `transformers` writes.
    pub fn parse(json: &str) -> anyhow::Result<Self> {
        let v: serde_json::Value = serde_json::from_str(json).context("not JSON")?;
        let obj = v.as_object().context("not a JSON object")?;
        let token = |key: &str| -> anyhow::Result<Option<String>> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(o @ serde_json::Value::Object(_)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    _ => anyhow::bail!("`{key}` is an object without a string `content`"),
                },
                Some(other) => anyhow::bail!("`{key}` is neither a string nor an object: {other}"),
            }
        };
        let mut cfg = TokenizerConfig {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            add_bos_token: match obj.get("add_bos_token") {
                None | Some(serde_json::Value::Null) => false,
                Some(b) => b.as_bool().context("`add_bos_token` is not a boolean")?,
            },
            ..TokenizerConfig::default()
        };
        match obj.get("chat_template") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(s)) => cfg.chat_template = Some(s.clone()),
            Some(serde_json::Value::Array(list)) => {
                let mut names = Vec::new();
                for t in list {
                    let name = t.get("name").and_then(|n| n.as_str());
                    let template = t.get("template").and_then(|n| n.as_str());
                    let (Some(name), Some(template)) = (name, template) else {
                        anyhow::bail!("`chat_template` list entry without a string `name` and `template`");
                    };
                    if name == "default" {
                        cfg.chat_template = Some(template.to_owned());
                    }
                    names.push(name.to_owned());
                }
                if cfg.chat_template.is_none() {
                    cfg.no_template = Some(format!(
                        "`chat_template` lists no template named `default` (only {})",
                        names.join(", ")
                    ));
                }
            }
            Some(other) => anyhow::bail!("`chat_template` is neither a string nor a list: {other}"),
        }
        Ok(cfg)
    }
}

/// A Hugging Face tokenizer with its chat template. Held twice, once with
/// `encode_special_tokens`: `tokenizers` takes that switch per tokenizer, not per call, and a lock
/// around one copy would serialise the send tasks' counting.
#[derive(Debug)]
pub struct HfTokenizer {
    /// Special-token text is plain text (`encode_special_tokens`): the trait's `encode`.
    plain: Tokenizer,
    /// Special tokens written in the text become those tokens: the rendered chat prompt.
    special: Tokenizer,
    chat: Option<ChatTemplate>,
    /// The BOS id `count_chat` puts first (`add_bos_token`).
    bos: Option<u32>,
    /// Where the template came from, or why there is none.
    template_note: String,
    /// The longest token's text in bytes (an upper bound of the bytes one token covers), so
    /// text that cannot fit a context is refused before it is encoded.
    max_token_bytes: usize,
}

impl HfTokenizer {
    /// Loads `tokenizer.json` at `path` and, when present, `tokenizer_config.json` and
    /// `chat_template.jinja` next to it. Errors name the file at fault.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let at = |p: &Path| format!("--tokenizer {}", p.display());
        let bytes = std::fs::read(path).with_context(|| at(path))?;
        let json = bytes.strip_prefix(b"\xEF\xBB\xBF".as_slice()).unwrap_or(&bytes);
        let mut special = Tokenizer::from_bytes(json).map_err(|e| {
            let hint = if path.file_name().is_some_and(|n| n == "tokenizer_config.json") {
                " (give the tokenizer.json next to it, or their directory)"
            } else {
                ""
            };
            anyhow::anyhow!("{}: not a Hugging Face tokenizer.json{hint}: {e}", at(path))
        })?;
        special.with_truncation(None).map_err(|e| anyhow::anyhow!("{}: {e}", at(path)))?;
        special.with_padding(None);
        let mut plain = special.clone();
        plain.set_encode_special_tokens(true);

        let dir = path.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(TokenizerConfig::parse(&text).with_context(|| at(&config_path))?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| at(&config_path)),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let jinja = match std::fs::read_to_string(&jinja_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| at(&jinja_path)),
        };
        let cfg = config.clone().unwrap_or_default();
        let (source, from, template_note) = match (jinja, &cfg.chat_template) {
            (Some(t), _) => {
                (Some(t), jinja_path.clone(), format!("chat template from {}", jinja_path.display()))
            }
            (None, Some(t)) => (
                Some(t.clone()),
                config_path.clone(),
                format!("chat template from {}", config_path.display()),
            ),
            (None, None) => {
                let why = match (&config, &cfg.no_template) {
                    (None, _) => format!("no {} or {}", config_path.display(), jinja_path.display()),
                    (Some(_), Some(why)) => format!("{}: {why}", config_path.display()),
                    (Some(_), None) => format!("{} has no `chat_template`", config_path.display()),
                };
                (None, config_path.clone(), format!("no chat template ({why})"))
            }
        };
        let bos_text = cfg.bos_token.clone().unwrap_or_default();
        let eos_text = cfg.eos_token.clone().unwrap_or_default();
        let chat = source
            .map(|s| ChatTemplate::new(&s, &bos_text, &eos_text))
            .transpose()
            .with_context(|| format!("{}: the chat template", at(&from)))?;
        let bos = if cfg.add_bos_token {
            let id = special.token_to_id(&bos_text).with_context(|| {
                format!(
                    "{}: `add_bos_token` is set but `bos_token` {bos_text:?} is not in {}",
                    at(&config_path),
                    path.display()
                )
            })?;
            Some(id)
        } else {
            None
        };
        let max_token_bytes = special.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        Ok(Self { plain, special, chat, bos, template_note, max_token_bytes })
    }

    /// Whether a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// One line for the log: the vocabulary, the template's source, BOS handling.
    pub fn describe(&self) -> String {
        format!(
            "Hugging Face tokenizer.json, {} tokens, {}{}",
            self.special.get_vocab_size(true),
            self.template_note,
            self.bos.map_or(String::new(), |id| format!(", BOS {id} first (add_bos_token)"))
        )
    }

    /// Token ids of `text` with special-token text matched as those tokens (what `count_chat`
    /// encodes the rendered prompt with), no special tokens added.
    pub fn encode_with_special_tokens(&self, text: &str) -> Vec<u32> {
        self.special.encode_fast(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }
}

impl PromptTokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.plain.encode_fast(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.plain.decode(ids, true).unwrap_or_default()
    }

    fn chat_prompt(&self, messages: &[PromptMessage], limit: usize) -> Result<Vec<u32>, ProtocolError> {
        let chat = self.chat.as_ref().ok_or_else(|| ProtocolError::InvalidRequest {
            param: None,
            message: format!("The model's tokenizer has no chat template ({}).", self.template_note),
        })?;
        let text = chat.render(messages, true).map_err(|e| ProtocolError::InvalidRequest {
            param: None,
            message: format!("The prompt cannot be tokenized: {e}"),
        })?;
        self.text_prompt(&text, limit)
    }

    /// Special-token text matched (what the chat template wrote, or a completion prompt's, as
    /// vLLM encodes one), BOS first when `add_bos_token` asks and the text does not start with it.
    fn text_prompt(&self, text: &str, limit: usize) -> Result<Vec<u32>, ProtocolError> {
        if text.len() > limit.saturating_mul(self.max_token_bytes) {
            return Err(too_long(limit));
        }
        let enc = self.special.encode_fast(text, false).map_err(|e| ProtocolError::InvalidRequest {
            param: None,
            message: format!("The prompt cannot be tokenized: {e}"),
        })?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if let Some(b) = self.bos.filter(|&b| enc.get_ids().first() != Some(&b)) {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        if ids.len() > limit {
            return Err(too_long(limit));
        }
        Ok(ids)
    }
}
