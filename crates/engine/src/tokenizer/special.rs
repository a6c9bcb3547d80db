//! Special-token partition: cut input text at occurrences of special tokens before BPE.
//!
//! Mirrors llama.cpp's `tokenizer_st_partition`: control, user-defined and unknown tokens are
//! tried longest text first; each one splits every remaining text fragment at all of its
//! occurrences, left to right. With `parse_special` off, control and unknown tokens are
//! skipped but user-defined ones still match (as HF tokenizers do). The order matters when
//! special texts overlap, so we keep llama.cpp's (length descending; equal lengths by id,
//! where llama.cpp's unstable sort leaves the order unspecified). The LSTRIP/RSTRIP
//! attributes llama.cpp sets by model name (phi-3, jina, modern-bert) are not modelled: none
//! of the supported pre-tokenizer families uses them.

use super::vocab::TokenType;
use memchr::memmem::Finder;

/// The special tokens of a vocabulary in matching order.
#[derive(Debug, Default)]
pub(crate) struct SpecialTokens {
    list: Vec<Special>,
}

/// One special token and its searcher, built once (building a substring searcher per token per
/// prompt was a tenth of a gateway request's tokenization).
#[derive(Debug)]
struct Special {
    id: u32,
    /// Its text's bytes (a UTF-8 needle matches a UTF-8 haystack only at char boundaries).
    finder: Finder<'static>,
    /// Control or unknown: matched only when parsing specials.
    control: bool,
}

impl SpecialTokens {
    pub fn new(texts: &[String], types: &[TokenType]) -> Self {
        let mut list: Vec<(u32, String, bool)> = texts
            .iter()
            .zip(types)
            .enumerate()
            .filter(|(_, (_, ty))| {
                matches!(ty, TokenType::Control | TokenType::UserDefined | TokenType::Unknown)
            })
            .map(|(id, (text, ty))| (id as u32, text.clone(), ty.is_special()))
            .collect();
        list.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        let list = list
            .into_iter()
            .map(|(id, text, control)| Special {
                id,
                finder: Finder::new(text.as_bytes()).into_owned(),
                control,
            })
            .collect();
        Self { list }
    }
}

/// Token texts that llama.cpp treats as end-of-generation and forces to CONTROL, whatever
/// type the GGUF gave them (`llama_vocab::impl::load`, "special_eog_ids").
pub(crate) const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
];

/// llama.cpp's name-based token-type fix-ups that change how text is partitioned:
/// EOG-looking tokens become CONTROL; gpt-oss's `<|channel|>`-style tokens become
/// USER_DEFINED; `<|end|>` becomes USER_DEFINED next to `<|return|>`+`<|call|>` (or
/// `<|calls|>`+`<|flush|>`). Not modelled (first-found over a hash map in llama.cpp, so not
/// reproducible, and already CONTROL in real conversions): the FIM token fix-ups, and the
/// gemma4/plamo `</s>` rule. `id_of` is the text → id map (last duplicate wins).
pub(crate) fn apply_llama_cpp_overrides(types: &mut [TokenType], id_of: impl Fn(&str) -> Option<u32>) {
    let set = |text: &str, ty: TokenType, types: &mut [TokenType]| {
        if let Some(id) = id_of(text) {
            types[id as usize] = ty;
        }
    };
    // Whatever the GGUF type, adding the CONTROL bit makes a token behave as CONTROL for both
    // partition and decoding.
    for t in EOG_TEXTS {
        set(t, TokenType::Control, types);
    }
    for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        set(t, TokenType::UserDefined, types);
    }
    let has = |t: &str| id_of(t).is_some();
    if has("<|end|>") && ((has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>"))) {
        set("<|end|>", TokenType::UserDefined, types);
    }
}

/// A piece of input: text still to be BPE-encoded, or an already-identified token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// Splits `text` into fragments at special-token occurrences.
pub(crate) fn partition<'a>(
    specials: &SpecialTokens,
    text: &'a str,
    parse_special: bool,
) -> Vec<Fragment<'a>> {
    if text.is_empty() {
        return Vec::new();
    }
    let mut frags = vec![Fragment::Text(text)];
    for Special { id, finder, control } in &specials.list {
        let len = finder.needle().len();
        if (*control && !parse_special) || len == 0 {
            continue;
        }
        if !frags.iter().any(|f| matches!(f, Fragment::Text(t) if finder.find(t.as_bytes()).is_some())) {
            continue;
        }
        let mut next = Vec::with_capacity(frags.len() + 2);
        for f in frags {
            let Fragment::Text(mut t) = f else {
                next.push(f);
                continue;
            };
            while let Some(at) = finder.find(t.as_bytes()) {
                if at > 0 {
                    next.push(Fragment::Text(&t[..at]));
                }
                next.push(Fragment::Token(*id));
                t = &t[at + len..];
            }
            if !t.is_empty() {
                next.push(Fragment::Text(t));
            }
        }
        frags = next;
    }
    frags
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> SpecialTokens {
        let texts: Vec<String> =
            ["a", "<s>", "<|im_start|>", "<u>", "<|im"].iter().map(|s| s.to_string()).collect();
        let types = [
            TokenType::Normal,
            TokenType::Control,
            TokenType::Control,
            TokenType::UserDefined,
            TokenType::Control,
        ];
        SpecialTokens::new(&texts, &types)
    }

    #[test]
    fn longest_first_and_user_defined_always() {
        let s = specials();
        use Fragment::{Text, Token};
        assert_eq!(partition(&s, "x<|im_start|>y<s>", true), [Text("x"), Token(2), Text("y"), Token(1)]);
        assert_eq!(partition(&s, "x<|im_start|><u>", false), [Text("x<|im_start|>"), Token(3)]);
        assert_eq!(partition(&s, "<s><s>", true), [Token(1), Token(1)]);
        assert_eq!(partition(&s, "", true), []);
    }
}
