//! Workloads: what each request asks for. Seeded, so a run can be repeated exactly; the default
//! is `agent-longtail` (mostly short prompts, a tail of long ones), the shape under which
//! prefill/decode interference shows. `shared-prefix` exercises a prefix cache, `multi-turn`
//! grows each session's prompt with the answers the server really gave (the runner fills those
//! in), and `trace` replays a recorded JSONL trace whose timestamps replace the arrival process.

use crate::text::prose;
use crate::tokens::{exact_prose, PromptTokenizer};
use crate::trace::Trace;
use crate::BenchError;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::str::FromStr;
use std::sync::Arc;

/// Where a request sits in a multi-turn session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTurn {
    /// Session index.
    pub session: usize,
    /// Turn within the session, from 0.
    pub turn: usize,
}

/// One request's content.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// A system message before the user message (`shared-prefix`: the group's shared prompt).
    pub system: Option<String>,
    /// The user message (for a later turn of a session: only this turn's new text; the runner
    /// puts the earlier turns and answers before it).
    pub prompt: String,
    /// The length the workload aimed for, in tokens of `system` + `prompt` (exact with a
    /// tokenizer; otherwise approximate and the server's `usage` is the truth).
    pub target_input_tokens: usize,
    /// `max_tokens` to ask for.
    pub max_tokens: u32,
    /// Multi-turn position, for `multi-turn` workloads.
    pub session: Option<SessionTurn>,
}

/// A length distribution for `random`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LenDist {
    /// Uniform over `LO..=HI`.
    Uniform(usize, usize),
    /// Log-normal with this median and σ of the log, rounded and clamped to `1..=MAX_LEN`.
    LogNormal {
        /// Median length.
        median: f64,
        /// Standard deviation of ln(length).
        sigma: f64,
    },
}

/// Longest prompt or output a workload generates.
pub const MAX_LEN: usize = 1 << 17;

impl LenDist {
    fn sample(&self, rng: &mut ChaCha8Rng) -> usize {
        match *self {
            LenDist::Uniform(lo, hi) => uniform(rng, (lo, hi)),
            LenDist::LogNormal { median, sigma } => {
                // Box–Muller from two uniforms in (0, 1].
                let u = |rng: &mut ChaCha8Rng| ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
                let (u1, u2) = (u(rng), u(rng));
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                let x = (median.ln() + sigma * z).exp().round();
                (x.max(1.0) as usize).min(MAX_LEN)
            }
        }
    }
}

/// A workload shape.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// Every request the same lengths.
    Fixed {
        /// Prompt tokens.
        input: usize,
        /// Output tokens.
        output: u32,
    },
    /// `long_share` of requests have long prompts, the rest short ones; lengths uniform in range.
    AgentLongtail {
        /// Short prompt range.
        short: (usize, usize),
        /// Long prompt range.
        long: (usize, usize),
        /// Fraction of long prompts (0..=1).
        long_share: f64,
        /// Output range.
        output: (u32, u32),
    },
    /// Prompt and output lengths drawn independently from two distributions.
    Random {
        /// Prompt length distribution.
        input: LenDist,
        /// Output length distribution.
        output: LenDist,
    },
    /// `groups` system prompts of `prefix` tokens; each request picks a group (uniformly) and adds
    /// a unique user message, so requests of a group share their first `prefix` tokens.
    SharedPrefix {
        /// Number of groups.
        groups: usize,
        /// Length of each group's system prompt.
        prefix: usize,
        /// Unique suffix length range.
        suffix: (usize, usize),
        /// Output range.
        output: (u32, u32),
    },
    /// Sessions of `turns` turns: request `i` is turn `i % turns` of session `i / turns`; each
    /// turn adds a new user message of `input` tokens after the previous turns and answers.
    MultiTurn {
        /// Turns per session.
        turns: usize,
        /// New user text per turn, range.
        input: (usize, usize),
        /// Output range.
        output: (u32, u32),
    },
    /// A recorded trace: one request per line, sent at its timestamp.
    Trace(Arc<Trace>),
}

impl Default for Workload {
    fn default() -> Self {
        Workload::AgentLongtail { short: (64, 256), long: (1500, 3000), long_share: 0.1, output: (32, 128) }
    }
}

