//! Token-for-token parity with llama.cpp on the default model.
//!
//! `fixtures/tokenizer_parity.json` holds llama.cpp's output (via `scripts/peer/llama_tokenize.py`,
//! llama-cpp-python 0.3.36) for `fixtures/tokenizer_corpus.json`; regenerate it with
//! `scripts/peer/gen_fixtures.sh`. Every entry must match exactly.

mod support;

use serde_json::Value;

#[test]
fn matches_llama_cpp_on_the_corpus() {
    let Some(l) = support::load_default() else { return };
    let raw = std::fs::read_to_string(support::fixture("tokenizer_parity.json")).expect("fixture");
    let cases: Vec<Value> = serde_json::from_str(&raw).expect("fixture JSON");
    assert!(cases.len() >= 40, "corpus too small");
    let mut bad = Vec::new();
    for c in &cases {
        let text = c["text"].as_str().expect("text");
        let special = c["parse_special"].as_bool().expect("parse_special");
        let want: Vec<u32> =
            c["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        let got = l.tok.encode(text, false, special).expect("encode");
        if got != want {
            let show = |ids: &[u32]| {
                ids.iter()
                    .map(|&i| format!("{i}:{:?}", l.tok.token_text(i).unwrap_or("?")))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            bad.push(format!(
                "{text:?} (special={special})\n  llama.cpp: {}\n  ours:      {}",
                show(&want),
                show(&got)
            ));
        }
        let back = l.tok.decode(&got, true).expect("decode");
        assert_eq!(String::from_utf8(back).expect("utf8"), text, "decode(encode(s)) != s");
    }
    eprintln!("parity: {}/{} identical", cases.len() - bad.len(), cases.len());
    assert!(bad.is_empty(), "{} mismatches:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn add_special_follows_the_vocabulary() {
    let Some(l) = support::load_default() else { return };
    let plain = l.tok.encode("Hello", false, false).expect("encode");
    let with = l.tok.encode("Hello", true, false).expect("encode");
    if l.tok.add_bos() {
        assert_eq!(with[0], l.tok.bos().expect("bos"));
        assert_eq!(&with[1..], &plain[..]);
    } else {
        assert_eq!(with, plain);
    }
}

#[test]
fn unknown_ids_are_typed_errors() {
    let Some(l) = support::load_default() else { return };
    let n = l.tok.vocab_size() as u32;
    assert!(l.tok.decode(&[1, n], true).is_err());
    assert!(l.tok.decode_token(u32::MAX, false).is_err());
}

/// Differential run against a larger llama.cpp-tokenized corpus, e.g. from
/// `tools/diff_corpus.py` (`TOKENIZER_DIFF=out.json cargo test differential -- --nocapture`);
/// the JSON names the GGUF it was made with, so variants with other pre-tokenizers work too.
#[test]
fn differential_from_env() {
    let Some(path) = std::env::var_os("TOKENIZER_DIFF") else { return };
    let raw = std::fs::read_to_string(path).expect("TOKENIZER_DIFF file");
    let doc: Value = serde_json::from_str(&raw).expect("json");
    let model = std::path::PathBuf::from(doc["model"].as_str().expect("model"));
    let (tok, pre) = support::tokenizer_at(&model);
    let cases = doc["cases"].as_array().expect("cases");
    let mut bad = 0;
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let special = c["parse_special"].as_bool().expect("parse_special");
        let want: Vec<u32> =
            c["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        let got = tok.encode(text, false, special).expect("encode");
        if got != want {
            bad += 1;
            if bad <= 10 {
                eprintln!("MISMATCH {text:?} special={special}\n  llama.cpp: {want:?}\n  ours:      {got:?}");
            }
        }
    }
    eprintln!(
        "differential ({:?}, {}): {}/{} identical",
        pre,
        model.display(),
        cases.len() - bad,
        cases.len()
    );
    assert_eq!(bad, 0);
}

/// Every token's piece against llama.cpp's `llama_token_to_piece` (special on and off):
/// `TOKENIZER_PIECES=pieces.json` with `{model, special: [hex], plain: [hex]}`.
#[test]
fn pieces_from_env() {
    let Some(path) = std::env::var_os("TOKENIZER_PIECES") else { return };
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("file")).expect("json");
    let (tok, _pre) = support::tokenizer_at(std::path::Path::new(doc["model"].as_str().expect("model")));
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut bad = 0;
    for (key, special) in [("special", true), ("plain", false)] {
        let want = doc[key].as_array().expect("pieces");
        assert_eq!(want.len(), tok.vocab_size());
        for (id, w) in want.iter().enumerate() {
            let got = hex(tok.decode_token(id as u32, special).expect("id"));
            if got != w.as_str().expect("hex") {
                bad += 1;
                if bad <= 10 {
                    eprintln!("MISMATCH id {id} special={special}: llama.cpp {w} ours {got}");
                }
            }
        }
    }
    eprintln!("pieces: {} mismatches over {} tokens x 2", bad, tok.vocab_size());
    assert_eq!(bad, 0);
}
