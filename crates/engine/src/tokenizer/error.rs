//! The tokenizer's one error type.
//!
//! Kept separate and self-contained (thiserror, no foreign error types inside except as
//! strings) so the engine can fold it into its own error enum with a single `#[from]`
//! variant. Every fallible public function of the tokenizer returns this; nothing panics on
//! bad vocabularies, unknown ids or broken templates.

/// Everything that can go wrong while building a tokenizer from GGUF metadata, encoding,
/// decoding or rendering a chat template.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// `tokenizer.ggml.model` is not one this tokenizer implements (only `gpt2` BPE is).
    #[error("unsupported tokenizer model {0:?} (only \"gpt2\" byte-level BPE is implemented)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this tokenizer does not implement.
    #[error("unsupported pre-tokenizer {0:?}")]
    UnsupportedPreTokenizer(String),
    /// The vocabulary metadata is inconsistent (lengths, ids out of range, empty vocab...).
    #[error("invalid vocabulary: {0}")]
    InvalidVocab(String),
    /// A token id outside the vocabulary was given to a decoder.
    #[error("unknown token id {id} (vocabulary has {vocab_size} tokens)")]
    UnknownTokenId {
        /// The offending id.
        id: u32,
        /// Number of tokens in the vocabulary.
        vocab_size: usize,
    },
    /// `add_special` asked for a BOS/EOS token that the vocabulary does not define.
    #[error("the vocabulary has no {0} token but adding it was requested")]
    MissingSpecialToken(&'static str),
    /// The chat template does not parse.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// The text is more tokens than allowed (the context): refused before or while tokenizing.
    #[error("the text is longer than {limit} tokens")]
    TooLong {
        /// The limit.
        limit: usize,
    },
    /// The chat template failed while rendering (including its own `raise_exception`).
    #[error("chat template failed to render: {0}")]
    TemplateRender(String),
}