impl FromStr for Workload {
    type Err = BenchError;
    /// `fixed:IN:OUT`, `agent-longtail` (defaults) or
    /// `agent-longtail:SHORT_LO-SHORT_HI:LONG_LO-LONG_HI:SHARE:OUT_LO-OUT_HI`,
    /// `random:uniform:IN_LO-IN_HI:OUT_LO-OUT_HI`, `random:lognormal:IN_MEDIAN,SIGMA:OUT_MEDIAN,SIGMA`,
    /// `shared-prefix[:GROUPS:PREFIX:SUF_LO-SUF_HI:OUT_LO-OUT_HI]`,
    /// `multi-turn[:TURNS:IN_LO-IN_HI:OUT_LO-OUT_HI]`, `trace:PATH.jsonl`.
    fn from_str(s: &str) -> Result<Self, BenchError> {
        if let Some(path) = s.strip_prefix("trace:") {
            return Ok(Workload::Trace(Arc::new(Trace::load(std::path::Path::new(path))?)));
        }
        let bad = |why: &str| BenchError::BadWorkload(format!("{s:?}: {why}"));
        let num = |x: &str| x.trim().parse::<usize>().map_err(|_| bad(&format!("{x:?} is not a count")));
        let range = |x: &str| -> Result<(usize, usize), BenchError> {
            let (a, b) = x.split_once('-').ok_or_else(|| bad(&format!("{x:?} is not LO-HI")))?;
            let (a, b) = (num(a)?, num(b)?);
            if a == 0 || a > b || b > MAX_LEN {
                return Err(bad(&format!("range {x:?} must have 1 ≤ LO ≤ HI ≤ {MAX_LEN}")));
            }
            Ok((a, b))
        };
        let out_range = |x: &str| range(x).map(|(a, b)| (a as u32, b as u32));
        let lognormal = |x: &str| -> Result<LenDist, BenchError> {
            let (m, sd) = x.split_once(',').ok_or_else(|| bad(&format!("{x:?} is not MEDIAN,SIGMA")))?;
            let median: f64 = m.trim().parse().map_err(|_| bad(&format!("{m:?} is not a number")))?;
            let sigma: f64 = sd.trim().parse().map_err(|_| bad(&format!("{sd:?} is not a number")))?;
            if !(median.is_finite() && (1.0..=MAX_LEN as f64).contains(&median)) {
                return Err(bad(&format!("median {median} must be within 1..={MAX_LEN}")));
            }
            if !(sigma.is_finite() && (0.0..=4.0).contains(&sigma)) {
                return Err(bad(&format!("sigma {sigma} must be within 0..=4")));
            }
            Ok(LenDist::LogNormal { median, sigma })
        };
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["fixed", i, o] => {
                let (input, output) = (num(i)?, num(o)?);
                if input == 0 || output == 0 || input > MAX_LEN || output > MAX_LEN {
                    return Err(bad(&format!("lengths must be within 1..={MAX_LEN}")));
                }
                Ok(Workload::Fixed { input, output: output as u32 })
            }
            ["agent-longtail"] => Ok(Workload::default()),
            ["agent-longtail", sh, lo, share, out] => {
                let long_share: f64 = share.parse().map_err(|_| bad("share is not a number"))?;
                if !(0.0..=1.0).contains(&long_share) {
                    return Err(bad("share must be within 0..=1"));
                }
                Ok(Workload::AgentLongtail {
                    short: range(sh)?,
                    long: range(lo)?,
                    long_share,
                    output: out_range(out)?,
                })
            }
            ["random", "uniform", i, o] => {
                let (i, o) = (range(i)?, range(o)?);
                Ok(Workload::Random { input: LenDist::Uniform(i.0, i.1), output: LenDist::Uniform(o.0, o.1) })
            }
            ["random", "lognormal", i, o] => {
                Ok(Workload::Random { input: lognormal(i)?, output: lognormal(o)? })
            }
            ["shared-prefix"] => {
                Ok(Workload::SharedPrefix { groups: 4, prefix: 512, suffix: (32, 128), output: (16, 64) })
            }
            ["shared-prefix", g, p, suf, out] => {
                let (groups, prefix) = (num(g)?, num(p)?);
                if groups == 0 || prefix == 0 || prefix > MAX_LEN {
                    return Err(bad(&format!("GROUPS ≥ 1 and 1 ≤ PREFIX ≤ {MAX_LEN}")));
                }
                Ok(Workload::SharedPrefix { groups, prefix, suffix: range(suf)?, output: out_range(out)? })
            }
            ["multi-turn"] => Ok(Workload::MultiTurn { turns: 4, input: (32, 128), output: (16, 64) }),
            ["multi-turn", t, i, o] => {
                let turns = num(t)?;
                if !(1..=1000).contains(&turns) {
                    return Err(bad("TURNS must be within 1..=1000"));
                }
                Ok(Workload::MultiTurn { turns, input: range(i)?, output: out_range(o)? })
            }
            _ => Err(bad("expected fixed:IN:OUT, agent-longtail[:S_LO-S_HI:L_LO-L_HI:SHARE:O_LO-O_HI], \
                 random:uniform:I_LO-I_HI:O_LO-O_HI, random:lognormal:I_MED,I_SIGMA:O_MED,O_SIGMA, \
                 shared-prefix[:GROUPS:PREFIX:S_LO-S_HI:O_LO-O_HI], multi-turn[:TURNS:I_LO-I_HI:O_LO-O_HI] \
                 or trace:PATH")),
        }
    }
}

