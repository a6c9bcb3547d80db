//! The embedded CPU engine: it turns a GGUF file into tokens. GGUF loading, the tokenizer and
//! chat template, paged KV blocks, the prefill/decode forward pass and sampling live here.
//!
//! The engine knows nothing about HTTP, queues or processes: it is a model runner that a worker
//! drives one step at a time ([`model::Model::forward`] over a batch that mixes prefill chunks and
//! decode steps). Everything that reads untrusted bytes (the GGUF file) does so with bounded reads
//! and typed errors, because a model file is input like any other.

pub mod error;
pub mod generate;
pub mod gguf;
pub mod kv_cache;
pub mod model;
pub mod quant;
pub mod sampling;
pub mod stop;
pub mod tiny;
pub mod tokenizer;

pub use error::EngineError;
pub use generate::{Engine, Finish, GenerateRequest, Generation};
