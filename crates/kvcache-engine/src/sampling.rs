//! Choosing the next token from a row of logits, and stopping on text.
//!
//! [`Sampler`] is greedy at temperature 0, else samples from the softmax of
//! `logits / temperature` restricted to the smallest set of most likely tokens
//! whose probability reaches `top_p` (nucleus sampling). Its random numbers come
//! from its own seeded generator, so a request with a seed draws the same tokens
//! whatever else runs beside it.
//!
//! [`StopText`] watches generated text for stop sequences that may span token
//! boundaries: it holds back any tail that could still become a stop sequence
//! and cuts the text right before the first one found.

use crate::engine::argmax;
use crate::{EngineError, Result};

/// How a request picks its tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy; larger values flatten the distribution. At most 2.
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to
    /// at least this. In `(0, 1]`; 1 keeps every token.
    pub top_p: f32,
    /// Seed of the request's random numbers; `None` picks one.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams::default()
    }

    /// Checks the ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(EngineError::InvalidArgument(format!(
                "temperature {} must lie in 0..=2",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::InvalidArgument(format!(
                "top_p {} must lie in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }

    /// Whether every choice is the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A request's token picker: its parameters and its random state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler for `params` (validated). Without a seed, the seed comes from
    /// the clock.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x5eed)
        });
        Ok(Sampler {
            params,
            rng: SplitMix64(seed),
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token given `logits` (one value per vocabulary entry).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / t).exp()))
            .collect();
        let sum: f32 = probs.iter().map(|p| p.1).sum();
        // Most likely first; ties by token id, so the order is deterministic.
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut kept = 0;
        let mut mass = 0.0;
        for &(_, p) in &probs {
            kept += 1;
            mass += p / sum;
            if mass >= self.params.top_p {
                break;
            }
        }
        let probs = &probs[..kept];
        let total: f32 = probs.iter().map(|p| p.1).sum();
        let mut x = self.rng.next_f32() * total;
        for &(token, p) in probs {
            if x < p {
                return token;
            }
            x -= p;
        }
        probs[kept - 1].0
    }
}

/// A small, fast, seedable generator (Steele, Lea and Flood's SplitMix64).
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// What [`StopText::push`] lets out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text safe to show: it cannot be part of a stop sequence.
    pub text: String,
    /// A stop sequence was found; `text` ends right before it and the
    /// request should end.
    pub stopped: bool,
}

/// Stop sequences matched on generated text, across token boundaries.
#[derive(Debug, Clone, Default)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopText {
    /// Watches for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        StopText {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds generated `text`; returns what may be shown now.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome {
                text: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(text);
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome { text, stopped: true };
        }
        // Hold back the longest tail that is a proper prefix of some stop.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - hold;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutcome { text, stopped: false }
    }

    /// The text still held back, once generation ended without a stop.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`,
/// cut on character boundaries.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop.as_bytes().starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_p_limits_choices() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.5).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            seed: Some(7),
        };
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p).unwrap();
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = draw(params);
        assert_eq!(a, draw(params));
        assert_ne!(
            a,
            draw(SamplingParams {
                seed: Some(8),
                ..params
            })
        );
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 3);
        // top_p tiny: only the most likely token (ties broken by id: 6).
        let narrow = draw(SamplingParams {
            top_p: 0.01,
            ..params
        });
        assert!(narrow.iter().all(|&t| t == 6), "{narrow:?}");
    }

    #[test]
    fn bad_params_are_rejected() {
        for p in [
            SamplingParams {
                temperature: -0.1,
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: 2.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 1.5,
                ..SamplingParams::default()
            },
        ] {
            assert!(Sampler::new(p).is_err(), "{p:?}");
        }
    }

    #[test]
    fn stop_sequence_across_pieces() {
        let mut stop = StopText::new(vec!["END".into(), "".into()]);
        assert_eq!(stop.push("hello E").text, "hello ");
        let out = stop.push("N");
        assert_eq!(
            out,
            StopOutcome {
                text: String::new(),
                stopped: false
            }
        );
        let out = stop.push("D and more");
        assert_eq!(
            out,
            StopOutcome {
                text: String::new(),
                stopped: true
            }
        );
        assert_eq!(stop.push("x").text, "");
    }

    #[test]
    fn held_text_is_released_when_it_cannot_stop() {
        let mut stop = StopText::new(vec!["ab".into()]);
        assert_eq!(stop.push("xa").text, "x");
        assert_eq!(stop.push("c").text, "ac");
        assert_eq!(stop.push("é a").text, "é ");
        assert_eq!(stop.finish(), "a");
    }
}
