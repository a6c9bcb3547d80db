//! Pre-tokenization: cut text into the "words" that BPE merges within, exactly as llama.cpp does.
//!
//! llama.cpp describes each pre-tokenizer as a list of regexes applied one after another, each
//! one splitting every fragment left by the previous one (`unicode_regex_split`). The GPT-2 and
//! Llama-3 regexes are not run as regexes there but by hand-written scanners
//! (`unicode_regex_split_custom_gpt2/llama3`) with quirks a real regex engine would not have:
//! a fragment edge counts as "end of text" for `\s+(?!\S)`, so "a  " + "1" (after the digit
//! split) keeps both spaces together. The simpler regexes (`\p{N}`, `[0-9][0-9][0-9]`, the
//! `default` punctuation class) go through `std::regex` on a "collapsed" copy of the text.
//! To agree byte for byte we transcribe the scanners and implement the simple regexes as
//! predicate scanners over code points, with categories from llama.cpp's own Unicode table.
//! No regex crate: the whole job is a few character-class loops, and a regex engine would
//! differ from llama.cpp on exactly those edge cases.

use super::unicode::{category, is_whitespace, Cat, Flags};
use super::TokenizerError;

/// Which pre-tokenizer a vocabulary uses (`tokenizer.ggml.pre`), grouped the way llama.cpp
/// groups the names into regex lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// No or `"default"` pre type: punctuation runs, GPT-2, number runs, digit triples.
    Default,
    /// `"gpt-2"`, `"phi-2"`, `"mpt"`, `"olmo"`, `"jais"`, `"trillion"`, `"granite-docling"`,
    /// `"exaone4"`: the plain GPT-2 regex.
    Gpt2,
    /// `"llama3"`, `"llama-v3"`, `"llama-bpe"`, `"falcon3"`, `"falcon-h1"`, `"pixtral"`,
    /// `"midm-2.0"`, `"lfm2"`, `"jina-v5-nano"`: the Llama-3 regex (digits in groups of ≤ 3).
    Llama3,
    /// `"smollm"`, `"starcoder"`, `"refact"`, `"command-r"`, `"codeshell"`, `"exaone"`,
    /// `"minerva-7b"`, `"mellum2"`: every number code point alone, then the GPT-2 regex.
    Smollm,
}

impl PreTokenizer {
    /// Maps the GGUF `tokenizer.ggml.pre` value to a pre-tokenizer; `None` means the key is
    /// absent (llama.cpp falls back to `default` with a warning).
    pub fn from_gguf(pre: Option<&str>) -> Result<Self, TokenizerError> {
        let Some(name) = pre else { return Ok(Self::Default) };
        Ok(match name {
            "" | "default" => Self::Default,
            "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" => {
                Self::Gpt2
            }
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
            | "lfm2" | "jina-v5-nano" => Self::Llama3,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b"
            | "mellum2" => Self::Smollm,
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        })
    }

    /// llama.cpp's `ignore_merges`: a word that is already a whole token is emitted as is.
    pub fn ignores_merges(self) -> bool {
        matches!(self, Self::Llama3)
    }

    /// llama.cpp's default for `add_bos` when the GGUF has no `tokenizer.ggml.add_bos_token`.
    pub fn default_add_bos(self) -> bool {
        matches!(self, Self::Llama3)
    }

    /// Splits `text` into words; each returned range is a byte range of `text`, in order,
    /// covering it exactly.
    pub fn split(self, text: &str) -> Vec<std::ops::Range<usize>> {
        let cpts: Vec<char> = text.chars().collect();
        let mut offsets = if cpts.is_empty() { Vec::new() } else { vec![cpts.len()] };
        match self {
            Self::Smollm => {
                offsets = isolate(&cpts, &offsets, |c, p, _| is_collapsed_number(c[p]).then_some(1));
                offsets = split_gpt2(&cpts, &offsets);
            }
            Self::Gpt2 => offsets = split_gpt2(&cpts, &offsets),
            Self::Llama3 => offsets = split_llama3(&cpts, &offsets),
            Self::Default => {
                offsets = isolate(&cpts, &offsets, |c, p, e| run(c, p, e, is_default_punct));
                offsets = split_gpt2(&cpts, &offsets);
                offsets = isolate(&cpts, &offsets, |c, p, e| run(c, p, e, is_collapsed_number));
                offsets = isolate(&cpts, &offsets, |c, p, e| {
                    (p + 3 <= e && c[p..p + 3].iter().all(char::is_ascii_digit)).then_some(3)
                });
            }
        }
        let mut out = Vec::with_capacity(offsets.len());
        let mut byte = 0;
        let mut cp = 0;
        for len in offsets {
            let start = byte;
            byte += cpts[cp..cp + len].iter().map(|c| c.len_utf8()).sum::<usize>();
            cp += len;
            out.push(start..byte);
        }
        out
    }
}

