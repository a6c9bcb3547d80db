//! A client-side Server-Sent Events decoder for response streams from *any* server: bytes are
//! untrusted and arrive split anywhere (inside a UTF-8 sequence, between `\r` and `\n`).
//!
//! It follows the WHATWG event-stream parsing algorithm: `\n`, `\r\n` and `\r` all end a line; a
//! blank line dispatches; `:` starts a comment (`: keep-alive`); `data:` lines accumulate, joined by
//! `\n`; one space after the colon is stripped; `event:` names the event; `id:` sets the last event
//! id; `retry:` and unknown fields are ignored; a leading BOM is dropped. Bytes are buffered and
//! only whole lines are decoded (lossily) as UTF-8, so a character split across reads survives.
//!
//! Bounded: the line being read plus the event being accumulated may not exceed `max_event_bytes`
//! (default 1 MiB); crossing it is a [`ProtocolError::TooLarge`] and the decoder stays failed, so
//! memory never grows with hostile input. Events are appended to a caller-owned `Vec`, so those
//! completed before an error are not lost and the output is the same however the input is split.
//! One deliberate leniency over the spec: [`SseDecoder::finish`] dispatches a final event that was
//! not followed by a blank line (some servers close right after `data: [DONE]\n`).

use crate::ProtocolError;

/// Default bound on one event (and on one line): 1 MiB.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` name; `None` for the default (`message`).
    pub event: Option<String>,
    /// The `data:` lines joined by `\n`.
    pub data: String,
    /// The last event id seen on the stream, if any.
    pub id: Option<String>,
}

#[derive(Debug, Default)]
struct Pending {
    data: Vec<u8>,
    has_data: bool,
    event: Option<String>,
    last_id: Option<String>,
}

/// Incremental SSE decoder; see the module docs.
#[derive(Debug)]
pub struct SseDecoder {
    max: usize,
    line: Vec<u8>,
    after_cr: bool,
    started: bool,
    pending: Pending,
    failed: Option<ProtocolError>,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl SseDecoder {
    /// A decoder bounded by [`DEFAULT_MAX_EVENT_BYTES`].
    pub fn new() -> Self {
        Self::with_max_event_bytes(DEFAULT_MAX_EVENT_BYTES)
    }

    /// A decoder with its own bound on one event.
    pub fn with_max_event_bytes(max: usize) -> Self {
        SseDecoder {
            max,
            line: Vec::new(),
            after_cr: false,
            started: false,
            pending: Pending::default(),
            failed: None,
        }
    }

    /// Bytes currently buffered (partial line + accumulated event); never above the bound by
    /// more than one line terminator.
    pub fn buffered_len(&self) -> usize {
        self.line.len() + self.pending.data.len()
    }

    /// Feeds the next bytes; completed events are appended to `out`. After an error every call
    /// returns the same error.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) -> Result<(), ProtocolError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut rest = chunk;
        while let Some((&first, tail)) = rest.split_first() {
            if self.after_cr {
                self.after_cr = false;
                if first == b'\n' {
                    rest = tail;
                    continue;
                }
            }
            let Some(end) = memchr::memchr2(b'\n', b'\r', rest) else {
                self.check(rest.len())?;
                self.line.extend_from_slice(rest);
                break;
            };
            self.check(end)?;
            self.after_cr = rest[end] == b'\r';
            if self.line.is_empty() {
                self.process_line(&rest[..end], out)?;
            } else {
                self.line.extend_from_slice(&rest[..end]);
                let line = std::mem::take(&mut self.line);
                let r = self.process_line(&line, out);
                self.line = line;
                self.line.clear();
                r?;
            }
            rest = &rest[end + 1..];
        }
        Ok(())
    }

