//! `tokenpath bench --tokenizer tokenizer.json`: the Hugging Face tokenizer path.
//!
//! - A small byte-level BPE `tokenizer.json` written here by hand, with exact expected ids for
//!   encode, decode and the ChatML chat count, every `tokenizer_config.json` form the loader
//!   reads, and the errors for missing or wrong files.
//! - Differential: the GGUF tokenizer of the tiny test model and of the default model (SmolLM2,
//!   `scripts/setup --model`) converted into the equivalent `tokenizer.json` +
//!   `tokenizer_config.json` (`support/hf_json.rs`), then HF's `tokenizers` crate and the engine's
//!   llama.cpp-exact tokenizer must give the same ids on a varied corpus and on seeded random
//!   mixtures of the constructs where pre-tokenizers differ (digit runs, whitespace runs before
//!   digits and letters, contractions, marks, emoji sequences, special-token text).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use std::path::{Path, PathBuf};
use tokenpath_bench::tokens::{PromptMessage, PromptTokenizer, Role};
use tokenpath_cli::tokenizer::{FileTokenizer, HfTokenizer, ModelTokenizer, TokenizerFile};
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::tokenizer::{tokenizer_from_gguf, Tokenizer};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// GPT-2's byte → printable character map (`bytes_to_unicode`).
fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> =
        (u32::from(b'!')..=u32::from(b'~')).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// Specials 0..=2, then byte `b` is id `3 + b`, then the merge products from 259 on.
const MERGES: [&str; 9] = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"];
const HELLO: u32 = 262;
const SP_WORLD: u32 = 267;
fn byte_id(b: u8) -> u32 {
    3 + u32::from(b)
}

fn small_tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    for (i, s) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].iter().enumerate() {
        vocab.insert((*s).into(), i.into());
    }
    for (b, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), byte_id(b as u8).into());
    }
    for (i, m) in MERGES.iter().enumerate() {
        vocab.insert(m.replace(' ', ""), (259 + i).into());
    }
    let added: Vec<serde_json::Value> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    // Written as a user would find it: JSON text, not built through the library.
    format!(
        r#"{{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": {added},
  "normalizer": null,
  "pre_tokenizer": {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}},
  "post_processor": null,
  "decoder": {{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}},
  "model": {{
    "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
    "vocab": {vocab},
    "merges": {merges}
  }}
}}"#,
        added = serde_json::Value::from(added),
        vocab = serde_json::Value::from(vocab),
        merges = serde_json::json!(MERGES),
    )
}

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// `tokenizer_config.json` text with the ChatML template as `chat_template`.
fn chatml_config(extra: &str) -> String {
    format!(
        r#"{{"add_bos_token": false, "bos_token": "<|im_start|>",
  "eos_token": {{"__type": "AddedToken", "content": "<|im_end|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false}},
  "model_max_length": 2048, {extra} "chat_template": {}}}"#,
        serde_json::Value::from(CHATML)
    )
}

/// A directory with the small tokenizer.json and, when given, a tokenizer_config.json.
fn small_dir(name: &str, config: Option<&str>) -> PathBuf {
    let dir = temp_dir(name);
    std::fs::write(dir.join("tokenizer.json"), small_tokenizer_json()).unwrap();
    if let Some(c) = config {
        std::fs::write(dir.join("tokenizer_config.json"), c).unwrap();
    }
    dir
}

/// ChatML tokens of one message in the small vocabulary: `<|im_start|>`, the role's bytes, `\n`,
/// the content, `<|im_end|>`, `\n`.
fn chatml_tokens(role: &str, content_tokens: usize) -> usize {
    1 + role.len() + 1 + content_tokens + 1 + 1
}
/// `<|im_start|>assistant\n`.
const GENERATION_PROMPT: usize = 1 + 9 + 1;