/// `\p{N}` on llama.cpp's collapsed text: ASCII digits, or a non-ASCII, non-whitespace code
/// point whose category is N.
fn is_collapsed_number(c: char) -> bool {
    if c.is_ascii() {
        c.is_ascii_digit()
    } else {
        !is_whitespace(c) && category(c) == Cat::N
    }
}

/// `[\p{P}\$\+<=>\^~\|]` on the collapsed text. The ASCII part of `\p{P}` is llama.cpp's
/// hard-coded list `!-#%-*,-/:-;?-@[-]_{}`.
fn is_default_punct(c: char) -> bool {
    if c.is_ascii() {
        matches!(c, '!'..='#' | '%'..='*' | ','..='/' | ':'..=';' | '?'..='@' | '['..=']' | '_' | '{' | '}')
            || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|')
    } else {
        !is_whitespace(c) && category(c) == Cat::P
    }
}

/// Greedy run of `pred` starting at `p` (a `[...]+` match), if at least one code point matches.
fn run(c: &[char], p: usize, end: usize, pred: fn(char) -> bool) -> Option<usize> {
    let n = c[p..end].iter().take_while(|&&x| pred(x)).count();
    (n > 0).then_some(n)
}

/// `unicode_regex_split_stl` for a pattern without empty matches: in every fragment, each
/// leftmost match becomes its own fragment and the text between matches stays as fragments.
fn isolate(
    cpts: &[char],
    offsets: &[usize],
    matcher: impl Fn(&[char], usize, usize) -> Option<usize>,
) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let end = start + len;
        let mut gap_start = start;
        let mut p = start;
        while p < end {
            match matcher(cpts, p, end) {
                Some(m) => {
                    if p > gap_start {
                        out.push(p - gap_start);
                    }
                    out.push(m);
                    p += m;
                    gap_start = p;
                }
                None => p += 1,
            }
        }
        if end > gap_start {
            out.push(end - gap_start);
        }
        start = end;
    }
    out
}

/// A view of one fragment: code points outside it read as out of range, as in llama.cpp.
struct Frag<'a> {
    cpts: &'a [char],
    ini: usize,
    end: usize,
}

impl Frag<'_> {
    fn cpt(&self, p: usize) -> Option<char> {
        (self.ini <= p && p < self.end).then(|| self.cpts[p])
    }
    fn flags(&self, p: usize) -> Flags {
        self.cpt(p).map_or(Flags::OUT, Flags::of)
    }
}

/// Records word ends for one fragment (llama.cpp's `_add_token`).
struct Words<'o> {
    out: &'o mut Vec<usize>,
    prev_end: usize,
}

impl Words<'_> {
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, transcribed
/// from `unicode_regex_split_custom_gpt2`.
fn split_gpt2(cpts: &[char], offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let f = Frag { cpts, ini: start, end: start + len };
        start += len;
        let mut w = Words { out: &mut out, prev_end: f.ini };
        let mut pos = f.ini;
        while pos < f.end {
            let cpt = cpts[pos];
            let flags = f.flags(pos);

            // 's|'t|'re|'ve|'m|'ll|'d
            if cpt == '\'' && pos + 1 < f.end {
                let next = f.cpt(pos + 1);
                if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                    pos += w.add(pos + 2);
                    continue;
                }
                if pos + 2 < f.end {
                    let nn = f.cpt(pos + 2);
                    if matches!(
                        (next, nn),
                        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
                    ) {
                        pos += w.add(pos + 3);
                        continue;
                    }
                }
            }

            let mut flags2 = if cpt == ' ' { f.flags(pos + 1) } else { flags };
            // <space>?\p{L}+
            if flags2.is_letter() {
                pos += usize::from(cpt == ' ');
                while flags2.is_letter() {
                    pos += 1;
                    flags2 = f.flags(pos);
                }
                w.add(pos);
                continue;
            }
            // <space>?\p{N}+
            if flags2.is_number() {
                pos += usize::from(cpt == ' ');
                while flags2.is_number() {
                    pos += 1;
                    flags2 = f.flags(pos);
                }
                w.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+
            if flags2.is_other() {
                pos += usize::from(cpt == ' ');
                while flags2.is_other() {
                    pos += 1;
                    flags2 = f.flags(pos);
                }
                w.add(pos);
                continue;
            }

            let mut num_ws = 0;
            while f.flags(pos + num_ws).whitespace {
                num_ws += 1;
            }
            // \s+(?!\S)
            if num_ws > 1 && f.cpt(pos + num_ws).is_some() {
                pos += num_ws - 1;
                w.add(pos);
                continue;
            }
            // \s+
            if num_ws > 0 {
                pos += num_ws;
                w.add(pos);
                continue;
            }
            // no match
            pos += 1;
            w.add(pos);
        }
    }
    out
}

