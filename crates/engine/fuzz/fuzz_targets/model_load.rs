//! Fuzz target: arbitrary bytes as a model file — the loader above the parser (hyper-parameters,
//! tensor shapes against them, the repacked copies) and the tokenizer built from the file's
//! metadata, which then encodes, decodes and streams text. Errors, never panics, never an
//! allocation the file talked it into (libFuzzer's -rss_limit_mb). The stable test
//! `tests/hostile_model_files.rs` runs the same walk on seeded mutations of a real file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_engine::gguf::GgufIndex;
use tokenpath_engine::model::Model;
use tokenpath_engine::tokenizer::{ModelTokenizer, StreamDecoder};

fuzz_target!(|data: &[u8]| {
    if let Some(t) = GgufIndex::parse(data).ok().and_then(|g| ModelTokenizer::from_gguf(&g).ok()) {
        for text in ["hello world", "  \n\t 12345 ünïcødé 你好 🙂", "<|im_start|>user\nhi<|im_end|>"] {
            let ids = t.tokenizer().encode(text, true, true).unwrap_or_default();
            let _ = t.tokenizer().decode(&ids, true);
            let mut stream = StreamDecoder::new(false);
            for &id in ids.iter().chain(&[0, 1, u32::MAX]) {
                let _ = stream.push(t.tokenizer(), id);
            }
        }
    }
    let _ = Model::from_bytes(data.to_vec());
});
