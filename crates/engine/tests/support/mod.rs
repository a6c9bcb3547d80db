//! Shared test helpers: locate the default model and build its tokenizer with the engine's own
//! GGUF parser.
//!
//! Tests that need the real SmolLM2 GGUF skip (loudly, on stderr) when it is absent so a
//! developer without the download can still run the rest — except under CI (`CI` set), where
//! `scripts/test` has fetched the model and a missing file is a failure, not a skip.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use tokenpath_engine::gguf::GgufFile;
use tokenpath_engine::tokenizer::{tokenizer_from_gguf, ChatTemplate, Tokenizer};

/// Where the default model lives: `$TOKENPATH_MODEL`, else the set-up's cache path.
pub fn default_model_location() -> PathBuf {
    if let Some(p) = std::env::var_os("TOKENPATH_MODEL") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("TOKENPATH_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
        home.join("tokenpath")
    });
    cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The default model's path, or `None` (with a note) when it is absent outside CI.
pub fn model_path() -> Option<PathBuf> {
    let p = default_model_location();
    if p.is_file() {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "default model missing at {} under CI: scripts/test should have fetched it",
        p.display()
    );
    eprintln!("SKIP: default model not found at {} (run scripts/setup --model)", p.display());
    None
}

/// A tokenizer (and its pre-tokenizer name) read from the GGUF at `path`.
pub fn tokenizer_at(path: &Path) -> (Tokenizer, Option<String>) {
    let g = GgufFile::open(path).expect("open GGUF");
    let pre = g.get_str("tokenizer.ggml.pre").ok().map(str::to_owned);
    (tokenizer_from_gguf(&g).expect("tokenizer from GGUF"), pre)
}

pub struct Loaded {
    pub tok: Tokenizer,
    pub template: Option<String>,
    pub bos_text: String,
    pub eos_text: String,
}

pub fn load_default() -> Option<Loaded> {
    let path = model_path()?;
    let g = GgufFile::open(&path).expect("open GGUF");
    let tok = tokenizer_from_gguf(&g).expect("tokenizer from GGUF");
    let template = g.get_str("tokenizer.chat_template").ok().map(str::to_owned);
    let text = |id: Option<u32>| id.map(|i| tok.token_text(i).expect("id").to_string()).unwrap_or_default();
    let (bos_text, eos_text) = (text(tok.bos()), text(tok.eos()));
    Some(Loaded { tok, template, bos_text, eos_text })
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub fn template_of(l: &Loaded) -> ChatTemplate {
    ChatTemplate::new(l.template.as_deref().expect("model has a chat template"), &l.bos_text, &l.eos_text)
        .expect("template compiles")
}
