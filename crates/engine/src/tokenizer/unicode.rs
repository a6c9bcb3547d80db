//! Code-point classes and the GPT-2 byte↔unicode mapping, shaped after llama.cpp's `unicode.cpp`.
//!
//! The pre-tokenizer asks three questions of every code point: letter? number? whitespace?
//! (plus "punctuation?" for the `default` pre-type). The answers must be Unicode general
//! categories (`\p{L}`, `\p{N}`, ...), not `char::is_alphabetic` & co. (Alphabetic is not
//! `\p{L}`), so they come from the `unicode-general-category` crate (Unicode 16). llama.cpp's
//! own table is a Unicode 15 snapshot: the two agree on every code point llama.cpp knows, and
//! differ only on characters first assigned in Unicode 16, which llama.cpp treats as unassigned.

use unicode_general_category::{get_general_category, GeneralCategory as G};

/// Unicode's White_Space property, the `\s` of llama.cpp's splitters (includes U+0085, U+00A0).
const WHITESPACE: [u32; 25] = [
    0x0009, 0x000A, 0x000B, 0x000C, 0x000D, 0x0020, 0x0085, 0x00A0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003,
    0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
];

/// One Unicode general-category family, as llama.cpp's `unicode_cpt_flags` keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cat {
    /// Unassigned (`UNDEFINED`).
    U,
    /// `\p{N}`
    N,
    /// `\p{L}`
    L,
    /// `\p{Z}`
    Z,
    /// `\p{M}`
    M,
    /// `\p{P}`
    P,
    /// `\p{S}`
    S,
    /// `\p{C}`
    C,
}

/// What the splitters need to know about one code point. `Flags::OUT` stands for a position
/// outside the fragment being split (llama.cpp returns all-zero flags there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Flags {
    /// `None` outside the fragment.
    pub cat: Option<Cat>,
    pub whitespace: bool,
}

impl Flags {
    pub const OUT: Flags = Flags { cat: None, whitespace: false };

    pub fn of(c: char) -> Flags {
        Flags { cat: Some(category(c)), whitespace: is_whitespace(c) }
    }
    pub fn is_letter(self) -> bool {
        self.cat == Some(Cat::L)
    }
    pub fn is_number(self) -> bool {
        self.cat == Some(Cat::N)
    }
    /// llama.cpp's `flags.as_uint() != 0`: true for any code point inside the fragment.
    pub fn in_range(self) -> bool {
        self.cat.is_some()
    }
    /// `[^\s\p{L}\p{N}]` for an in-range code point.
    pub fn is_other(self) -> bool {
        self.in_range() && !(self.whitespace || self.is_letter() || self.is_number())
    }
}

/// The general-category family of `c`.
pub(crate) fn category(c: char) -> Cat {
    match get_general_category(c) {
        G::UppercaseLetter | G::LowercaseLetter | G::TitlecaseLetter | G::ModifierLetter | G::OtherLetter => {
            Cat::L
        }
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => Cat::N,
        G::SpaceSeparator | G::LineSeparator | G::ParagraphSeparator => Cat::Z,
        G::NonspacingMark | G::SpacingMark | G::EnclosingMark => Cat::M,
        G::ConnectorPunctuation
        | G::DashPunctuation
        | G::OpenPunctuation
        | G::ClosePunctuation
        | G::InitialPunctuation
        | G::FinalPunctuation
        | G::OtherPunctuation => Cat::P,
        G::MathSymbol | G::CurrencySymbol | G::ModifierSymbol | G::OtherSymbol => Cat::S,
        G::Control | G::Format | G::Surrogate | G::PrivateUse => Cat::C,
        _ => Cat::U,
    }
}

/// llama.cpp's whitespace set (`\s` for its splitters), which includes U+0085 and U+00A0.
pub(crate) fn is_whitespace(c: char) -> bool {
    WHITESPACE.binary_search(&(c as u32)).is_ok()
}

/// GPT-2's reversible byte → printable code point map (`bytes_to_unicode`): printable Latin-1
/// bytes map to themselves, the other 68 bytes to U+0100.. in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        // Every value here is below U+0144, so it is always a valid scalar value.
        table[b as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
    }
    table
}

/// Inverse of [`byte_to_char_table`]: code point → byte, indexed by code point (< U+0144);
/// -1 for code points that no byte maps to.
pub(crate) fn char_to_byte_table() -> [i16; 0x144] {
    let mut inv = [-1i16; 0x144];
    for (b, c) in byte_to_char_table().iter().enumerate() {
        inv[*c as usize] = b as i16;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_round_trips() {
        let t = byte_to_char_table();
        let inv = char_to_byte_table();
        for b in 0..=255u8 {
            assert_eq!(inv[t[b as usize] as usize], b as i16);
        }
        assert_eq!(inv.iter().filter(|&&b| b >= 0).count(), 256);
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
    }

    #[test]
    fn categories_follow_llama_cpp() {
        assert_eq!(category('a'), Cat::L);
        assert_eq!(category('7'), Cat::N);
        assert_eq!(category('中'), Cat::L);
        assert_eq!(category('²'), Cat::N);
        assert_eq!(category('!'), Cat::P);
        assert_eq!(category('$'), Cat::S);
        assert_eq!(category('\u{0301}'), Cat::M);
        assert_eq!(category('\u{10FFFF}'), Cat::U);
        assert!(is_whitespace('\u{3000}') && is_whitespace('\t') && !is_whitespace('x'));
    }
}
