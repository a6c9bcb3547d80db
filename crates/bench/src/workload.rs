//! Workloads: what each request asks for. Seeded, so a run can be repeated exactly; the default
//! is `agent-longtail` (mostly short prompts, a tail of long ones), the shape under which
//! prefill/decode interference shows.

use crate::text::prose;
use crate::BenchError;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::str::FromStr;

/// One request's content.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// The user message.
    pub prompt: String,
    /// The length the workload aimed for (the server's `usage` is the truth).
    pub target_input_tokens: usize,
    /// `max_tokens` to ask for.
    pub max_tokens: u32,
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
}

impl Default for Workload {
    fn default() -> Self {
        Workload::AgentLongtail { short: (64, 256), long: (1500, 3000), long_share: 0.1, output: (32, 128) }
    }
}

impl FromStr for Workload {
    type Err = BenchError;
    /// `fixed:IN:OUT`, `agent-longtail` (defaults) or
    /// `agent-longtail:SHORT_LO-SHORT_HI:LONG_LO-LONG_HI:SHARE:OUT_LO-OUT_HI`.
    fn from_str(s: &str) -> Result<Self, BenchError> {
        let bad = |why: &str| BenchError::BadWorkload(format!("{s:?}: {why}"));
        let num = |x: &str| x.trim().parse::<usize>().map_err(|_| bad(&format!("{x:?} is not a count")));
        let range = |x: &str| -> Result<(usize, usize), BenchError> {
            let (a, b) = x.split_once('-').ok_or_else(|| bad(&format!("{x:?} is not LO-HI")))?;
            let (a, b) = (num(a)?, num(b)?);
            if a == 0 || a > b {
                return Err(bad(&format!("range {x:?} must have 1 ≤ LO ≤ HI")));
            }
            Ok((a, b))
        };
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["fixed", i, o] => {
                let (input, output) = (num(i)?, num(o)?);
                if input == 0 || output == 0 {
                    return Err(bad("lengths must be at least 1"));
                }
                Ok(Workload::Fixed { input, output: output as u32 })
            }
            ["agent-longtail"] => Ok(Workload::default()),
            ["agent-longtail", sh, lo, share, out] => {
                let long_share: f64 = share.parse().map_err(|_| bad("share is not a number"))?;
                if !(0.0..=1.0).contains(&long_share) {
                    return Err(bad("share must be within 0..=1"));
                }
                let o = range(out)?;
                Ok(Workload::AgentLongtail {
                    short: range(sh)?,
                    long: range(lo)?,
                    long_share,
                    output: (o.0 as u32, o.1 as u32),
                })
            }
            _ => Err(bad("expected fixed:IN:OUT or agent-longtail[:S_LO-S_HI:L_LO-L_HI:SHARE:O_LO-O_HI]")),
        }
    }
}

fn uniform(rng: &mut ChaCha8Rng, (lo, hi): (usize, usize)) -> usize {
    lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize
}

impl Workload {
    /// `n` requests, the same for the same seed.
    pub fn requests(&self, n: usize, seed: u64) -> Vec<RequestSpec> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x005e_ed0f_3077);
        (0..n)
            .map(|i| {
                let (input, output) = match self {
                    Workload::Fixed { input, output } => (*input, *output),
                    Workload::AgentLongtail { short, long, long_share, output } => {
                        let is_long = (rng.next_u64() as f64 / u64::MAX as f64) < *long_share;
                        let input = uniform(&mut rng, if is_long { *long } else { *short });
                        (input, uniform(&mut rng, (output.0 as usize, output.1 as usize)) as u32)
                    }
                };
                RequestSpec { prompt: prose(input, i * 37), target_input_tokens: input, max_tokens: output }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
