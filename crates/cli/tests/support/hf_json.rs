//! A GGUF file's tokenizer written out as the Hugging Face files a vLLM or SGLang user has next to
//! the model: `tokenizer.json` (byte-level BPE: vocabulary, merges, added tokens, pre-tokenizer,
//! decoder) and `tokenizer_config.json` (chat template, BOS/EOS, `add_bos_token`), so tests can
//! check the `tokenizer.json` path of `tokenpath bench --tokenizer` against the GGUF path on the
//! same vocabulary.
//!
//! The pre-tokenizer is the one the original HF files have for the GGUF's `tokenizer.ggml.pre`:
//! `smollm` (SmolLM2, StarCoder) is llama.cpp's regex list [`\p{N}`, GPT-2], which HF writes as
//! `Sequence[Digits(individual_digits), ByteLevel(use_regex)]`; `gpt-2` is the plain
//! `ByteLevel(use_regex)`. Token types come from the engine's tokenizer (after llama.cpp's
//! overrides): control tokens become special added tokens, user-defined ones non-special added
//! tokens (both always matched by HF, except that `encode_special_tokens` leaves special ones as
//! text, which is llama.cpp's `parse_special = false`).

use serde_json::{json, Map, Value};
use std::path::Path;
use tokenpath_engine::gguf::GgufFile;
use tokenpath_engine::tokenizer::{tokenizer_from_gguf, TokenType};

/// `tokenizer.json` and `tokenizer_config.json` (as JSON values) equivalent to the tokenizer of
/// the GGUF file at `gguf`.
pub fn hf_files_from_gguf(gguf: &Path) -> (Value, Value) {
    let file = GgufFile::open(gguf).expect("open GGUF");
    let g = file.index();
    let tok = tokenizer_from_gguf(g).expect("GGUF tokenizer");
    let tokens = g.get_str_array("tokenizer.ggml.tokens").expect("tokens");
    let merges = g.get_str_array("tokenizer.ggml.merges").expect("merges");
    let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");

    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, text) in tokens.iter().enumerate() {
        let id = id as u32;
        assert!(vocab.insert(text.clone(), id.into()).is_none(), "duplicate token {text:?}");
        let ty = tok.token_type(id).expect("type");
        if matches!(ty, TokenType::Control | TokenType::UserDefined) {
            added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == TokenType::Control,
            }));
        }
        assert!(
            !matches!(ty, TokenType::Unknown | TokenType::Byte | TokenType::Unused),
            "token {id} {text:?} of type {ty:?}: not a plain byte-level BPE vocabulary"
        );
    }
    let byte_level =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level,
        ]}),
        "gpt-2" => byte_level,
        other => panic!("no HF equivalent written for pre-tokenizer {other:?}"),
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });

    let text_of = |id: Option<u32>| id.map(|i| tok.token_text(i).expect("id").to_owned());
    let mut config = json!({
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer",
        "clean_up_tokenization_spaces": false,
        "add_bos_token": tok.add_bos(),
        // Both spellings transformers writes: a plain string, and an AddedToken object.
        "bos_token": text_of(tok.bos()),
        "eos_token": text_of(tok.eos()).map(|t| json!({
            "__type": "AddedToken", "content": t, "lstrip": false, "normalized": false,
            "rstrip": false, "single_word": false,
        })),
    });
    if let Ok(t) = g.get_str("tokenizer.chat_template") {
        config["chat_template"] = t.into();
    }
    (tokenizer_json, config)
}

/// Writes both files into `dir` (created).
pub fn write_hf_files(gguf: &Path, dir: &Path) {
    let (tokenizer, config) = hf_files_from_gguf(gguf);
    std::fs::create_dir_all(dir).expect("create dir");
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("write tokenizer.json");
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&config).expect("json"))
        .expect("write tokenizer_config.json");
}
