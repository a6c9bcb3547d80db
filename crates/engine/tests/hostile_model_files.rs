//! The loader above the GGUF parser on hostile files (invariant 8; the parser's own walk is
//! `gguf::tests::mutations_and_truncations_never_panic`): a model file and its tokenizer
//! metadata, mutated where lengths, counts, shapes and hyper-parameters live, must load or be
//! refused with an error — never panic, never abort on an allocation the file talked it into —
//! and a tokenizer that loads must encode, decode and stream any text. The fuzz target
//! `model_load` (`crates/engine/fuzz`) runs the same walk on arbitrary bytes.

use tokenpath_engine::gguf::GgufIndex;
use tokenpath_engine::model::Model;
use tokenpath_engine::tiny::{mutations, tiny_model_bytes, TinySpec};
use tokenpath_engine::tokenizer::{ModelTokenizer, StreamDecoder};

/// Everything a server does with a file before its first request.
fn load(bytes: &[u8]) -> (bool, bool) {
    let tokenizer = GgufIndex::parse(bytes).ok().and_then(|g| ModelTokenizer::from_gguf(&g).ok());
    if let Some(t) = &tokenizer {
        for text in ["hello world", "", "  \n\t 12345 ünïcødé 你好 🙂", "<|im_start|>user\nhi<|im_end|>"]
        {
            let ids = t.tokenizer().encode(text, true, true).unwrap_or_default();
            let _ = t.tokenizer().decode(&ids, true);
            let _ = t.tokenizer().decode_lossy(&ids, false);
            let mut stream = StreamDecoder::new(false);
            for &id in ids.iter().chain(&[0, 1, u32::MAX]) {
                let _ = stream.push(t.tokenizer(), id);
            }
        }
    }
    (tokenizer.is_some(), Model::from_bytes(bytes.to_vec()).is_ok())
}

#[test]
fn mutated_model_files_load_or_are_refused_never_panic() {
    let spec = TinySpec { n_ctx: 256, ..TinySpec::default() };
    let base = tiny_model_bytes(&spec).unwrap();
    assert_eq!(load(&base), (true, true), "the unmutated file loads");
    // The metadata and tensor table come first: most mutations go there, where they bite.
    let (mut tokenizers, mut models) = (0, 0);
    for b in mutations(&base, 64 << 10, 4000, 0x2545_F491_4F6C_DD1D) {
        let (t, m) = load(&b);
        tokenizers += t as usize;
        models += m as usize;
    }
    // Sanity: the walk reached past the parser (some mutations still load).
    eprintln!("of 4000 mutated files: {tokenizers} tokenizers and {models} models loaded");
    assert!(tokenizers > 400 && models > 400, "only {tokenizers} tokenizers and {models} models loaded");
}