/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
/// \s*[\r\n]+|\s+(?!\S)|\s+`, transcribed from `unicode_regex_split_custom_llama3`.
fn split_llama3(cpts: &[char], offsets: &[usize]) -> Vec<usize> {
    // llama.cpp lower-cases with its own table; no non-ASCII code point lower-cases to one of
    // the ASCII letters compared here, so ASCII lower-casing is exact.
    let lower = |c: Option<char>| c.map(|c| c.to_ascii_lowercase());
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let f = Frag { cpts, ini: start, end: start + len };
        start += len;
        let mut w = Words { out: &mut out, prev_end: f.ini };
        let mut pos = f.ini;
        while pos < f.end {
            let cpt = cpts[pos];
            let flags = f.flags(pos);

            if cpt == '\'' && pos + 1 < f.end {
                let next = lower(f.cpt(pos + 1));
                if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                    pos += w.add(pos + 2);
                    continue;
                }
                if pos + 2 < f.end {
                    let nn = lower(f.cpt(pos + 2));
                    if matches!(
                        (next, nn),
                        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
                    ) {
                        pos += w.add(pos + 3);
                        continue;
                    }
                }
            }

            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(cpt == '\r' || cpt == '\n' || flags.is_number())
                && (flags.is_letter() || f.flags(pos + 1).is_letter())
            {
                pos += 1;
                while f.flags(pos).is_letter() {
                    pos += 1;
                }
                w.add(pos);
                continue;
            }

            // \p{N}{1,3}
            if flags.is_number() {
                let mut ini = pos;
                while f.flags(pos).is_number() {
                    pos += 1;
                    if pos - ini >= 3 {
                        w.add(pos);
                        ini = pos;
                    }
                }
                w.add(pos);
                continue;
            }

            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let mut flags2 = if cpt == ' ' { f.flags(pos + 1) } else { flags };
            if !(flags2.whitespace || flags2.is_letter() || flags2.is_number()) && flags.in_range() {
                pos += usize::from(cpt == ' ');
                while flags2.is_other() {
                    pos += 1;
                    flags2 = f.flags(pos);
                }
                while matches!(f.cpt(pos), Some('\r' | '\n')) {
                    pos += 1;
                }
                w.add(pos);
                continue;
            }

            let mut num_ws = 0;
            let mut last_end_r_or_n = 0;
            while f.flags(pos + num_ws).whitespace {
                if matches!(f.cpt(pos + num_ws), Some('\r' | '\n')) {
                    last_end_r_or_n = pos + num_ws + 1;
                }
                num_ws += 1;
            }
            // \s*[\r\n]+
            if last_end_r_or_n > 0 {
                pos = last_end_r_or_n;
                w.add(pos);
                continue;
            }
            // \s+(?!\S)
            if num_ws > 1 && f.cpt(pos + num_ws).is_some() {
                pos += num_ws - 1;
                w.add(pos);
                continue;
            }
            // \s+
            if num_ws > 0 {
                pos += num_ws;
                w.add(pos);
                continue;
            }
            pos += 1;
            w.add(pos);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_basic() {
        assert_eq!(
            words(PreTokenizer::Gpt2, "Hello world, don't!"),
            ["Hello", " world", ",", " don", "'t", "!"]
        );
        assert_eq!(words(PreTokenizer::Gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(words(PreTokenizer::Gpt2, "a   "), ["a", "   "]);
        assert_eq!(words(PreTokenizer::Gpt2, " 123 x"), [" 123", " x"]);
    }

    #[test]
    fn smollm_isolates_digits_and_fragment_edges_end_whitespace() {
        assert_eq!(words(PreTokenizer::Smollm, "abc 1234"), ["abc", " ", "1", "2", "3", "4"]);
        assert_eq!(words(PreTokenizer::Smollm, "a   1"), ["a", "   ", "1"]);
        assert_eq!(words(PreTokenizer::Smollm, ""), Vec::<&str>::new());
    }

    #[test]
    fn llama3_digit_triples_and_newlines() {
        assert_eq!(words(PreTokenizer::Llama3, "1234567"), ["123", "456", "7"]);
        assert_eq!(words(PreTokenizer::Llama3, "hi\n\nthere"), ["hi", "\n\n", "there"]);
        assert_eq!(words(PreTokenizer::Llama3, "I'LL go"), ["I", "'LL", " go"]);
    }

    #[test]
    fn default_splits_punctuation_first() {
        assert_eq!(words(PreTokenizer::Default, "don't 12345"), ["don", "'", "t", " ", "123", "45"]);
    }

    #[test]
    fn unknown_pre_is_an_error() {
        assert!(PreTokenizer::from_gguf(Some("no-such-pre")).is_err());
        assert_eq!(PreTokenizer::from_gguf(Some("smollm")).ok(), Some(PreTokenizer::Smollm));
    }
}
