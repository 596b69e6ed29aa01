//! What a request is and what happens to it: the request a caller submits,
//! the events the engine reports while it runs, and how it ends.

use std::time::Duration;

use kvcache_api::{Namespace, Pos, SeqId};

use crate::detokenizer::DecodeError;
use crate::sampling::TokenLogprobs;

/// A generation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Caller's id, echoed in events.
    pub id: usize,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// The tenant's namespace: prefixes are reused within it only.
    pub namespace: Namespace,
    /// Texts that end the request once its generated text contains one
    /// (OpenAI's `stop`); matched on the text a user is shown, so they need
    /// the engine's tokenizer ([`Engine::set_tokenizer`](super::Engine::set_tokenizer)). The text of the
    /// request's [`Event::Token`]s ends right before the first one found.
    pub stop: Vec<String>,
    /// Keep generating past [`EngineConfig::stop_tokens`](super::EngineConfig::stop_tokens)
    /// (vLLM's `ignore_eos`): they become ordinary tokens (their text is
    /// still left out), and only [`Request::stop_token_ids`], stop sequences
    /// and the length end the request.
    pub ignore_eos: bool,
    /// Tokens generated before anything but the length may end the request
    /// (vLLM's `min_tokens`): until then the tokens that would end it cannot
    /// be picked (their logits are masked), and stop sequences are matched
    /// only on the text from the `min_tokens`-th token on. At most
    /// `max_new_tokens`.
    pub min_tokens: usize,
    /// More tokens that end the request when generated, as the engine's stop
    /// tokens do, `ignore_eos` or not (vLLM's `stop_token_ids`); their text is
    /// left out of the answer.
    pub stop_token_ids: Vec<u32>,
}

impl Request {
    /// A request in the shared namespace, without stop sequences.
    pub fn new(id: usize, prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            id,
            prompt,
            max_new_tokens,
            namespace: Namespace::shared(),
            stop: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
        }
    }

    /// Whether generating `token` ends the request, the engine's stop
    /// tokens being `stop_tokens`: one of its own stop token ids, or one of
    /// the engine's unless it ignores them.
    pub(super) fn ends_on(&self, token: u32, stop_tokens: &[u32]) -> bool {
        self.stop_token_ids.contains(&token) || (!self.ignore_eos && stop_tokens.contains(&token))
    }

    /// `row`, the logits of the pick after `generated` tokens, with the
    /// tokens that would end the request masked while it has not generated
    /// `min_tokens` yet; `None` when nothing is masked.
    pub(super) fn hold_back_end(
        &self,
        generated: usize,
        row: &[f32],
        stop_tokens: &[u32],
    ) -> Option<Vec<f32>> {
        if generated >= self.min_tokens {
            return None;
        }
        let mut masked = row.to_vec();
        for (token, logit) in masked.iter_mut().enumerate() {
            if self.ends_on(token as u32, stop_tokens) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Some(masked)
    }
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated one of [`EngineConfig::stop_tokens`](super::EngineConfig::stop_tokens) (the model ended its
    /// turn), the last of its generated tokens.
    StopToken,
    /// Its text came to contain `Request::stop[index]`.
    StopSequence(usize),
    /// It generated `max_new_tokens`.
    Length,
}

impl FinishReason {
    /// OpenAI's name for it: `stop` or `length`.
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::StopToken | FinishReason::StopSequence(_) => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The request's id.
    pub id: usize,
    /// The sequence slot it ran in.
    pub seq: SeqId,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated: Vec<u32>,
    /// From joining to the first generated token.
    pub time_to_first_token: Duration,
    /// From joining to the last token.
    pub total: Duration,
    /// Context shifts the sequence went through.
    pub context_shifts: usize,
    /// Prompt tokens imported from the prefix store instead of evaluated.
    pub restored: usize,
    /// Prompt tokens taken from another sequence's cells instead of evaluated
    /// ([`Engine::set_prefix_reuse`](super::Engine::set_prefix_reuse)).
    pub reused: usize,
    /// Why it ended.
    pub reason: FinishReason,
}

/// What happened during [`Engine::run`](super::Engine::run), in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A request took a free sequence slot.
    Joined {
        /// The request's id.
        id: usize,
        /// Its slot.
        seq: SeqId,
        /// Prompt length.
        prompt_tokens: usize,
        /// How long it waited in the queue for a slot.
        waited: Duration,
        /// Prompt tokens taken from cached cells instead of evaluated
        /// ([`Engine::set_prefix_reuse`](super::Engine::set_prefix_reuse)).
        reused: usize,
        /// Prompt tokens imported from the prefix store instead of evaluated.
        restored: usize,
        /// The store tiers those came from: `(tier, tokens)`, in order.
        restored_from: Vec<(&'static str, usize)>,
    },
    /// Part of a prompt was evaluated.
    Prefilled {
        /// The request's id.
        id: usize,
        /// Prompt tokens evaluated so far.
        done: usize,
        /// Prompt length.
        total: usize,
    },
    /// A token was generated.
    Token {
        /// The request's id.
        id: usize,
        /// The token.
        token: u32,
        /// The text it adds to the answer ([`crate::detokenizer`]): complete
        /// characters only (the bytes of one it starts are held until a
        /// later token completes it), nothing of a stop sequence or after
        /// it, nothing for control and stop tokens; the last token of a
        /// request carries what was still held. Empty without the engine's
        /// tokenizer ([`Engine::set_tokenizer`](super::Engine::set_tokenizer)).
        text: String,
        /// Its log-probabilities, when the request's sampler asked for them
        /// ([`crate::sampling::SamplingOptions::logprobs`]); never for a
        /// stop token or a control token, which the text leaves out too.
        logprobs: Option<TokenLogprobs>,
    },
    /// A request's text could not be decoded: it was dropped and its cells
    /// freed.
    Failed {
        /// The request's id.
        id: usize,
        /// What the tokenizer said.
        error: DecodeError,
    },
    /// A sequence reached its context and dropped `removed` positions.
    ContextShift {
        /// The request's id.
        id: usize,
        /// Its slot.
        seq: SeqId,
        /// The removed positions; later ones moved down by its length.
        removed: std::ops::Range<Pos>,
    },
    /// A request finished and left its slot.
    Finished(Finished),
    /// One forward pass ran.
    Pass {
        /// Decode tokens in the pass.
        decode: usize,
        /// Prefill tokens in the pass.
        prefill: usize,
        /// Its duration.
        elapsed: Duration,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_is_held_back_until_min_tokens_and_ignore_eos_drops_only_the_engines_stops() {
        let mut request = Request::new(0, vec![0], 8);
        request.stop_token_ids = vec![2];
        request.min_tokens = 2;
        let row = [0.5f32, 1.0, 2.0];
        let masked = request.hold_back_end(1, &row, &[1]).unwrap();
        assert_eq!(masked, [0.5, f32::NEG_INFINITY, f32::NEG_INFINITY]);
        assert_eq!(request.hold_back_end(2, &row, &[1]), None);
        assert!(request.ends_on(1, &[1]) && request.ends_on(2, &[1]));
        request.ignore_eos = true;
        assert!(!request.ends_on(1, &[1]) && request.ends_on(2, &[1]));
        assert_eq!(
            request.hold_back_end(0, &row, &[1]).unwrap(),
            [0.5, 1.0, f32::NEG_INFINITY]
        );
    }
}
