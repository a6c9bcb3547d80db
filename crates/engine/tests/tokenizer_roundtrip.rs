//! Properties: `decode(encode(s)) == s` for any string, encode never panics, and the streaming
//! decoder reproduces `decode` exactly. Run on a small synthetic byte-level vocabulary (always)
//! and on the default model's vocabulary (when it is present).

mod support;

use proptest::prelude::*;
use tokenpath_engine::tokenizer::{PreTokenizer, StreamDecoder, Tokenizer};

/// GPT-2 bytes_to_unicode, written independently of the crate's version.
fn byte_char(b: u8) -> char {
    let printable =
        |x: u32| (0x21..=0x7E).contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x);
    if printable(u32::from(b)) {
        return char::from(b);
    }
    let n = (0..u32::from(b)).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("valid")
}

fn synthetic(pre: &str) -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let merges: Vec<String> =
        ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "1 2", "12 3", "ä ¸", "Ġ Ġ", "ĠĠ ĠĠ"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1; tokens.len()];
    tokens.push("<|x|>".into());
    types.push(3);
    tokens.push("<u>".into());
    types.push(4);
    Tokenizer::from_gguf_parts(tokens, types, merges, Some(pre), None, None, Some(false), None)
        .expect("vocab")
}

fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        any::<String>(),
        "[a-zA-Z']{0,12}",
        "[ \t\n\r]{0,6}",
        "[0-9]{0,9}",
        "[\u{4e00}-\u{4e20}\u{3040}-\u{3060}]{0,6}",
        Just("👨‍👩‍👧‍👦 🇺🇸 1️⃣".to_string()),
        Just("<|x|>".to_string()),
        Just("<u>".to_string()),
        Just("<|im_start|>".to_string()),
        Just("\u{a0}\u{3000}\u{85}".to_string()),
    ];
    prop::collection::vec(piece, 0..6).prop_map(|v| v.concat())
}

fn check(tok: &Tokenizer, s: &str) -> Result<(), TestCaseError> {
    for parse_special in [false, true] {
        let ids = tok.encode(s, false, parse_special).expect("encode");
        let back = tok.decode(&ids, true).expect("decode");
        prop_assert_eq!(String::from_utf8(back.clone()).expect("utf8"), s);
        let mut sd = StreamDecoder::new(true);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&sd.push(tok, id).expect("push"));
        }
        streamed.push_str(&sd.finish());
        prop_assert_eq!(&streamed, s);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn synthetic_round_trip(s in text_strategy()) {
        for pre in ["smollm", "gpt-2", "llama3", "default"] {
            check(&synthetic(pre), &s)?;
        }
    }
}

#[test]
fn synthetic_pre_types_parse() {
    assert_eq!(synthetic("llama3").pre_tokenizer(), PreTokenizer::Llama3);
    assert_eq!(synthetic("default").pre_tokenizer(), PreTokenizer::Default);
}

#[test]
fn default_model_round_trip() {
    let Some(l) = support::load_default() else { return };
    let mut runner =
        proptest::test_runner::TestRunner::new(ProptestConfig { cases: 256, ..ProptestConfig::default() });
    runner.run(&text_strategy(), |s| check(&l.tok, &s)).expect("round trip");
}

#[test]
fn long_words_are_merged_in_bounded_pieces_and_refused_past_the_limit() {
    let tok = synthetic("smollm");
    // A 4 MB run of one letter: refused from its length alone when it cannot fit 8192 tokens.
    let huge = "a".repeat(4_000_000);
    let limit = 8192;
    assert!(huge.len() > limit * tok.max_token_bytes());
    assert!(matches!(
        tok.encode_at_most(&huge, false, false, limit),
        Err(tokenpath_engine::tokenizer::TokenizerError::TooLong { limit: 8192 })
    ));
    // Shorter than the byte bound but still more tokens than the limit: refused while encoding.
    let many = "a ".repeat(limit);
    assert!(tok.encode_at_most(&many, false, false, limit).is_err());
    assert!(tok.encode_at_most(&many, false, false, 4 * limit).is_ok());
    // A long word decodes back to itself (pieces change the merges, never the text).
    let word = "é".repeat(30_000) + &"x".repeat(50_000);
    let ids = tok.encode(&word, false, false).expect("encode");
    assert_eq!(String::from_utf8(tok.decode(&ids, true).expect("decode")).expect("utf8"), word);
}
