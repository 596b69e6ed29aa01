//! The batching engine's three features as ready-to-run workloads on the
//! SmolLM2 model: several conversations sharing one causal cache through
//! continuous batching, sequences attending through a sliding window, and one
//! sequence generating past its context through context shift.
//!
//! Each function builds a [`CausalKvCache`] sized for the workload, an
//! [`Engine`] over it, and submits the requests; the caller runs the engine
//! (`Engine::run`) and sees its [`Event`]s. Request `i` asks `questions[i]`
//! (cycling when there are fewer questions than requests). `kv` is how the cache
//! stores keys and values (f32, f16, bf16 or q8_0), whatever the model computes in.

use kvcache_api::{CausalConfig, KvStorage, SlidingWindow};
use kvcache_causal::{CausalKvCache, RopeLayout, RopeShift};
use kvcache_engine::engine::{Engine, EngineConfig, Event, Request};
use kvcache_engine::{EngineError, Result};
use kvcache_models::{ChatTokenizer, Llama};

/// An engine over the causal cache, requests submitted.
pub type CausalEngine<'m> = Engine<'m, CausalKvCache>;

/// A causal cache for `model` configured by `config`, on the model's device,
/// with the model's RoPE shift (GGUF's normal layout) for context shifts.
pub fn causal_cache(model: &Llama, config: CausalConfig) -> Result<CausalKvCache> {
    let c = model.config();
    let shift = RopeShift::new(RopeLayout::Normal, c.head_dim, c.rope_base as f32)?;
    Ok(CausalKvCache::new(
        config,
        model.device().clone(),
        Some(Box::new(shift)),
    )?)
}

fn question(questions: &[String], i: usize) -> Result<&str> {
    if questions.is_empty() {
        return Err(EngineError::InvalidArgument("no questions to ask".into()));
    }
    Ok(&questions[i % questions.len()])
}

/// Continuous batching: `conversations` requests through `slots` sequences of
/// one cache (512 positions each, passes of up to 256 tokens, prefill in chunks
/// of 64), stopping at end of turn. Replies get different lengths (around
/// `max_new`) so that sequences leave at different times and queued requests
/// join mid-flight, beside sequences still decoding.
pub fn continuous_batching<'m>(
    model: &'m Llama,
    tokenizer: &ChatTokenizer,
    questions: &[String],
    conversations: usize,
    slots: usize,
    max_new: usize,
    kv: KvStorage,
) -> Result<CausalEngine<'m>> {
    let slots = slots.min(conversations);
    if slots == 0 || max_new == 0 {
        return Err(EngineError::InvalidArgument(format!(
            "continuous batching needs a conversation, a slot and a token \
             ({conversations} conversations, {slots} slots, {max_new} tokens)"
        )));
    }
    let cache = causal_cache(model, CausalConfig::new(slots, 512, 256).with_kv_storage(kv))?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 256,
            prefill_chunk: 64,
            stop_tokens: vec![tokenizer.eos_token_id()],
            ..EngineConfig::default()
        },
    )?;
    for id in 0..conversations {
        let max_new = (max_new / 2 + (id * 7) % max_new).max(1);
        engine.submit(Request::new(
            id,
            tokenizer.encode_user(question(questions, id)?)?,
            max_new,
        ))?;
    }
    Ok(engine)
}

/// Sliding window: `sequences` requests (at most as many as questions) that
/// attend to their last `window` positions, `max_new` tokens each (ending at
/// the end of turn), in a cache of 4096 positions per sequence whose memory
/// keeps only what the window needs. A sequence reaches the window once its
/// prompt and answer together are longer: ask for long answers.
pub fn sliding_window<'m>(
    model: &'m Llama,
    tokenizer: &ChatTokenizer,
    questions: &[String],
    sequences: usize,
    window: usize,
    max_new: usize,
    kv: KvStorage,
) -> Result<CausalEngine<'m>> {
    let sequences = sequences.min(questions.len());
    if sequences == 0 || window == 0 || max_new == 0 {
        return Err(EngineError::InvalidArgument(format!(
            "a sliding window needs a question, a position and a token \
             ({sequences} sequences, window {window}, {max_new} tokens)"
        )));
    }
    let config = CausalConfig::new(sequences, 4096, 128)
        .with_window(SlidingWindow::new(window))
        .with_kv_storage(kv);
    let cache = causal_cache(model, config)?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 128,
            prefill_chunk: 64,
            stop_tokens: tokenizer.end_of_turn_ids(),
            ..EngineConfig::default()
        },
    )?;
    for id in 0..sequences {
        engine.submit(Request::new(
            id,
            tokenizer.encode_user(question(questions, id)?)?,
            max_new,
        ))?;
    }
    Ok(engine)
}

