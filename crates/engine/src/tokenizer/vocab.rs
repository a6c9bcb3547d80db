//! The tokenizer proper: a GGUF `gpt2` vocabulary, encode (llama_tokenize) and decode
//! (llama_token_to_piece), with llama.cpp's semantics.
//!
//! It is built from the plain values the GGUF metadata holds (`from_gguf_parts`), not from a
//! GGUF reader, so it has no dependency on the engine's parser and can be tested on small
//! hand-made vocabularies. Encoding follows `llama_vocab::impl::tokenize` for BPE: optional BOS,
//! special-token partition (`special.rs`), pre-tokenization (`pretokenize.rs`), GPT-2 byte
//! encoding, rank-ordered merges (`bpe.rs`), whole-word lookups with llama.cpp's per-byte
//! fallback, optional EOS. Decoding pieces are precomputed once per token, as llama.cpp's
//! `cache_token_to_piece` is. The type is `Send + Sync`; the per-word cache sits behind a mutex.

use ahash::AHashMap as HashMap;
use std::sync::Mutex;

use super::bpe::MergeRanks;
use super::pretokenize::PreTokenizer;
use super::special::{apply_llama_cpp_overrides, partition, Fragment, SpecialTokens, EOG_TEXTS};
use super::unicode::{byte_to_char_table, char_to_byte_table};
use super::TokenizerError;

/// A token's type as stored in `tokenizer.ggml.token_type` (llama.cpp `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    /// 0, or any value not listed below.
    Undefined,
    /// 1: an ordinary BPE token.
    Normal,
    /// 2
    Unknown,
    /// 3: control tokens such as `<|im_start|>`; matched in text only with `parse_special`.
    Control,
    /// 4: user-defined tokens; always matched in text as whole tokens.
    UserDefined,
    /// 5
    Unused,
    /// 6: `<0xXX>` byte tokens.
    Byte,
}