    /// Ends the stream: a partial last line is taken as a line, and an event still pending is
    /// dispatched (see the module docs). The decoder is then reset for reuse.
    pub fn finish(&mut self) -> Result<Option<SseEvent>, ProtocolError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut out = Vec::new();
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.process_line(&line, &mut out)?;
        }
        self.process_line(b"", &mut out)?;
        let max = self.max;
        *self = Self::with_max_event_bytes(max);
        Ok(out.pop())
    }

    /// Fails when appending `more` bytes to the current line would cross the bound.
    fn check(&mut self, more: usize) -> Result<(), ProtocolError> {
        let len = self.buffered_len().saturating_add(more);
        if len > self.max {
            return Err(self.fail(len));
        }
        Ok(())
    }

    fn fail(&mut self, len: usize) -> ProtocolError {
        let e = ProtocolError::TooLarge { what: "SSE event", len: len as u64, max: self.max as u64 };
        self.failed = Some(e.clone());
        self.line = Vec::new();
        self.pending = Pending::default();
        e
    }

    fn process_line(&mut self, mut line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), ProtocolError> {
        if !self.started {
            self.started = true;
            line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
        }
        if line.is_empty() {
            let p = &mut self.pending;
            let event = p.event.take().filter(|e| !e.is_empty());
            if p.has_data {
                p.data.pop(); // the '\n' after the last data line
                out.push(SseEvent {
                    event,
                    // Valid UTF-8 (every engine's) checked by the fast validator; anything else
                    // repaired as the SSE spec says (U+FFFD).
                    data: match std::str::from_utf8(&p.data) {
                        Ok(s) => s.to_owned(),
                        Err(_) => String::from_utf8_lossy(&p.data).into_owned(),
                    },
                    id: p.last_id.clone(),
                });
                p.data.clear();
                p.has_data = false;
            }
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(()); // comment / keep-alive
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                let p = &mut self.pending;
                p.data.extend_from_slice(value);
                p.data.push(b'\n');
                p.has_data = true;
                if p.data.len() > self.max {
                    let len = p.data.len();
                    return Err(self.fail(len));
                }
            }
            b"event" => self.pending.event = Some(String::from_utf8_lossy(value).into_owned()),
            b"id" if !value.contains(&0) => {
                self.pending.last_id = Some(String::from_utf8_lossy(value).into_owned())
            }
            _ => {} // retry, unknown fields
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> Vec<SseEvent> {
        let mut d = SseDecoder::new();
        let mut out = Vec::new();
        d.feed(bytes, &mut out).unwrap();
        out.extend(d.finish().unwrap());
        out
    }

    fn data(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn invalid_utf8_is_replaced_and_valid_text_kept_exactly() {
        assert_eq!(
            data(&decode(b"data: a\xffb\n\ndata: h\xc3\xa9 <|x|>\n\n")),
            ["a\u{fffd}b", "h\u{e9} <|x|>"]
        );
    }

    #[test]
    fn all_three_line_endings() {
        assert_eq!(
            data(&decode(b"data: a\n\ndata: b\r\n\r\ndata: c\r\rdata: d\n\r\n")),
            ["a", "b", "c", "d"]
        );
    }

    #[test]
    fn comments_multiline_data_event_names_and_ids() {
        let ev =
            decode(b": keep-alive\n\nevent: error\ndata: x\ndata:y\nid: 7\nretry: 10\nfoo: bar\n\ndata\n\n");
        assert_eq!(ev.len(), 2);
        assert_eq!(
            ev[0],
            SseEvent { event: Some("error".into()), data: "x\ny".into(), id: Some("7".into()) }
        );
        assert_eq!(ev[1], SseEvent { event: None, data: String::new(), id: Some("7".into()) });
    }

    #[test]
    fn only_one_space_is_stripped_and_bom_is_dropped() {
        let ev = decode(b"\xEF\xBB\xBFdata:  two\n\n");
        assert_eq!(data(&ev), [" two"]);
    }

    #[test]
    fn event_without_data_is_not_dispatched() {
        assert!(decode(b"event: ping\n\n: c\n\n").is_empty());
        // ...and its name does not leak into the next event.
        assert_eq!(decode(b"event: ping\n\ndata: x\n\n")[0].event, None);
    }

    #[test]
    fn splits_inside_crlf_and_utf8() {
        let bytes = "data: h\u{e9}llo\r\n\r\ndata: [DONE]\r\n\r\n".as_bytes();
        for cut in 0..bytes.len() {
            let mut d = SseDecoder::new();
            let mut out = Vec::new();
            d.feed(&bytes[..cut], &mut out).unwrap();
            d.feed(&bytes[cut..], &mut out).unwrap();
            assert_eq!(data(&out), ["h\u{e9}llo", "[DONE]"], "cut at {cut}");
        }
    }

    #[test]
    fn finish_dispatches_an_unterminated_last_event() {
        assert_eq!(data(&decode(b"data: a\n\ndata: [DONE]\n")), ["a", "[DONE]"]);
        assert_eq!(data(&decode(b"data: [DONE]")), ["[DONE]"]);
    }

    #[test]
    fn oversized_events_and_lines_fail_and_stay_failed() {
        let mut d = SseDecoder::with_max_event_bytes(16);
        let mut out = Vec::new();
        d.feed(b"data: ok\n\n", &mut out).unwrap();
        let e = d.feed(b"data: 0123456789\ndata: 0123456789\n", &mut out).unwrap_err();
        assert!(matches!(e, ProtocolError::TooLarge { max: 16, .. }), "{e}");
        assert_eq!(d.feed(b"\n", &mut out).unwrap_err(), e);
        assert_eq!(data(&out), ["ok"]);

        let mut d = SseDecoder::with_max_event_bytes(16);
        for _ in 0..4 {
            match d.feed(b": a comment that never ends", &mut out) {
                Ok(()) => assert!(d.buffered_len() <= 16),
                Err(e) => assert!(matches!(e, ProtocolError::TooLarge { .. })),
            }
        }
        assert!(d.buffered_len() <= 16);
    }
}
