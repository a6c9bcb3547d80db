//! Stop strings over a token stream. Text is released to the client only once it can no longer
//! be the start of a stop string, so a stop string split over several tokens is never half-sent,
//! and the stop string itself is never sent (OpenAI's behaviour).

/// Incremental stop-string matcher: one Knuth–Morris–Pratt automaton per stop string, fed each
/// new byte once, so a push costs O(bytes × stop strings) whatever the stop strings' lengths and
/// however long a near-match runs (the naive rescan of every prefix was quadratic in the held
/// text and stalled every stream on the batcher's thread). Matching bytes is matching text: UTF-8
/// is self-synchronizing, so a byte match of a whole string starts and ends on char boundaries.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<Kmp>,
    held: String,
    stopped: bool,
}

/// One stop string's automaton: `state` bytes of it match the end of the text seen so far.
#[derive(Debug, Clone)]
struct Kmp {
    pat: Vec<u8>,
    /// `fail[i]`: the longest proper border of `pat[..=i]`.
    fail: Vec<usize>,
    state: usize,
}

impl Kmp {
    fn new(pat: &str) -> Self {
        let pat = pat.as_bytes().to_vec();
        let mut fail = vec![0; pat.len()];
        let mut k = 0;
        for i in 1..pat.len() {
            while k > 0 && pat[i] != pat[k] {
                k = fail[k - 1];
            }
            if pat[i] == pat[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Self { pat, fail, state: 0 }
    }

    /// Feeds one byte; `true` when the whole string just matched.
    fn step(&mut self, b: u8) -> bool {
        while self.state > 0 && self.pat[self.state] != b {
            self.state = self.fail[self.state - 1];
        }
        if self.pat[self.state] == b {
            self.state += 1;
        }
        if self.state == self.pat.len() {
            self.state = self.fail[self.state - 1];
            return true;
        }
        false
    }
}

/// What one push produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStep {
    /// Text safe to send now.
    pub emit: String,
    /// A stop string was seen: generation must end (nothing after it is emitted).
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).map(|s| Kmp::new(&s)).collect(),
            ..Self::default()
        }
    }

    /// Feeds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.stopped {
            return StopStep { emit: String::new(), stopped: true };
        }
        let base = self.held.len();
        self.held.push_str(text);
        // The earliest-starting stop string completed by this push (a later, shorter one may
        // complete first).
        let mut first: Option<usize> = None;
        for (j, &b) in text.as_bytes().iter().enumerate() {
            for k in &mut self.stops {
                if k.step(b) {
                    // The held text keeps every byte an automaton is in the middle of, so the
                    // match starts inside it.
                    let start = (base + j + 1).saturating_sub(k.pat.len());
                    first = Some(first.map_or(start, |f| f.min(start)));
                }
            }
        }
        if let Some(at) = first {
            let emit = self.held[..at].to_owned();
            self.held.clear();
            self.stopped = true;
            return StopStep { emit, stopped: true };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self.stops.iter().map(|k| k.state).max().unwrap_or(0).min(self.held.len());
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_owned();
        self.held.drain(..cut);
        StopStep { emit, stopped: false }
    }

    /// Whether a stop string was seen.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Releases whatever is held back (generation ended for another reason).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stop_split_across_pushes_is_held_then_dropped() {
        let mut m = StopMatcher::new(["\nUser:".to_owned()]);
        assert_eq!(m.push("Hello").emit, "Hello");
        let s = m.push(" there\nUs");
        assert_eq!((s.emit.as_str(), s.stopped), (" there", false));
        let s = m.push("er: hi");
        assert_eq!((s.emit.as_str(), s.stopped), ("", true));
        assert_eq!(m.push("more").emit, "");
    }

    #[test]
    fn false_alarm_is_released() {
        let mut m = StopMatcher::new(["STOP".to_owned()]);
        assert_eq!(m.push("ST").emit, "");
        assert_eq!(m.push("AY").emit, "STAY");
        assert_eq!(m.push("S").emit, "");
        assert_eq!(m.finish(), "S");
    }

    #[test]
    fn a_long_near_match_costs_linear_time() {
        // The review's case: a stop of a million 'a's and a 'b', and output that is all 'a's.
        // The old matcher rescanned every prefix of the held text on every push (quadratic: this
        // test would not finish); the automaton holds exactly the near-match and moves on.
        let stop = "a".repeat(1_000_000) + "b";
        let mut m = StopMatcher::new([stop]);
        for _ in 0..20_000 {
            assert_eq!(m.push("aaaaaaaa").emit, "");
        }
        assert_eq!(m.finish().len(), 160_000);
        let mut m = StopMatcher::new(["a".repeat(100) + "b"]);
        let mut out = 0;
        for _ in 0..100_000 {
            out += m.push("aaaaaaaa").emit.len();
        }
        assert_eq!(out + m.finish().len(), 800_000);
    }

    #[test]
    fn the_earliest_starting_stop_wins_within_a_push() {
        let mut m = StopMatcher::new(["bc".to_owned(), "abcd".to_owned()]);
        let s = m.push("xabcd");
        assert_eq!((s.emit.as_str(), s.stopped), ("x", true));
        // Multi-byte text: matches are whole characters.
        let mut m = StopMatcher::new(["é!".to_owned()]);
        assert_eq!(m.push("café").emit, "caf");
        let s = m.push("!x");
        assert_eq!((s.emit.as_str(), s.stopped), ("", true));
    }

    proptest! {
        #[test]
        fn several_stops_agree_with_a_plain_search(
            pieces in proptest::collection::vec("[ab\u{e9}]{0,4}", 0..24),
            stops in proptest::collection::vec("[ab\u{e9}]{1,4}", 1..4),
        ) {
            let whole: String = pieces.concat();
            let mut m = StopMatcher::new(stops.clone());
            let (mut out, mut stopped, mut seen) = (String::new(), false, String::new());
            let mut want = None;
            for p in &pieces {
                seen.push_str(p);
                let s = m.push(p);
                out.push_str(&s.emit);
                if s.stopped {
                    stopped = true;
                    // The reference: the earliest start of any stop in the text seen so far.
                    want = stops.iter().filter_map(|st| seen.find(st.as_str())).min();
                    break;
                }
            }
            if stopped {
                prop_assert_eq!(Some(out.len()), want);
                prop_assert_eq!(&out[..], &whole[..out.len()]);
            } else {
                out.push_str(&m.finish());
                prop_assert_eq!(&out, &whole);
                prop_assert!(stops.iter().all(|st| !whole.contains(st.as_str())));
            }
        }

        #[test]
        fn emitted_text_is_the_prefix_before_the_first_stop(
            pieces in proptest::collection::vec("[a-c]{0,3}", 0..20),
            stop in "[a-c]{1,3}",
        ) {
            let whole: String = pieces.concat();
            let mut m = StopMatcher::new([stop.clone()]);
            let mut out = String::new();
            let mut stopped = false;
            for p in &pieces {
                let s = m.push(p);
                out.push_str(&s.emit);
                stopped |= s.stopped;
            }
            if !stopped { out.push_str(&m.finish()); }
            match whole.find(&stop) {
                Some(at) => { prop_assert!(stopped); prop_assert_eq!(&out, &whole[..at]); }
                None => { prop_assert!(!stopped); prop_assert_eq!(&out, &whole); }
            }
        }
    }
}
