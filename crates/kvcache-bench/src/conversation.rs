//! Several multi-turn conversations answered in interleaved turns through one
//! chat: the workload that shows prefix reuse across conversations.
//!
//! Every conversation opens with [`SYSTEM_PROMPT`] and its own first question;
//! later turns ask the [`FOLLOW_UPS`] in order. Turn `t` of every conversation
//! is answered before turn `t + 1` of any, so a trie-backed chat switches
//! conversations on every request and must page them in and out.
//!
//! The chat is any `generate(prompt, n_predict, eos)` function
//! ([`Generate`]): [`Chat::generate`](kvcache_engine::chat::Chat::generate)
//! on candle, or the mlx chat.

use kvcache_engine::chat::TurnOutcome;
use kvcache_engine::{EngineError, Result};
use kvcache_models::tokenizer::{Message, Role};
use kvcache_models::ChatTokenizer;

/// The system message every conversation starts with.
pub const SYSTEM_PROMPT: &str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face. \
You answer questions clearly and briefly, in plain English. If you are not sure about something, \
you say so instead of guessing.";

/// The user's messages after the first question, asked in this order (and
/// again from the start past the last).
pub const FOLLOW_UPS: &[&str] = &[
    "Tell me a little more.",
    "Sum that up in one short sentence.",
    "Thank you!",
];

/// A chat's `generate(prompt, n_predict, eos)`: greedy tokens for
/// `prompt`, at most `n_predict`, stopping after `eos` if given.
pub type Generate<'a> = dyn FnMut(&[u32], usize, Option<u32>) -> Result<TurnOutcome> + 'a;

/// How many conversations, turns and tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConversationPlan {
    /// Conversations, each opened by one of the questions (at most as many
    /// as there are questions).
    pub conversations: usize,
    /// Turns per conversation, the first included.
    pub turns: usize,
    /// Tokens generated per reply, at most (a reply ends early at end of turn).
    pub max_new: usize,
}

/// One answered turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationTurn {
    /// Which conversation, from 0.
    pub conversation: usize,
    /// Which turn of it, from 1.
    pub turn: usize,
    /// The user's message.
    pub user: String,
    /// The assistant's reply, decoded, without the end-of-turn token and trimmed.
    pub reply: String,
    /// What the chat did for it.
    pub outcome: TurnOutcome,
}

