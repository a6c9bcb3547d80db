//! Fuzzes the bench's SSE decoder and chunk reader with untrusted bytes: no panic, the buffer
//! stays within its bound, and the events do not depend on where the input was split (the first
//! byte picks the split point and the bound, the rest is the stream).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_protocol::{parse_stream_chunk, SseDecoder, SseEvent};

fn run(parts: &[&[u8]], max: usize) -> (Vec<SseEvent>, bool) {
    let mut d = SseDecoder::with_max_event_bytes(max);
    let mut out = Vec::new();
    for p in parts {
        if d.feed(p, &mut out).is_err() {
            return (out, true);
        }
        assert!(d.buffered_len() <= max + 1);
    }
    match d.finish() {
        Ok(last) => {
            out.extend(last);
            (out, false)
        }
        Err(_) => (out, true),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&knob, stream)) = data.split_first() else { return };
    let max = 1 + usize::from(knob % 64) * 8;
    let cut = usize::from(knob) % (stream.len() + 1);
    let whole = run(&[stream], max);
    let split = run(&[&stream[..cut], &stream[cut..]], max);
    assert_eq!(whole, split);
    for e in &whole.0 {
        let _ = parse_stream_chunk(&e.data);
    }
});
