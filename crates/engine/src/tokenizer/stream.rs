//! Streaming detokenization for SSE: text out per token, never half a character.
//!
//! A byte-level BPE token can end in the middle of a UTF-8 sequence (emoji and CJK often span
//! two or three tokens), so turning each token into a `String` on its own would emit U+FFFD
//! pairs where the model wrote one character. The decoder keeps the incomplete tail (at most
//! three bytes) until the next token completes it; bytes that can never become valid UTF-8
//! are replaced with U+FFFD right away, so output is never held back for more than one
//! character. It holds no reference to the tokenizer, so a request can own one cheaply.

use super::{Tokenizer, TokenizerError};

/// Per-request incremental decoder; see the module docs.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    render_special: bool,
}

impl StreamDecoder {
    /// A decoder; `render_special` decides whether control tokens (e.g. `<|im_end|>`) appear
    /// in the text.
    pub fn new(render_special: bool) -> Self {
        Self { pending: Vec::new(), render_special }
    }

    /// Adds one token and returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        let piece = tok.decode_token(id, self.render_special)?;
        Ok(self.push_bytes(piece))
    }

    /// Adds raw bytes and returns the text that is now complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` is valid UTF-8 by construction.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &after[bad..];
                        }
                        None => {
                            rest = after; // incomplete character at the end: hold it
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let drain_to = self.pending.len() - keep;
        self.pending.drain(..drain_to);
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is still held is emitted, lossily (U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_incomplete_characters() {
        let mut d = StreamDecoder::new(false);
        let smile = "😀".as_bytes();
        assert_eq!(d.push_bytes(b"hi "), "hi ");
        assert_eq!(d.push_bytes(&smile[..1]), "");
        assert_eq!(d.push_bytes(&smile[1..3]), "");
        assert_eq!(d.pending().len(), 3);
        assert_eq!(d.push_bytes(&smile[3..]), "😀");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut d = StreamDecoder::new(false);
        assert_eq!(d.push_bytes(b"a\xffb"), "a\u{FFFD}b");
        assert_eq!(d.push_bytes(b"\xe4\xb8"), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
