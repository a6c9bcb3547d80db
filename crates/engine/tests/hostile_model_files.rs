//! The loader above the GGUF parser on hostile files (invariant 8; the parser's own walk is
//! `gguf::tests::mutations_and_truncations_never_panic`): a model file and its tokenizer
//! metadata, mutated where lengths, counts, shapes and hyper-parameters live, must load or be
//! refused with an error — never panic, never abort on an allocation the file talked it into —
//! and a tokenizer that loads must encode, decode and stream any text. The fuzz target
//! `model_load` (`crates/engine/fuzz`) runs the same walk on arbitrary bytes.

use tokenpath_engine::gguf::GgufIndex;
use tokenpath_engine::model::Model;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::tokenizer::{ModelTokenizer, StreamDecoder};

/// xorshift64*: the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

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
    let head = base.len().min(64 << 10);
    let interesting: [u64; 8] = [0, 1, 0x7f, 0xff, 0xffff_ffff, 1 << 32, 1 << 60, u64::MAX];
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let (mut tokenizers, mut models) = (0, 0);
    for i in 0..4000 {
        let mut b = base.clone();
        match i % 4 {
            0 => b.truncate(rng.below(b.len())),
            1 => {
                for _ in 0..1 + rng.below(4) {
                    let p = rng.below(head);
                    b[p] ^= 1 << rng.below(8);
                }
            }
            2 => {
                let p = rng.below(head - 8);
                let v = interesting[rng.below(interesting.len())];
                b[p..p + 8].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let p = rng.below(head - 4);
                let v = interesting[rng.below(interesting.len())] as u32;
                b[p..p + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        let (t, m) = load(&b);
        tokenizers += t as usize;
        models += m as usize;
    }
    // Sanity: the walk reached past the parser (some mutations still load).
    eprintln!("of 4000 mutated files: {tokenizers} tokenizers and {models} models loaded");
    assert!(tokenizers > 400 && models > 400, "only {tokenizers} tokenizers and {models} models loaded");
}
