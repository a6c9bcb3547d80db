//! The one error type of the engine crate.
//!
//! Every fallible engine operation (GGUF parsing, tensor loading, kernels, and later the
//! tokenizer, forward pass and sampling) returns [`EngineError`]. It is a single enum rather than
//! one per module so that callers (the worker) match on one type, and so that a model file that
//! is wrong in any way produces a message a user can act on: each variant names the thing that
//! is wrong (key, tensor, byte offset) and, where there is a closed set, what would be accepted.
//! Variants are deliberately general (`Gguf { offset, reason }`, `ShapeMismatch { what, .. }`)
//! so later modules can reuse them instead of growing one variant per call site.

use std::path::PathBuf;

/// Result alias used throughout the engine crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Everything that can go wrong inside the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// Reading or mapping a file failed.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The bytes are not a valid GGUF file; `offset` is where in the file the problem was found.
    #[error("invalid GGUF file at byte offset {offset}: {reason}")]
    Gguf {
        /// Byte offset from the start of the file.
        offset: u64,
        /// Human-readable description of what is wrong.
        reason: String,
    },

    /// A metadata key the engine needs is absent.
    #[error("missing GGUF metadata key `{0}`")]
    MissingMetadata(String),

    /// A metadata key exists but its value has the wrong type (or does not fit the requested
    /// integer type).
    #[error("GGUF metadata key `{key}` has {found}, expected {expected}")]
    MetadataType {
        /// The key looked up.
        key: String,
        /// What the caller asked for, e.g. "an unsigned 32-bit integer".
        expected: &'static str,
        /// What the file contains, e.g. "type string" or "value -3".
        found: String,
    },

    /// A tensor the engine needs is absent from the model file.
    #[error("tensor `{0}` not found in the model file")]
    MissingTensor(String),

    /// A tensor uses a ggml type the compute kernels do not implement.
    #[error("unsupported tensor type {ty} for tensor `{name}`; supported: {supported}")]
    UnsupportedTensorType {
        /// Tensor name (or a description of the operand when there is no name).
        name: String,
        /// The ggml type name, e.g. "Q5_K".
        ty: String,
        /// Comma-separated list of supported type names.
        supported: String,
    },

    /// The model's `general.architecture` is not one the engine can run.
    #[error("unsupported model architecture `{arch}`; supported: {supported}")]
    UnsupportedArchitecture {
        /// Architecture named in the file.
        arch: String,
        /// Comma-separated list of supported architectures.
        supported: String,
    },

    /// Two things that must agree in shape or length do not.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// What was being checked, e.g. "matvec input for tensor `blk.0.attn_q.weight`".
        what: String,
        /// The expected shape or length.
        expected: String,
        /// The actual shape or length.
        got: String,
    },

    /// The model file is well-formed GGUF but its contents are inconsistent for the engine
    /// (e.g. head count does not divide the embedding width).
    #[error("invalid model: {0}")]
    InvalidModel(String),

    /// A caller passed an argument the engine cannot accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A sequence would grow past the model's context length. Never truncated silently.
    #[error("{tokens} tokens exceed the model's context length of {limit}")]
    ContextOverflow {
        /// Tokens the sequence would hold.
        tokens: usize,
        /// The model's context length.
        limit: usize,
    },

    /// The KV cache has fewer free blocks than a step needs.
    #[error("KV cache full: {needed} more blocks needed, {free} free")]
    KvCacheFull {
        /// Blocks the step needed beyond what the sequence had.
        needed: usize,
        /// Blocks free at the time.
        free: usize,
    },

    /// The system refused memory the engine asked for (a KV cache larger than the machine).
    #[error("could not allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// What the memory was for.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },

    /// Tokenizer or chat-template failure.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

impl EngineError {
    /// Shorthand for [`EngineError::Gguf`].
    pub fn gguf(offset: u64, reason: impl Into<String>) -> Self {
        Self::Gguf { offset, reason: reason.into() }
    }

    /// Shorthand for [`EngineError::ShapeMismatch`].
    pub fn shape(
        what: impl Into<String>,
        expected: impl std::fmt::Display,
        got: impl std::fmt::Display,
    ) -> Self {
        Self::ShapeMismatch { what: what.into(), expected: expected.to_string(), got: got.to_string() }
    }
}