/// Context shift: one request asking `question` in a context of `context`
/// positions, allowed one and a half contexts' worth of tokens and ending at
/// the end of turn, so that an answer longer than what the context leaves
/// after the prompt makes the engine drop old positions (keeping the prompt,
/// up to half the context) and re-rotate the later keys. `None` when the
/// prompt leaves no room to generate (it needs `context - 2` positions at
/// most).
pub fn context_shift<'m>(
    model: &'m Llama,
    tokenizer: &ChatTokenizer,
    question: &str,
    context: usize,
    kv: KvStorage,
) -> Result<Option<CausalEngine<'m>>> {
    let prompt = tokenizer.encode_user(question)?;
    if prompt.len() + 2 > context {
        return Ok(None);
    }
    let cache = causal_cache(model, CausalConfig::new(1, context + 1, 64).with_kv_storage(kv))?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 64,
            prefill_chunk: 64,
            context: Some(context),
            keep: prompt.len().min(context / 2),
            stop_tokens: tokenizer.end_of_turn_ids(),
            block_tokens: None,
        },
    )?;
    engine.submit(Request::new(0, prompt, context + context / 2))?;
    Ok(Some(engine))
}

/// Counts what the passes of a run mixed: decode-only passes (and their
/// tokens), and passes that carried decode steps beside a joining prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassMix {
    /// Passes of decode tokens only.
    pub decode_passes: usize,
    /// Tokens in those passes.
    pub decode_tokens: usize,
    /// Passes with both decode tokens and prompt tokens.
    pub mixed: usize,
}

impl PassMix {
    /// Counts `event` if it is a pass.
    pub fn observe(&mut self, event: &Event) {
        if let Event::Pass { decode, prefill, .. } = *event {
            if prefill == 0 {
                self.decode_passes += 1;
                self.decode_tokens += decode;
            } else if decode > 0 {
                self.mixed += 1;
            }
        }
    }

    /// Sequences per decode-only pass, on average (0 with none).
    pub fn mean_decode_batch(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_passes.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_core::Device;
    use kvcache_api::CausalCache;

    use super::*;
    use kvcache_models::LlamaConfig;

    #[test]
    fn pass_mix_counts_decode_only_and_mixed_passes() {
        let pass = |decode, prefill| Event::Pass {
            decode,
            prefill,
            elapsed: Duration::ZERO,
        };
        let mut mix = PassMix::default();
        assert_eq!(mix.mean_decode_batch(), 0.0);
        for ev in [pass(0, 40), pass(3, 0), pass(2, 17), pass(1, 0), pass(4, 0)] {
            mix.observe(&ev);
        }
        mix.observe(&Event::Token {
            id: 0,
            token: 5,
            text: String::new(),
            logprobs: None,
        });
        assert_eq!(
            mix,
            PassMix {
                decode_passes: 3,
                decode_tokens: 8,
                mixed: 1
            }
        );
        assert!((mix.mean_decode_batch() - 8.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn causal_caches_carry_the_models_shift_and_the_config() {
        let model = Llama::random(LlamaConfig::tiny(), 1, &Device::Cpu).unwrap();
        let config = CausalConfig::new(3, 40, 16).with_window(SlidingWindow::new(8));
        let cache = causal_cache(&model, config.clone()).unwrap();
        assert_eq!(cache.config(), &config);
        assert_eq!(cache.num_cells(), config.num_cells());
    }
}
