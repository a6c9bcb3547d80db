//! Property tests for the SSE decoder, the one decoder the bench points at untrusted servers:
//! the events must not depend on where the network split the bytes, arbitrary bytes must never
//! panic, and the buffer must stay within its bound whatever arrives.

use proptest::prelude::*;
use tokenpath_protocol::{ProtocolError, SseDecoder, SseEvent};

/// Feeds `bytes` cut at `cuts` (positions, any order, may repeat); returns the events and the
/// first error's bound (its reported length depends on how much had arrived), finishing the
/// stream when there was none.
fn run(bytes: &[u8], cuts: &[usize], max: usize) -> (Vec<SseEvent>, Option<u64>) {
    let (events, err) = run_raw(bytes, cuts, max);
    let err = err.map(|e| match e {
        ProtocolError::TooLarge { what: "SSE event", len, max } => {
            assert!(len > max);
            max
        }
        other => panic!("unexpected error {other}"),
    });
    (events, err)
}

fn run_raw(bytes: &[u8], cuts: &[usize], max: usize) -> (Vec<SseEvent>, Option<ProtocolError>) {
    let mut pos: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    pos.push(0);
    pos.push(bytes.len());
    pos.sort_unstable();
    let mut d = SseDecoder::with_max_event_bytes(max);
    let mut out = Vec::new();
    for w in pos.windows(2) {
        if let Err(e) = d.feed(&bytes[w[0]..w[1]], &mut out) {
            return (out, Some(e));
        }
        assert!(d.buffered_len() <= max + 1, "buffer {} over bound {max}", d.buffered_len());
    }
    match d.finish() {
        Ok(last) => {
            out.extend(last);
            (out, None)
        }
        Err(e) => (out, Some(e)),
    }
}

#[derive(Debug, Clone)]
struct Ev {
    name: Option<String>,
    lines: Vec<String>,
    comment: bool,
}

fn ev() -> impl Strategy<Value = Ev> {
    (proptest::option::of("[a-z]{1,6}"), proptest::collection::vec("[^\r\n]{0,12}", 1..4), any::<bool>())
        .prop_map(|(name, lines, comment)| Ev { name, lines, comment })
}

fn encode(events: &[Ev], eols: &[u8]) -> Vec<u8> {
    let mut s = Vec::new();
    let mut k = 0;
    let mut eol = |s: &mut Vec<u8>| {
        let e: &[u8] = match eols[k % eols.len()] % 3 {
            // "\r" then "\n" would read as one "\r\n": the format's own ambiguity, not a bug.
            0 if s.last() == Some(&b'\r') => b"\r\n",
            0 => b"\n",
            1 => b"\r\n",
            _ => b"\r",
        };
        k += 1;
        s.extend_from_slice(e);
    };
    for e in events {
        if e.comment {
            s.extend_from_slice(b": keep-alive");
            eol(&mut s);
        }
        if let Some(n) = &e.name {
            s.extend_from_slice(format!("event: {n}").as_bytes());
            eol(&mut s);
        }
        for l in &e.lines {
            s.extend_from_slice(format!("data: {l}").as_bytes());
            eol(&mut s);
        }
        eol(&mut s);
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn well_formed_streams_decode_to_their_events_however_split(
        events in proptest::collection::vec(ev(), 0..8),
        eols in proptest::collection::vec(any::<u8>(), 1..16),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let bytes = encode(&events, &eols);
        let (got, err) = run(&bytes, &cuts, 1 << 20);
        prop_assert!(err.is_none());
        let want: Vec<SseEvent> = events
            .iter()
            .map(|e| SseEvent { event: e.name.clone(), data: e.lines.join("\n"), id: None })
            .collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_do_not_depend_on_splits(
        bytes in proptest::collection::vec(
            prop_oneof![
                4 => any::<u8>(),
                2 => Just(b'\n'),
                2 => Just(b'\r'),
                1 => Just(b':'),
                1 => Just(b' '),
            ],
            0..400,
        ),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
        max in 1usize..128,
    ) {
        prop_assert_eq!(run(&bytes, &cuts, max), run(&bytes, &[], max));
        prop_assert_eq!(run(&bytes, &cuts, 1 << 20), run(&bytes, &[], 1 << 20));
    }

    #[test]
    fn data_prefixed_noise_stays_split_invariant(
        body in proptest::collection::vec(any::<u8>(), 0..200),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
    ) {
        let mut bytes = b"data: ".to_vec();
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(b"\r\n\r\n");
        let (whole, e1) = run(&bytes, &[], 64);
        let (split, e2) = run(&bytes, &cuts, 64);
        prop_assert_eq!(whole, split);
        prop_assert_eq!(e1, e2);
    }
}