impl TokenType {
    /// Maps a GGUF `token_type` value.
    pub fn from_gguf(v: i32) -> Self {
        match v {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
    /// Control or unknown: hidden from decoded text unless special tokens are rendered, and
    /// matched in input text only when `parse_special` is on.
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// Words cached per tokenizer before the cache is cleared (bounds memory on adversarial input).
const WORD_CACHE_LIMIT: usize = 1 << 16;
/// Words longer than this (in bytes) are not cached.
const WORD_CACHE_MAX_WORD: usize = 128;
/// Words longer than this (in bytes) are merged in pieces of at most this many bytes. BPE on one
/// word costs memory and time superlinear in its length (a symbol and heap entries per byte); a
/// run of one letter or punctuation mark is one "word" to the GPT-2 pre-tokenizers, so a 4 MB
/// prompt of `a` was one merge of 4 M symbols (~0.5 GB, seconds). 16 KiB bounds one merge to a
/// few MB; text tokenizes exactly as Hugging Face's tokenizer does unless one pre-token (a run
/// of whitespace, say) is longer than that (the differential test holds runs of several KB).
const MAX_BPE_WORD: usize = 16 * 1024;

/// `word` in pieces of at most `max` bytes, cut at char boundaries (one piece when it is short).
fn pieces_of(word: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = word;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut cut = rest.len().min(max);
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut == 0 {
            // One char longer than `max` bytes (never: chars are ≤ 4 bytes).
            cut = rest.char_indices().nth(1).map_or(rest.len(), |(i, _)| i);
        }
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// A GGUF byte-level BPE tokenizer (`tokenizer.ggml.model = "gpt2"`).
#[derive(Debug)]
pub struct Tokenizer {
    texts: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    ranks: MergeRanks,
    pre: PreTokenizer,
    specials: SpecialTokens,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    /// End-of-generation ids (llama.cpp's `special_eog_ids`, minus the FIM ones), sorted.
    eog: Vec<u32>,
    /// `token_to_piece(id, special = true)` for every token.
    pieces: Vec<Box<[u8]>>,
    byte_chars: [char; 256],
    word_cache: Mutex<HashMap<Box<str>, Box<[u32]>>>,
    /// The longest token's text in bytes: no text longer than `n × max_piece` fits in `n` tokens.
    max_piece: usize,
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata values:
    /// `tokenizer.ggml.tokens`, `.token_type` (may be empty: all normal), `.merges`, `.pre`,
    /// `.bos_token_id`, `.eos_token_id`, and `.add_bos_token` / `.add_eos_token` (`None` when
    /// the key is absent: llama.cpp's per-pre-type default applies).
    #[allow(clippy::too_many_arguments)]
    pub fn from_gguf_parts(
        tokens: Vec<String>,
        token_types: Vec<i32>,
        merges: Vec<String>,
        pre: Option<&str>,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: Option<bool>,
        add_eos: Option<bool>,
    ) -> Result<Self, TokenizerError> {
        let pre = PreTokenizer::from_gguf(pre)?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(TokenizerError::InvalidVocab(format!("vocabulary has {n} tokens")));
        }
        if !token_types.is_empty() && token_types.len() < n {
            return Err(TokenizerError::InvalidVocab(format!(
                "{} token types for {n} tokens",
                token_types.len()
            )));
        }
        for (what, id) in [("BOS", bos), ("EOS", eos)] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::InvalidVocab(format!(
                    "{what} id {id} is outside the vocabulary ({n})"
                )));
            }
        }
        let types: Vec<TokenType> = if token_types.is_empty() {
            vec![TokenType::Normal; n]
        } else {
            token_types[..n].iter().map(|&t| TokenType::from_gguf(t)).collect()
        };
        let mut texts = tokens;
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in texts.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]"); // as llama.cpp does
            }
            token_to_id.insert(t.clone(), i as u32); // a later duplicate wins, as in llama.cpp
        }
        let mut types = types;
        apply_llama_cpp_overrides(&mut types, |t| token_to_id.get(t).copied());
        let inv = char_to_byte_table();
        let pieces: Vec<Box<[u8]>> = texts.iter().zip(&types).map(|(t, ty)| piece_of(t, *ty, &inv)).collect();
        let max_piece = pieces.iter().map(|p| p.len()).max().unwrap_or(1).max(1);
        let specials = SpecialTokens::new(&texts, &types);
        let mut eog: Vec<u32> =
            EOG_TEXTS.iter().filter_map(|t| token_to_id.get(*t).copied()).chain(eos).collect();
        eog.sort_unstable();
        eog.dedup();
        Ok(Self {
            ranks: MergeRanks::new(&merges),
            specials,
            texts,
            types,
            token_to_id,
            pre,
            bos,
            eos,
            add_bos: add_bos.unwrap_or_else(|| pre.default_add_bos()),
            add_eos: add_eos.unwrap_or(false),
            eog,
            pieces,
            byte_chars: byte_to_char_table(),
            word_cache: Mutex::new(HashMap::new()),
            max_piece,
        })
    }

    /// Checks `tokenizer.ggml.model`: only `"gpt2"` (byte-level BPE) is implemented.
    pub fn check_model(model: &str) -> Result<(), TokenizerError> {
        match model {
            "gpt2" => Ok(()),
            other => Err(TokenizerError::UnsupportedModel(other.to_string())),
        }
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }
    /// Number of usable merge rules.
    pub fn merge_count(&self) -> usize {
        self.ranks.len()
    }
    /// BOS id, if the vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    /// EOS id, if the vocabulary has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    /// Whether generating `id` ends the turn: EOS plus the end-of-turn tokens llama.cpp
    /// recognises by text (`<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
    /// All end-of-generation ids, sorted (see [`Tokenizer::is_eog`]).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }
    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// The pre-tokenizer in use.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }
    /// The raw vocabulary text of a token (byte-encoded for normal tokens).
    pub fn token_text(&self, id: u32) -> Result<&str, TokenizerError> {
        self.texts.get(id as usize).map(String::as_str).ok_or(self.unknown(id))
    }
    /// The type of a token.
    pub fn token_type(&self, id: u32) -> Result<TokenType, TokenizerError> {
        self.types.get(id as usize).copied().ok_or(self.unknown(id))
    }
    /// The id whose vocabulary text is exactly `text` (e.g. `"<|im_end|>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Tokenizes `text` like `llama_tokenize(vocab, text, add_special, parse_special)`.
    /// `add_special` adds BOS/EOS as the vocabulary asks; `parse_special` lets control tokens
    /// written in the text (`<|im_start|>`) become those tokens; user-defined tokens are
    /// always matched.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_at_most(text, add_special, parse_special, usize::MAX)
    }

    /// The longest token's text, in bytes.
    pub fn max_token_bytes(&self) -> usize {
        self.max_piece
    }

    /// [`Tokenizer::encode`], refusing (with [`TokenizerError::TooLong`]) text of more than
    /// `limit` tokens — before any work when the text is longer than `limit` tokens could
    /// ever be, and as soon as the count passes `limit` otherwise.
    pub fn encode_at_most(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        limit: usize,
    ) -> Result<Vec<u32>, TokenizerError> {
        // Specials added or parsed are ≤ their text in bytes too, so the bound holds for them.
        if text.len() > limit.saturating_mul(self.max_piece) {
            return Err(TokenizerError::TooLong { limit });
        }
        let mut out = Vec::with_capacity((text.len() / 3 + 2).min(limit.saturating_add(2)));
        if add_special && self.add_bos {
            out.push(self.bos.ok_or(TokenizerError::MissingSpecialToken("BOS"))?);
        }
        for frag in partition(&self.specials, text, parse_special) {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(t) => self.encode_text(t, &mut out, limit)?,
            }
            if out.len() > limit {
                return Err(TokenizerError::TooLong { limit });
            }
        }
        if add_special && self.add_eos {
            out.push(self.eos.ok_or(TokenizerError::MissingSpecialToken("EOS"))?);
        }
        Ok(out)
    }

    fn encode_text(&self, text: &str, out: &mut Vec<u32>, limit: usize) -> Result<(), TokenizerError> {
        let mut encoded = String::new();
        let mut syms = Vec::new();
        for raw in self.pre.split(text).into_iter().flat_map(|r| pieces_of(&text[r], MAX_BPE_WORD)) {
            if out.len() > limit {
                return Err(TokenizerError::TooLong { limit });
            }
            if raw.len() <= WORD_CACHE_MAX_WORD {
                if let Some(ids) = self.cache().get(raw) {
                    out.extend_from_slice(ids);
                    continue;
                }
            }
            let before = out.len();
            encoded.clear();
            encoded.extend(raw.bytes().map(|b| self.byte_chars[b as usize]));
            syms.clear();
            match self.token_to_id.get(encoded.as_str()) {
                Some(&id) if self.pre.ignores_merges() => out.push(id),
                _ => {
                    self.ranks.merge(&encoded, &mut syms);
                    for r in &syms {
                        let sym = &encoded[r.clone()];
                        match self.token_to_id.get(sym) {
                            Some(&id) => out.push(id),
                            // llama.cpp's fallback: look up each byte of the encoded symbol as a
                            // one-byte token; bytes without one are dropped.
                            None => {
                                for b in sym.bytes() {
                                    let one = [b];
                                    let key = std::str::from_utf8(&one).unwrap_or("");
                                    if let Some(&id) = self.token_to_id.get(key) {
                                        out.push(id);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            if raw.len() <= WORD_CACHE_MAX_WORD {
                let mut cache = self.cache();
                if cache.len() >= WORD_CACHE_LIMIT {
                    cache.clear();
                }
                cache.insert(raw.into(), out[before..].into());
            }
        }
        Ok(())
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Box<[u32]>>> {
        // A poisoned cache is still a valid cache (entries are inserted whole).
        self.word_cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bytes one token stands for (`llama_token_to_piece`). With `render_special` false,
    /// control and unknown tokens decode to nothing. A piece may end inside a UTF-8 character;
    /// see [`super::StreamDecoder`] for streaming text.
    pub fn decode_token(&self, id: u32, render_special: bool) -> Result<&[u8], TokenizerError> {
        let ty = self.token_type(id)?;
        if !render_special && ty.is_special() {
            return Ok(&[]);
        }
        Ok(&self.pieces[id as usize])
    }

    /// Concatenated pieces of `ids` (no space clean-up; `decode(encode(s)) == s`).
    pub fn decode(&self, ids: &[u32], render_special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.decode_token(id, render_special)?);
        }
        Ok(out)
    }

    /// [`Tokenizer::decode`] as a string, invalid UTF-8 replaced by U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32], render_special: bool) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode(ids, render_special)?).into_owned())
    }

    fn unknown(&self, id: u32) -> TokenizerError {
        TokenizerError::UnknownTokenId { id, vocab_size: self.texts.len() }
    }
}

/// `token_to_piece(special = true)` for a BPE vocabulary.
fn piece_of(text: &str, ty: TokenType, inv: &[i16; 0x144]) -> Box<[u8]> {
    match ty {
        TokenType::Control | TokenType::Unknown | TokenType::UserDefined => text.as_bytes().into(),
        TokenType::Normal => {
            let mut out = Vec::with_capacity(text.len());
            for c in text.chars() {
                match inv.get(c as usize).copied().filter(|&b| b >= 0) {
                    Some(b) => out.push(b as u8),
                    // llama_decode_text's marker for a character outside the byte map.
                    None => {
                        out.extend_from_slice(b"[UNK_BYTE_0x");
                        let mut utf8 = [0u8; 4];
                        for b in c.encode_utf8(&mut utf8).bytes() {
                            out.extend_from_slice(format!("{b:02x}").as_bytes());
                        }
                        out.extend_from_slice(text.as_bytes());
                        out.push(b']');
                    }
                }
            }
            out.into()
        }
        TokenType::Byte => {
            let hex = text.get(3..5).and_then(|h| u8::from_str_radix(h, 16).ok());
            hex.map(|b| Box::from([b].as_slice())).unwrap_or_default()
        }
        TokenType::Unused | TokenType::Undefined => Box::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn bad_vocabularies_are_typed_errors() {
        let toks = || vec!["a".to_string(), "b".to_string()];
        let mk = |tokens: Vec<String>, types: Vec<i32>, pre: Option<&str>, bos: Option<u32>| {
            Tokenizer::from_gguf_parts(tokens, types, vec![], pre, bos, None, None, None)
        };
        assert!(matches!(mk(vec![], vec![], None, None), Err(TokenizerError::InvalidVocab(_))));
        assert!(matches!(mk(toks(), vec![1], None, None), Err(TokenizerError::InvalidVocab(_))));
        assert!(matches!(mk(toks(), vec![], None, Some(2)), Err(TokenizerError::InvalidVocab(_))));
        assert!(matches!(
            mk(toks(), vec![], Some("qwen2"), None),
            Err(TokenizerError::UnsupportedPreTokenizer(_))
        ));
        assert!(Tokenizer::check_model("gpt2").is_ok());
        assert!(matches!(Tokenizer::check_model("llama"), Err(TokenizerError::UnsupportedModel(_))));
        let t = mk(toks(), vec![], Some("llama3"), None).expect("ok");
        assert!(t.add_bos(), "llama3 defaults to add_bos");
        assert!(matches!(t.encode("a", true, false), Err(TokenizerError::MissingSpecialToken("BOS"))));
        assert_eq!(t.encode("ab", false, false).expect("encode"), [0, 1]);
    }

    #[test]
    fn eog_and_pieces_follow_llama_cpp() {
        let tokens: Vec<String> =
            ["<|im_end|>", "Ġhi", "<0x41>", "x"].iter().map(|s| s.to_string()).collect();
        // <|im_end|> typed NORMAL in the GGUF is forced to CONTROL, as llama.cpp does.
        let t = Tokenizer::from_gguf_parts(
            tokens,
            vec![1, 1, 6, 5],
            vec![],
            Some("gpt-2"),
            None,
            Some(3),
            Some(false),
            None,
        )
        .expect("ok");
        assert_eq!(t.token_type(0).expect("id"), TokenType::Control);
        assert_eq!(t.eog_ids(), [0, 3]);
        assert!(t.is_eog(0) && !t.is_eog(1));
        assert_eq!(t.decode_token(0, false).expect("id"), b"");
        assert_eq!(t.decode_token(0, true).expect("id"), b"<|im_end|>");
        assert_eq!(t.decode_token(1, false).expect("id"), b" hi");
        assert_eq!(t.decode_token(2, false).expect("id"), b"A");
        assert_eq!(t.decode_token(3, true).expect("id"), b"");
        assert_eq!(t.encode("a<|im_end|>", false, true).expect("encode").last(), Some(&0));
    }
}
