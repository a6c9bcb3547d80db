//! The library half of the `tokenpath` binary: the code of the binary that is more than argument
//! glue and that its tests use directly. For now, the tokenizers `tokenpath bench --tokenizer`
//! reads (GGUF metadata or a Hugging Face `tokenizer.json`), which need both the engine (its
//! tokenizer and chat-template renderer) and the bench crate (its `PromptTokenizer` trait), so they
//! belong to neither. And the cluster file's rules (`[[worker]]` and `[[upstream]]` tables), kept
//! here so they are tested without a process.

pub mod cluster_file;
pub mod tokenizer;
