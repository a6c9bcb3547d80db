//! Stop strings over a token stream. Text is released to the client only once it can no longer
//! be the start of a stop string, so a stop string split over several tokens is never half-sent,
//! and the stop string itself is never sent (OpenAI's behaviour).

/// Incremental stop-string matcher.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
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
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Self::default() }
    }

    /// Feeds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.stopped {
            return StopStep { emit: String::new(), stopped: true };
        }
        self.held.push_str(text);
        // Earliest complete stop string.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let emit = self.held[..at].to_owned();
            self.held.clear();
            self.stopped = true;
            return StopStep { emit, stopped: true };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
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

    proptest! {
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
