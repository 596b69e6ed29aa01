//! Choosing the next token from a row of logits.
//!
//! [`Sampler`] is greedy at temperature 0, else samples from the softmax of
//! `logits / temperature` restricted to the smallest set of most likely tokens
//! whose probability reaches `top_p` (nucleus sampling). Its random numbers come
//! from its own seeded generator, so a request with a seed draws the same tokens
//! whatever else runs beside it.
//!
//! [`SamplingOptions`] adds what changes the row before the pick, as OpenAI
//! defines it: `logit_bias` (added to a token's logit), `presence_penalty`
//! (subtracted once from every token already generated) and
//! `frequency_penalty` (subtracted once per time it was generated), and asks
//! for log-probabilities: the log-softmax of the row the sampler saw (after
//! bias and penalties, before temperature and `top_p`), the picked token's and
//! the `top` most likely ones ([`Sampler::take_logprobs`]). With none of them
//! set, the pick is exactly the one without options.
//!
//! [`SamplingOptions::top_k`] and [`SamplingOptions::min_p`] (vLLM's) narrow
//! the tokens a sampled pick draws from, as `top_p` does.
//!
//! Stop sequences are matched on the answer's text by the engine's
//! [`crate::detokenizer`].

use crate::{EngineError, Result};
use kvcache_models::argmax;

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

/// What changes the row of logits before the pick, and the log-probabilities
/// asked for (OpenAI's `logit_bias`, `presence_penalty`, `frequency_penalty`,
/// `logprobs` and `top_logprobs`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOptions {
    /// Subtracted once from the logit of every token generated so far; in `-2..=2`.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated; in `-2..=2`.
    pub frequency_penalty: f32,
    /// `(token, bias)`: added to the token's logit; each bias in `-100..=100`.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report the picked token's log-probability and this many most likely
    /// alternatives (`None`: report nothing); at most [`MAX_TOP_LOGPROBS`].
    pub logprobs: Option<usize>,
    /// Sample among this many most likely tokens only (vLLM's `top_k`;
    /// `None`: all); at least 1. Greedy picks ignore it.
    pub top_k: Option<usize>,
    /// Sample only among tokens at least this fraction as likely as the most
    /// likely one (vLLM's `min_p`); in `0..=1`, 0 keeps every token. Greedy
    /// picks ignore it.
    pub min_p: f32,
}

/// Most alternatives [`SamplingOptions::logprobs`] may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl SamplingOptions {
    /// Checks the ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(EngineError::InvalidArgument(format!(
                    "{name} {v} must lie in -2..=2"
                )));
            }
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|b| !(-100.0..=100.0).contains(&b.1)) {
            return Err(EngineError::InvalidArgument(format!(
                "logit_bias {bias} of token {token} must lie in -100..=100"
            )));
        }
        if self.top_k == Some(0) {
            return Err(EngineError::InvalidArgument(
                "top_k must be at least 1 (or unset: every token)".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(EngineError::InvalidArgument(format!(
                "min_p {} must lie in 0..=1",
                self.min_p
            )));
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(EngineError::InvalidArgument(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probabilities"
            )));
        }
        Ok(())
    }

    /// Whether the row is used as it comes (no bias, no penalty).
    fn leaves_row(&self) -> bool {
        self.presence_penalty == 0.0 && self.frequency_penalty == 0.0 && self.logit_bias.is_empty()
    }
}

/// The log-probabilities of one pick.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The picked token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first
    /// (ties by id), as many as asked.
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of `row` (natural log; `-inf` stays `-inf`).
pub fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return row.iter().map(|_| f32::NEG_INFINITY).collect();
    }
    let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_sum = sum.ln() as f32;
    row.iter().map(|&l| l - max - log_sum).collect()
}

/// A request's token picker: its parameters and its random state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    options: SamplingOptions,
    rng: SplitMix64,
    /// Times each token was generated (for the penalties).
    counts: std::collections::HashMap<u32, u32>,
    /// The last pick's log-probabilities, when asked for.
    last: Option<TokenLogprobs>,
}

impl Sampler {
    /// A sampler for `params` (validated). Without a seed, the seed comes from
    /// the clock.
    pub fn new(params: SamplingParams) -> Result<Self> {
        Self::with_options(params, SamplingOptions::default())
    }

