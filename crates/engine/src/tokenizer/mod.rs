//! GGUF-driven tokenizer and chat template for tokenpath's embedded engine.
//!
//! Everything here is built from the values a GGUF file's `tokenizer.*` metadata holds, and
//! reproduces llama.cpp's behaviour token for token (llama.cpp is the project's correctness
//! oracle, see `scripts/peer/llama_tokenize.py`). Files refer to each other only through `super::`:
//! - `vocab.rs`: [`Tokenizer`]: encode / decode, the GGUF entry point;
//! - `pretokenize.rs`: llama.cpp's pre-tokenizers (`smollm`, `gpt-2`, `llama3`, `default`);
//! - `bpe.rs`: rank-ordered merges; `special.rs`: special-token partition;
//! - `unicode.rs`: code-point classes (Unicode general categories, GPT-2 byte map);
//! - `stream.rs`: [`StreamDecoder`] for SSE; `chat.rs`: [`ChatTemplate`]; `sandbox.rs`: the
//!   child processes templates render in; `reviewed.rs`: the templates that need none;
//! - `error.rs`: [`TokenizerError`], wrapped by the engine's error enum;
//! - `from_gguf.rs`: which `tokenizer.*` GGUF keys build all of the above; `prompt.rs`:
//!   [`ModelTokenizer`], tokenizer and template together (the protocol's `PromptTokenizer`).

mod bpe;
mod chat;
mod error;
mod from_gguf;
mod pretokenize;
mod prompt;
mod pycompat;
pub mod reviewed;
pub mod sandbox;
mod special;
mod stream;
mod unicode;
mod vocab;

pub use chat::ChatTemplate;
pub use error::TokenizerError;
pub use from_gguf::{chat_template_from_gguf, tokenizer_from_gguf};
pub use pretokenize::PreTokenizer;
pub use prompt::ModelTokenizer;
pub use stream::StreamDecoder;
/// One chat message (role and text), defined once in the protocol crate.
pub use tokenpath_protocol::{PromptMessage, Role};
pub(crate) use unicode::byte_to_char_table;
pub use vocab::{TokenType, Tokenizer};