/// Answers `plan.turns` turns of `plan.conversations` conversations opened by
/// `questions` (conversation `c` by `questions[c]`), interleaved turn by turn,
/// through `generate`; each reply joins its conversation's history, which the
/// next turn's prompt repeats in full. `on_turn` sees every turn as it is
/// answered. Returns the number of conversations run.
///
/// No questions, or zero conversations, turns or tokens, is an
/// [`EngineError::InvalidArgument`] before anything is generated.
pub fn interleaved(
    tokenizer: &ChatTokenizer,
    questions: &[String],
    plan: ConversationPlan,
    generate: &mut Generate<'_>,
    on_turn: &mut dyn FnMut(&ConversationTurn),
) -> Result<usize> {
    if questions.is_empty() || plan.conversations == 0 || plan.turns == 0 || plan.max_new == 0 {
        return Err(EngineError::InvalidArgument(format!(
            "conversations need questions and at least one conversation, turn and token \
             ({} questions, {plan:?})",
            questions.len()
        )));
    }
    let conversations = plan.conversations.min(questions.len());
    let mut history = vec![vec![Message::new(Role::System, SYSTEM_PROMPT)]; conversations];
    let eos = tokenizer.eos_token_id();
    for turn in 1..=plan.turns {
        for (conversation, messages) in history.iter_mut().enumerate() {
            let user = if turn == 1 {
                questions[conversation].clone()
            } else {
                FOLLOW_UPS[(turn - 2) % FOLLOW_UPS.len()].to_owned()
            };
            messages.push(Message::new(Role::User, user.clone()));
            let prompt = tokenizer.chatml_ids(messages, true)?;
            let outcome = generate(&prompt, plan.max_new, Some(eos))?;
            let reply_tokens: Vec<u32> = outcome.generated.iter().copied().filter(|&t| t != eos).collect();
            let reply = tokenizer.decode(&reply_tokens)?.trim().to_owned();
            messages.push(Message::new(Role::Assistant, reply.clone()));
            on_turn(&ConversationTurn {
                conversation,
                turn,
                user,
                reply,
                outcome,
            });
        }
    }
    Ok(conversations)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    use super::*;

    const IM_START: &str = "<|im_start|>";
    const IM_END: &str = "<|im_end|>";

    /// A byte-level tokenizer with no merges: one token per byte, then the
    /// two ChatML specials (ids 256 and 257, the latter end of turn).
    fn tokenizer() -> ChatTokenizer {
        let mut tokens: Vec<String> = ByteLevel::alphabet().into_iter().map(String::from).collect();
        tokens.sort();
        tokens.extend([IM_START.to_owned(), IM_END.to_owned()]);
        ChatTokenizer::from_parts(tokens, &[], &[IM_START.to_owned(), IM_END.to_owned()], 256, 257).unwrap()
    }

    fn outcome(prompt: &[u32], generated: Vec<u32>) -> TurnOutcome {
        TurnOutcome {
            prompt_tokens: prompt.len(),
            matched: 0,
            restored: 0,
            tiers: Vec::new(),
            evaluated: prompt.len(),
            time_to_first_token: Duration::ZERO,
            total: Duration::ZERO,
            generated,
        }
    }

    #[test]
    fn turns_interleave_and_each_prompt_repeats_its_conversation() {
        let tok = tokenizer();
        let questions = ["Why?".to_owned(), "How?".to_owned(), "Unused".to_owned()];
        let plan = ConversationPlan {
            conversations: 2,
            turns: 3,
            max_new: 5,
        };
        let mut prompts = Vec::new();
        let mut turns = Vec::new();
        let reply = tok.encode(" Yes. ").unwrap();
        let run = interleaved(
            &tok,
            &questions,
            plan,
            &mut |prompt, n, eos| {
                assert_eq!((n, eos), (5, Some(257)));
                prompts.push(prompt.to_vec());
                Ok(outcome(prompt, [reply.clone(), vec![257]].concat()))
            },
            &mut |t| turns.push((t.conversation, t.turn, t.user.clone(), t.reply.clone())),
        )
        .unwrap();
        assert_eq!(run, 2);
        let order: Vec<(usize, usize)> = turns.iter().map(|t| (t.0, t.1)).collect();
        assert_eq!(order, [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]);
        assert_eq!(turns[1].2, "How?");
        assert_eq!(
            (turns[2].2.as_str(), turns[4].2.as_str()),
            (FOLLOW_UPS[0], FOLLOW_UPS[1])
        );
        // The reply is decoded, trimmed, without the end-of-turn token.
        assert!(turns.iter().all(|t| t.3 == "Yes."));
        // Conversation 0's third prompt is its whole history, the system prompt first.
        let history = [
            Message::new(Role::System, SYSTEM_PROMPT),
            Message::new(Role::User, "Why?"),
            Message::new(Role::Assistant, "Yes."),
            Message::new(Role::User, FOLLOW_UPS[0]),
            Message::new(Role::Assistant, "Yes."),
            Message::new(Role::User, FOLLOW_UPS[1]),
        ];
        assert_eq!(prompts[4], tok.chatml_ids(&history, true).unwrap());
        // Each turn's prompt extends the same conversation's previous one.
        assert!(prompts[2].starts_with(&prompts[0]) && prompts[4].starts_with(&prompts[2]));
        assert!(!prompts[1].starts_with(&prompts[0]));
    }

    #[test]
    fn an_empty_plan_is_rejected_before_generating() {
        let tok = tokenizer();
        let questions = ["Why?".to_owned()];
        let plans = [
            (0, 1, 1, &questions[..]),
            (1, 0, 1, &questions[..]),
            (1, 1, 0, &questions[..]),
            (1, 1, 1, &[][..]),
        ];
        for (conversations, turns, max_new, questions) in plans {
            let plan = ConversationPlan {
                conversations,
                turns,
                max_new,
            };
            let err = interleaved(
                &tok,
                questions,
                plan,
                &mut |_, _, _| unreachable!("nothing is generated for {plan:?}"),
                &mut |_| unreachable!("no turn for {plan:?}"),
            )
            .unwrap_err();
            assert!(matches!(err, EngineError::InvalidArgument(_)), "{err}");
        }
    }
}