    /// A sampler for `params` whose rows `options` change (both validated).
    pub fn with_options(params: SamplingParams, options: SamplingOptions) -> Result<Self> {
        params.validate()?;
        options.validate()?;
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x5eed)
        });
        Ok(Sampler {
            params,
            options,
            rng: SplitMix64(seed),
            counts: Default::default(),
            last: None,
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The options.
    pub fn options(&self) -> &SamplingOptions {
        &self.options
    }

    /// The log-probabilities of the last pick, when asked for (once per pick).
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.last.take()
    }

    /// The next token given `logits` (one value per vocabulary entry): the
    /// row changed by the options, then picked from.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = if self.options.leaves_row() {
            let token = self.pick(logits);
            self.note(logits, token);
            token
        } else {
            let mut row = logits.to_vec();
            for &(t, bias) in &self.options.logit_bias {
                if let Some(l) = row.get_mut(t as usize) {
                    *l += bias;
                }
            }
            let (presence, frequency) = (self.options.presence_penalty, self.options.frequency_penalty);
            for (&t, &n) in &self.counts {
                if let Some(l) = row.get_mut(t as usize) {
                    *l -= presence + frequency * n as f32;
                }
            }
            let token = self.pick(&row);
            self.note(&row, token);
            token
        };
        *self.counts.entry(token).or_default() += 1;
        token
    }

    /// Records the log-probabilities of `token` in `row`, when asked for.
    fn note(&mut self, row: &[f32], token: u32) {
        let Some(k) = self.options.logprobs else { return };
        let lp = log_softmax(row);
        let mut order: Vec<u32> = (0..lp.len() as u32).collect();
        let k = k.min(order.len());
        let by_prob = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
        if k > 0 && k < order.len() {
            order.select_nth_unstable_by(k - 1, by_prob);
        }
        order.truncate(k);
        order.sort_by(by_prob);
        self.last = Some(TokenLogprobs {
            token,
            logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY),
            top: order.into_iter().map(|t| (t, lp[t as usize])).collect(),
        });
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
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
        let mut sum: f32 = probs.iter().map(|p| p.1).sum();
        // Most likely first; ties by token id, so the order is deterministic.
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // `top_k` first; `top_p`'s mass is then a share of what it kept.
        if let Some(k) = self.options.top_k.filter(|&k| k < probs.len()) {
            probs.truncate(k);
            sum = probs.iter().map(|p| p.1).sum();
        }
        let mut kept = 0;
        let mut mass = 0.0;
        for &(_, p) in &probs {
            kept += 1;
            mass += p / sum;
            if mass >= self.params.top_p {
                break;
            }
        }
        // `min_p`: relative to the most likely token (probs[0] is 1 here).
        let floor = self.options.min_p * probs[0].1;
        kept = kept.min(probs.iter().take_while(|p| p.1 >= floor).count().max(1));
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
    fn logprobs_are_the_log_softmax_of_the_row_and_top_k_is_ordered() {
        let options = SamplingOptions {
            logprobs: Some(2),
            ..SamplingOptions::default()
        };
        let mut s = Sampler::with_options(SamplingParams::greedy(), options).unwrap();
        let row = [1.0f32, 3.0, 2.0, 0.0];
        assert_eq!(s.sample(&row), 1);
        let lp = s.take_logprobs().unwrap();
        let z: f32 = row.iter().map(|l| l.exp()).sum();
        assert!((lp.logprob - (3.0 - z.ln())).abs() < 1e-5, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((lp.top[1].1 - (2.0 - z.ln())).abs() < 1e-5);
        assert_eq!(s.take_logprobs(), None);
        // Not asked: nothing recorded.
        let mut plain = Sampler::new(SamplingParams::greedy()).unwrap();
        plain.sample(&row);
        assert_eq!(plain.take_logprobs(), None);
    }

    #[test]
    fn logit_bias_and_penalties_change_the_pick_as_openai_defines_them() {
        let row = [0.0f32, 5.0, 4.5, 1.0];
        let greedy = SamplingParams::greedy();
        // A bias of -100 bans token 1; +100 forces token 3.
        let ban = SamplingOptions {
            logit_bias: vec![(1, -100.0)],
            ..SamplingOptions::default()
        };
        assert_eq!(Sampler::with_options(greedy, ban).unwrap().sample(&row), 2);
        let force = SamplingOptions {
            logit_bias: vec![(3, 100.0), (999, 1.0)],
            logprobs: Some(0),
            ..SamplingOptions::default()
        };
        let mut s = Sampler::with_options(greedy, force).unwrap();
        assert_eq!(s.sample(&row), 3);
        // The reported log-probability is the biased row's.
        let lp = s.take_logprobs().unwrap();
        assert!(lp.logprob > -1e-3 && lp.top.is_empty(), "{lp:?}");
        // Presence 1: token 1 drops to 4.0 after its first pick, below 2's 4.5.
        let presence = SamplingOptions {
            presence_penalty: 1.0,
            ..SamplingOptions::default()
        };
        let mut s = Sampler::with_options(greedy, presence).unwrap();
        assert_eq!([s.sample(&row), s.sample(&row), s.sample(&row)], [1, 2, 1]);
        // Frequency 0.3: 5.0, 4.7, 4.4 (< 4.5) for token 1.
        let frequency = SamplingOptions {
            frequency_penalty: 0.3,
            ..SamplingOptions::default()
        };
        let mut s = Sampler::with_options(greedy, frequency).unwrap();
        let picks: Vec<u32> = (0..4).map(|_| s.sample(&row)).collect();
        assert_eq!(picks, [1, 1, 2, 1]);
        // None set: the same picks as a plain sampler, seeded sampling included.
        let hot = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: Some(3),
        };
        let mut a = Sampler::new(hot).unwrap();
        let mut b = Sampler::with_options(hot, SamplingOptions::default()).unwrap();
        let logits: Vec<f32> = (0..40).map(|i| (i % 9) as f32 * 0.4).collect();
        for _ in 0..32 {
            assert_eq!(a.sample(&logits), b.sample(&logits));
        }
    }

    #[test]
    fn top_k_and_min_p_narrow_the_choices() {
        // Token i has logit i / 4: all likely enough to be drawn at temperature 2.
        let logits: Vec<f32> = (0..16).map(|i| i as f32 / 4.0).collect();
        let hot = SamplingParams {
            temperature: 2.0,
            top_p: 1.0,
            seed: Some(11),
        };
        let draw = |options: SamplingOptions| {
            let mut s = Sampler::with_options(hot, options).unwrap();
            (0..256)
                .map(|_| s.sample(&logits))
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert!(draw(SamplingOptions::default()).len() > 8);
        let top3 = SamplingOptions {
            top_k: Some(3),
            ..SamplingOptions::default()
        };
        assert_eq!(draw(top3), [13, 14, 15].into());
        let top1 = SamplingOptions {
            top_k: Some(1),
            ..SamplingOptions::default()
        };
        assert_eq!(draw(top1), [15].into());
        // At temperature 2 token 15 - n is exp(-n / 8) as likely as token 15:
        // a floor of 0.7 keeps n = 0, 1, 2 (0.88, 0.78; 0.69 falls below).
        let min_p = SamplingOptions {
            min_p: 0.7,
            ..SamplingOptions::default()
        };
        assert_eq!(draw(min_p), [13, 14, 15].into());
    }

    #[test]
    fn bad_options_are_rejected() {
        let greedy = SamplingParams::greedy();
        for o in [
            SamplingOptions {
                presence_penalty: 2.5,
                ..SamplingOptions::default()
            },
            SamplingOptions {
                frequency_penalty: -2.01,
                ..SamplingOptions::default()
            },
            SamplingOptions {
                logit_bias: vec![(0, 101.0)],
                ..SamplingOptions::default()
            },
            SamplingOptions {
                logprobs: Some(21),
                ..SamplingOptions::default()
            },
            SamplingOptions {
                top_k: Some(0),
                ..SamplingOptions::default()
            },
            SamplingOptions {
                min_p: 1.5,
                ..SamplingOptions::default()
            },
        ] {
            assert!(Sampler::with_options(greedy, o.clone()).is_err(), "{o:?}");
        }
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
}