#[test]
fn small_byte_level_bpe_encodes_decodes_and_counts_chat() {
    let dir = small_dir("small", Some(&chatml_config("")));
    let tok = HfTokenizer::open(&dir.join("tokenizer.json")).unwrap();
    assert!(tok.has_chat_template());
    assert!(
        tok.describe().contains("268 tokens") && tok.describe().contains("tokenizer_config.json"),
        "{}",
        tok.describe()
    );

    // Merges by rank; a space run before a word keeps its last space on the word (`\s+(?!\S)`).
    assert_eq!(tok.encode("hello world"), [HELLO, SP_WORLD]);
    assert_eq!(tok.encode("hello  world"), [HELLO, byte_id(b' '), SP_WORLD]);
    assert_eq!(tok.encode("hello\n"), [HELLO, byte_id(b'\n')]);
    assert_eq!(tok.encode("world"), [byte_id(b'w'), 264, 266], "`w or ld`: no merge `w o`");
    // Plain encode: special-token text is text, and nothing is added.
    assert_eq!(tok.encode("<|im_start|>"), "<|im_start|>".bytes().map(byte_id).collect::<Vec<_>>());
    assert_eq!(tok.encode(""), Vec::<u32>::new());
    // The chat path matches special tokens.
    assert_eq!(tok.encode_with_special_tokens("<|im_start|>hello<|im_end|>"), [1, HELLO, 2]);

    // Decode: byte-level, special tokens skipped, lossy at a cut UTF-8 sequence.
    for s in ["hello world", "héllo 世界 🙂 ok\n\t x", "  lead and trail  "] {
        assert_eq!(tok.decode(&tok.encode(s)), s);
    }
    assert_eq!(tok.decode(&[1, HELLO, 2, SP_WORLD]), "hello world");
    let shi = tok.encode("世");
    assert_eq!(shi.len(), 3, "three bytes, no merges");
    assert_eq!(tok.decode(&shi[..2]), "\u{FFFD}");

    // count_chat: the ChatML template rendered with the generation prompt, special tokens matched.
    let user = [PromptMessage::new(Role::User, "hello")];
    let rendered_ids: Vec<u32> = [1]
        .into_iter()
        .chain("user\n".bytes().map(byte_id))
        .chain([HELLO, 2, byte_id(b'\n'), 1])
        .chain("assistant\n".bytes().map(byte_id))
        .collect();
    assert_eq!(
        tok.encode_with_special_tokens("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"),
        rendered_ids
    );
    assert_eq!(tok.count_chat(&user), Some(rendered_ids.len()));
    assert_eq!(tok.count_chat(&user), Some(chatml_tokens("user", 1) + GENERATION_PROMPT));
    let two = [PromptMessage::new(Role::System, "hello world"), PromptMessage::new(Role::User, "hello")];
    assert_eq!(
        tok.count_chat(&two),
        Some(chatml_tokens("system", 2) + chatml_tokens("user", 1) + GENERATION_PROMPT)
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn every_tokenizer_config_form_is_read() {
    let user = [PromptMessage::new(Role::User, "hello")];
    let chatml = chatml_tokens("user", 1) + GENERATION_PROMPT;
    let open = |name: &str, config: Option<&str>| {
        let dir = small_dir(name, config);
        // A directory stands for the tokenizer.json inside it.
        let tok = FileTokenizer::open(&dir).unwrap();
        assert!(matches!(tok, FileTokenizer::Hf(_)));
        (tok, dir)
    };

    // The list of named templates: `default` is used. BOS as an object, `add_bos_token`: the
    // template does not write BOS, so it is put first.
    let list = serde_json::json!([
        {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        {"name": "default", "template": CHATML},
    ]);
    let cfg = format!(
        r#"{{"add_bos_token": true, "bos_token": {{"content": "<|endoftext|>"}}, "eos_token": "<|im_end|>", "chat_template": {list}}}"#
    );
    let (tok, dir) = open("list", Some(&cfg));
    assert_eq!(tok.count_chat(&user), Some(chatml + 1), "{}", tok.describe());
    assert!(tok.describe().contains("BOS 0 first"), "{}", tok.describe());
    std::fs::remove_dir_all(dir).unwrap();

    // A template that writes `bos_token` itself: not doubled by `add_bos_token`.
    let with_bos = format!("{{{{ bos_token }}}}{CHATML}");
    for add_bos in [true, false] {
        let cfg = serde_json::json!({"add_bos_token": add_bos, "bos_token": "<|endoftext|>", "chat_template": with_bos});
        let (tok, dir) = open("bos", Some(&cfg.to_string()));
        assert_eq!(tok.count_chat(&user), Some(chatml + 1), "add_bos_token {add_bos}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    // `eos_token` reaches the template.
    let cfg = serde_json::json!({"eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages[0]['content'] }}{{ eos_token }}"});
    let (tok, dir) = open("eos", Some(&cfg.to_string()));
    assert_eq!(tok.count_chat(&user), Some(2), "hello + <|im_end|>");
    std::fs::remove_dir_all(dir).unwrap();

    // No template: count_chat is None, and the description says why.
    let cfg = serde_json::json!({"chat_template": [{"name": "tool_use", "template": CHATML}]});
    let (tok, dir) = open("nodefault", Some(&cfg.to_string()));
    assert!(!tok.has_chat_template() && tok.count_chat(&user).is_none());
    assert!(tok.describe().contains("no template named `default` (only tool_use)"), "{}", tok.describe());
    std::fs::remove_dir_all(dir).unwrap();
    let (tok, dir) = open("noconfig", None);
    assert!(!tok.has_chat_template() && tok.count_chat(&user).is_none());
    assert!(tok.describe().contains("no chat template"), "{}", tok.describe());
    assert_eq!(tok.encode("hello world"), [HELLO, SP_WORLD], "encode needs no config");
    std::fs::remove_dir_all(dir).unwrap();
    let (tok, dir) = open("notemplate", Some(r#"{"bos_token": null, "add_bos_token": false}"#));
    assert!(tok.count_chat(&user).is_none());
    assert!(tok.describe().contains("has no `chat_template`"), "{}", tok.describe());
    std::fs::remove_dir_all(dir).unwrap();

    // A chat_template.jinja beside the config wins over the config's template (as transformers).
    let dir = small_dir("jinja", Some(&chatml_config("")));
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}{{ m['content'] }}{% endfor %}")
        .unwrap();
    let tok = FileTokenizer::open(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(tok.count_chat(&user), Some(1));
    assert!(tok.describe().contains("chat_template.jinja"), "{}", tok.describe());
    std::fs::remove_dir_all(dir).unwrap();
}

fn open_err(path: &Path) -> String {
    format!("{:#}", FileTokenizer::open(path).unwrap_err())
}

#[test]
fn missing_and_invalid_files_are_clear_errors() {
    let dir = temp_dir("errors");
    let missing = dir.join("nope.json");
    let e = open_err(&missing);
    assert!(e.contains(&missing.display().to_string()) && e.contains("No such file"), "{e}");

    let empty_dir = dir.join("empty");
    std::fs::create_dir_all(&empty_dir).unwrap();
    let e = open_err(&empty_dir);
    assert!(e.contains(&empty_dir.display().to_string()) && e.contains("without a tokenizer.json"), "{e}");

    let not_tok = dir.join("x.json");
    std::fs::write(&not_tok, r#"{"version": "1.0"}"#).unwrap();
    let e = open_err(&not_tok);
    assert!(
        e.contains(&not_tok.display().to_string()) && e.contains("not a Hugging Face tokenizer.json"),
        "{e}"
    );

    let cfg_given = dir.join("cfg").join("tokenizer_config.json");
    std::fs::create_dir_all(cfg_given.parent().unwrap()).unwrap();
    std::fs::write(&cfg_given, chatml_config("")).unwrap();
    let e = open_err(&cfg_given);
    assert!(e.contains("give the tokenizer.json next to it"), "{e}");

    let text = dir.join("notes.txt");
    std::fs::write(&text, "hello").unwrap();
    let e = open_err(&text);
    assert!(e.contains(&text.display().to_string()) && e.contains("neither a GGUF file"), "{e}");
    let fake_gguf = dir.join("model.gguf");
    std::fs::write(&fake_gguf, "GGU").unwrap();
    assert!(open_err(&fake_gguf).contains("no GGUF magic"));
    let bad_gguf = dir.join("bad.gguf");
    std::fs::write(&bad_gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    let e = open_err(&bad_gguf);
    assert!(e.contains(&bad_gguf.display().to_string()), "{e}");

    // tokenizer_config.json at fault: named, with what is wrong.
    let cases = [
        ("{not json", "not JSON"),
        (r#"{"bos_token": 3}"#, "`bos_token` is neither"),
        (r#"{"add_bos_token": "yes"}"#, "`add_bos_token` is not a boolean"),
        (r#"{"chat_template": 1}"#, "`chat_template` is neither"),
        (r#"{"chat_template": "{% for x in %}"}"#, "chat template"),
        (r#"{"add_bos_token": true, "bos_token": "<s>"}"#, "`bos_token` \"<s>\" is not in"),
    ];
    for (i, (cfg, want)) in cases.iter().enumerate() {
        let d = small_dir(&format!("badcfg{i}"), Some(cfg));
        let e = open_err(&d);
        let config = d.join("tokenizer_config.json");
        assert!(e.contains(&config.display().to_string()) && e.contains(want), "{cfg}: {e}");
        std::fs::remove_dir_all(d).unwrap();
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_kind_is_told_by_content() {
    let dir = temp_dir("kind");
    let gguf = dir.join("model.bin");
    std::fs::write(&gguf, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    assert_eq!(TokenizerFile::detect(&gguf).unwrap(), TokenizerFile::Gguf(gguf.clone()));
    let tok = FileTokenizer::open(&gguf).unwrap();
    assert!(matches!(tok, FileTokenizer::Gguf(_)) && tok.has_chat_template());
    let json = dir.join("vocab.data");
    std::fs::write(&json, format!("\u{feff}\n  {}", small_tokenizer_json())).unwrap();
    assert_eq!(TokenizerFile::detect(&json).unwrap(), TokenizerFile::HfJson(json.clone()));
    assert_eq!(FileTokenizer::open(&json).unwrap().encode("hello world"), [HELLO, SP_WORLD]);
    std::fs::remove_dir_all(dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Differential: GGUF tokenizer (engine, llama.cpp-exact) against the equivalent tokenizer.json.

/// Hand-picked texts covering the classes the pre-tokenizers treat differently.
fn corpus() -> Vec<String> {
    let mut c: Vec<String> = [
        "Hello world! This is a test of the tokenizer.",
        "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they've gone, I'm here, you'd know.",
        "IT'S LOUD, WE'LL SHOUT, THEY'RE GONE",
        "Don’t use curly quotes’s",
        "我爱北京天安门。今天天气很好，我们去公园散步吧！",
        "日本語のテキストと、カタカナ、ひらがな。",
        "한국어 문장입니다. 안녕하세요!",
        "Привет, мир! Ελληνικά κείμενα. مرحبا بالعالم. שלום עולם",
        "emoji 🙂😀🎉 family 👩‍👩‍👧‍👦 flag 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣ heart ❤️",
        "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n",
        "def f(a, b=2):\n\tif a >= b:\n\t\treturn a ** b  # power\n\treturn None\n",
        "{\"key\": [1, 2.5, -3e10], \"nested\": {\"ok\": true, \"s\": \"a\\\"b\"}}",
        "SELECT id, name FROM users WHERE age > 30 AND city = 'Paris';",
        "<html><body class=\"main\">&nbsp;&amp;</body></html>",
        "1234567890 3.14159 1,000,000 2024-02-29 12:34:56 0x1F 1e-9 +44 (0)20 7946 0958",
        "99999999999999999999999999 000 007",
        "fullwidth １２３ arabic-indic ٣٤٥ devanagari ४२ roman Ⅻ fractions ½ ¾ superscript x² H₂O",
        "a  b   c    d",
        "a\t\tb\t c \t d",
        "\n\n\nthree newlines\n\n",
        "   leading spaces",
        "trailing spaces   ",
        "a \n b \r\n c\r\n\r\nd",
        "x   1 y  22 z\t3",
        "nbsp\u{a0}here ideographic\u{3000}space en\u{2002}space thin\u{2009}space",
        "zero\u{200b}width joiner\u{200d}x bom\u{feff}y",
        "café vs cafe\u{301} naïve Ångström ß İstanbul ǅ",
        "…—–•·©®™°±×÷€£¥§¶",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "text with <|endoftext|> inside and <|im_end|> and <|im_start|>",
        "<|im_start|<|im_start|>>",
        "",
        " ",
        "\t",
        "a",
        "'s",
        "'",
        "____----====****",
        "$100 + €200 = ¥300?!",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    c.push(" ".repeat(1000));
    c.push(format!("word{}word", " ".repeat(500)));
    c.push(format!("{}1", " ".repeat(300)));
    c.push(format!("{}x", " ".repeat(20_000))); // within fancy-regex's backtracking limit
    c.push(format!("a{}b", "\t \n".repeat(3000)));
    c.push("\n".repeat(200));
    c.push("ab".repeat(2000));
    c.push("1".repeat(400));
    c.push("🙂".repeat(100));
    c.push(tokenpath_bench::text::prose(400, 3));
    c
}

/// Seeded random mixtures of fragments from every class (xorshift, no dependency).
fn random_mixtures(n: usize, seed: u64) -> Vec<String> {
    const POOL: &[&str] = &[
        "the",
        "The",
        "HELLO",
        "x",
        "Z",
        "ok",
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\t",
        "\r\n",
        " \n",
        "0",
        "7",
        "42",
        "123",
        "٣",
        "½",
        "Ⅻ",
        "²",
        "１",
        "世界",
        "日本",
        "한",
        "é",
        "e\u{301}",
        "ß",
        "İ",
        "🙂",
        "👩‍👩‍👧",
        "🇫🇷",
        "👍🏽",
        "'s",
        "'t",
        "'re",
        "'LL",
        "'",
        "\"",
        "(",
        ")",
        "{",
        "}",
        ";",
        "->",
        "==",
        "::",
        "_",
        "-",
        ".",
        ",",
        "!",
        "?",
        "$",
        "€",
        "…",
        "—",
        "\u{a0}",
        "\u{3000}",
        "\u{200b}",
        "\u{feff}",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|",
        "|>",
        "fn",
        "let",
        "Привет",
        "مرحبا",
    ];
    let mut state = seed.max(1);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .map(|_| {
            let len = 1 + (next() % 24) as usize;
            (0..len).map(|_| POOL[(next() % POOL.len() as u64) as usize]).collect()
        })
        .collect()
}

/// Checks the tokenizer.json converted from the GGUF at `gguf` against the GGUF's own tokenizer:
/// ids (special-token text as text, and matched), decoded text, and chat counts.
fn differential(gguf: &Path, name: &str) {
    let dir = temp_dir(name);
    support::hf_json::write_hf_files(gguf, &dir);
    let engine: Tokenizer =
        tokenizer_from_gguf(tokenpath_engine::gguf::GgufFile::open(gguf).unwrap().index()).unwrap();
    let hf = HfTokenizer::open(&dir.join("tokenizer.json")).unwrap();
    let gguf_tok = ModelTokenizer::open(gguf).unwrap();

    let texts: Vec<String> = corpus().into_iter().chain(random_mixtures(600, 0x5eed)).collect();
    let mut mismatches = Vec::new();
    for text in &texts {
        let want = engine.encode(text, false, false).unwrap();
        let got = hf.encode(text);
        if got != want {
            mismatches.push(format!("plain {text:?}:\n  engine {want:?}\n  hf     {got:?}"));
        }
        let want_special = engine.encode(text, false, true).unwrap();
        let got_special = hf.encode_with_special_tokens(text);
        if got_special != want_special {
            mismatches
                .push(format!("special {text:?}:\n  engine {want_special:?}\n  hf     {got_special:?}"));
        }
        let want_text = engine.decode_lossy(&want_special, false).unwrap();
        if hf.decode(&want_special) != want_text {
            mismatches.push(format!("decode {text:?}: hf {:?}", hf.decode(&want_special)));
        }
        assert_eq!(gguf_tok.encode(text), want, "the GGUF adapter is the engine's plain encode");
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} texts differ between the engine and HF tokenizers:\n{}",
        mismatches.len(),
        texts.len() * 3,
        mismatches.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );

    let conversations: Vec<Vec<PromptMessage>> = vec![
        vec![PromptMessage::new(Role::User, "hello")],
        vec![PromptMessage::new(Role::System, "Be brief."), PromptMessage::new(Role::User, "What is 2 + 2?")],
        vec![
            PromptMessage::new(Role::User, "Write a haiku about 東京 🌸"),
            PromptMessage::new(Role::Assistant, "Cherry blossoms fall\n  on 1000 streets\t"),
            PromptMessage::new(Role::User, "  again, with <|im_end|> inside  "),
        ],
        vec![PromptMessage::new(Role::User, tokenpath_bench::text::prose(300, 9))],
    ];
    for msgs in &conversations {
        let want = gguf_tok.count_chat(msgs);
        assert!(want.is_some());
        assert_eq!(hf.count_chat(msgs), want, "{msgs:?}");
    }
    // What the gateway admits with (`chat_prompt`) keeps special-token text inside a message as
    // text (a message cannot close its own turn), where the count above parses it, as an HF
    // server does.
    let injected = [PromptMessage::new(Role::User, "again, with <|im_end|> inside")];
    let admitted = gguf_tok.chat_prompt(&injected, usize::MAX).unwrap().len();
    if gguf_tok.tokenizer().encode("<|im_end|>", false, true).unwrap().len() == 1 {
        assert!(admitted > gguf_tok.count_chat(&injected).unwrap(), "{admitted}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tiny_model_tokenizer_json_matches_its_gguf_tokenizer() {
    let dir = temp_dir("tiny-gguf");
    let gguf = dir.join("tiny.gguf");
    std::fs::write(&gguf, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    differential(&gguf, "tiny");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn smollm2_tokenizer_json_matches_the_engine_gguf_tokenizer() {
    let Some(model) = support::default_model() else { return };
    differential(&model, "smollm2");
}
