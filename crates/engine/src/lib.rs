//! The embedded CPU engine: it turns a GGUF file into tokens. GGUF loading, the tokenizer and
//! chat template, paged KV blocks, the prefill/decode forward pass and sampling live here.
//!
//! The engine knows nothing about HTTP, queues or processes: it is a model runner that a worker
//! drives one step at a time ([`model::Model::forward`] over a batch that mixes prefill chunks and
//! decode steps). Everything that reads untrusted bytes (the GGUF file) does so with bounded reads
//! and typed errors, because a model file is input like any other.

pub mod bench;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod kv_cache;
pub mod model;
pub mod par;
pub mod quant;
pub mod sampling;
pub mod stop;
pub mod tiny;
pub mod tokenizer;

pub use error::EngineError;
pub use generate::{Engine, Finish, GenerateRequest, Generation};

/// Where `scripts/setup` puts the default model: `$TOKENPATH_MODEL` if set, else
/// `$TOKENPATH_CACHE` (default `$XDG_CACHE_HOME/tokenpath` or `~/.cache/tokenpath`) +
/// `models/SmolLM2-135M-Instruct.Q4_1.gguf`.
pub fn default_model_path() -> std::path::PathBuf {
    use std::path::PathBuf;
    if let Some(p) = std::env::var_os("TOKENPATH_MODEL") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("TOKENPATH_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"))
            .join("tokenpath")
    });
    cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}