impl std::fmt::Display for Workload {
    /// The spec in the form [`Workload::from_str`] reads (a trace by its file name).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = |d: &LenDist| match *d {
            LenDist::Uniform(a, b) => format!("{a}-{b}"),
            LenDist::LogNormal { median, sigma } => format!("{median},{sigma}"),
        };
        match self {
            Workload::Fixed { input, output } => write!(f, "fixed:{input}:{output}"),
            Workload::AgentLongtail { short, long, long_share, output } => write!(
                f,
                "agent-longtail:{}-{}:{}-{}:{long_share}:{}-{}",
                short.0, short.1, long.0, long.1, output.0, output.1
            ),
            Workload::Random { input, output } => {
                let kind = if matches!(input, LenDist::Uniform(..)) { "uniform" } else { "lognormal" };
                write!(f, "random:{kind}:{}:{}", len(input), len(output))
            }
            Workload::SharedPrefix { groups, prefix, suffix, output } => write!(
                f,
                "shared-prefix:{groups}:{prefix}:{}-{}:{}-{}",
                suffix.0, suffix.1, output.0, output.1
            ),
            Workload::MultiTurn { turns, input, output } => {
                write!(f, "multi-turn:{turns}:{}-{}:{}-{}", input.0, input.1, output.0, output.1)
            }
            Workload::Trace(t) => write!(f, "trace:{}", t.source),
        }
    }
}

fn uniform(rng: &mut ChaCha8Rng, (lo, hi): (usize, usize)) -> usize {
    lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize
}

fn text(tok: Option<&dyn PromptTokenizer>, tokens: usize, offset: usize) -> String {
    match tok {
        Some(t) => exact_prose(t, tokens, offset),
        None => prose(tokens, offset),
    }
}

fn tagged(tok: Option<&dyn PromptTokenizer>, tag: &str, tokens: usize, offset: usize) -> String {
    let Some(t) = tok else {
        return format!(
            "{tag} {}",
            prose(tokens.saturating_sub(tag.split_whitespace().count()).max(1), offset)
        );
    };
    // The tag and the text can merge at the seam: measure the whole and correct the text's share.
    let mut k = tokens.saturating_sub(t.encode(tag).len()).max(1);
    let mut best = String::new();
    for _ in 0..3 {
        best = format!("{tag} {}", exact_prose(t, k, offset));
        let m = t.encode(&best).len();
        if m == tokens || (m > tokens && k == 1) {
            break;
        }
        k = (k + tokens).saturating_sub(m).max(1);
    }
    best
}

impl Workload {
    /// `n` requests, the same for the same seed (a trace gives at most its length).
    pub fn requests(&self, n: usize, seed: u64) -> Vec<RequestSpec> {
        self.requests_with(n, seed, None)
    }

    /// How many requests the workload can give at most (`None`: unbounded).
    pub fn len_limit(&self) -> Option<usize> {
        match self {
            Workload::Trace(t) => Some(t.entries.len()),
            _ => None,
        }
    }

    /// The send schedule the workload itself fixes (a trace's timestamps), if any.
    pub fn schedule(&self) -> Option<Vec<std::time::Duration>> {
        match self {
            Workload::Trace(t) => Some(t.offsets()),
            _ => None,
        }
    }

    /// Whether requests come in multi-turn sessions.
    pub fn turns(&self) -> Option<usize> {
        match self {
            Workload::MultiTurn { turns, .. } => Some(*turns),
            _ => None,
        }
    }

