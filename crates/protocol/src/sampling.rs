//! How the next token is picked, as one type from the HTTP request to the engine's sampler:
//! the gateway fills [`SamplingParams`] from the request, a worker message carries it as is, and
//! the engine's sampler reads it. [`SamplerState`] is where a sampler stands in its random
//! stream, handed from a prefill worker to a decode worker so a PD request samples exactly what
//! a colocated one would.
//!
//! Both are wire types between tokenpath processes (strict: unknown fields and non-finite
//! numbers are refused), which is why they live here and not in the engine.

use crate::ProtocolError;
use serde::{Deserialize, Serialize};

/// How to pick tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it before softmax. (Each number here must be
    /// a finite `f32` on the wire: `1e39` is refused, not taken as infinity.)
    #[serde(deserialize_with = "crate::wire::finite_f32")]
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1 = off.
    #[serde(deserialize_with = "crate::wire::finite_f32")]
    pub top_p: f32,
    /// Seed of the random stream; `None` draws one from the OS clock.
    pub seed: Option<u64>,
    /// Subtracted once from the logit of every token already generated (−2..=2).
    #[serde(deserialize_with = "crate::wire::finite_f32")]
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated (−2..=2).
    #[serde(deserialize_with = "crate::wire::finite_f32")]
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Checks the ranges OpenAI documents.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        let bad = |param: &str, m: String| {
            Err(ProtocolError::InvalidRequest { param: Some(param.to_owned()), message: m })
        };
        if !(0.0..=2.0).contains(&self.temperature) {
            return bad("temperature", format!("temperature {} is outside 0..=2", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("top_p {} is outside (0, 1]", self.top_p));
        }
        for (name, v) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&v) {
                return bad(name, format!("{name} {v} is outside -2..=2"));
            }
        }
        Ok(())
    }
}

/// A sampler's position in its random stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplerState {
    /// The seed actually used (the request's, or the one drawn from the clock).
    pub seed: u64,
    /// Position in the ChaCha stream, in 32-bit words; a decimal string on the wire, since JSON
    /// numbers are not u128.
    #[serde(with = "u128_string")]
    pub word_pos: u128,
}

mod u128_string {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    pub(super) fn serialize<S: Serializer>(v: &u128, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u128, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_parameters_name_the_parameter() {
        let p = SamplingParams { top_p: 0.0, ..SamplingParams::default() };
        match p.validate() {
            Err(ProtocolError::InvalidRequest { param, .. }) => assert_eq!(param.as_deref(), Some("top_p")),
            other => panic!("{other:?}"),
        }
        assert!(SamplingParams::greedy().validate().is_ok());
    }

    #[test]
    fn a_sampler_state_round_trips_past_u64() {
        let s = SamplerState { seed: 7, word_pos: u128::from(u64::MAX) + 5 };
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<SamplerState>(&j).unwrap(), s);
    }
}