    /// `n` requests with prompt texts cut to exact token counts when `tok` is given.
    pub fn requests_with(&self, n: usize, seed: u64, tok: Option<&dyn PromptTokenizer>) -> Vec<RequestSpec> {
        let n = self.len_limit().map_or(n, |l| n.min(l));
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x005e_ed0f_3077);
        // Where in the text this run's prompts start: another seed, other bytes (a second run
        // against a server with a prefix cache would otherwise measure its hits). A stream of its
        // own, so the lengths each seed draws stay as they were.
        let base = (ChaCha8Rng::seed_from_u64(seed ^ 0x007e_470f_f5e7).next_u64() % 100_003) as usize;
        // Group prompts are drawn once, from their own offsets, so a group's requests share them
        // byte for byte.
        let group_prompts: Vec<String> = match self {
            Workload::SharedPrefix { groups, prefix, .. } => {
                let group_base = (rng.next_u64() % 10_000) as usize;
                (0..*groups).map(|g| text(tok, *prefix, group_base + g * 211)).collect()
            }
            _ => Vec::new(),
        };
        let out = |rng: &mut ChaCha8Rng, o: (u32, u32)| uniform(rng, (o.0 as usize, o.1 as usize)) as u32;
        (0..n)
            .map(|i| {
                let simple = |input: usize, max_tokens: u32| RequestSpec {
                    system: None,
                    prompt: text(tok, input, base + i * 37),
                    target_input_tokens: input,
                    max_tokens,
                    session: None,
                };
                match self {
                    Workload::Fixed { input, output } => simple(*input, *output),
                    Workload::AgentLongtail { short, long, long_share, output } => {
                        let is_long = (rng.next_u64() as f64 / u64::MAX as f64) < *long_share;
                        let input = uniform(&mut rng, if is_long { *long } else { *short });
                        let o = out(&mut rng, *output);
                        simple(input, o)
                    }
                    Workload::Random { input, output } => {
                        let i = input.sample(&mut rng);
                        let o = output.sample(&mut rng).min(u32::MAX as usize) as u32;
                        simple(i, o)
                    }
                    Workload::SharedPrefix { groups, prefix, suffix, output } => {
                        let g = (rng.next_u64() % *groups as u64) as usize;
                        let suf = uniform(&mut rng, *suffix);
                        let o = out(&mut rng, *output);
                        RequestSpec {
                            system: group_prompts.get(g).cloned(),
                            // A numbered tag keeps every suffix unique even where the prose
                            // repeats; the tag's tokens count towards the suffix length.
                            prompt: tagged(tok, &format!("Request {i}:"), suf, base + 50_000 + i * 53),
                            target_input_tokens: prefix + suf,
                            max_tokens: o,
                            session: None,
                        }
                    }
                    Workload::MultiTurn { turns, input, output } => {
                        let len = uniform(&mut rng, *input);
                        let o = out(&mut rng, *output);
                        let turn = SessionTurn { session: i / turns, turn: i % turns };
                        RequestSpec { session: Some(turn), ..simple(len, o) }
                    }
                    Workload::Trace(t) => {
                        let e = &t.entries[i];
                        let (prompt, len) = match (&e.prompt, e.prompt_tokens) {
                            (Some(p), n) => (p.clone(), n.unwrap_or_else(|| p.split_whitespace().count())),
                            (None, Some(n)) => (text(tok, n, base + i * 37), n),
                            (None, None) => (String::new(), 0),
                        };
                        RequestSpec {
                            system: None,
                            prompt,
                            target_input_tokens: len,
                            max_tokens: e.output_tokens,
                            session: None,
                        }
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::tokens::test_support::ByteTokenizer;
    use proptest::prelude::*;

    #[test]
    fn random_lengths_follow_their_distribution() {
        let w: Workload = "random:uniform:10-20:3-5".parse().unwrap();
        let r = w.requests(300, 4);
        assert!(r
            .iter()
            .all(|s| (10..=20).contains(&s.target_input_tokens) && (3..=5).contains(&s.max_tokens)));
        let w: Workload = "random:lognormal:200,0.5:50,0.1".parse().unwrap();
        let mut lens: Vec<usize> = w.requests(2001, 4).iter().map(|s| s.target_input_tokens).collect();
        lens.sort_unstable();
        let median = lens[1000] as f64;
        assert!((170.0..235.0).contains(&median), "median {median}");
        assert!(lens[1990] > 400, "a log-normal tail: p99.5 {}", lens[1990]);
        for bad in [
            "random:lognormal:0,1:5,1",
            "random:lognormal:5,9:5,1",
            "random:uniform:5-1:1-2",
            "random:x:1-2:1-2",
        ] {
            assert!(bad.parse::<Workload>().is_err(), "{bad}");
        }
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let w: Workload = "shared-prefix:3:40:20-30:4-4".parse().unwrap();
        let r = w.requests_with(60, 2, Some(&ByteTokenizer));
        let prefixes: std::collections::BTreeSet<&str> =
            r.iter().map(|s| s.system.as_deref().unwrap()).collect();
        assert_eq!(prefixes.len(), 3, "three groups, each one system prompt");
        for p in &prefixes {
            assert_eq!(p.len(), 40, "exact prefix length with a tokenizer");
        }
        let prompts: std::collections::BTreeSet<&str> = r.iter().map(|s| s.prompt.as_str()).collect();
        assert_eq!(prompts.len(), 60, "every suffix unique");
        assert!(r.iter().all(|s| s.target_input_tokens == 40 + s.prompt.len()));
    }

    #[test]
    fn multi_turn_numbers_sessions_and_turns() {
        let w: Workload = "multi-turn:3:5-8:2-4".parse().unwrap();
        let r = w.requests(7, 0);
        let pos: Vec<(usize, usize)> =
            r.iter().map(|s| s.session.map(|t| (t.session, t.turn)).unwrap()).collect();
        assert_eq!(pos, vec![(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]);
        assert_eq!(w.turns(), Some(3));
        assert!("multi-turn:0:5-8:2-4".parse::<Workload>().is_err());
        for spec in
            ["multi-turn:3:5-8:2-4", "shared-prefix:2:10:1-5:1-3", "random:lognormal:20,1.5:5,1", "fixed:3:4"]
        {
            assert_eq!(spec.parse::<Workload>().unwrap().to_string(), spec);
        }
    }

    #[test]
    fn exact_lengths_with_a_tokenizer() {
        let w: Workload = "random:uniform:1-300:3-5".parse().unwrap();
        for s in w.requests_with(50, 8, Some(&ByteTokenizer)) {
            assert_eq!(s.prompt.len(), s.target_input_tokens);
        }
    }

    /// Regression: every run sent the same prompt bytes whatever its seed, so a second run
    /// against a prefix-caching server measured its hits.
    #[test]
    fn another_seed_sends_other_prompts_with_the_same_lengths() {
        for spec in ["fixed:64:3", "shared-prefix:2:10:8-8:1-3"] {
            let w: Workload = spec.parse().unwrap();
            let (a, b) = (w.requests(8, 1), w.requests(8, 2));
            assert!(a.iter().zip(&b).all(|(x, y)| x.prompt != y.prompt), "{spec}");
            assert!(a
                .iter()
                .zip(&b)
                .all(|(x, y)| x.target_input_tokens == y.target_input_tokens || spec.starts_with("shared")));
        }
    }

    proptest! {
        #[test]
        fn every_workload_is_seeded_and_bounded(seed in any::<u64>(), n in 0usize..40, which in 0usize..6) {
            let spec = ["fixed:5:3", "agent-longtail:2-9:20-30:0.3:1-4", "random:uniform:1-50:1-9",
                "random:lognormal:20,1:5,1", "shared-prefix:2:10:1-5:1-3", "multi-turn:4:1-9:1-3"][which];
            let w: Workload = spec.parse().unwrap();
            let a = w.requests(n, seed);
            prop_assert_eq!(a.len(), n);
            prop_assert_eq!(&a, &w.requests(n, seed));
            for r in &a {
                prop_assert!(r.max_tokens >= 1 && r.target_input_tokens >= 1 && !r.prompt.is_empty());
                prop_assert!(r.target_input_tokens <= MAX_LEN);
            }
        }
    }

    #[test]
    fn parses_and_is_reproducible() {
        let w: Workload = "agent-longtail:10-20:1000-2000:0.25:5-9".parse().unwrap();
        let a = w.requests(400, 1);
        assert_eq!(a, w.requests(400, 1));
        assert_ne!(a, w.requests(400, 2));
        let long = a.iter().filter(|r| r.target_input_tokens >= 1000).count();
        assert!((60..140).contains(&long), "{long} long of 400 at share 0.25");
        assert!(a.iter().all(|r| (5..=9).contains(&r.max_tokens)));
        assert_eq!("fixed:8:4".parse::<Workload>().unwrap(), Workload::Fixed { input: 8, output: 4 });
    }

    #[test]
    fn bad_specs_are_typed_errors() {
        for s in [
            "fixed:0:4",
            "fixed:x:4",
            "agent-longtail:9-2:1-2:0.1:1-2",
            "agent-longtail:1-2:1-2:1.5:1-2",
            "zipf",
        ] {
            assert!(matches!(s.parse::<Workload>(), Err(BenchError::BadWorkload(_))), "{s}");
        }
    }
}
